#!/usr/bin/python3
"""Dataset views at scale, all measured in the same run:

  views           a Megatron dataset of 10^9 sequences (a sparse .idx of
                  empty sequences: the views never read it to be built) is
                  mounted under dp=8 and switched to dp=7 and back; the
                  time until a new open of rank.json shows the new dp, and
                  the mount's resident memory against the same mount with a
                  dataset of 10^3 sequences (O(1): the same).
  epoch           every rank's sample-ids.u64 of one full epoch of 10^8
                  samples under dp=3 (global batch 1000, not divisible by 3)
                  read through the mount, and a bitmap of 10^8 bits proving
                  zero repeats and zero skips.
  random reads    open+read+close of random samples/K of a 10^5-sequence
                  uint16 dataset (about 100 MB), p50/p99, against the same
                  bytes read from the .bin itself (open, seek, read, close).

Run by hand after building:  tools/bench_data.py [WORKDIR] [--reads N]
"""
import argparse
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALAI = os.environ.get("SCALAI") or os.path.join(ROOT, "build", "tools", "scalai")
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from dataset_files import write_megatron  # noqa


def scalai(*args):
    return subprocess.run([SCALAI, *args], check=True, capture_output=True, text=True).stdout


def sparse_megatron(prefix, sequences):
    """An .idx of `sequences` empty uint16 sequences, written as a sparse
    file (its zero tables are holes), and a one-byte .bin."""
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, sequences, 0))
        f.truncate(34 + 12 * sequences)
    with open(prefix + ".bin", "wb") as f:
        f.write(b"\0")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def mount(store, mnt, config):
    server = subprocess.Popen([SCALAI, "mount", store, mnt, "--foreground", "--config", config],
                              stdout=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    line = server.stdout.readline()
    assert line.startswith("mounted"), line
    return server, time.perf_counter() - t0


def umount(mnt, server):
    scalai("umount", mnt)
    server.wait()


def switch(mnt, name, config, dp):
    t0 = time.perf_counter()
    with open(f"{mnt}/config", "w") as f:
        f.write(config + "\n")
    while True:
        with open(f"{mnt}/data/{name}/rank-00000/rank.json") as f:
            if json.load(f)["dp"] == dp:
                return time.perf_counter() - t0


def views(work, sequences):
    prefix, store, mnt = f"{work}/big{sequences}", f"{work}/store{sequences}", f"{work}/mnt"
    os.makedirs(mnt, exist_ok=True)
    sparse_megatron(prefix, sequences)
    scalai("init", store, "--layout", "megatron-core-gpt")
    t0 = time.perf_counter()
    scalai("dataset", "add", store, "big", "--format", "megatron", "--global-batch", "64",
           prefix)
    add = time.perf_counter() - t0
    server, mounted = mount(store, mnt, "tp=1,pp=1,dp=8")
    switches = []
    for _ in range(3):
        switches.append(switch(mnt, "big", "tp=1,pp=1,dp=7", 7))
        switches.append(switch(mnt, "big", "tp=1,pp=1,dp=8", 8))
    with open(f"{mnt}/data/big/rank-00003/rank.json") as f:
        samples = json.load(f)["samples"]
    with open(f"{mnt}/data/big/rank-00003/sample-ids.u64", "rb") as f:
        f.seek(8 * (samples - 1))
        last = struct.unpack("<Q", f.read(8))[0]
    rss = rss_kib(server.pid)
    umount(mnt, server)
    return {"sequences": sequences, "add_s": add, "mount_s": mounted,
            "switch_ms": [1000 * s for s in switches], "rss_kib": rss,
            "rank3_samples": samples, "rank3_last_id": last}


def epoch(work, sequences, batch, dp):
    prefix, store, mnt = f"{work}/epoch", f"{work}/store-epoch", f"{work}/mnt"
    sparse_megatron(prefix, sequences)
    scalai("init", store, "--layout", "megatron-core-gpt")
    scalai("dataset", "add", store, "e", "--format", "megatron", "--global-batch", str(batch),
           prefix)
    server, _ = mount(store, mnt, f"tp=1,pp=1,dp={dp}")
    seen = np.zeros(sequences, dtype=bool)
    total = 0
    t0 = time.perf_counter()
    for d in range(dp):
        ids = np.fromfile(f"{mnt}/data/e/rank-{d:05d}/sample-ids.u64", dtype="<u8")
        total += len(ids)
        seen[ids] = True
    read_s = time.perf_counter() - t0
    umount(mnt, server)
    missing = int(sequences - np.count_nonzero(seen))
    # total == sequences and nothing missing: every id exactly once.
    return {"samples": sequences, "dp": dp, "ids_read": total, "missing": missing,
            "repeats": total - (sequences - missing), "read_s": read_s,
            "ids_per_s": total / read_s}


def random_reads(work, reads):
    rng = np.random.default_rng(1)
    prefix, store, mnt = f"{work}/real", f"{work}/store-real", f"{work}/mnt"
    seqs = [rng.integers(0, 50000, size=int(n)).astype(np.uint16)
            for n in rng.integers(1, 1024, size=100000)]
    write_megatron(prefix, seqs, np.uint16)
    scalai("init", store, "--layout", "megatron-core-gpt")
    scalai("dataset", "add", store, "r", "--format", "megatron", "--global-batch", "64", prefix)
    server, _ = mount(store, mnt, "tp=1,pp=1,dp=4")
    ids = [np.fromfile(f"{mnt}/data/r/rank-{d:05d}/sample-ids.u64", dtype="<u8") for d in range(4)]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths * 2)])
    picks = [(d, random.Random(k).randrange(len(ids[d]))) for k, d in
             enumerate(np.random.default_rng(2).integers(0, 4, size=reads))]
    # Warm both paths' page cache the same way: one pass over the .bin.
    with open(prefix + ".bin", "rb") as f:
        while f.read(1 << 24):
            pass
    mount_lat, direct_lat = [], []
    for d, k in picks:
        sid = int(ids[d][k])
        t0 = time.perf_counter()
        with open(f"{mnt}/data/r/rank-{d:05d}/samples/{k}", "rb") as f:
            got = f.read()
        t1 = time.perf_counter()
        with open(prefix + ".bin", "rb") as f:
            f.seek(int(offsets[sid]))
            want = f.read(int(lengths[sid]) * 2)
        t2 = time.perf_counter()
        assert got == want, (d, k, sid)
        mount_lat.append(1000 * (t1 - t0))
        direct_lat.append(1000 * (t2 - t1))
    umount(mnt, server)

    def pct(xs, p):
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
    return {"reads": reads, "mount_p50_ms": pct(mount_lat, 0.5), "mount_p99_ms": pct(mount_lat, 0.99),
            "direct_p50_ms": pct(direct_lat, 0.5), "direct_p99_ms": pct(direct_lat, 0.99)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", nargs="?")
    ap.add_argument("--reads", type=int, default=5000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.workdir or "/var/tmp") as work:
        small = views(work, 10 ** 3)
        big = views(work, 10 ** 9)
        for v in (small, big):
            print(f"views, {v['sequences']:>10} samples: dataset add {v['add_s']:.2f} s, "
                  f"mount {v['mount_s']:.3f} s, switch dp 8<->7 median "
                  f"{statistics.median(v['switch_ms']):.1f} ms (max {max(v['switch_ms']):.1f}), "
                  f"mount RSS {v['rss_kib'] / 1024:.1f} MiB")
        e = epoch(work, 10 ** 8, 1000, 3)
        print(f"epoch of {e['samples']} samples, dp={e['dp']}: {e['ids_read']} ids read in "
              f"{e['read_s']:.2f} s ({e['ids_per_s'] / 1e6:.1f} M ids/s), "
              f"{e['repeats']} repeats, {e['missing']} skips")
        r = random_reads(work, a.reads)
        print(f"random samples/K, {r['reads']} reads: mount p50 {r['mount_p50_ms']:.3f} ms, "
              f"p99 {r['mount_p99_ms']:.3f} ms; the .bin directly p50 {r['direct_p50_ms']:.3f} ms,"
              f" p99 {r['direct_p99_ms']:.3f} ms; p99 ratio "
              f"{r['mount_p99_ms'] / r['direct_p99_ms']:.1f}x")
        json.dump({"views": [small, big], "epoch": e, "random": r},
                  open(os.path.join(ROOT, "build", "bench_data.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
