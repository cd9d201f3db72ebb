#!/usr/bin/python3
"""The Python client (python/scalai) against a real mount:
- load_shard under two configs gives every rank the numpy reference's
  direct cut (torch tensors, bfloat16 included, and numpy arrays);
- save_shard writes a step that commits and reads back, under two configs;
- a save the mount refuses raises ScalaiError with the mount's reason;
- RankSamples over a dp change (dp=2 -> dp=3 after a step saved at two
  global batches) yields exactly the global batches of the unchanged job,
  JSONL decoded and Megatron tokens as numpy arrays;
- reconfigure waits until the mount is ready; status reads it;
- loading a 278 MiB bfloat16 shard and touching one tensor grows the process's RSS
  by less than 32 MiB (the tensors are views of the mapped file).
Exits 77 only where /dev/fuse is missing."""
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import scalai  # noqa
from dataset_files import write_jsonl, write_megatron  # noqa
from harness import Mounts, require_fuse, test_seed  # noqa
from reference import random_gpt, scalai as run_cli, write_safetensors, rank_shards  # noqa
from views import expected  # noqa

BIN = sys.argv[1]
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 4, 64, 8, 4, 96, 203, 8
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]
B = 6  # global batch


def run(*args, expect=0):
    return run_cli(BIN, *args, expect=expect)


def check_loaded(mnt, full, config):
    for rank, tensors in expected(full, config, LAYERS, DIVISOR).items():
        shard = scalai.load_shard(mnt, rank=rank)
        assert sorted(shard) == sorted(tensors), (config, rank)
        assert shard.metadata["scalai.config"] == config
        for name, x in tensors.items():
            assert isinstance(shard[name], torch.Tensor)
            assert np.array_equal(shard[name].numpy(), x), (config, rank, name)
        arrays = scalai.load_shard(mnt, rank=rank, device=None)
        assert all(isinstance(a, np.ndarray) for a in arrays.values())


def global_batches(mnt, dataset, config, count):
    """The first `count` global batches as the dp ranks of `config` read
    them: each rank's share of a batch, in dp-rank order."""
    c = scalai.parse_config(config)
    dp, tp = c["dp"], c["tp"]
    views = [scalai.RankSamples(mnt, dataset, rank=d * tp) for d in range(dp)]
    out = []
    for j in range(count):
        batch_ids, batch_samples = [], []
        for d, v in enumerate(views):
            mine = B // dp + (1 if d < B % dp else 0)
            batch_ids += v.sample_ids[j * mine:(j + 1) * mine].tolist()
            batch_samples += [v[k] for k in range(j * mine, (j + 1) * mine)]
        out.append((batch_ids, batch_samples))
    return out


def rss_growth_of_one_tensor(mnt):
    """RSS growth (bytes) of loading rank 0's shard and touching one tensor,
    measured in a fresh interpreter."""
    code = f"""
import sys
sys.path.insert(0, {os.path.join(HERE, '..', '..', 'python')!r})
import scalai
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
before = rss()
shard = scalai.load_shard({mnt!r}, rank=0)
total = sum(t.numel() * t.element_size() for t in shard.values())
t = shard['decoder.final_layernorm.weight']
t.float().sum().item()
print(rss() - before, total, t.dtype)
"""
    p = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = p.stdout.split()
    assert out[2] == "torch.bfloat16", out
    return int(out[0]), int(out[1])


