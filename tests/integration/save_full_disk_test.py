#!/usr/bin/python3
"""A save through the mount into a full filesystem: the store lives on a
small tmpfs; a writer filling it gets ENOSPC, the step does not commit, the
earlier steps stay intact (fsck, every byte through the mount), and once
space is freed (the failed step removed with rm -r, a filler file deleted)
the same save commits. Exits 77 where /dev/fuse is missing or a tmpfs
cannot be mounted (not root)."""
import errno
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, small_tmpfs, test_seed  # noqa
from reference import random_gpt, scalai, write_safetensors  # noqa
from views import check_bytes, expected, status  # noqa

BIN = sys.argv[1]
MOUNTS = Mounts()  # the FUSE mount and the tmpfs under the store
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 2, 256, 8, 4, 512, 1001, 8
CONFIG = "tp=2,pp=1,dp=1"
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]
MIB = 1 << 20


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def save(mnt, step, full):
    """Saves every rank in turn; returns the errno of the first failure."""
    for rank, tensors in expected(full, CONFIG, LAYERS, DIVISOR).items():
        path = f"{mnt}/ckpt/step-{step:08d}/rank-{rank:05d}/model.safetensors"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            write_safetensors(path, tensors, {"scalai.step": str(step)})
        except OSError as e:
            return e.errno
    return 0


def main():
    require_fuse()
    seed = test_seed()
    rng = np.random.default_rng(seed)
    full = [random_gpt(rng, LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, gated=True)
            for _ in range(3)]
    step_bytes = sum(x.nbytes for x in full[0].values())
    with tempfile.TemporaryDirectory() as tmp:
        with MOUNTS:
            body(tmp, full, step_bytes)
    print("save_full_disk_test: ok")


def body(tmp, full, step_bytes):
    small, src, mnt = f"{tmp}/small", f"{tmp}/src", f"{tmp}/mnt"
    os.makedirs(mnt)
    # Room for the catalog, two steps and a filler that leaves less
    # than a third step.
    size = 2 * step_bytes + 2 * step_bytes + 16 * MIB
    small_tmpfs(small, size, MOUNTS)
    store = f"{small}/store"
    for rank, tensors in expected(full[0], CONFIG, LAYERS, DIVISOR).items():
        os.makedirs(f"{src}/rank-{rank:05d}")
        write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", tensors)
    run("init", store, *LAYOUT)
    run("import", store, src, "--config", CONFIG, "--step", "1")
    run("mount", store, mnt)
    MOUNTS.add(mnt)
    assert save(mnt, 2, full[1]) == 0
    assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000002"
    free = shutil.disk_usage(small).free
    with open(f"{small}/filler", "wb") as f:
        f.write(b"\0" * (free - step_bytes // 2))
    print(f"tmpfs of {size / MIB:.1f} MiB, a step is {step_bytes / MIB:.1f} MiB, "
          f"{shutil.disk_usage(small).free / MIB:.1f} MiB left")
    err = save(mnt, 3, full[2])
    assert err == errno.ENOSPC, (err, status(mnt))
    assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000002"
    check_bytes(mnt, full[1], CONFIG, LAYERS, DIVISOR)
    print(f"save into a full filesystem: ENOSPC; status: {status(mnt)['error']}")
    # Free the space: the failed step, then the filler; the save commits.
    shutil.rmtree(f"{mnt}/ckpt/step-00000003")
    os.unlink(f"{small}/filler")
    assert save(mnt, 3, full[2]) == 0, status(mnt)
    assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000003"
    check_bytes(mnt, full[2], CONFIG, LAYERS, DIVISOR)
    run("umount", mnt)
    MOUNTS.discard(mnt)
    run("fsck", store)
    run("mount", store, mnt)
    MOUNTS.add(mnt)
    assert sorted(os.listdir(f"{mnt}/ckpt")) == ["latest", "step-00000001", "step-00000002",
                                                "step-00000003"]
    run("umount", mnt)
    MOUNTS.discard(mnt)


if __name__ == "__main__":
    main()
