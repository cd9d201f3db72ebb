#!/usr/bin/python3
"""The end-to-end scenario: a GPT (train.py) trained by PyTorch through
Scalai mounts while its GPUs change. Two jobs start from the same initial
model and data, each in a store of its own: the uninterrupted one trains
every iteration under one config; the other trains a few iterations under
each config of PHASES, saving a checkpoint through the mount at the end of
each phase, then the mount is reconfigured (shrinks as if GPUs failed,
grows as if granted, tp and pp change) and the workers restart under the
new config from that checkpoint. Both jobs log, per iteration, the loss and
the sample ids of the global batch.

    scenario.py BINARY [--work DIR] [--report] [--plot PNG] [--json FILE]

With --report it prints each phase's config, iterations, loss, and each
reconfiguration's times and bytes moved; --plot draws both loss curves.
It exits 1 when the two jobs differ: any batch's sample ids, any loss
beyond 1e-9 relative (float64), or the final parameters beyond 1e-9."""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import scalai as client  # noqa: the Python client (python/scalai)
from dataset_files import write_megatron  # noqa
from reference import write_safetensors  # noqa

MODEL = {"layers": 4, "hidden": 32, "heads": 4, "groups": 2, "ffn": 48, "vocab": 203, "seq": 16}
DIVISOR = 8
BATCH, SEQUENCES, EPOCHS = 8, 100, 2
UNINTERRUPTED = "tp=1,pp=1,dp=1"
# (config, iterations): start, two GPUs fail, down to one, then four granted,
# and the state sharded on the way: FSDP-style (fsdp=2), Megatron's
# distributed optimizer (distopt=1) and HSDP (two replicas of two shards).
PHASES = [("tp=2,pp=2,dp=1", 4), ("tp=1,pp=2,dp=2,fsdp=2", 4), ("tp=1,pp=1,dp=1", 4),
          ("tp=2,pp=1,dp=2,distopt=1", 4), ("tp=1,pp=1,dp=4,fsdp=2", 4),
          ("tp=1,pp=1,dp=3,distopt=1", 4)]
TOLERANCE = 1e-9


def model_arg():
    return ",".join(f"{k}={v}" for k, v in MODEL.items())


def initial_model(seed=11):
    """The full model at iteration 0, Megatron-Core names, with Adam's
    moments (zeros) for every parameter."""
    rng = np.random.default_rng(seed)
    h, heads, groups, ffn, vocab = (MODEL[k] for k in ("hidden", "heads", "groups", "ffn", "vocab"))
    hd = h // heads
    shapes = {"embedding.word_embeddings.weight": (vocab, h)}
    for n in range(MODEL["layers"]):
        p = f"decoder.layers.{n}."
        shapes[p + "self_attention.linear_qkv.layer_norm_weight"] = (h,)
        shapes[p + "self_attention.linear_qkv.weight"] = ((heads + 2 * groups) * hd, h)
        shapes[p + "self_attention.linear_proj.weight"] = (h, h)
        shapes[p + "mlp.linear_fc1.layer_norm_weight"] = (h,)
        shapes[p + "mlp.linear_fc1.weight"] = (2 * ffn, h)
        shapes[p + "mlp.linear_fc2.weight"] = (h, ffn)
    shapes["decoder.final_layernorm.weight"] = (h,)
    shapes["output_layer.weight"] = (vocab, h)
    full = {}
    for name, shape in shapes.items():
        full[name] = (np.ones(shape) if "layernorm" in name or "layer_norm" in name
                      else rng.normal(0, 0.05, size=shape))
    for name in list(full):
        full["optimizer.exp_avg." + name] = np.zeros(shapes[name])
        full["optimizer.exp_avg_sq." + name] = np.zeros(shapes[name])
    return full


def token_sequences(seed=3):
    """Sequences of a noisy bigram rule, so that the loss visibly falls."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(SEQUENCES):
        s = [int(rng.integers(0, MODEL["vocab"]))]
        for _ in range(MODEL["seq"]):
            nxt = (5 * s[-1] + 3) % MODEL["vocab"]
            s.append(nxt if rng.random() < 0.8 else int(rng.integers(0, MODEL["vocab"])))
        out.append(np.array(s, dtype=np.int32))
    return out


def scalai(binary, *args):
    r = subprocess.run([binary, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"scalai {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size(config):
    c = dict(p.split("=") for p in config.split(","))
    return int(c["tp"]) * int(c["pp"]) * int(c["dp"])


def train(mnt, config, iterations, log, save=True, timeout=300):
    """Runs one phase: a process per rank, all reading and saving through
    the mount; returns its wall time."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world_size(config)), OMP_NUM_THREADS="1")
    cmd = ["/usr/bin/python3", os.path.join(HERE, "train.py"), "--mount", mnt,
           "--config", config, "--model", model_arg(), "--dataset", "tokens",
           "--iterations", str(iterations), "--log", log] + (["--save"] if save else [])
    t0 = time.time()
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stderr=subprocess.PIPE, text=True)
             for r in range(world_size(config))]
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{config}: rank {r} timed out")
        if p.returncode != 0:
            errors.append(f"rank {r} exited {p.returncode}: {err.strip()[-2000:]}")
    if errors:
        raise RuntimeError(f"{config}: " + "\n".join(errors))
    return time.time() - t0


