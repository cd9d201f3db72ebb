#!/usr/bin/python3
"""scalai synth against slicing: writes a model unsharded (--full) and as
per-rank shards under several configs, parses every file with this script's
own safetensors reader, and checks each rank's tensors equal the slices that
SPEC section 4 prescribes (splits, SwiGLU blocks, vocab padding, stages, local
layer numbers). Also checks `scalai plan --json` and the exit codes."""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

import numpy as np

SCALAI = sys.argv[1]
DTYPES = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16, "F64": np.float64,
          "I8": np.int8, "U8": np.uint8}


def read_safetensors(path):
    """Returns ({name: array}, metadata), checking the layout as it goes."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = blob[8 + n:]
    out, end = {}, 0
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, en = e["data_offsets"]
        assert b == end, f"{path}: {name} leaves a hole"
        end = en
        arr = np.frombuffer(data[b:en], dtype=DTYPES[e["dtype"]])
        out[name] = arr.reshape(e["shape"])
    assert end == len(data), f"{path}: trailing bytes"
    return out, meta


def run(*args, expect=0):
    p = subprocess.run([SCALAI, *args], capture_output=True, text=True)
    assert p.returncode == expect, f"scalai {' '.join(args)}: exit {p.returncode}\n{p.stderr}"
    return p


def rule(name, gated):
    """SPEC section 4's megatron-core-gpt rules: (split, blocks, vocab, stage)."""
    if name.endswith("word_embeddings.weight"):
        return 0, 1, True, "first"
    if name.endswith("output_layer.weight"):
        return 0, 1, True, "last"
    if re.search(r"linear_fc1\.(weight|bias)$", name) and gated:
        return 0, 2, False, "first"
    if re.search(r"linear_(qkv|fc1)\.(weight|bias)$", name):
        return 0, 1, False, "first"
    if re.search(r"linear_(proj|fc2)\.weight$", name):
        return 1, 1, False, "first"
    if "final_layernorm." in name:
        return None, 1, False, "last"
    return None, 1, False, "first"


