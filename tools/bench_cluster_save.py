#!/usr/bin/python3
"""What `mount --replicas 2` costs a save across hosts: two hosts, each in its
own network namespace with its own store, and one etcd member, on this
machine (needs root). Each round the workers of both hosts write their ranks
of a new step through their own host's mount at once, and the round is timed
from the first write until `ckpt/latest` names the step on both hosts: the
step saved, voted, (with replicas) each host's shards copied to the other
host and checked, committed by one etcd transaction and recorded on both.
The same rounds run with every host mounted with --replicas 1, then 2.
Reference in the same run: `cp` of the same shard files into a directory of
each host's store disk, with `sync`, both hosts at once.

    sudo /usr/bin/python3 tools/bench_cluster_save.py build/tools/scalai [ROUNDS]"""
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import Etcd, Network, write_cluster_file  # noqa

BIN = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build/tools/scalai")
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
HOSTS = ["h0", "h1"]
MODEL = os.environ.get("SCALAI_BENCH_MODEL",
                       "layers=8,hidden=1024,heads=16,groups=16,vocab=8000")
SAVED = "tp=2,pp=2,dp=1"
CONFIG = SAVED + ",hosts=" + "+".join(HOSTS)  # h0: stage 0, h1: stage 1


def latest(mnt):
    try:
        return os.readlink(f"{mnt}/ckpt/latest")
    except OSError:
        return ""


def status(mnt):
    with open(f"{mnt}/status") as f:
        return json.load(f)


def wait(what, ok, timeout=120):
    deadline = time.time() + timeout
    while not ok():
        if time.time() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.005)


def ranks_of(h):
    i = HOSTS.index(h)
    return [2 * i, 2 * i + 1]


def save_round(mnts, shards, step):
    """Seconds from the first write until both hosts show `step` latest."""
    name = f"step-{step:08d}"

    def worker(h):
        for rank in ranks_of(h):
            d = f"{mnts[h]}/ckpt/{name}/rank-{rank:05d}"
            os.makedirs(d, exist_ok=True)
            with open(shards[rank], "rb") as src, open(f"{d}/model.safetensors", "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
                dst.flush()
                os.fsync(dst.fileno())
    start = time.perf_counter()
    os.makedirs(f"{mnts['h0']}/ckpt/{name}")
    threads = [threading.Thread(target=worker, args=(h,)) for h in HOSTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait(f"step {step} on every host",
         lambda: all(latest(m) == name for m in mnts.values()))
    return time.perf_counter() - start


def cp_round(tmp, shards):
    """The same files copied with cp on each host's disk, then sync."""
    outs = [f"{tmp}/cp-{h}" for h in HOSTS]
    for o in outs:
        shutil.rmtree(o, ignore_errors=True)
        os.makedirs(o)
    start = time.perf_counter()
    procs = [subprocess.Popen(["sh", "-c", " && ".join(
                 f"cp {shards[r]} {o}/rank-{r:05d}.safetensors" for r in ranks_of(h))])
             for h, o in zip(HOSTS, outs)]
    for p in procs:
        p.wait()
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start


def main():
    with tempfile.TemporaryDirectory(dir=os.environ.get("SCALAI_BENCH_DIR")) as tmp:
        net = Network(["e0"] + HOSTS)
        mnts = {h: f"{tmp}/mnt-{h}" for h in HOSTS}
        mounted = set()
        try:
            etcd = Etcd(net, ["e0"], tmp)
            etcd.wait_healthy("h0")
            cluster = write_cluster_file(tmp, net, etcd, HOSTS, "bench-save")
            subprocess.run([BIN, "synth", f"{tmp}/ckpt", "--layout", "megatron-core-gpt",
                            "--config", SAVED, "--model", MODEL], check=True,
                           capture_output=True)
            vocab = dict(kv.split("=") for kv in MODEL.split(","))["vocab"]
            shards = sorted(glob.glob(f"{tmp}/ckpt/rank-*/model.safetensors"))
            size = sum(os.path.getsize(s) for s in shards)
            for h in HOSTS:
                subprocess.run([BIN, "init", f"{tmp}/store-{h}", "--layout",
                                "megatron-core-gpt", "--param", f"vocab_size={vocab}"],
                               check=True, capture_output=True)
                subprocess.run([BIN, "import", f"{tmp}/store-{h}", f"{tmp}/ckpt", "--config",
                                SAVED, "--step", "1"], check=True, capture_output=True)
                os.makedirs(mnts[h])

            def mount_all(replicas):
                for h in sorted(mounted):
                    subprocess.run([BIN, "umount", mnts[h]], check=True)
                    mounted.discard(h)
                for h in HOSTS:
                    net.run(h, BIN, "mount", f"{tmp}/store-{h}", mnts[h], "--cluster", cluster,
                            "--host", h, "--replicas", str(replicas), "--keep-steps", "2",
                            check=True, capture_output=True)
                    mounted.add(h)
                wait("both hosts live", lambda: all(
                    len([x for x in status(m)["cluster"]["hosts"] if x["live"]]) == 2
                    for m in mnts.values()))

            step = 100
            times = {}
            for replicas in [1, 2]:
                mount_all(replicas)
                if status(mnts["h0"])["config"] != CONFIG:
                    with open(f"{mnts['h0']}/config", "w") as f:
                        f.write(CONFIG + "\n")
                wait(CONFIG, lambda: all(status(m)["config"] == CONFIG and
                                         status(m)["state"] == "ready" for m in mnts.values()))
                times[replicas] = []
                for _ in range(ROUNDS + 1):  # the first round warms up
                    step += 1
                    times[replicas].append(save_round(mnts, shards, step))
                times[replicas] = times[replicas][1:]
                held = {h: x.get("holds", []) for m in mnts.values()
                        for x in status(m)["cluster"]["hosts"] for h in [x["name"]]}
                print(f"--replicas {replicas}: what each host holds: {json.dumps(held)}")
            cp = [cp_round(tmp, shards) for _ in range(ROUNDS)]
            mb = size / 1e6
            one, two, ref = (statistics.median(times[1]), statistics.median(times[2]),
                             statistics.median(cp))
            print(f"model {MODEL} (bf16), {SAVED} on {'+'.join(HOSTS)}: {mb:.0f} MB a step, "
                  f"{mb / 2:.0f} MB a host; {ROUNDS} rounds each")
            print(f"save, committed on both, --replicas 1: median {one:.2f} s "
                  f"(max {max(times[1]):.2f} s), {mb / one:.0f} MB/s")
            print(f"save, committed on both, --replicas 2: median {two:.2f} s "
                  f"(max {max(times[2]):.2f} s), {mb / two:.0f} MB/s")
            print(f"cp + sync of the same files, both hosts: median {ref:.2f} s")
            print(f"replication costs {two / one:.2f}x the time of a save without it; "
                  f"saving is {one / ref:.2f}x / {two / ref:.2f}x the time of cp")
        finally:
            for h in HOSTS:
                subprocess.run(["umount", "-l", mnts[h]], capture_output=True)
            net.close()


if __name__ == "__main__":
    main()
