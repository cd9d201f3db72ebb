#!/usr/bin/python3
"""Saving checkpoints through a real mount (docs/reference.md, "Saving a
checkpoint through the mount"). Eight processes, one per rank of
tp=2,pp=2,dp=2, each write their model.safetensors with the test's own
safetensors writer and fsync it; the step commits when the last dp_rank 0
rank closes, `latest` moves, and the step read back under other configs
equals numpy slicing. Each kind of bad shard fails its close() with EIO and
`status` names the reason; the step stays uncommitted until a good file is
written again or the step is removed. A step left unfinished at unmount is
gone at the next mount; --keep-steps drops old steps but never an open one;
the data views follow the newest step. Export writes each rank's extra
files, and refuses one damaged on the disk. Exits 77 only where /dev/fuse is
missing."""
import errno
import json
import multiprocessing
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, flip, require_fuse, test_seed  # noqa
from dataset_files import write_jsonl  # noqa
from reference import random_gpt, scalai, write_safetensors  # noqa
from views import check_bytes, expected, status  # noqa

BIN = sys.argv[1]
MOUNTS = Mounts()
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 4, 64, 8, 4, 128, 203, 8
SAVED = "tp=2,pp=2,dp=2"
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def save_rank(path, tensors, metadata):
    """One worker: makes its directory and writes its shard, then fsyncs."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_safetensors(path, tensors, metadata)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def save_step(mnt, step, shards, config, extra_meta=None):
    """All ranks at once, each in its own process."""
    procs = []
    for rank, tensors in shards.items():
        meta = {"scalai.step": str(step), "scalai.rank": str(rank)}
        meta.update(extra_meta or {})
        p = multiprocessing.Process(target=save_rank, args=(
            f"{mnt}/ckpt/step-{step:08d}/rank-{rank:05d}/model.safetensors", tensors, meta))
        p.start()
        procs.append(p)
    for p in procs:
        p.join()
        assert p.exitcode == 0, (p.exitcode, status(mnt))


def write_bad(path, data):
    """Writes `data` to `path` and returns the errno of close(), or 0."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, data)
    try:
        os.close(fd)
        return 0
    except OSError as e:
        return e.errno


def safetensors_bytes(tensors, metadata=None):
    with tempfile.NamedTemporaryFile() as f:
        write_safetensors(f.name, tensors, metadata)
        return open(f.name, "rb").read()


def save_rank_with_extra(path, tensors, metadata, extra):
    """A worker that writes its extra/ files first, then its shard."""
    rank_dir = os.path.dirname(path)
    for name, data in extra.items():
        os.makedirs(os.path.dirname(f"{rank_dir}/extra/{name}"), exist_ok=True)
        with open(f"{rank_dir}/extra/{name}", "wb") as f:
            f.write(data)
    save_rank(path, tensors, metadata)


def extra_of(rank):
    """What rank `rank` of SAVED keeps in extra/: its own RNG state; rank 0
    also its arguments, in a subdirectory; rank 5 a file of several MiB."""
    files = {"rng.bin": f"rng state of rank {rank}\n".encode() + bytes(range(256))}
    if rank == 0:
        files["args/run.json"] = b'{"lr": 0.001}\n'
    if rank == 5:
        files["big/blob.bin"] = np.random.default_rng(5).bytes(3 << 20)
    return files


def read_extra(mnt, rank):
    """{path below extra/: bytes} of a rank of the newest step."""
    base = f"{mnt}/ckpt/latest/rank-{rank:05d}/extra"
    out = {}
    for root, _, files in os.walk(base):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, base)] = open(path, "rb").read()
    return out


