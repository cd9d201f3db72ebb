#!/usr/bin/python3
"""The mount as operators run it (issue 22): with this build's helpers in
/sbin (put there for the test and removed after), `mount -t fuse.scalai
STORE MOUNTPOINT -o config=...` mounts and serves a shard; after `umount
MOUNTPOINT` (which returns a beat before the server lets go of the store)
mounting it again at once succeeds, three times over; an fstab line (`mount -T FILE MOUNTPOINT`,
the way /etc/fstab is read) mounts with its options; an unknown option is
refused naming it. Exits 77 where /dev/fuse is missing or not root."""
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, synth_store  # noqa
from reference import read_safetensors  # noqa
from views import status  # noqa

BIN = sys.argv[1]
HELPERS = sys.argv[2:3]  # this build's mount.fuse.scalai
MODEL = "layers=2,hidden=64,heads=4,vocab=100"


def sh(*args, expect=0):
    p = subprocess.run(args, capture_output=True, text=True)
    assert p.returncode == expect, (args, p.returncode, p.stdout, p.stderr)
    return p


def check(mnt, config):
    assert status(mnt)["config"] == config, status(mnt)
    tensors, meta = read_safetensors(f"{mnt}/ckpt/latest/rank-00000/model.safetensors")
    assert meta["scalai.config"] == config and tensors, meta


def main():
    require_fuse()
    if os.geteuid() != 0:
        print("not root: cannot put helpers in /sbin; skipped")
        sys.exit(77)
    placed = []
    try:
        for helper in HELPERS:
            target = f"/sbin/{os.path.basename(helper)}"
            if os.path.exists(target):
                print(f"{target} exists (an installed scalai?): skipped")
                sys.exit(77)
            shutil.copy(helper, target)
            placed.append(target)
        with tempfile.TemporaryDirectory() as tmp, Mounts() as mounts:
            _, store = synth_store(BIN, tmp, "tp=2,pp=1,dp=1", MODEL, 100)
            mnt = f"{tmp}/mnt"
            os.makedirs(mnt)
            for config in ("tp=2,pp=1,dp=1", "tp=1,pp=1,dp=1", "tp=1,pp=2,dp=2"):
                sh("mount", "-t", "fuse.scalai", store, mnt, "-o", f"config={config},noatime")
                mounts.add(mnt)
                check(mnt, config)
                sh("umount", mnt)
                mounts.discard(mnt)
            print("mount -t fuse.scalai and umount, three times back to back: ok")

            fstab = f"{tmp}/fstab"
            with open(fstab, "w") as f:
                f.write(f"# a line as /etc/fstab holds it\n"
                        f"{store} {mnt} fuse.scalai config=tp=2,pp=1,dp=2,keep_steps=3,"
                        f"noauto,nofail,_netdev 0 0\n")
            sh("mount", "-T", fstab, mnt)
            mounts.add(mnt)
            check(mnt, "tp=2,pp=1,dp=2")
            sh("umount", mnt)
            mounts.discard(mnt)
            print("an fstab line: mounted with its options, unmounted")

            p = sh("mount", "-t", "fuse.scalai", store, mnt, "-o", "config=tp=1,pp=1,dp=1,bogus=1",
                   expect=1)
            assert 'unknown option "bogus=1"' in p.stderr, p.stderr
            assert not os.path.ismount(mnt)
            print("an unknown option refused:", p.stderr.strip())
    finally:
        for target in placed:
            os.remove(target)


if __name__ == "__main__":
    main()
