#!/usr/bin/python3
"""Saving shards far larger than the mount's write-behind window (8 MiB spans,
16 MiB kept in the page cache), so that most of each file has been streamed
to disk and dropped from the cache before its close is checked. Writers use
writes of random sizes (1 byte to 3 MiB, so nothing is aligned), one rank
empties its file halfway with ftruncate and starts over, and its dp replica
is compared after both were dropped from the cache. The step must commit,
read back equal to numpy slicing under another config (after materializing
from the streamed blobs), and pass fsck, which hashes every blob from disk.
Exits 77 only where /dev/fuse is missing."""
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, test_seed  # noqa
from reference import random_gpt, safetensors_bytes, scalai, write_safetensors  # noqa
from views import check_bytes, expected, status  # noqa

BIN = sys.argv[1]
MOUNTS = Mounts()
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 2, 512, 8, 8, 2048, 8000, 8
SAVED = "tp=1,pp=1,dp=2"
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]


def write_in_pieces(path, data, rng, restart_at=None):
    """Writes `data` front to back in pieces of random sizes; with
    `restart_at`, empties the file there once and writes it all again."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    at, restarted = 0, False
    while at < len(data):
        if restart_at is not None and not restarted and at >= restart_at:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            at, restarted = 0, True
        n = min(len(data) - at, int(rng.integers(1, 3 << 20)))
        at += os.write(fd, data[at:at + n])
    os.fsync(fd)
    os.close(fd)


def main():
    require_fuse()
    seed = test_seed()
    rng = np.random.default_rng(seed)
    full = random_gpt(rng, LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, gated=True)
    full2 = {k: (v * 3 - 1).astype(v.dtype) for k, v in full.items()}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        src, store, mnt = f"{tmp}/src", f"{tmp}/store", f"{tmp}/mnt"
        os.makedirs(mnt)
        MOUNTS.add(mnt)
        os.makedirs(f"{src}/rank-00000")
        write_safetensors(f"{src}/rank-00000/model.safetensors", expected(full, SAVED, LAYERS, DIVISOR)[0])
        scalai(BIN, "init", store, *LAYOUT)
        scalai(BIN, "import", store, src, "--config", SAVED, "--step", "100")
        scalai(BIN, "mount", store, mnt)
        with MOUNTS:  # unmounted before the directory goes
            save_and_read_back(store, mnt, full, full2, rng)
    print("save_large_test: ok")


def save_and_read_back(store, mnt, full, full2, rng):
    want = expected(full2, SAVED, LAYERS, DIVISOR)
    data = {r: safetensors_bytes(want[r], {"scalai.step": "200"}) for r in (0, 1)}
    assert len(data[0]) > 3 * (16 << 20), len(data[0])  # several windows
    step = f"{mnt}/ckpt/step-00000200"
    for r in (0, 1):
        os.makedirs(f"{step}/rank-{r:05d}")
    # The replica first, so that the commit compares against it.
    write_in_pieces(f"{step}/rank-00001/model.safetensors", data[1], rng)
    write_in_pieces(f"{step}/rank-00000/model.safetensors", data[0], rng,
                    restart_at=len(data[0]) // 2)
    assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000200", status(mnt)
    assert status(mnt)["error"] is None, status(mnt)
    print(f"committed 2 shards of {len(data[0]) / 2**20:.1f} MiB written in random pieces")
    check_bytes(mnt, full2, SAVED, LAYERS, DIVISOR)
    scalai(BIN, "reconfigure", mnt, "tp=2,pp=2,dp=1", "--wait")
    check_bytes(mnt, full2, "tp=2,pp=2,dp=1", LAYERS, DIVISOR)
    print("read back under tp=2,pp=2,dp=1 after materializing")
    scalai(BIN, "umount", mnt)
    MOUNTS.discard(mnt)
    scalai(BIN, "fsck", store)


if __name__ == "__main__":
    main()