def check_extra_files(mnt, full):
    """extra/ files saved with a step: each rank sees its own under the
    config they were saved under; under another config a rank sees the
    saved rank with its coordinates, else the one with its (tp_rank,
    pp_rank) and dp_rank 0, else rank 0's; they survive materialization;
    one closed after its step committed fails with EIO."""
    want = expected(full, SAVED, LAYERS, DIVISOR)
    step_dir = f"{mnt}/ckpt/step-00000350"
    # Every rank makes its directory first, as a job does before saving
    # (a barrier): a rank with dp_rank > 0 that has one is waited for.
    for rank in range(8):
        os.makedirs(f"{step_dir}/rank-{rank:05d}")
    # Rank 2 (dp_rank 1) keeps one extra file open past the commit.
    os.makedirs(f"{step_dir}/rank-00002/extra")
    slow = open(f"{step_dir}/rank-00002/extra/slow.bin", "wb")
    slow.write(b"late")
    procs = []
    for rank in range(8):
        meta = {"scalai.step": "350", "scalai.rank": str(rank)}
        p = multiprocessing.Process(target=save_rank_with_extra, args=(
            f"{step_dir}/rank-{rank:05d}/model.safetensors", want[rank], meta, extra_of(rank)))
        p.start()
        procs.append(p)
    for p in procs:
        p.join()
        assert p.exitcode == 0, (p.exitcode, status(mnt))
    assert latest(mnt) == "step-00000350", latest(mnt)
    try:
        slow.close()
        raise AssertionError("an extra file closed after its step committed was taken")
    except OSError as e:
        assert e.errno == errno.EIO, e
    assert "extra/slow.bin: step 350 is already committed" in status(mnt)["error"], status(mnt)
    try:
        open(f"{step_dir}/rank-00001/extra/late.bin", "wb")
        raise AssertionError("a committed step took a new extra file")
    except OSError as e:
        assert e.errno in (errno.EACCES, errno.EROFS), e
    for rank in range(8):
        assert read_extra(mnt, rank) == extra_of(rank), rank
    # Under other configs: the saved rank with the same coordinates, else
    # the one with the same (tp_rank, pp_rank) and dp_rank 0, else rank 0.
    for config, sources in (("tp=1,pp=2,dp=1", [0, 4]),
                            ("tp=4,pp=1,dp=2", [0, 1, 0, 0, 2, 3, 0, 0]),
                            ("tp=2,pp=2,dp=3", [0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 4, 5])):
        run("reconfigure", mnt, config, "--wait")
        for rank, source in enumerate(sources):
            assert read_extra(mnt, rank) == extra_of(source), (config, rank, source)
    run("reconfigure", mnt, SAVED, "--wait")
    for rank in range(8):
        assert read_extra(mnt, rank) == extra_of(rank), rank
    check_bytes(mnt, full, SAVED, LAYERS, DIVISOR)
    print("extra/ files: saved by 8 ranks, seen by the right ranks under 3 other configs")


def latest(mnt):
    return os.readlink(f"{mnt}/ckpt/latest")


