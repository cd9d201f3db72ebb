#!/usr/bin/python3
"""Simulated training through a real mount: data-parallel ranks read their
samples batch by batch while dp changes 4 -> 3 -> 8 -> 1 (a global batch of
10, so no dp after the first divides it) across epoch boundaries, with steps
committed in between (by import, since the mount saves nothing yet) and
work after the last commit thrown away as a crash would. The concatenated
global batches must equal those of an unchanged job exactly. Both formats
are checked against files written by an independent writer
(dataset_files.py): every sample's bytes through samples/K, every rank's
samples.jsonl and sample-ids.u64. Exits 77 only where /dev/fuse is
missing."""
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, test_seed  # noqa
from dataset_files import random_records, random_sequences, write_jsonl, write_megatron  # noqa
from reference import random_gpt, rank_shards, scalai, write_safetensors  # noqa
from views import status  # noqa

BIN = sys.argv[1]
MOUNTS = Mounts()
B = 10
MODEL = dict(layers=1, hidden=16, heads=2, groups=2, ffn=32, vocab=40)


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def load(path):
    with open(path, "rb") as f:
        return f.read()


def slice_count(dp, d):
    return B // dp + (1 if d < B % dp else 0)


class Job:
    """What the job consumed, batch by batch, per dataset."""

    def __init__(self, expected):
        self.expected = expected  # name -> [bytes of sample i]
        self.batches = {name: [] for name in expected}


def read_phase(mnt, job, dp, batches, position_batch, check_stream):
    """Each rank reads `batches` global batches from the views (or all that
    are left); returns them as lists of sample ids per dataset, checking
    every sample's bytes against the writer's."""
    got = {}
    for name, samples in job.expected.items():
        meta = json.loads(load(f"{mnt}/data/{name}/dataset.json"))
        assert meta["dp"] == dp and meta["global_batch"] == B, meta
        assert meta["position"] == min(position_batch * B, meta["positions"]), \
            (name, meta, position_batch)
        left = (meta["positions"] - meta["position"]) // B
        n = left if batches is None else min(batches, left)
        per_rank = []
        for d in range(dp):
            rank = f"{mnt}/data/{name}/rank-{d:05d}"
            info = json.loads(load(f"{rank}/rank.json"))
            c = slice_count(dp, d)
            assert info == {"dp_rank": d, "dp": dp, "samples": left * c,
                            "first_position": meta["position"] + sum(
                                slice_count(dp, e) for e in range(d))}, (name, info)
            ids = np.frombuffer(load(f"{rank}/sample-ids.u64"), dtype="<u8")
            assert len(ids) == left * c, (name, d, len(ids))
            assert len(os.listdir(f"{rank}/samples")) == left * c
            for k in range(n * c):
                assert load(f"{rank}/samples/{k}") == samples[ids[k]], (name, d, k, ids[k])
            if check_stream and name == "web":
                stream = load(f"{rank}/samples.jsonl")
                assert stream == b"".join(samples[i] + b"\n" for i in ids), (name, d)
            per_rank.append([ids[j * c:(j + 1) * c] for j in range(n)])
        got[name] = [np.concatenate([per_rank[d][j] for d in range(dp)]).tolist()
                     for j in range(n)]
    return got


def commit_step(store, tmp, full, step, consumed=None):
    src = f"{tmp}/ckpt-{step}"
    shard = rank_shards(full, "tp=1,pp=1,dp=1", False, 8, MODEL["layers"])[0]
    os.makedirs(f"{src}/rank-00000")
    meta = {"scalai.step": str(step)}
    if consumed is not None:
        meta["scalai.consumed_samples"] = str(consumed)
    write_safetensors(f"{src}/rank-00000/model.safetensors", shard, meta)
    run("import", store, src, "--config", "tp=1,pp=1,dp=1")


