#!/usr/bin/python3
"""A dataset registered again (`dataset add --replace`) loses nothing when
the replacement fails. With the store on a full filesystem (a small tmpfs)
the new line index cannot be written: one line naming the error, no index
file left, and the old record still serves its samples through a mount.
Filled to the last byte, every command that opens the store for writing
fails with one line (it used to abort in RocksDB's own log writer). A
replacement SIGKILLed while it indexes leaves the old record too; its half
written index is removed when the store is next opened for writing. Exits
77 where /dev/fuse is missing or a tmpfs cannot be mounted (not root)."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, deadline_in, require_fuse, small_tmpfs  # noqa
from dataset_files import write_jsonl  # noqa
from reference import scalai  # noqa

BIN = sys.argv[1]
MOUNTS = Mounts()  # the FUSE mount and the tmpfs under the store
OLD = [{"old": i} for i in range(8)]


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def replace(store, source):
    return [BIN, "dataset", "add", store, "web", "--replace", "--format", "jsonl",
            "--global-batch", "4", source]


def indexes(store):
    return sorted(os.listdir(f"{store}/datasets"))


def store_with_web(store, tmp):
    """A new store at `store` with the dataset `web` of OLD's lines; returns
    the index files it holds."""
    run("init", store, "--layout", "megatron-core-gpt")
    write_jsonl(f"{tmp}/old.jsonl", OLD)
    run("dataset", "add", store, "web", "--format", "jsonl", "--global-batch", "4",
        f"{tmp}/old.jsonl")
    return indexes(store)


def serves_old(store, mnt):
    """A mount of `store` shows `web` as first registered: 8 samples, rank
    0's first one of them."""
    run("mount", store, mnt, "--config", "tp=1,pp=1,dp=1")
    try:
        with open(f"{mnt}/data/web/dataset.json") as f:
            count = json.load(f)["samples"]
        with open(f"{mnt}/data/web/rank-00000/samples/0", "rb") as f:
            first = f.read().strip()
    finally:
        run("umount", mnt)
    lines = [json.dumps(r).encode() for r in OLD]
    assert count == len(OLD) and first in lines, (count, first)


def big_jsonl(path, lines):
    """`lines` short JSON lines, written in blocks."""
    with open(path, "w") as f:
        for start in range(0, lines, 100_000):
            f.write("".join(f'{{"i":{i}}}\n' for i in range(start, min(lines, start + 100_000))))


def full_disk(tmp, mnt):
    fs = small_tmpfs(f"{tmp}/fs", 6 << 20, MOUNTS)
    store = f"{fs}/store"
    before = store_with_web(store, tmp)
    # A million lines need an 8 MB index: more than the filesystem holds.
    big_jsonl(f"{tmp}/big.jsonl", 1_000_000)
    p = subprocess.run(replace(store, f"{tmp}/big.jsonl"), capture_output=True, text=True)
    assert p.returncode == 1, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], p.stderr
    assert indexes(store) == before, indexes(store)
    run("fsck", store)
    serves_old(store, mnt)
    print(f"full disk: {lines[0]}; the old record serves its 8 samples")
    # Filled to the last byte before the command starts: opening the catalog
    # for writing fails too, with the error, not an abort.
    with open(f"{fs}/filler", "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        except OSError:
            pass
    for args in (replace(store, f"{tmp}/old.jsonl"), [BIN, "fsck", store],
                 [BIN, "mount", store, mnt, "--config", "tp=1,pp=1,dp=1"]):
        p = subprocess.run(args, capture_output=True, text=True)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1 and "No space left on device" in lines[0], \
            (args[1], p.returncode, p.stderr)
    print(f"a disk full before it starts: {lines[0]}")
    os.unlink(f"{fs}/filler")
    run("fsck", store)
    serves_old(store, mnt)


def killed(tmp, mnt):
    store = f"{tmp}/store"
    before = store_with_web(store, tmp)
    big_jsonl(f"{tmp}/huge.jsonl", 8_000_000)
    # Killed once its new index exists, while it indexes.
    proc = subprocess.Popen(replace(store, f"{tmp}/huge.jsonl"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = deadline_in(60)
    while len(indexes(store)) == len(before) and proc.poll() is None:
        assert time.time() < deadline, "no new index appeared"
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, \
        f"the replacement ended before it was killed ({proc.returncode})"
    assert len(indexes(store)) == 2, indexes(store)
    p = run("fsck", store)
    assert "removed 1 orphaned file" in p.stdout, p.stdout
    assert indexes(store) == before, indexes(store)
    serves_old(store, mnt)
    print("killed while indexing: the old record stands, the half-written index is gone")


def main():
    require_fuse()
    with tempfile.TemporaryDirectory() as tmp:
        mnt = f"{tmp}/mnt"
        os.makedirs(mnt)
        with MOUNTS:
            MOUNTS.add(mnt)
            full_disk(tmp, mnt)
            killed(tmp, mnt)
    print("dataset_replace_test: ok")


if __name__ == "__main__":
    main()