def status(mnt):
    with open(f"{mnt}/status") as f:
        return json.load(f)


def reconfigure(mnt, config):
    """Writes the new config; returns the switch's and the
    materialization's seconds and the bytes written."""
    t0 = time.time()
    with open(f"{mnt}/config", "w") as f:
        f.write(config + "\n")
    switched = time.time() - t0
    while True:
        s = status(mnt)
        if s["state"] == "ready":
            break
        time.sleep(0.005)
    ready = time.time() - t0
    assert s["config"] == config and s["error"] is None, s
    return {"to": config, "switch_s": switched, "ready_s": ready, "bytes_moved": s["bytes_moved"]}


def make_job(binary, work, name, first_config):
    """A store of its own, holding the initial model and the dataset,
    mounted."""
    store, mnt = f"{work}/{name}", f"{work}/{name}-mnt"
    os.makedirs(mnt)
    scalai(binary, "init", store, "--layout", "megatron-core-gpt",
           "--param", f"vocab_size={MODEL['vocab']}", "--param", "gated_linear_unit=1",
           "--param", f"make_vocab_size_divisible_by={DIVISOR}")
    scalai(binary, "import", store, f"{work}/initial.safetensors", "--config", first_config,
           "--step", "0")
    scalai(binary, "dataset", "add", store, "tokens", "--format", "megatron",
           "--global-batch", str(BATCH), "--epochs", str(EPOCHS), "--seed", "7",
           f"{work}/tokens")
    scalai(binary, "mount", store, mnt)
    return store, mnt


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def final_params(mnt, config):
    """The newest step's tensors as every rank of `config` loads them:
    {(rank, local name): array}."""
    out = {}
    for r in range(world_size(config)):
        for name, arr in client.load_shard(mnt, r, device=None).items():
            out[(r, name)] = np.array(arr)
    return out


def run(binary, work):
    total = sum(n for _, n in PHASES)
    write_safetensors(f"{work}/initial.safetensors", initial_model(), {"scalai.step": "0"})
    write_megatron(f"{work}/tokens", token_sequences(), np.int32)
    result = {"model": MODEL, "batch": BATCH, "phases": [], "reconfigurations": []}

    # The uninterrupted job: every iteration under one config.
    secs, ref_final = uninterrupted(binary, work, total)
    result["uninterrupted"] = {"config": UNINTERRUPTED, "iterations": total, "seconds": secs}

    # The job whose GPUs change.
    store, mnt = make_job(binary, work, "elastic", PHASES[0][0])
    try:
        done = 0
        for i, (config, n) in enumerate(PHASES):
            if i > 0:
                result["reconfigurations"].append(dict(reconfigure(mnt, config),
                                                       **{"from": PHASES[i - 1][0]}))
            secs = train(mnt, config, n, f"{work}/elastic.log")
            result["phases"].append({"config": config, "first": done + 1, "last": done + n,
                                     "seconds": secs})
            done += n
        # Under the uninterrupted job's config, to compare every parameter.
        reconfigure(mnt, UNINTERRUPTED)
        final = final_params(mnt, UNINTERRUPTED)
    finally:
        scalai(binary, "umount", mnt)
    scalai(binary, "fsck", store)

    ref_log, log = read_log(f"{work}/uninterrupted.log"), read_log(f"{work}/elastic.log")
    result["uninterrupted_log"], result["elastic_log"] = ref_log, log
    result.update(compare(ref_log, log, ref_final, final, total))
    return result


def uninterrupted(binary, work, total):
    """The job that never changes: every iteration under UNINTERRUPTED, in
    a store of its own. Returns its seconds and its final parameters."""
    _, ref_mnt = make_job(binary, work, "uninterrupted", UNINTERRUPTED)
    try:
        secs = train(ref_mnt, UNINTERRUPTED, total, f"{work}/uninterrupted.log")
        return secs, final_params(ref_mnt, UNINTERRUPTED)
    finally:
        scalai(binary, "umount", ref_mnt)


