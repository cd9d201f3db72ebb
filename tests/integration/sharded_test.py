#!/usr/bin/python3
"""State sharded across data-parallel ranks on a real mount. fsdp=S: a step
saved under tp=2,pp=2,dp=4,fsdp=2 by the numpy reference (every tensor cut
on dim 0 into torch.chunk chunks after its tp split) is imported, served,
saved again through the mount by the ranks of the first run only (dp_rank <
S), and read back under configs with and without fsdp, every byte equal to
numpy slicing. A chunk of the wrong size fails its close() with EIO and
`status` names the tensor, the rank and its chunk; a replica (dp_rank >= S)
that joins with a differing chunk is refused; export and import round-trip
the sharded step. distopt=1: a model with Adam's moments saved under
tp=2,pp=2,dp=3,distopt=1 by the numpy reference (Megatron-Core's buffer
layout, written there independently) is imported, served, resharded across
configs with and without it, saved through the mount by every rank, and a
part of the moments of the wrong size is refused. Exits 77 only where
/dev/fuse is missing."""
import errno
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, test_seed  # noqa
from reference import random_gpt, rank_shards, read_safetensors, scalai, write_safetensors  # noqa
from views import check_bytes, expected, status  # noqa

BIN = sys.argv[1]
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 4, 64, 8, 4, 96, 203, 8
SAVED = "tp=2,pp=2,dp=4,fsdp=2"
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def write_shard(path, tensors, rank):
    """One rank's shard written through the mount; the errno of close(), or 0."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile() as f:
        write_safetensors(f.name, tensors, {"scalai.rank": str(rank)})
        data = open(f.name, "rb").read()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, data)
    try:
        os.close(fd)
        return 0
    except OSError as e:
        return e.errno


def latest(mnt):
    return os.readlink(f"{mnt}/ckpt/latest")


def main():
    require_fuse()
    seed = test_seed()
    full = random_gpt(np.random.default_rng(seed), LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB,
                      gated=True)
    full2 = {k: (v * 2 + 1).astype(v.dtype) for k, v in full.items()}
    with tempfile.TemporaryDirectory() as tmp, Mounts() as mounts:
        src, store, mnt = f"{tmp}/src", f"{tmp}/store", f"{tmp}/mnt"
        saved = rank_shards(full, SAVED, True, DIVISOR, LAYERS)
        # The first run of dp ranks saves: dp_rank 0 and 1 of each (tp, pp).
        assert sorted(saved) == [0, 1, 2, 3, 8, 9, 10, 11], sorted(saved)
        for rank, shard in saved.items():
            os.makedirs(f"{src}/rank-{rank:05d}")
            write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", shard)
        run("init", store, *LAYOUT)
        out = run("import", store, src, "--config", SAVED, "--step", "100").stdout
        assert "tp=2,pp=2,dp=4,fsdp=2" in out, out
        os.makedirs(mnt)
        run("mount", store, mnt)
        mounts.add(mnt)
        check_bytes(mnt, full, SAVED, LAYERS, DIVISOR)
        info = json.load(open(f"{mnt}/ckpt/latest/rank-00002/rank.json"))
        qkv = info["tensors"]["decoder.layers.0.self_attention.linear_qkv.weight"]
        # tp_rank 0 holds rows 0..63 of 128; dp_rank 1 holds chunk 1: rows 32..63.
        assert qkv["shape"] == [32, 64] and qkv["global_offset"] == [32, 0], qkv
        print(f"imported {SAVED}: every rank's chunks equal numpy slicing")

        # Step 200 saved through the mount by the 8 ranks of the first run.
        want2 = expected(full2, SAVED, LAYERS, DIVISOR)
        for rank in sorted(saved):
            path = f"{mnt}/ckpt/step-00000200/rank-{rank:05d}/model.safetensors"
            assert write_shard(path, want2[rank], rank) == 0, (rank, status(mnt))
        assert latest(mnt) == "step-00000200", (latest(mnt), status(mnt))
        check_bytes(mnt, full2, SAVED, LAYERS, DIVISOR)
        for config in ("tp=1,pp=1,dp=8,fsdp=8", "tp=4,pp=1,dp=2", "tp=2,pp=1,dp=6,fsdp=3"):
            run("reconfigure", mnt, config, "--wait")
            check_bytes(mnt, full2, config, LAYERS, DIVISOR)
        run("reconfigure", mnt, SAVED, "--wait")
        print("saved by the first run of dp ranks, read back under 3 other configs")

        # A chunk of the wrong size: rank 2 (tp_rank 0, dp_rank 1) writes its
        # whole tp shard instead of chunk 1 of it.
        name = "decoder.layers.0.self_attention.linear_qkv.weight"
        whole = rank_shards(full, "tp=2,pp=2,dp=4", True, DIVISOR, LAYERS)[0]
        wrong = dict(expected(full, SAVED, LAYERS, DIVISOR)[2])
        wrong[name] = whole[name]
        step = f"{mnt}/ckpt/step-00000300"
        assert write_shard(f"{step}/rank-00002/model.safetensors", wrong, 2) == errno.EIO
        err = status(mnt)["error"]
        assert (f"tensor {name}: expected [32, 64] on rank 2 (tp_rank 0, pp_rank 0, "
                "fsdp chunk 1), got [64, 64]") in err, err
        assert latest(mnt) == "step-00000200"
        print(f"refused (wrong chunk): {err}")
        # A replica of chunk 0 (rank 4: dp_rank 2) that differs from rank 0's.
        want = expected(full, SAVED, LAYERS, DIVISOR)
        assert write_shard(f"{step}/rank-00000/model.safetensors", want[0], 0) == 0
        assert write_shard(f"{step}/rank-00004/model.safetensors", want2[4], 4) == errno.EIO
        assert "differs from its replica rank-00000" in status(mnt)["error"], status(mnt)
        assert write_shard(f"{step}/rank-00004/model.safetensors", want[4], 4) == 0
        for rank in sorted(saved):
            if rank != 0:
                assert write_shard(f"{step}/rank-{rank:05d}/model.safetensors", want[rank],
                                   rank) == 0, (rank, status(mnt))
        assert latest(mnt) == "step-00000300", (latest(mnt), status(mnt))
        assert status(mnt)["error"] is None, status(mnt)
        check_bytes(mnt, full, SAVED, LAYERS, DIVISOR)
        print("a differing replica refused; the step committed once right")
        run("umount", mnt)
        mounts.discard(mnt)
        run("fsck", store)

        # Export under fsdp and import back into a new store: the same bytes.
        run("export", store, f"{tmp}/out", "--config", "tp=1,pp=2,dp=3,fsdp=3")
        ranks = sorted(os.listdir(f"{tmp}/out"))
        assert ranks == [f"rank-{r:05d}" for r in (0, 1, 2, 3, 4, 5)], ranks
        out_want = expected(full, "tp=1,pp=2,dp=3,fsdp=3", LAYERS, DIVISOR)
        for r in range(6):
            got, _ = read_safetensors(f"{tmp}/out/rank-{r:05d}/model.safetensors")
            assert sorted(got) == sorted(out_want[r]), r
            for k, x in out_want[r].items():
                assert np.array_equal(got[k], x), (r, k)
        run("init", f"{tmp}/store2", *LAYOUT)
        run("import", f"{tmp}/store2", f"{tmp}/out", "--config", "tp=1,pp=2,dp=3,fsdp=3")
        run("export", f"{tmp}/store2", f"{tmp}/merged", "--merged")
        got = {}
        for f in sorted(os.listdir(f"{tmp}/merged")):
            if f.endswith(".safetensors"):
                got.update(read_safetensors(f"{tmp}/merged/{f}")[0])
        assert sorted(got) == sorted(full)
        for k, x in full.items():
            assert np.array_equal(got[k], x), k
        print("exported under tp=1,pp=2,dp=3,fsdp=3, imported into a new store, merged: "
              "the model as it was")
        distopt(tmp, mounts, full)
    print("sharded test: ok")


def distopt(tmp, mounts, params):
    """Megatron's distributed optimizer: the moments cut flat per dp rank."""
    rng = np.random.default_rng(5)
    full = dict(params)
    for name, x in params.items():
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"optimizer.{key}.{name}"] = rng.standard_normal(x.shape).astype(x.dtype)
    config = "tp=2,pp=2,dp=3,distopt=1"
    src, store, mnt = f"{tmp}/dsrc", f"{tmp}/dstore", f"{tmp}/dmnt"
    saved = rank_shards(full, config, True, DIVISOR, LAYERS)
    assert sorted(saved) == list(range(12)), sorted(saved)  # every rank saves
    # dp rank 0 of (tp 0, pp 0) holds the moments of the last parameters
    # only (the buffer runs backwards); its parameters are whole.
    assert not any(k.startswith("optimizer.") and "embedding" in k for k in saved[0]), saved[0]
    for rank, shard in saved.items():
        os.makedirs(f"{src}/rank-{rank:05d}")
        write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", shard)
    run("init", store, *LAYOUT)
    run("import", store, src, "--config", config, "--step", "100")
    os.makedirs(mnt)
    run("mount", store, mnt)
    mounts.add(mnt)
    check_bytes(mnt, full, config, LAYERS, DIVISOR)
    info = json.load(open(f"{mnt}/ckpt/latest/rank-00004/rank.json"))["tensors"]
    flat = [v for k, v in info.items() if k.startswith("optimizer.") and v["shape"] != v["global_shape"]]
    assert flat and all(len(v["shape"]) == 1 and "flat_begin" in v for v in flat), info
    for other in ("tp=1,pp=1,dp=4,distopt=1", "tp=2,pp=1,dp=2,fsdp=2", "tp=1,pp=2,dp=5,distopt=1"):
        run("reconfigure", mnt, other, "--wait")
        check_bytes(mnt, full, other, LAYERS, DIVISOR)
    run("reconfigure", mnt, config, "--wait")
    print(f"imported {config}: every rank's parameters and parts of the moments equal "
          "numpy, and under 3 other configs")
    # Saved through the mount by all 12 ranks; one part of the wrong size
    # first.
    full2 = {k: (v * 2 + 1).astype(v.dtype) for k, v in full.items()}
    want = expected(full2, config, LAYERS, DIVISOR)
    name = next(k for k in want[4] if k.startswith("optimizer.") and want[4][k].ndim == 1
                and want[4][k].size > 1)
    wrong = dict(want[4])
    wrong[name] = want[4][name][:-1]
    step = f"{mnt}/ckpt/step-00000200"
    assert write_shard(f"{step}/rank-00004/model.safetensors", wrong, 4) == errno.EIO
    err = status(mnt)["error"]
    assert (f"tensor {name}: expected [{want[4][name].size}] on rank 4 (tp_rank 0, pp_rank 0, "
            f"dp_rank 2), got [{want[4][name].size - 1}]") in err, err
    print(f"refused (wrong part): {err}")
    for rank in range(12):
        assert write_shard(f"{step}/rank-{rank:05d}/model.safetensors", want[rank], rank) == 0, \
            (rank, status(mnt))
    assert latest(mnt) == "step-00000200", (latest(mnt), status(mnt))
    check_bytes(mnt, full2, config, LAYERS, DIVISOR)
    run("reconfigure", mnt, "tp=1,pp=1,dp=1", "--wait")
    check_bytes(mnt, full2, "tp=1,pp=1,dp=1", LAYERS, DIVISOR)
    run("umount", mnt)
    mounts.discard(mnt)
    run("fsck", store)
    print("saved by every rank under distopt, read back whole under tp=1,pp=1,dp=1")


if __name__ == "__main__":
    main()