def main():
    require_fuse()
    seed = test_seed()
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        store, mnt = f"{tmp}/store", f"{tmp}/mnt"
        os.makedirs(mnt)
        MOUNTS.add(mnt)
        # JSONL: two files, the second without a final newline (103 lines).
        web = write_jsonl(f"{tmp}/a.jsonl", random_records(rng, 61))
        web += write_jsonl(f"{tmp}/b.jsonl", random_records(rng, 42), final_newline=False)
        # Megatron: two int32 pairs (77 sequences); one dataset has one
        # token dtype (dataset_errors_test refuses a mix).
        tok = write_megatron(f"{tmp}/m1", random_sequences(rng, 57, np.int32), np.int32)
        tok += write_megatron(f"{tmp}/m2", random_sequences(rng, 20, np.int32), np.int32)
        job = Job({"web": web, "tok": tok})

        run("init", store, "--layout", "megatron-core-gpt", "--param", f"vocab_size={MODEL['vocab']}",
            "--param", "make_vocab_size_divisible_by=8")
        out = run("dataset", "add", store, "web", "--format", "jsonl", "--global-batch", str(B),
                  "--epochs", "2", "--seed", str(seed), f"{tmp}/a.jsonl", f"{tmp}/b.jsonl").stdout
        assert "103 samples" in out and "3 dropped per epoch" in out, out
        run("dataset", "add", store, "tok", "--format", "megatron", "--global-batch", str(B),
            "--epochs", "3", f"{tmp}/m1", f"{tmp}/m2.idx", f"{tmp}/m2.bin")
        info = json.loads(run("inspect", store, "--json").stdout)
        assert [(d["name"], d["samples"]) for d in info["datasets"]] == [("tok", 77), ("web", 103)]

        # The unchanged job: dp=4 from the start to the end.
        run("mount", store, mnt, "--config", "tp=1,pp=1,dp=4")
        unchanged = read_phase(mnt, job, 4, None, 0, check_stream=True)
        run("umount", mnt)
        assert len(unchanged["web"]) == 20 and len(unchanged["tok"]) == 21
        for name, n in (("web", 103), ("tok", 77)):
            per_epoch = n // B
            for e in range(0, len(unchanged[name]), per_epoch):
                ids = sum(unchanged[name][e:e + per_epoch], [])
                assert len(set(ids)) == len(ids) == per_epoch * B and max(ids) < n, (name, e)

        full = random_gpt(rng, MODEL["layers"], MODEL["hidden"], MODEL["heads"],
                          MODEL["groups"], MODEL["ffn"], MODEL["vocab"], gated=False)
        consumed = {name: [] for name in job.expected}

        def keep(got, batches):
            for name in got:
                consumed[name] += got[name][:batches]

        # dp=4: 5 iterations, step 5 committed.
        run("mount", store, mnt, "--config", "tp=1,pp=1,dp=4")
        keep(read_phase(mnt, job, 4, 5, 0, False), 5)
        run("umount", mnt)
        commit_step(store, tmp, full, 5)
        # dp=3 (4 GPUs lost a worker): 9 iterations, but only 7 are committed
        # (step 12) before a crash; the last 2 are read again later.
        run("mount", store, mnt, "--config", "tp=1,pp=1,dp=3")
        keep(read_phase(mnt, job, 3, 9, 5, True), 7)
        run("umount", mnt)
        commit_step(store, tmp, full, 12)
        # dp=8 (granted): 4 iterations; the step's number is not its position
        # here: rank 0's metadata says 160 samples were consumed.
        run("mount", store, mnt, "--config", "tp=1,pp=1,dp=8")
        keep(read_phase(mnt, job, 8, 4, 12, False), 4)
        run("umount", mnt)
        commit_step(store, tmp, full, 1600, consumed=160)
        # dp=1, switched while mounted: a handle opened under dp=8 keeps its
        # bytes, and the views recompute from the same position.
        run("mount", store, mnt, "--config", "tp=1,pp=1,dp=8")
        old = open(f"{mnt}/data/web/rank-00005/samples/0", "rb")
        old_ids = load(f"{mnt}/data/web/rank-00005/sample-ids.u64")
        with open(f"{mnt}/config", "w") as f:
            f.write("tp=1,pp=1,dp=1\n")
        assert status(mnt)["config"] == "tp=1,pp=1,dp=1", status(mnt)
        first = int(np.frombuffer(old_ids[:8], dtype="<u8")[0])
        assert old.read() == web[first]
        old.close()
        keep(read_phase(mnt, job, 1, None, 16, True), None)
        run("umount", mnt)

        for name in job.expected:
            assert consumed[name] == unchanged[name], name
            print(f"{name}: {len(consumed[name])} global batches over dp 4 -> 3 -> 8 -> 1 "
                  f"equal the unchanged job's")
        run("fsck", store)
    print("dataset_test: ok")


if __name__ == "__main__":
    with MOUNTS:
        main()