def main():
    require_fuse()
    seed = test_seed()
    rng = np.random.default_rng(seed)
    full = random_gpt(rng, LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, gated=True)
    full2 = {k: (v * 2 + 1).astype(v.dtype) for k, v in full.items()}
    with tempfile.TemporaryDirectory() as tmp:
        src, store, mnt = f"{tmp}/src", f"{tmp}/store", f"{tmp}/mnt"
        os.makedirs(mnt)
        MOUNTS.add(mnt)
        want = expected(full, SAVED, LAYERS, DIVISOR)
        for rank in (0, 1, 4, 5):
            os.makedirs(f"{src}/rank-{rank:05d}")
            write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", want[rank])
        run("init", store, *LAYOUT)
        run("import", store, src, "--config", SAVED, "--step", "100")
        write_jsonl(f"{tmp}/d.jsonl", [{"i": i} for i in range(400)])
        run("dataset", "add", store, "d", "--format", "jsonl", "--global-batch", "4", f"{tmp}/d.jsonl")
        run("mount", store, mnt)

        # Every rank saves step 200 at once, replicas included.
        save_step(mnt, 200, expected(full2, SAVED, LAYERS, DIVISOR), SAVED,
                  {"scalai.consumed_samples": "204"})
        assert latest(mnt) == "step-00000200", latest(mnt)
        st = status(mnt)
        assert st["saving"] == [] and st["error"] is None, st
        check_bytes(mnt, full2, SAVED, LAYERS, DIVISOR)
        assert json.load(open(f"{mnt}/data/d/dataset.json"))["position"] == 204
        # Read back under other configs, through reconfiguration.
        for config in ("tp=1,pp=2,dp=1", "tp=4,pp=1,dp=1"):
            run("reconfigure", mnt, config, "--wait")
            check_bytes(mnt, full2, config, LAYERS, DIVISOR)
        run("reconfigure", mnt, SAVED, "--wait")
        print("saved by 8 processes, committed, read back under 2 other configs")
        # Saving a committed shard again (a late replica) is taken only if
        # its tensors are identical; a committed step never changes.
        committed = f"{mnt}/ckpt/step-00000200/rank-00003/model.safetensors"
        again = safetensors_bytes(expected(full2, SAVED, LAYERS, DIVISOR)[3], {"scalai.rank": "3"})
        assert write_bad(committed, again) == 0, status(mnt)
        changed = safetensors_bytes(expected(full, SAVED, LAYERS, DIVISOR)[3])
        assert write_bad(committed, changed) == errno.EIO
        assert "differs from the committed shard" in status(mnt)["error"], status(mnt)
        check_bytes(mnt, full2, SAVED, LAYERS, DIVISOR)

        # Bad shards: each fails its close with EIO and a reason in status.
        good = expected(full, SAVED, LAYERS, DIVISOR)[1]
        name = "decoder.layers.0.mlp.linear_fc2.weight"
        wrong_shape = dict(good)
        wrong_shape[name] = np.zeros((good[name].shape[0], good[name].shape[1] * 2), np.float32)
        renamed = {("decoder.layers.0.mlp.linear_fc9.weight" if k == name else k): v
                   for k, v in good.items()}
        missing = {k: v for k, v in good.items() if k != name}
        extra = dict(good)
        extra["decoder.layers.0.mlp.surprise.weight"] = np.zeros(3, np.float32)
        wrong_dtype = dict(good)
        wrong_dtype[name] = good[name].astype(np.float64)
        whole = safetensors_bytes(good)
        cases = [
            ("wrong shape", safetensors_bytes(wrong_shape),
             f"tensor {name}: expected [64, 64] on rank 1 (tp_rank 1, pp_rank 0), got [64, 128]"),
            ("wrong name", safetensors_bytes(renamed), "tensor decoder.layers.0.mlp.linear_fc2.weight is missing"),
            ("missing tensor", safetensors_bytes(missing), f"tensor {name} is missing"),
            ("extra tensor", safetensors_bytes(extra),
             "tensor decoder.layers.0.mlp.surprise.weight is not one the layout places on rank 1"),
            ("wrong dtype", safetensors_bytes(wrong_dtype), f"tensor {name} is F64, expected F32"),
            ("bad header", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all", "rank-00001/model.safetensors:"),
            ("truncated data", whole[:-100], "past the data section of"),
            ("trailing bytes", whole + bytes(100), "has 100 bytes after the last tensor"),
        ]
        step_dir = f"{mnt}/ckpt/step-00000300"
        os.makedirs(f"{step_dir}/rank-00001")
        for what, data, reason in cases:
            err = write_bad(f"{step_dir}/rank-00001/model.safetensors", data)
            st = status(mnt)
            assert err == errno.EIO, (what, err)
            assert st["error"] and reason in st["error"], (what, st["error"])
            assert st["saving"] == [{"step": 300, "waiting_for": [0, 1, 4, 5]}], (what, st)
            assert latest(mnt) == "step-00000200"
            print(f"refused ({what}): {st['error']}")
        # A differing replica (rank 3 is rank 1's dp copy).
        os.makedirs(f"{step_dir}/rank-00003")
        assert write_bad(f"{step_dir}/rank-00001/model.safetensors", whole) == 0
        other = safetensors_bytes(expected(full2, SAVED, LAYERS, DIVISOR)[1])
        assert write_bad(f"{step_dir}/rank-00003/model.safetensors", other) == errno.EIO
        assert "differs from its replica rank-00001" in status(mnt)["error"], status(mnt)
        # Not committed: the other ranks' files stay until the step is removed.
        assert sorted(os.listdir(step_dir)) == ["rank-00001", "rank-00003"]
        assert open(f"{step_dir}/rank-00001/model.safetensors", "rb").read() == whole
        shutil.rmtree(step_dir)
        assert not os.path.exists(step_dir) and "step-00000300" not in os.listdir(f"{mnt}/ckpt")
        # Rewriting a refused file commits the step.
        save_step(mnt, 300, {r: expected(full, SAVED, LAYERS, DIVISOR)[r] for r in (0, 4, 5)},
                  SAVED)
        assert latest(mnt) == "step-00000200"
        os.mkdir(f"{mnt}/ckpt/step-00000300/rank-00001")
        assert write_bad(f"{mnt}/ckpt/step-00000300/rank-00001/model.safetensors",
                         safetensors_bytes(wrong_shape)) == errno.EIO
        err = write_bad(f"{mnt}/ckpt/step-00000300/rank-00001/model.safetensors", whole)
        assert err == 0, (err, status(mnt))
        assert latest(mnt) == "step-00000300", latest(mnt)
        check_bytes(mnt, full, SAVED, LAYERS, DIVISOR)
        assert status(mnt)["error"] is None, status(mnt)
        # Names that are not steps or ranks are refused.
        for bad, code in ((f"{mnt}/ckpt/step-7", errno.EINVAL),
                          (f"{mnt}/ckpt/step-00000300", errno.EEXIST),
                          (f"{mnt}/data/new", errno.EACCES)):
            try:
                os.mkdir(bad)
                raise AssertionError(f"mkdir {bad} worked")
            except OSError as e:
                assert e.errno == code, (bad, e)
        os.makedirs(f"{mnt}/ckpt/step-00000400")
        try:
            os.mkdir(f"{mnt}/ckpt/step-00000400/rank-00008")
            raise AssertionError("rank 8 of a world of 8")
        except OSError as e:
            assert e.errno == errno.EINVAL, e
        check_extra_files(mnt, full)

        # An unfinished step at unmount is gone at the next mount.
        save_step(mnt, 400, {0: expected(full, SAVED, LAYERS, DIVISOR)[0]}, SAVED)
        run("umount", mnt)
        run("fsck", store)
        # Export writes the extra/ files each exported rank sees, and import
        # takes them back: a round trip through another store.
        def exported_extra(out, rank):
            base = f"{out}/rank-{rank:05d}/extra"
            return {os.path.relpath(os.path.join(d, n), base): open(os.path.join(d, n), "rb").read()
                    for d, _, names in os.walk(base) for n in names}
        run("export", store, f"{tmp}/out", "--config", "tp=2,pp=1,dp=1", "--step", "350")
        for rank in (0, 1):
            assert exported_extra(f"{tmp}/out", rank) == extra_of(rank), rank
        run("init", f"{tmp}/store2", *LAYOUT)
        run("import", f"{tmp}/store2", f"{tmp}/out", "--config", "tp=2,pp=1,dp=1")
        run("fsck", f"{tmp}/store2")
        run("export", f"{tmp}/store2", f"{tmp}/out2", "--config", "tp=2,pp=1,dp=1")
        for rank in (0, 1):
            assert exported_extra(f"{tmp}/out2", rank) == extra_of(rank), rank
        run("export", f"{tmp}/store2", f"{tmp}/out1", "--config", "tp=1,pp=1,dp=1")
        assert exported_extra(f"{tmp}/out1", 0) == extra_of(0)
        # An extra file damaged on the disk is refused, naming its blob, and
        # nothing is written.
        rng_bytes = extra_of(0)["rng.bin"]
        blob = next(n for n in os.listdir(f"{tmp}/store2/blobs")
                    if open(f"{tmp}/store2/blobs/{n}", "rb").read() == rng_bytes)
        flip(f"{tmp}/store2/blobs/{blob}", 7)
        err = run("export", f"{tmp}/store2", f"{tmp}/out3", "--config", "tp=1,pp=1,dp=1",
                  expect=1).stderr
        assert blob in err, err
        assert not os.path.exists(f"{tmp}/out3")
        flip(f"{tmp}/store2/blobs/{blob}", 7)  # back as it was
        os.mkfifo(f"{tmp}/out/rank-00001/extra/pipe")
        err = run("import", f"{tmp}/store2", f"{tmp}/out", "--config", "tp=2,pp=1,dp=1",
                  "--step", "351", expect=1).stderr
        assert "rank-00001/extra/pipe: is neither a file nor a directory" in err, err
        info = json.loads(run("inspect", f"{tmp}/store2", "--json").stdout)
        assert [st["step"] for st in info["steps"]] == [350], info["steps"]
        assert info["blobs"] == len(os.listdir(f"{tmp}/store2/blobs")), info
        run("mount", store, mnt, "--keep-steps", "2")
        assert sorted(os.listdir(f"{mnt}/ckpt")) == ["latest", "step-00000100", "step-00000200",
                                                    "step-00000300", "step-00000350"]
        assert all(read_extra(mnt, r) == extra_of(r) for r in range(8))  # kept across mounts
        # Retention: a step with an open file is spared, then dropped later.
        before = open(f"{mnt}/ckpt/step-00000100/rank-00000/model.safetensors", "rb").read()
        held = open(f"{mnt}/ckpt/step-00000100/rank-00000/model.safetensors", "rb")
        save_step(mnt, 500, expected(full, SAVED, LAYERS, DIVISOR), SAVED)
        assert sorted(os.listdir(f"{mnt}/ckpt")) == ["latest", "step-00000100", "step-00000350",
                                                    "step-00000500"], os.listdir(f"{mnt}/ckpt")
        assert held.read() == before  # its bytes stay while it is open
        held.close()
        save_step(mnt, 600, expected(full2, SAVED, LAYERS, DIVISOR), SAVED)
        assert sorted(os.listdir(f"{mnt}/ckpt")) == ["latest", "step-00000500", "step-00000600"]
        check_bytes(mnt, full2, SAVED, LAYERS, DIVISOR)
        run("umount", mnt)
        run("fsck", store)
        info = json.loads(run("inspect", store, "--json").stdout)
        assert [s["step"] for s in info["steps"]] == [500, 600], info["steps"]
        assert info["blobs"] == len(os.listdir(f"{store}/blobs")), info
    print("save_test: ok")


if __name__ == "__main__":
    with MOUNTS:
        main()