def main():
    require_fuse()
    seed = test_seed()
    rng = np.random.default_rng(seed)
    full = random_gpt(rng, LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, gated=True)
    with tempfile.TemporaryDirectory() as tmp, Mounts() as mounts:
        src, store, mnt = f"{tmp}/src", f"{tmp}/store", f"{tmp}/mnt"
        for rank, shard in rank_shards(full, "tp=2,pp=2,dp=1", True, DIVISOR, LAYERS).items():
            os.makedirs(f"{src}/rank-{rank:05d}")
            write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", shard)
        run("init", store, *LAYOUT)
        run("import", store, src, "--config", "tp=2,pp=2,dp=1", "--step", "0")
        records = [{"id": i, "text": f"sample {i}"} for i in range(60)]
        write_jsonl(f"{tmp}/web.jsonl", records)
        tokens = [rng.integers(0, VOCAB, 5 + i % 3) for i in range(60)]
        write_megatron(f"{tmp}/tok", tokens, np.uint16)
        run("dataset", "add", store, "web", "--format", "jsonl", "--global-batch", str(B),
            f"{tmp}/web.jsonl")
        run("dataset", "add", store, "tok", "--format", "megatron", "--global-batch", str(B),
            f"{tmp}/tok.idx")
        os.makedirs(mnt)
        run("mount", store, mnt, "--config", "tp=2,pp=1,dp=2")
        mounts.add(mnt)

        check_loaded(mnt, full, "tp=2,pp=1,dp=2")
        s = scalai.reconfigure(mnt, "tp=1,pp=2,dp=2")
        assert s["state"] == "ready" and scalai.status(mnt)["config"] == "tp=1,pp=2,dp=2"
        check_loaded(mnt, full, "tp=1,pp=2,dp=2")
        print("load_shard: every rank's direct cut under tp=2,pp=1,dp=2 and tp=1,pp=2,dp=2")

        # The unchanged job's first four global batches, under dp=2.
        scalai.reconfigure(mnt, "tp=1,pp=1,dp=2")
        unchanged = global_batches(mnt, "web", "tp=1,pp=1,dp=2", 4)
        unchanged_tok = global_batches(mnt, "tok", "tp=1,pp=1,dp=2", 4)
        assert [s["id"] for s in unchanged[0][1]] == unchanged[0][0]
        assert all(isinstance(t, np.ndarray) and t.dtype == np.uint16
                   for t in unchanged_tok[0][1])

        # Step 200 (the model doubled) saved through the client by both dp
        # ranks' saver (dp_rank 0 of tp=1,pp=1: rank 0), after two batches.
        doubled = {k: (v * 2).astype(v.dtype) for k, v in full.items()}
        want = expected(doubled, "tp=1,pp=1,dp=2", LAYERS, DIVISOR)
        scalai.save_shard(mnt, 200, 0, {k: torch.from_numpy(v) for k, v in want[0].items()},
                          extra={"state.json": '{"iteration": 2}'},
                          consumed_samples=2 * B)
        assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000200"
        assert open(f"{mnt}/ckpt/latest/rank-00001/extra/state.json").read() == \
            '{"iteration": 2}'
        check_loaded(mnt, doubled, "tp=1,pp=1,dp=2")
        scalai.reconfigure(mnt, "tp=2,pp=1,dp=3")
        check_loaded(mnt, doubled, "tp=2,pp=1,dp=3")
        print("save_shard: step 200 committed, read back under tp=1,pp=1,dp=2 and tp=2,pp=1,dp=3")

        # dp=3 from the saved position: the unchanged job's batches 3 and 4.
        after = global_batches(mnt, "web", "tp=2,pp=1,dp=3", 2)
        assert after == unchanged[2:], (after, unchanged[2:])
        after_tok = global_batches(mnt, "tok", "tp=2,pp=1,dp=3", 2)
        for (ids, got), (want_ids, want_tok) in zip(after_tok, unchanged_tok[2:]):
            assert ids == want_ids and all(np.array_equal(a, b) for a, b in zip(got, want_tok))
        print("RankSamples: after dp=2 -> dp=3 at two batches, the unchanged job's batches 3, 4")

        # A refused save: rank 0 of tp=2 saves its tp shard of the wrong size.
        wrong = dict(expected(doubled, "tp=2,pp=1,dp=3", LAYERS, DIVISOR)[0])
        name = "decoder.layers.0.self_attention.linear_qkv.weight"
        wrong[name] = np.zeros((3, HIDDEN), np.float32)
        try:
            scalai.save_shard(mnt, 300, 0, wrong)
            raise AssertionError("a wrong shard was accepted")
        except scalai.ScalaiError as e:
            assert f"tensor {name}: expected" in str(e) and "got [3, 64]" in str(e), e
            print(f"refused save raised: {e}")
        try:
            scalai.reconfigure(mnt, "tp=3,pp=1,dp=1")
            raise AssertionError("a bad config was accepted")
        except scalai.ScalaiError as e:
            assert str(e).startswith(f"{mnt}/config: Invalid argument: tensor ") and \
                "is not divisible by tp=3" in str(e), e
            assert scalai.status(mnt)["config"] == "tp=2,pp=1,dp=3"  # nothing changed
        run("umount", mnt)
        mounts.discard(mnt)

        # Zero-copy: a 278 MiB bfloat16 shard, one small tensor touched.
        big_src, big_store, big_mnt = f"{tmp}/big-src", f"{tmp}/big-store", f"{tmp}/big-mnt"
        model = "layers=9,hidden=2048,heads=16,vocab=32000"
        run("synth", big_src, "--layout", "megatron-core-gpt", "--config", "tp=4,pp=1,dp=1",
            "--model", model, "--dtype", "bf16")
        run("init", big_store, "--layout", "megatron-core-gpt", "--param", "vocab_size=32000")
        run("import", big_store, big_src, "--config", "tp=4,pp=1,dp=1")
        os.makedirs(big_mnt)
        run("mount", big_store, big_mnt)
        mounts.add(big_mnt)
        growth, total = rss_growth_of_one_tensor(big_mnt)
        assert total >= 256 << 20, total
        assert growth < 32 << 20, growth
        print(f"zero-copy: a {total / 2**20:.0f} MiB shard loaded, one tensor touched: "
              f"RSS grew {growth / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
