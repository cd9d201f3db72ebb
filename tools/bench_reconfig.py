#!/usr/bin/python3
"""Reconfiguration speed on a ~2 GiB, 303-tensor GPT checkpoint (bf16, SwiGLU,
GQA), all measured in the same run on the same filesystem:

  switch          writing MOUNT/config until a new open sees the new layout
  materialize     from the switch until status says "ready" again (plan, copy,
                  checksums, syncfs, catalog commit, new tree), against `cp` of
                  as many bytes as had to move, followed by `sync`
  counters        the bytes the materializer wrote against `scalai plan`'s
                  minimum (bytes_to_write)

Run by hand after building:  tools/bench_reconfig.py [WORKDIR] [--rounds N]
(default WORKDIR: a temporary directory under /var/tmp). Each timed copy
starts after a sync and a pause: this VM's disk lags by seconds in write-back.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALAI = os.path.join(ROOT, "build", "tools", "scalai")
MODEL = "layers=50,hidden=1280,heads=16,groups=4,ffn=4096,vocab=32000,gated_linear_unit=1"
LAYOUT = ["--layout", "megatron-core-gpt", "--param", "vocab_size=32000",
          "--param", "gated_linear_unit=1"]
A, B = "tp=2,pp=2,dp=1", "tp=4,pp=1,dp=1"  # every split tensor moves both ways
DP_ONLY = "tp=2,pp=2,dp=4"


def scalai(*args):
    return subprocess.run([SCALAI, *args], check=True, capture_output=True, text=True).stdout


def settle(server=None):
    """Lets the disk go quiet before a timed step: the blobs a materialization
    freed are released once the mount's old trees go (this root filesystem
    is mounted with `discard`, so freeing 2 GiB costs disk time too), then
    everything is synced, then a pause for the disk's own write-back."""
    deadline = time.time() + 30
    while server is not None and time.time() < deadline:
        fds = f"/proc/{server.pid}/fd"
        held = [f for f in os.listdir(fds) if "(deleted)" in os.readlink(f"{fds}/{f}")]
        if not held:
            break
        time.sleep(0.1)
    os.sync()
    time.sleep(3)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def switch(mnt, config):
    """Seconds from the write to the first open that sees the new layout."""
    before = read_json(f"{mnt}/status")["generation"]
    t0 = time.perf_counter()
    with open(f"{mnt}/config", "w") as f:
        f.write(config + "\n")
    while read_json(f"{mnt}/ckpt/latest/rank-00000/rank.json")["config"] != config:
        pass
    t1 = time.perf_counter()
    while True:
        s = read_json(f"{mnt}/status")
        # The switch makes a new generation and marks it materializing at once.
        if s["state"] == "ready" and s["generation"] > before:
            break
        time.sleep(0.002)
    t2 = time.perf_counter()
    assert s["config"] == config and s["error"] is None, s
    return t1 - t0, t2 - t0, s["bytes_moved"]


def cp_sync(work, nbytes, server):
    """Seconds for `cp` of nbytes (a file in the page cache) and `sync`."""
    src, dst = f"{work}/ref-src", f"{work}/ref-dst"
    if not os.path.exists(src) or os.path.getsize(src) != nbytes:
        with open(src, "wb") as f:
            f.write(os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1)))
    settle(server)
    t0 = time.perf_counter()
    subprocess.run(["cp", src, dst], check=True)
    subprocess.run(["sync"], check=True)
    t = time.perf_counter() - t0
    os.unlink(dst)
    return t


def planned(before, after):
    out = scalai("plan", *LAYOUT, "--model", MODEL, "--from", before, "--to", after, "--json")
    return json.loads(out)["bytes_to_write"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="?")
    ap.add_argument("--rounds", type=int, default=3)
    o = ap.parse_args()
    work = o.work or tempfile.mkdtemp(prefix="scalai-reconfig.", dir="/var/tmp")
    mnt = f"{work}/mnt"
    try:
        scalai("synth", f"{work}/ckpt", *LAYOUT[:2], "--model", MODEL, "--config", A, "--seed", "1")
        scalai("init", f"{work}/store", *LAYOUT)
        scalai("import", f"{work}/store", f"{work}/ckpt", "--config", A)
        shutil.rmtree(f"{work}/ckpt")
        os.makedirs(mnt)
        server = subprocess.Popen([SCALAI, "mount", f"{work}/store", mnt, "--foreground"],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().startswith("mounted")
        job = read_json(f"{mnt}/job.json")
        tensors, size = len(job["model"]["tensors"]), job["model"]["bytes"]
        print(f"model: {tensors} tensors, {size / 2**30:.2f} GiB ({MODEL}, bf16)")
        rows = {"switch": [], "dp": [], "mat": [], "ref": [], "count": []}
        current = A
        for _ in range(o.rounds):
            for target in (B, A):
                want = planned(current, target)
                settle(server)
                sw, mat, moved = switch(mnt, target)
                rows["switch"].append(sw)
                rows["mat"].append((mat, moved))
                rows["count"].append((current, target, want, moved))
                rows["ref"].append(cp_sync(work, moved, server))
                current = target
            for target in (DP_ONLY, A):
                sw, mat, moved = switch(mnt, target)
                rows["dp"].append((sw, mat, moved))
                current = target
        scalai("umount", mnt)
        server.wait(timeout=60)
        fsck = scalai("fsck", f"{work}/store").strip()

        ms = [1000 * t for t in rows["switch"]]
        print(f"switch (tp=2,pp=2 <-> tp=4,pp=1), write to new layout seen: "
              f"median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms, n={len(ms)}")
        dp = [1000 * s for s, _, _ in rows["dp"]]
        dpm = [1000 * m for _, m, _ in rows["dp"]]
        print(f"switch (dp=1 <-> dp=4): median {statistics.median(dp):.1f} ms; ready again "
              f"(nothing to move: {max(m for _, _, m in rows['dp'])} bytes) after median "
              f"{statistics.median(dpm):.1f} ms")
        ratios = []
        for (mat, moved), ref in zip(rows["mat"], rows["ref"]):
            ratios.append(ref / mat)
            print(f"materialize {moved / 2**30:.2f} GiB: {mat:.2f} s ({moved / 2**30 / mat:.2f} GiB/s)"
                  f"; cp + sync of the same bytes {ref:.2f} s; ratio {ref / mat:.2f}x cp")
        print(f"materialization vs cp + sync: best {max(ratios):.2f}x, "
              f"median {statistics.median(ratios):.2f}x")
        for before, after, want, moved in rows["count"]:
            assert want == moved, (before, after, want, moved)
        print(f"counters: bytes written = plan's bytes_to_write in all {len(rows['count'])} "
              f"materializations (e.g. {rows['count'][0][3]} bytes for {A} -> {B})")
        print(f"fsck: {fsck}")
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)
        if not o.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
