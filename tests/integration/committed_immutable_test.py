#!/usr/bin/python3
"""Committed bytes never change (issue 26). A step is saved through the
mount while a second handle on its shard, and one on an extra/ file, were
opened for writing before the commit, and a shell sits in the rank's
directory. After the commit, every way to change the bytes is refused with
EROFS or EACCES: pwrite and ftruncate through the old handles, truncate and
a new O_WRONLY open (without O_TRUNC) by the old working directory and by
the committed path. The mount stays up, reads give the saved bytes, and
after unmounting `scalai fsck` passes. Exits 77 only where /dev/fuse is
missing."""
import errno
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, synth_store  # noqa
from reference import scalai  # noqa
from views import status  # noqa

BIN = sys.argv[1]
MODEL = "layers=2,hidden=256,heads=4,vocab=512"
CONFIG = "tp=1,pp=1,dp=1"
REFUSED = {errno.EROFS, errno.EACCES}


def refused(what, fn):
    try:
        fn()
    except OSError as e:
        assert e.errno in REFUSED, f"{what}: {e}"
        return
    raise AssertionError(f"{what}: accepted")


def read(path):
    with open(path, "rb") as f:
        return f.read()


def tensor_bytes(data):
    """What follows a safetensors header: the view's header names its rank."""
    return data[8 + int.from_bytes(data[:8], "little"):]


def main():
    require_fuse()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, Mounts() as mounts:
        src, store = synth_store(BIN, tmp, CONFIG, MODEL, 512, seed=3)
        mnt = f"{tmp}/mnt"
        os.makedirs(mnt)
        data = read(f"{src}/rank-00000/model.safetensors")
        scalai(BIN, "mount", store, mounts.add(mnt))

        rank_dir = f"{mnt}/ckpt/step-00000200/rank-00000"
        os.makedirs(f"{rank_dir}/extra")
        cwd = os.getcwd()
        os.chdir(rank_dir)
        try:
            extra = os.open("extra/rng.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.write(extra, b"rng state")
            os.close(os.dup(extra))  # a close checks the file; the handle stays open
            writer = os.open("model.safetensors", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.write(writer, data)
            late = os.open("model.safetensors", os.O_WRONLY)
            os.close(writer)  # the last shard: the step commits
            assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000200", status(mnt)
            print("step 200 committed with a second writable handle still open")

            refused("pwrite through a handle opened before the commit",
                    lambda: os.pwrite(late, b"X" * 64, 100))
            refused("ftruncate through it", lambda: os.ftruncate(late, 0))
            refused("pwrite into extra/ through its open handle",
                    lambda: os.pwrite(extra, b"Y" * 4, 0))
            refused("ftruncate of extra/ through its open handle",
                    lambda: os.ftruncate(extra, 0))
            refused("truncate by the old working directory",
                    lambda: os.truncate("model.safetensors", 0))
            refused("O_WRONLY open by the old working directory",
                    lambda: os.close(os.open("model.safetensors", os.O_WRONLY)))
            refused("O_RDWR open by the old working directory",
                    lambda: os.close(os.open("model.safetensors", os.O_RDWR)))
            committed = f"{mnt}/ckpt/step-00000200/rank-00000/model.safetensors"
            refused("truncate by the committed path", lambda: os.truncate(committed, 0))
            refused("O_WRONLY open by the committed path",
                    lambda: os.close(os.open(committed, os.O_WRONLY)))
            refused("O_APPEND open by the committed path",
                    lambda: os.close(os.open(committed, os.O_WRONLY | os.O_APPEND)))
            os.close(late)
            os.close(extra)
            assert read("model.safetensors") == data
        finally:
            os.chdir(cwd)
        assert tensor_bytes(read(committed)) == tensor_bytes(data)
        assert read(f"{mnt}/ckpt/step-00000200/rank-00000/extra/rng.bin") == b"rng state"
        assert status(mnt)["error"] is None or "committed" in status(mnt)["error"], status(mnt)
        print("every write, truncation and writable open after the commit: refused; "
              "the bytes read back as saved")

        scalai(BIN, "umount", mnt)
        mounts.discard(mnt)
        print(scalai(BIN, "fsck", store).stdout.strip())
    print("committed_immutable_test: ok")


if __name__ == "__main__":
    main()
