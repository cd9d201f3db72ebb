#!/usr/bin/python3
"""Malformed datasets are refused with one clear line naming the file, and
register nothing (no record, no index file); a source file changed after
registration is never served: reads fail with EIO and `status` names the
file, while the mount and the other datasets go on. A jsonl dataset's line
index damaged in the store is named by fsck, and no mount serves from it.
`dataset add --replace` registers such a dataset again. Exits 77 only where
/dev/fuse is missing."""
import errno
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, flip, require_fuse  # noqa
from dataset_files import write_jsonl, write_megatron  # noqa
from reference import scalai  # noqa
from views import status  # noqa

BIN = sys.argv[1]
MOUNTS = Mounts()


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def refused(store, files, why, fmt="megatron", batch="4", name="bad"):
    """`dataset add` fails with one line naming `files[0]` and `why`, and
    leaves no trace."""
    p = run("dataset", "add", store, name, "--format", fmt, "--global-batch", batch, *files,
            expect=1)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and why in lines[0], (why, p.stderr)
    # It names the file at fault (a pair's .idx or .bin), or the dataset.
    assert any(os.path.basename(f).split(".")[0] in lines[0] for f in files) \
        or "global batch" in why, p.stderr
    names = [d["name"] for d in json.loads(run("inspect", store, "--json").stdout)["datasets"]]
    assert name not in names, names
    assert not os.path.exists(f"{store}/datasets") or os.listdir(f"{store}/datasets") == [], \
        os.listdir(f"{store}/datasets")
    print(f"refused: {lines[0]}")