def expected_shard(full, name, tp, t, gated, divisor):
    split, blocks, vocab, _ = rule(name, gated)
    x = full[name]
    if split is None:
        return x
    x = np.moveaxis(x, split, 0)
    if vocab:
        padded = -(-x.shape[0] // (divisor * tp)) * divisor * tp
        pad = np.zeros((padded - x.shape[0],) + x.shape[1:], x.dtype)
        part = np.concatenate([x, pad])[t * padded // tp:(t + 1) * padded // tp]
    else:
        part = np.concatenate([np.split(b, tp)[t] for b in np.split(x, blocks)])
    return np.moveaxis(part, 0, split)


def check_config(tmp, model, gated, config, layers):
    tp, pp, dp = (int(re.search(k + r"=(\d+)", config).group(1)) for k in ("tp", "pp", "dp"))
    m = re.search(r"stages=([\d:]+)", config)
    stages = [int(s) for s in m.group(1).split(":")] if m else [
        layers // pp + (1 if p < layers % pp else 0) for p in range(pp)]
    first = [sum(stages[:p]) for p in range(pp)]
    out = os.path.join(tmp, config.replace(",", "_").replace("=", "").replace(":", "-"))
    run("synth", out, "--layout", "megatron-core-gpt", "--model", model, "--config", config,
        "--dtype", "f32", "--seed", "5")
    full, _ = read_safetensors(os.path.join(tmp, "full", "model.safetensors"))
    ranks = sorted(os.listdir(out))
    expect_ranks = [f"rank-{(p * dp) * tp + t:05d}" for p in range(pp) for t in range(tp)]
    assert ranks == sorted(expect_ranks), (ranks, expect_ranks)
    for p in range(pp):
        for t in range(tp):
            rank = (p * dp) * tp + t
            shard, meta = read_safetensors(os.path.join(out, f"rank-{rank:05d}", "model.safetensors"))
            assert meta == {"scalai.rank": str(rank), "scalai.config": config}, meta
            expected = {}
            for name in full:
                lm = re.search(r"decoder\.layers\.(\d+)\.", name)
                if lm:
                    layer = int(lm.group(1))
                    if not first[p] <= layer < first[p] + stages[p]:
                        continue
                    local = name.replace(f"layers.{layer}.", f"layers.{layer - first[p]}.", 1)
                else:
                    stage = rule(name, gated)[3]
                    if (stage == "first") != (p == 0) and not (stage == "last" and p == pp - 1):
                        continue
                    if stage == "last" and p != pp - 1:
                        continue
                    local = name
                expected[local] = expected_shard(full, name, tp, t, gated, 8)
            assert sorted(shard) == sorted(expected), (config, rank, sorted(shard), sorted(expected))
            for local, want in expected.items():
                got = shard[local]
                assert got.shape == want.shape, (config, rank, local, got.shape, want.shape)
                assert np.array_equal(got, want), (config, rank, local)
    return out


def main():
    layers = 5
    model = "layers=5,hidden=48,heads=6,groups=3,ffn=96,vocab=101,bias=1,gated_linear_unit=1"
    with tempfile.TemporaryDirectory() as tmp:
        run("synth", os.path.join(tmp, "full"), "--layout", "megatron-core-gpt", "--model", model,
            "--full", "--dtype", "f32", "--seed", "5", "--param", "make_vocab_size_divisible_by=8")
        configs = ["tp=1,pp=1,dp=1", "tp=2,pp=2,dp=2", "tp=3,pp=3,dp=1,stages=1:3:1",
                   "tp=6,pp=1,dp=3", "tp=2,pp=5,dp=1"]
        for config in configs:
            check_config(tmp, model + ",make_vocab_size_divisible_by=8", True, config, layers)

        # plan --json: the SPEC fields, and totals that add up.
        p = run("plan", "--layout", "megatron-core-gpt", "--model", model, "--from",
                "tp=2,pp=2,dp=2", "--to", "tp=1,pp=2,dp=4", "--json")
        plan = json.loads(p.stdout)
        assert {"bytes_total", "bytes_kept", "bytes_fetched", "ranks"} <= set(plan), plan.keys()
        assert len(plan["ranks"]) == 8
        for r in plan["ranks"]:
            assert r["bytes_kept"] + r["bytes_fetched"] == r["bytes_total"], r
        assert sum(r["bytes_total"] for r in plan["ranks"]) == plan["bytes_total"]
        dp_only = json.loads(run("plan", "--layout", "megatron-core-gpt", "--model", model,
                                 "--from", "tp=2,pp=2,dp=2", "--to", "tp=2,pp=2,dp=3",
                                 "--json").stdout)
        assert dp_only["bytes_to_write"] == 0, dp_only["bytes_to_write"]

        # Errors: one line naming the fault, exit 1; usage errors exit 2.
        bad = run("plan", "--layout", "megatron-core-gpt", "--model", model, "--from",
                  "tp=2,pp=2,dp=2", "--to", "tp=5,pp=1,dp=1", expect=1)
        assert bad.stderr.count("\n") == 1 and "tp=5" in bad.stderr, bad.stderr
        bad = run("plan", "--layout", "megatron-core-gpt", "--model", model, "--from",
                  "tp=2,pp=2,dp=2", "--to", "tp=1,pp=9,dp=1", expect=1)
        assert "pp=9 needs at least 9 layers but the model has 5" in bad.stderr, bad.stderr
        bad = run("plan", "--layout", "megatron-core-gpt", "--model", model, "--from", "junk",
                  "--to", "tp=1,pp=1,dp=1", expect=1)
        assert 'config "junk"' in bad.stderr, bad.stderr
        run("plan", "--layout", "megatron-core-gpt", "--from", "tp=1,pp=1,dp=1", expect=2)
        run("frobnicate", expect=2)
        assert "synth" in run("--help").stdout
    print("synth slicing test: ok")


if __name__ == "__main__":
    main()
