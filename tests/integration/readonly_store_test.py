#!/usr/bin/python3
"""A store reached through a read-only path (a snapshot, a backup, here a
read-only bind mount of a live store): inspect, plan and export read it, and
the export equals one made through the writable path; fsck checks it as a
reader (and finds a byte flipped); every command that writes (mount,
import, dataset add, fsck --repair) is refused with one line naming the
read-only filesystem, and the store is unchanged. Readers take no
lock: while a mount serves the store through its writable path, and after
it has stored the step anew under another config, the read-only path's
inspect, plan and export read on, and the export is the same. A read-only
store without a LOCK file (a copy made without it) is exported all the
same. Exits 77 where no bind mount can be made (not root) or /dev/fuse is
missing."""
import filecmp
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, synth_store  # noqa
from dataset_files import write_jsonl  # noqa
from reference import scalai  # noqa

BIN = os.path.abspath(sys.argv[1])
MODEL = "layers=2,hidden=64,heads=4,vocab=128"
SAVED, OTHER = "tp=2,pp=1,dp=1", "tp=1,pp=2,dp=1"


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def listing(root):
    return sorted((os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
                  for d, _, files in os.walk(root) for f in files)


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def same_tree(a, b):
    assert listing(a) == listing(b), (listing(a), listing(b))
    for name, _ in listing(a):
        assert filecmp.cmp(f"{a}/{name}", f"{b}/{name}", shallow=False), name


def main():
    require_fuse()
    # The mounts go first, before the directory under them is removed.
    with tempfile.TemporaryDirectory() as tmp, Mounts() as mounts:
        src, store = synth_store(BIN, tmp, SAVED, MODEL, 128)
        write_jsonl(f"{tmp}/web.jsonl", [{"i": i} for i in range(40)])
        ro, mnt = f"{tmp}/ro", f"{tmp}/mnt"
        os.makedirs(ro)
        os.makedirs(mnt)
        if subprocess.run(["mount", "--bind", store, ro], stderr=subprocess.DEVNULL).returncode:
            print("cannot bind mount (not root?): skipped")
            sys.exit(77)
        mounts.add(ro)
        subprocess.run(["mount", "-o", "remount,ro,bind", ro], check=True)
        before = listing(store)

        # Readers.
        assert json.loads(run("inspect", ro, "--json").stdout) == \
            json.loads(run("inspect", store, "--json").stdout)
        plan = json.loads(run("plan", ro, "--to", OTHER, "--json").stdout)
        assert (plan["from"], plan["to"]) == (SAVED, OTHER), plan
        run("export", ro, f"{tmp}/from-ro", "--config", OTHER)
        run("export", store, f"{tmp}/from-rw", "--config", OTHER)
        same_tree(f"{tmp}/from-ro", f"{tmp}/from-rw")

        # Writers: one line each, nothing changed.
        for args in (["mount", ro, mnt], ["import", ro, src, "--config", SAVED, "--step", "200"],
                     ["dataset", "add", ro, "web", "--format", "jsonl", "--global-batch", "4",
                      f"{tmp}/web.jsonl"],
                     ["fsck", ro, "--repair"]):
            err = run(*args, expect=1).stderr
            assert err.count("\n") == 1 and "Read-only file system" in err, (args, err)
        assert not os.path.ismount(mnt)
        assert listing(store) == before
        # fsck checks it as a reader, and still finds a flipped byte.
        out = run("fsck", ro).stdout
        assert "ok" in out and "on a read-only filesystem" in out, out
        blob = sorted(os.listdir(f"{store}/blobs"))[0]
        flip(f"{store}/blobs/{blob}", 100)
        err = run("fsck", ro, expect=1).stderr
        assert blob in err and "checksum" in err, err
        flip(f"{store}/blobs/{blob}", 100)
        assert listing(store) == before

        # Beside a mount serving the store through the writable path, and
        # after it stored the step anew under another config.
        run("mount", store, mnt)
        mounts.add(mnt)
        run("export", ro, f"{tmp}/while-mounted", "--config", OTHER)
        same_tree(f"{tmp}/while-mounted", f"{tmp}/from-rw")
        assert json.loads(run("inspect", ro, "--json").stdout)["config"] == SAVED
        run("plan", ro, "--to", OTHER)
        run("reconfigure", mnt, OTHER, "--wait")
        assert json.loads(run("inspect", ro, "--json").stdout)["steps"][0]["config"] == OTHER
        run("export", ro, f"{tmp}/reconfigured", "--config", OTHER)
        same_tree(f"{tmp}/reconfigured", f"{tmp}/from-rw")
        run("umount", mnt)
        mounts.discard(mnt)
        run("export", ro, f"{tmp}/after", "--config", OTHER)
        same_tree(f"{tmp}/after", f"{tmp}/from-rw")
        # A copy made without the LOCK file: no writer ever opened it there.
        os.unlink(f"{store}/LOCK")
        run("export", ro, f"{tmp}/no-lock", "--config", OTHER)
        same_tree(f"{tmp}/no-lock", f"{tmp}/from-rw")
        subprocess.run(["umount", ro], check=True)
        mounts.discard(ro)
        run("fsck", store)
    print("read-only store: inspect, plan, export and fsck read it, also beside a mount; "
          "writers refused")


if __name__ == "__main__":
    main()
