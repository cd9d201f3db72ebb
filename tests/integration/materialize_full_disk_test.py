#!/usr/bin/python3
"""Bounded writes and a failed materialization that says so (issue 24).
- A write far past a shard's largest valid size (its tensors plus the largest
  header) fails at once with EFBIG, writes nothing (no blob file grows past
  the bound) and `status` says why; a valid shard written back to front still
  commits.
- With the store's filesystem full, a reconfiguration's materialization
  fails: `status` says "failed" with the error and the bytes still to move,
  `reconfigure --wait` exits 1, the views stay right (read from the stored
  shards), and the store stays clean (fsck). After space is freed, writing
  the same config again (`scalai reconfigure MOUNT C --wait`) finishes it and
  `status` is "ready".
Exits 77 where /dev/fuse is missing or a tmpfs cannot be mounted."""
import errno
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, small_tmpfs, test_seed  # noqa
from reference import random_gpt, safetensors_bytes, scalai, write_safetensors  # noqa
from views import check_bytes, expected, status  # noqa

BIN = sys.argv[1]
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 2, 256, 8, 4, 512, 1001, 8
SAVED, TARGET = "tp=2,pp=1,dp=1", "tp=1,pp=1,dp=1"
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]
MIB = 1 << 20


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def bounded_writes(store, mnt, full):
    want = expected(full, SAVED, LAYERS, DIVISOR)
    step = f"{mnt}/ckpt/step-00000005"
    for r in (0, 1):
        os.makedirs(f"{step}/rank-{r:05d}")
    fd = os.open(f"{step}/rank-00000/model.safetensors", os.O_WRONLY | os.O_CREAT)
    try:
        os.pwrite(fd, b"0123456789", 1 << 40)
        raise AssertionError("a write at 1 TiB was accepted")
    except OSError as e:
        assert e.errno == errno.EFBIG, e
    assert "largest valid size" in (status(mnt)["error"] or ""), status(mnt)
    largest = max(os.path.getsize(f"{store}/blobs/{b}") for b in os.listdir(f"{store}/blobs"))
    assert largest < 1 << 30, largest  # nothing sparse and huge
    try:
        os.close(fd)  # the handle saw a failed write: its close says so
    except OSError:
        pass
    # A valid shard written back to front, piece by piece, commits.
    for r in (0, 1):
        data = safetensors_bytes(want[r], {"scalai.step": "5"})
        fd = os.open(f"{step}/rank-{r:05d}/model.safetensors", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        cuts = list(range(0, len(data), 300_000)) + [len(data)]
        for a, b in reversed(list(zip(cuts, cuts[1:]))):
            os.pwrite(fd, data[a:b], a)
        os.close(fd)
    assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000005", status(mnt)
    check_bytes(mnt, full, SAVED, LAYERS, DIVISOR)
    print("a write at 1 TiB: EFBIG, nothing written; a shard written back to front commits")


def main():
    require_fuse()
    rng = np.random.default_rng(test_seed())
    full = random_gpt(rng, LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, gated=True)
    step_bytes = sum(x.nbytes for x in full.values())
    with tempfile.TemporaryDirectory() as tmp, Mounts() as mounts:
        small, src, mnt = f"{tmp}/small", f"{tmp}/src", f"{tmp}/mnt"
        os.makedirs(mnt)
        small_tmpfs(small, 6 * step_bytes + 16 * MIB, mounts)
        store = f"{small}/store"
        for rank, tensors in expected(full, SAVED, LAYERS, DIVISOR).items():
            os.makedirs(f"{src}/rank-{rank:05d}")
            write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", tensors)
        run("init", store, *LAYOUT)
        run("import", store, src, "--config", SAVED, "--step", "1")
        run("mount", store, mounts.add(mnt))
        bounded_writes(store, mnt, full)

        # Fill the filesystem but for half a step: materializing TARGET
        # (every tensor moves: a whole step) cannot fit.
        free = shutil.disk_usage(small).free
        with open(f"{small}/filler", "wb") as f:
            f.write(b"\0" * (free - step_bytes // 2))
        p = run("reconfigure", mnt, TARGET, "--wait", expect=1)
        st = status(mnt)
        assert st["state"] == "failed" and st["config"] == TARGET, st
        assert "No space left" in st["error"] and "No space left" in p.stderr, (st, p.stderr)
        assert st["bytes_to_move"] > st["bytes_moved"], st
        check_bytes(mnt, full, TARGET, LAYERS, DIVISOR)  # views right meanwhile
        print(f"full disk: state {st['state']}, {st['bytes_to_move'] - st['bytes_moved']} "
              f"bytes still to move; error: {st['error']}")
        run("umount", mnt)
        mounts.discard(mnt)
        run("fsck", store)
        # A new mount resumes materializing, and fails the same way.
        run("mount", store, mounts.add(mnt))
        p = run("reconfigure", mnt, TARGET, "--wait", expect=1)
        assert status(mnt)["state"] == "failed", status(mnt)

        os.unlink(f"{small}/filler")
        out = run("reconfigure", mnt, TARGET, "--wait").stdout
        st = status(mnt)
        assert st["state"] == "ready" and st["error"] is None and st["progress"] == 1.0, st
        assert st["bytes_moved"] == st["bytes_to_move"] > 0, st
        check_bytes(mnt, full, TARGET, LAYERS, DIVISOR)
        print(f"after freeing space: {out.strip()}")
        run("umount", mnt)
        mounts.discard(mnt)
        run("fsck", store)
        info = json.loads(run("inspect", store, "--json").stdout)
        assert info["config"] == TARGET and [s["config"] for s in info["steps"]] == [TARGET] * 2, info
    print("materialize_full_disk_test: ok")


if __name__ == "__main__":
    main()
