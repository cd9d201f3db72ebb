#!/usr/bin/python3
"""A damaged catalog never costs a blob (issue 26). A store with two steps,
the newest one's commit still in RocksDB's write-ahead log, is copied and
the log damaged in each copy:
- a flipped byte inside a record: the checksum catches it;
- a flipped byte in a record's length, which RocksDB takes for a log cut
  short by a crash and would drop silently: the catalog's sequence mark
  catches it;
- the same on a store without the mark (written by an older version) whose
  only commit was lost: the catalog names no blob while blob files exist.
Each time `fsck`, `mount` and `import` fail with one line saying what is
damaged, and every blob file is still there, byte for byte. The undamaged
store still passes fsck. Only `fsck --repair`, asked to, removes the
unrecorded blobs of the last case, and says so. Exits 77 only where
/dev/fuse is missing."""
import glob
import hashlib
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, flip, require_fuse, synth_store  # noqa
from reference import scalai  # noqa

BIN = sys.argv[1]
MODEL = "layers=2,hidden=256,heads=4,vocab=512"
CONFIG = "tp=2,pp=1,dp=1"
# A log record starts with a 4-byte checksum, a 2-byte length and a type.
LENGTH_HIGH_BYTE, INSIDE_RECORD = 5, 20


def blob_digests(store):
    out = {}
    for path in glob.glob(f"{store}/blobs/*"):
        with open(path, "rb") as f:
            out[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def newest_log(store):
    logs = sorted(glob.glob(f"{store}/catalog/*.log"))
    assert logs and os.path.getsize(logs[-1]) > LENGTH_HIGH_BYTE, logs
    return logs[-1]


def refused_everywhere(store, tmp, mounts, says):
    """fsck, mount and import all fail naming the damage; no blob changes."""
    before = blob_digests(store)
    assert before, store
    mnt = f"{tmp}/mnt"
    os.makedirs(mnt, exist_ok=True)
    for args in (["fsck", store], ["mount", store, mnt],
                 ["import", store, f"{tmp}/src", "--config", CONFIG, "--step", "300"]):
        p = scalai(BIN, *args, expect=1)
        if args[0] == "mount":
            mounts.add(mnt)  # in case it mounted after all
        line = p.stderr.strip()
        assert "\n" not in line and says in line, (args[0], line)
        assert blob_digests(store) == before, (args[0], "blobs changed")
    return line


def main():
    require_fuse()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, Mounts() as mounts:
        src, store = synth_store(BIN, tmp, CONFIG, MODEL, 512)
        single = f"{tmp}/single"
        shutil.copytree(store, single)  # one commit, in the log
        scalai(BIN, "import", store, src, "--config", CONFIG, "--step", "200")

        damaged = f"{tmp}/checksum"
        shutil.copytree(store, damaged)
        flip(newest_log(damaged), INSIDE_RECORD)
        line = refused_everywhere(damaged, tmp, mounts, "is damaged")
        print(f"a flipped byte in a log record: refused, no blob touched ({line})")

        damaged = f"{tmp}/length"
        shutil.copytree(store, damaged)
        flip(newest_log(damaged), LENGTH_HIGH_BYTE)
        line = refused_everywhere(damaged, tmp, mounts, "has lost commits")
        print(f"a flipped record length: refused, no blob touched ({line})")

        damaged = f"{tmp}/unmarked"
        shutil.copytree(single, damaged)
        os.unlink(f"{damaged}/catalog.sequence")
        flip(newest_log(damaged), LENGTH_HIGH_BYTE)
        line = refused_everywhere(damaged, tmp, mounts, "the catalog names none")
        print(f"an older store whose only commit was lost: refused, no blob touched ({line})")
        p = scalai(BIN, "fsck", damaged, "--repair")
        assert "removed 2 orphaned files" in p.stdout, p.stdout
        assert blob_digests(damaged) == {}
        print("fsck --repair removes them when asked")

        print(scalai(BIN, "fsck", store).stdout.strip())
    print("catalog_damage_test: ok")


if __name__ == "__main__":
    main()