def main():
    require_fuse()
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        store, mnt = f"{tmp}/store", f"{tmp}/mnt"
        os.makedirs(mnt)
        MOUNTS.add(mnt)
        run("init", store, "--layout", "megatron-core-gpt")
        seqs = [rng.integers(0, 1000, size=n).astype(np.uint16) for n in (5, 9, 3, 7, 4, 6)]
        write_megatron(f"{tmp}/good", seqs, np.uint16)
        idx = open(f"{tmp}/good.idx", "rb").read()
        bin_ = open(f"{tmp}/good.bin", "rb").read()

        def pair(name, idx_bytes, bin_bytes=bin_):
            open(f"{tmp}/{name}.idx", "wb").write(idx_bytes)
            open(f"{tmp}/{name}.bin", "wb").write(bin_bytes)
            return [f"{tmp}/{name}.idx"]

        refused(store, pair("truncated", idx, bin_[:-3]), "past the end of the .bin")
        refused(store, pair("magic", b"NOTANIDX\x00" + idx[9:]), "bad magic")
        refused(store, pair("version", idx[:9] + (2).to_bytes(8, "little") + idx[17:]),
                "version 2 is not supported")
        refused(store, pair("dtype", idx[:17] + bytes([11]) + idx[18:]), "unknown dtype code 11")
        far = bytearray(idx)
        far[34 + 4 * 6 + 8 * 2:34 + 4 * 6 + 8 * 3] = (1 << 40).to_bytes(8, "little")
        refused(store, pair("pointers", bytes(far)), "sequence 2 (pointer 1099511627776")
        refused(store, pair("short", idx[:-5]), "more than the file's 157 bytes hold")
        refused(store, pair("long", idx + b"xyz"), "tables end at byte 162 but the file has 165 bytes")
        refused(store, pair("counts", idx[:18] + (10 ** 12).to_bytes(8, "little") + idx[26:]),
                "more than the file")
        refused(store, pair("empty", b""), "empty file")
        refused(store, pair("emptybin", idx, b""), "empty file")
        refused(store, [f"{tmp}/missing.idx"], "No such file")
        # Two widths of token in one dataset: refused, naming both files.
        write_megatron(f"{tmp}/wide", [s.astype(np.int32) for s in seqs], np.int32)
        p = run("dataset", "add", store, "mixed", "--format", "megatron", "--global-batch", "4",
                f"{tmp}/good", f"{tmp}/wide", expect=1)
        for word in ("good.idx", "uint16", "wide.idx", "int32"):
            assert word in p.stderr, (word, p.stderr)
        print(f"refused: {p.stderr.strip()}")
        write_jsonl(f"{tmp}/lines.jsonl", [{"a": 1}, {"b": 2}])
        open(f"{tmp}/blank.jsonl", "w").write('{"a": 1}\n\n{"b": 2}\n')
        refused(store, [f"{tmp}/lines.jsonl", f"{tmp}/blank.jsonl"], "line 2 is empty", "jsonl",
                batch="1")
        open(f"{tmp}/broken.jsonl", "w").write('{"a": 1}\n{"b": \n')
        refused(store, [f"{tmp}/broken.jsonl"], "line 2 is not valid JSON", "jsonl", batch="1")
        open(f"{tmp}/nothing.jsonl", "w").write("")
        refused(store, [f"{tmp}/nothing.jsonl"], "empty file", "jsonl")
        refused(store, [f"{tmp}/good.idx"], "global batch 7 must be between 1 and the number "
                "of samples (6)", batch="7")

        # A global batch smaller than the store's dp.
        run("mount", store, mnt, "--config", "tp=1,pp=1,dp=4")
        run("umount", mnt)
        refused(store, [f"{tmp}/good"], "global batch 3 is smaller than dp=4", batch="3")

        # Registered, then changed.
        run("dataset", "add", store, "tok", "--format", "megatron", "--global-batch", "4",
            f"{tmp}/good")
        run("mount", store, mnt)
        with open(f"{mnt}/data/tok/dataset.json") as f:
            assert json.load(f)["token_dtype"] == "uint16"
        run("umount", mnt)
        run("dataset", "add", store, "web", "--format", "jsonl", "--global-batch", "2",
            f"{tmp}/lines.jsonl", expect=1)  # dp=4 > 2
        run("dataset", "add", store, "web", "--format", "jsonl", "--global-batch", "1",
            "--epochs", "4", f"{tmp}/lines.jsonl", expect=1)
        shutil.copy(f"{tmp}/lines.jsonl", f"{tmp}/more.jsonl")
        with open(f"{tmp}/more.jsonl", "a") as f:
            f.write('{"c": 3}\n{"d": 4}\n')
        run("dataset", "add", store, "web", "--format", "jsonl", "--global-batch", "4",
            f"{tmp}/more.jsonl")
        p = run("dataset", "add", store, "web", "--format", "jsonl", "--global-batch", "4",
                f"{tmp}/more.jsonl", expect=1)
        assert "dataset web already exists" in p.stderr and "--replace" in p.stderr, p.stderr
        run("mount", store, mnt)
        # A dp larger than a dataset's global batch is refused at the switch.
        try:
            with open(f"{mnt}/config", "w") as f:
                f.write("tp=1,pp=1,dp=5\n")
            raise AssertionError("dp=5 was accepted")
        except OSError as e:
            assert e.errno == errno.EINVAL, e
        assert "global batch 4 is smaller than dp=5" in status(mnt)["error"], status(mnt)
        assert open(f"{mnt}/data/tok/rank-00000/samples/0", "rb").read() in \
            [s.tobytes() for s in seqs]
        # Same size, new mtime: refused, and the file is named.
        os.utime(f"{tmp}/good.bin", ns=(10 ** 18, 10 ** 18))
        for path in (f"{mnt}/data/tok/rank-00000/samples/0",):
            try:
                open(path, "rb").read()
                raise AssertionError("a changed file was served")
            except OSError as e:
                assert e.errno == errno.EIO, e
        err = status(mnt)["error"]
        assert f"{tmp}/good.bin changed since it was registered" in err, err
        # Truncated under the mount: an error, not a crash.
        with open(f"{tmp}/more.jsonl", "r+") as f:
            f.truncate(3)
        try:
            open(f"{mnt}/data/web/rank-00001/samples/0", "rb").read()
            raise AssertionError("a truncated file was served")
        except OSError as e:
            assert e.errno == errno.EIO, e
        assert "more.jsonl changed since it was registered" in status(mnt)["error"]
        # The ids need no source file and stay readable.
        ids = np.frombuffer(open(f"{mnt}/data/web/rank-00000/sample-ids.u64", "rb").read(), "<u8")
        assert len(ids) == 1 and ids[0] < 4, ids
        run("umount", mnt)
        run("fsck", store)
        # The store's own line index of a jsonl dataset, damaged on the
        # disk: fsck names it, and no mount serves lines cut in the wrong
        # places.
        lines = [n for n in os.listdir(f"{store}/datasets") if n.endswith(".lines")]
        assert len(lines) == 1, lines
        index = f"{store}/datasets/{lines[0]}"
        original = open(index, "rb").read()
        damaged = bytearray(original)
        damaged[8] ^= 1  # where the second line starts
        open(index, "wb").write(bytes(damaged))
        p = run("fsck", store, expect=1)
        assert f"dataset web: its line index {lines[0]} does not match its checksum" in \
            p.stdout + p.stderr, (p.stdout, p.stderr)
        err = run("mount", store, mnt, expect=1).stderr
        assert "dataset web: its line index" in err and "checksum" in err, err
        assert len(err.strip().splitlines()) == 1, err
        open(index, "wb").write(original[:-8])
        p = run("fsck", store, expect=1)
        assert f"has {len(original) - 8} bytes, the record says {len(original)}" in \
            p.stdout + p.stderr, (p.stdout, p.stderr)
        os.unlink(index)
        p = run("fsck", store, expect=1)
        assert "cannot be read (open" in p.stdout + p.stderr, (p.stdout, p.stderr)
        err = run("mount", store, mnt, expect=1).stderr
        assert "cannot be read" in err and "--replace" in err, err
        open(index, "wb").write(original)
        run("fsck", store)
        replace_again(store, mnt, tmp, index, seqs)
    print("dataset_errors_test: ok")


