#!/usr/bin/python3
"""Importing a Megatron-LM checkpoint (model_optim_rng.pt files written by the
real torch.save: bf16 parameters, fp32 Adam state and master copies, args,
RNG state) against what a conversion script does with the same files, in the
same run, on the same filesystem:
  - torch.load of every rank file, then each tensor's bytes written as one
    safetensors-like file per rank and fsynced (the chore Scalai replaces);
  - cp -r + sync (the physical reference: the bytes read and written once).
Each timed command starts after a sync and a pause, so that the writeback of
the one before does not land on it; the files are in the page cache for all.
Run by hand:
  /usr/bin/python3 tools/bench_megatron.py build/tools/scalai [WORKDIR]
Prints the size, each measurement (best and median of 3) and the ratios
(>= 1.0: Scalai is faster)."""
import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "tools"))
from reference import random_gpt, rank_shards  # noqa

BIN = sys.argv[1]
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB = 8, 1024, 16, 4, 2816, 32000
CONFIG, TP, PP = "tp=2,pp=2,dp=1", 2, 2
ITERATION = 5000
ROUNDS = 3


def write_checkpoint(root):
    full = random_gpt(np.random.default_rng(1), LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB,
                      gated=True)
    shards = rank_shards(full, CONFIG, True, 128, LAYERS)
    for p in range(PP):
        for t in range(TP):
            model = collections.OrderedDict(
                (k, torch.from_numpy(v).to(torch.bfloat16)) for k, v in shards[p * TP + t].items())
            decay = [k for k, v in model.items() if v.dim() > 1]
            rest = [k for k, v in model.items() if v.dim() == 1]
            groups = [decay, rest]
            state, param_groups, masters, n = {}, [], [], 0
            for g, names in enumerate(groups):
                numbers = []
                for name in names:
                    x = model[name].float()
                    state[n] = {"step": torch.tensor(float(ITERATION)), "exp_avg": x * 0.1,
                                "exp_avg_sq": x * x}
                    numbers.append(n)
                    n += 1
                param_groups.append({"lr": 1e-4, "weight_decay": 0.1 if g == 0 else 0.0,
                                     "params": numbers})
                masters.append([model[name].float() for name in names])
            d = f"{root}/iter_{ITERATION:07d}/mp_rank_{t:02d}_{p:03d}"
            os.makedirs(d)
            torch.save({
                "args": argparse.Namespace(tensor_model_parallel_size=TP,
                                           pipeline_model_parallel_size=PP,
                                           num_layers=LAYERS, hidden_size=HIDDEN),
                "checkpoint_version": 3.0, "iteration": ITERATION, "model": model,
                "optimizer": {"optimizer": {"state": state, "param_groups": param_groups},
                              "fp32_from_fp16_params": masters},
                "rng_state": [{"torch_rng_state": torch.get_rng_state()}],
            }, f"{d}/model_optim_rng.pt")
    with open(f"{root}/latest_checkpointed_iteration.txt", "w") as f:
        f.write(f"{ITERATION}\n")


def convert(src, out):
    """What a conversion script does: torch.load, then every tensor written
    out (safetensors-like: a JSON header, then the bytes), fsynced."""
    os.makedirs(out)
    for dirpath, _, files in os.walk(src):
        for name in files:
            if name != "model_optim_rng.pt":
                continue
            saved = torch.load(f"{dirpath}/{name}")
            tensors = dict(saved["model"])
            opt = saved["optimizer"]["optimizer"]
            for number, s in opt["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    tensors[f"optimizer.{key}.{number}"] = s[key]
            for g, group in enumerate(saved["optimizer"]["fp32_from_fp16_params"]):
                for j, x in enumerate(group):
                    tensors[f"optimizer.fp32_param.{g}.{j}"] = x
            header, offset = {}, 0
            for k, x in tensors.items():
                n = x.numel() * x.element_size()
                header[k] = {"dtype": str(x.dtype), "shape": list(x.shape),
                             "data_offsets": [offset, offset + n]}
                offset += n
            path = f"{out}/{os.path.basename(dirpath)}.safetensors"
            with open(path, "wb") as f:
                text = json.dumps(header).encode()
                f.write(len(text).to_bytes(8, "little") + text)
                for x in tensors.values():
                    f.write(x.contiguous().view(torch.uint8).numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())


def timed(fn):
    subprocess.run(["sync"], check=True)
    time.sleep(3)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    work = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(dir="/var/tmp",
                                                                  prefix="scalai-bench.")
    try:
        src = f"{work}/ckpt"
        write_checkpoint(src)
        size = sum(os.path.getsize(f"{d}/{f}") for d, _, fs in os.walk(src) for f in fs)

        def scalai():
            subprocess.run([BIN, "init", f"{work}/store", "--layout", "megatron-core-gpt",
                            "--param", f"vocab_size={VOCAB}", "--param", "gated_linear_unit=1"],
                           check=True, capture_output=True)
            p = subprocess.run([BIN, "import", f"{work}/store", src, "--config", CONFIG],
                               capture_output=True, text=True)
            assert p.returncode == 0, p.stderr

        def cp():
            subprocess.run(["cp", "-r", src, f"{work}/cp"], check=True)
            subprocess.run(["sync"], check=True)

        times = {"scalai import": [], "torch.load + write + fsync": [], "cp -r + sync": []}
        for _ in range(ROUNDS):
            for d in ("store", "cp", "converted"):
                shutil.rmtree(f"{work}/{d}", ignore_errors=True)
            times["cp -r + sync"].append(timed(cp))
            times["torch.load + write + fsync"].append(
                timed(lambda: convert(src, f"{work}/converted")))
            times["scalai import"].append(timed(scalai))
        gib = size / (1 << 30)
        print(f"checkpoint: {gib:.2f} GiB in {TP * PP} model_optim_rng.pt files ({CONFIG}; "
              f"bf16 parameters, fp32 Adam state and master copies), best and median of {ROUNDS}")
        best = {k: min(v) for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in times:
            ratio = "" if k == "scalai import" else \
                f"  scalai {best[k] / best['scalai import']:.2f}x (median {med[k] / med['scalai import']:.2f}x)"
            print(f"{k:28s} best {best[k]:6.2f} s ({gib / best[k]:5.2f} GiB/s)  "
                  f"median {med[k]:6.2f} s{ratio}")
    finally:
        if len(sys.argv) <= 2:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
