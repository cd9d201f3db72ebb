#!/usr/bin/python3
"""scalai synth against slicing: writes a model unsharded (--full) and as
per-rank shards under several configs, parses every file with this script's
own safetensors reader, and checks each rank's tensors equal the slices that
docs/reference.md prescribes (splits, SwiGLU blocks, vocab padding, stages, local
layer numbers). Also checks `scalai plan --json` and the exit codes."""
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import read_safetensors, rank_shards, scalai  # noqa: E402

SCALAI = sys.argv[1]


def run(*args, expect=0):
    return scalai(SCALAI, *args, expect=expect)


def check_config(tmp, model, gated, config, layers):
    out = os.path.join(tmp, config.replace(",", "_").replace("=", "").replace(":", "-"))
    run("synth", out, "--layout", "megatron-core-gpt", "--model", model, "--config", config,
        "--dtype", "f32", "--seed", "5")
    full, _ = read_safetensors(os.path.join(tmp, "full", "model.safetensors"))
    expected = rank_shards(full, config, gated, 8, layers)
    assert sorted(os.listdir(out)) == [f"rank-{r:05d}" for r in sorted(expected)], config
    for rank, want in expected.items():
        shard, meta = read_safetensors(os.path.join(out, f"rank-{rank:05d}", "model.safetensors"))
        assert meta == {"scalai.rank": str(rank), "scalai.config": config}, meta
        assert sorted(shard) == sorted(want), (config, rank, sorted(shard), sorted(want))
        for local, x in want.items():
            assert shard[local].shape == x.shape, (config, rank, local, shard[local].shape)
            assert np.array_equal(shard[local], x), (config, rank, local)


def main():
    layers = 5
    model = "layers=5,hidden=48,heads=12,groups=6,ffn=96,vocab=101,bias=1,gated_linear_unit=1"
    with tempfile.TemporaryDirectory() as tmp:
        run("synth", os.path.join(tmp, "full"), "--layout", "megatron-core-gpt", "--model", model,
            "--full", "--dtype", "f32", "--seed", "5", "--param", "make_vocab_size_divisible_by=8")
        configs = ["tp=1,pp=1,dp=1", "tp=2,pp=2,dp=2", "tp=3,pp=3,dp=1,stages=1:3:1",
                   "tp=6,pp=1,dp=3", "tp=2,pp=5,dp=1"]
        for config in configs:
            check_config(tmp, model + ",make_vocab_size_divisible_by=8", True, config, layers)

        # plan --json: the documented fields, and totals that add up.
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