def replace_again(store, mnt, tmp, index, seqs):
    """`dataset add --replace` registers a dataset again: the way back from
    a source file changed or a line index damaged. A replacement refused
    (a file missing, the store mounted) leaves the old record as it was;
    one taken leaves one index file, the new one."""
    web = ["dataset", "add", store, "web", "--replace", "--format", "jsonl",
           "--global-batch", "4"]
    flip(index, 8)
    err = run("mount", store, mnt, expect=1).stderr
    assert "scalai dataset add --replace indexes its files again" in err, err
    err = run(*web, f"{tmp}/missing.jsonl", expect=1).stderr
    assert "missing.jsonl" in err and len(err.strip().splitlines()) == 1, err
    assert os.listdir(f"{store}/datasets") == [os.path.basename(index)]
    p = run("fsck", store, expect=1)
    assert "does not match its checksum" in p.stdout + p.stderr, (p.stdout, p.stderr)
    want = write_jsonl(f"{tmp}/more.jsonl", [{"n": i} for i in range(6)])
    out = run(*web, f"{tmp}/more.jsonl").stdout
    assert out.startswith("replaced dataset web (jsonl): 6 samples"), out
    lines = os.listdir(f"{store}/datasets")
    assert len(lines) == 1 and lines[0] != os.path.basename(index), lines
    # The source of tok changed its mtime above.
    run("dataset", "add", store, "tok", "--replace", "--format", "megatron",
        "--global-batch", "4", f"{tmp}/good")
    run("fsck", store)
    run("mount", store, mnt)
    with open(f"{mnt}/data/web/dataset.json") as f:
        assert json.load(f)["samples"] == 6
    got = [open(f"{mnt}/data/web/rank-{d:05d}/samples/0", "rb").read().strip()
           for d in range(4)]
    assert len(set(got)) == 4 and all(g in want for g in got), (got, want)
    assert open(f"{mnt}/data/tok/rank-00000/samples/0", "rb").read() in \
        [s.tobytes() for s in seqs]
    assert status(mnt)["error"] is None, status(mnt)
    # Not while a mount serves the store.
    err = run(*web, f"{tmp}/more.jsonl", expect=1).stderr
    assert "in use by another scalai process" in err, err
    run("umount", mnt)
    print("registered again with --replace after a damaged index and changed files")


if __name__ == "__main__":
    with MOUNTS:
        main()