def compare(ref_log, log, ref_final, final, total):
    """How the changed job differs from the uninterrupted one: every
    iteration logged once in order, the same sample ids per global batch,
    losses and final parameters within TOLERANCE."""
    problems = []
    if [e["iteration"] for e in log] != list(range(1, total + 1)):
        problems.append(f"iterations logged: {[e['iteration'] for e in log]}")
    worst_loss = 0.0
    for a, b in zip(ref_log, log):
        if a["sample_ids"] != b["sample_ids"]:
            problems.append(f"iteration {a['iteration']}: sample ids {b['sample_ids']} "
                            f"under {b['config']}, uninterrupted {a['sample_ids']}")
        rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
        worst_loss = max(worst_loss, rel)
        if rel > TOLERANCE:
            problems.append(f"iteration {a['iteration']}: loss {b['loss']!r} under "
                            f"{b['config']}, uninterrupted {a['loss']!r} (relative {rel:.2e})")
    worst_param = 0.0
    if sorted(final) != sorted(ref_final):
        problems.append("the final checkpoints hold different tensors")
    else:
        for key, a in ref_final.items():
            diff = np.max(np.abs(final[key] - a)) if a.size else 0.0
            rel = diff / max(np.max(np.abs(a)), 1e-300) if a.size else 0.0
            worst_param = max(worst_param, rel)
            if rel > TOLERANCE:
                problems.append(f"final {key[1]}: relative difference {rel:.2e}")
    return {"worst_loss_rel": worst_loss, "worst_param_rel": worst_param, "problems": problems}


def report(r):
    lines = [f"GPT: {r['model']['layers']} layers, hidden {r['model']['hidden']}, "
             f"{r['model']['heads']} heads in {r['model']['groups']} groups, SwiGLU ffn "
             f"{r['model']['ffn']}, vocab {r['model']['vocab']} (padded per tp), float64; "
             f"global batch {r['batch']} x {r['model']['seq']} tokens",
             "", f"{'phase':<30} {'world':>5} {'iterations':>10}   {'loss first -> last':<22} "
                 f"{'time':>6}"]

    def row(label, world, first, last, part, seconds):
        return (f"{label:<30} {world:>5} {first:>5}-{last:<4}   "
                f"{part[0]['loss']:.6f} -> {part[-1]['loss']:.6f}   {seconds:>5.1f}s")

    for p in r["phases"]:
        part = [e for e in r["elastic_log"] if p["first"] <= e["iteration"] <= p["last"]]
        lines.append(row(p["config"], world_size(p["config"]), p["first"], p["last"], part,
                         p["seconds"]))
    u = r["uninterrupted"]
    lines.append(row(u["config"] + " (uninterrupted)", world_size(u["config"]), 1,
                     u["iterations"], r["uninterrupted_log"], u["seconds"]))
    lines += ["", f"{'reconfiguration (while mounted)':<46} {'switch':>8} {'ready':>8} "
                  f"{'bytes written':>14}"]
    for c in r["reconfigurations"]:
        lines.append(f"{c['from'] + ' -> ' + c['to']:<46} {c['switch_s'] * 1000:>6.1f}ms "
                     f"{c['ready_s'] * 1000:>6.1f}ms {c['bytes_moved']:>14,}")
    lines += ["", f"every global batch's sample ids equal the uninterrupted job's: "
                  f"{'yes' if not any('sample ids' in p for p in r['problems']) else 'NO'}",
              f"largest loss difference: {r['worst_loss_rel']:.1e} relative (limit {TOLERANCE:.0e})",
              f"largest final parameter difference: {r['worst_param_rel']:.1e} relative "
              f"(limit {TOLERANCE:.0e})"]
    return "\n".join(lines)


def plot(r, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    ref = r["uninterrupted_log"]
    ax.plot([e["iteration"] for e in ref], [e["loss"] for e in ref], color="0.6", lw=5,
            label=f"uninterrupted ({r['uninterrupted']['config']})", zorder=1)
    for p in r["phases"]:
        part = [e for e in r["elastic_log"] if p["first"] <= e["iteration"] <= p["last"]]
        ax.plot([e["iteration"] for e in part], [e["loss"] for e in part], "o-", ms=5,
                label=p["config"], zorder=2)
    for p in r["phases"][1:]:
        ax.axvline(p["first"] - 0.5, color="0.3", ls=":", lw=1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title(f"Loss through {len(r['reconfigurations'])} reconfigurations of a Scalai mount")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--work")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--plot")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not os.path.exists("/dev/fuse"):
        print("no /dev/fuse: a FUSE mount is needed")
        return 77
    work = args.work or tempfile.mkdtemp(prefix="scalai-e2e.")
    os.makedirs(work, exist_ok=True)
    try:
        r = run(os.path.abspath(args.binary), work)
    finally:
        for m in ("uninterrupted-mnt", "elastic-mnt"):
            subprocess.run(["fusermount3", "-u", "-q", f"{work}/{m}"], stderr=subprocess.DEVNULL)
    if args.report:
        print(report(r))
    if args.plot:
        plot(r, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    for p in r["problems"]:
        print(p, file=sys.stderr)
    return 1 if r["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
