#!/usr/bin/python3
"""How long a reconfiguration takes to reach every host of a cluster: four
hosts, each in its own network namespace with its own store, and a
three-member etcd, on this machine (needs root). Each round writes a config
to one host's `config` and times (a) until that write() returns: the config
validated, agreed by one etcd transaction and this host's views switched;
(b) until every host's `config` file shows it: every watch has seen it and
switched. Reference in the same run: `etcdctl put` of a key to the same etcd,
one process start included, and the single-host switch (the same write on a
mount without --cluster).

    sudo /usr/bin/python3 tools/bench_cluster.py build/tools/scalai [ROUNDS]"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import Etcd, Network, write_cluster_file  # noqa

BIN = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build/tools/scalai")
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
HOSTS = ["h0", "h1", "h2", "h3"]
MODEL = "layers=8,hidden=512,heads=8,groups=8,vocab=4000"
CONFIGS = ["tp=2,pp=2,dp=1", "tp=4,pp=1,dp=2"]
# The cluster's configs place the ranks on the hosts: one rank each, then
# two (each host materializes only its own ranks, as on separate machines).
PLACED = [c + ",hosts=" + "+".join(HOSTS) for c in CONFIGS]


def write_config(mnt, config):
    fd = os.open(f"{mnt}/config", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, (config + "\n").encode())
    finally:
        os.close(fd)


def read_config(mnt):
    with open(f"{mnt}/config") as f:
        return f.read().strip()


def switch_times(mnts, writer, config):
    """(write returned, every host shows it) in seconds after the write began."""
    seen = {}

    def watch(h):
        while read_config(mnts[h]) != config:
            time.sleep(0.001)
        seen[h] = time.perf_counter()
    threads = [threading.Thread(target=watch, args=(h,)) for h in HOSTS]
    for t in threads:
        t.start()
    start = time.perf_counter()
    write_config(mnts[writer], config)
    wrote = time.perf_counter()
    for t in threads:
        t.join(30)
    return wrote - start, max(seen.values()) - start


def wait_settled(mnts, config, timeout=120):
    """Every mount has materialized `config`; in a cluster, every host has
    also released what it kept for its peers."""
    deadline = time.time() + timeout
    while True:
        done = True
        for m in mnts.values():
            with open(f"{m}/status") as f:
                s = json.load(f)
            done &= s["config"] == config and s["state"] == "ready"
            for h in s.get("cluster", {}).get("hosts", []):
                done &= (h.get("config") == config and h.get("state") == "ready" and
                         len({e["step"] for e in h.get("holds", [])}) == len(h.get("holds", [])))
        if done:
            return
        if time.time() > deadline:
            raise SystemExit(f"the mounts did not settle on {config}")
        time.sleep(0.01)


def wait_live(mnts, timeout=60):
    deadline = time.time() + timeout
    while True:
        with open(f"{mnts['h0']}/status") as f:
            hosts = json.load(f)["cluster"]["hosts"]
        if len(hosts) == len(HOSTS) and all(h["live"] for h in hosts):
            return
        if time.time() > deadline:
            raise SystemExit("the hosts did not all come up")
        time.sleep(0.05)


def ms(xs):
    return f"median {statistics.median(xs) * 1000:.1f} ms, max {max(xs) * 1000:.1f} ms"


def main():
    with tempfile.TemporaryDirectory() as tmp:
        net = Network(["e0", "e1", "e2"] + HOSTS)
        mnts = {h: f"{tmp}/mnt-{h}" for h in HOSTS}
        try:
            etcd = Etcd(net, ["e0", "e1", "e2"], tmp)
            etcd.wait_healthy("h0")
            write_cluster_file(tmp, net, etcd, HOSTS, "bench")
            subprocess.run([BIN, "synth", f"{tmp}/ckpt", "--layout", "megatron-core-gpt",
                            "--config", CONFIGS[0], "--model", MODEL], check=True)
            for h in HOSTS + ["single"]:
                subprocess.run([BIN, "init", f"{tmp}/store-{h}", "--layout", "megatron-core-gpt",
                                "--param", "vocab_size=4000"], check=True)
                subprocess.run([BIN, "import", f"{tmp}/store-{h}", f"{tmp}/ckpt", "--config",
                                CONFIGS[0], "--step", "100"], check=True, capture_output=True)
                os.makedirs(f"{tmp}/mnt-{h}")
            for h in HOSTS:
                net.run(h, BIN, "mount", f"{tmp}/store-{h}", mnts[h], "--cluster",
                        f"{tmp}/cluster.json", "--host", h, check=True, capture_output=True)
            single = f"{tmp}/mnt-single"
            subprocess.run([BIN, "mount", f"{tmp}/store-single", single], check=True,
                           capture_output=True)
            wait_live(mnts)
            write_config(mnts["h0"], PLACED[0])  # each host keeps its own ranks
            wait_settled(mnts, PLACED[0])
            wrote, everywhere, alone, put = [], [], [], []
            for i in range(ROUNDS):
                config = PLACED[(i + 1) % 2]
                w, e = switch_times(mnts, HOSTS[i % 4], config)
                wrote.append(w)
                everywhere.append(e)
                # Timed on a quiet machine: the four hosts share its two
                # cores and one disk, where a real cluster's each have their
                # own, so the next round waits for this one's writes.
                wait_settled(mnts, config)
                start = time.perf_counter()
                write_config(single, CONFIGS[(i + 1) % 2])
                alone.append(time.perf_counter() - start)
                wait_settled({"single": single}, CONFIGS[(i + 1) % 2])
                start = time.perf_counter()
                etcd.ctl("h0", "put", "/bench/key", str(i))
                put.append(time.perf_counter() - start)
            print(f"rounds: {ROUNDS}, model {MODEL} (bf16), "
                  f"configs {PLACED[0]} <-> {PLACED[1]} (single host: without hosts=)")
            print(f"cluster write() returned:       {ms(wrote)}")
            print(f"every host of 4 switched:       {ms(everywhere)}")
            print(f"single-host write() (no etcd):  {ms(alone)}")
            print(f"etcdctl put (process + txn):    {ms(put)}")
        finally:
            for h in list(mnts) + ["single"]:
                subprocess.run(["umount", "-l", f"{tmp}/mnt-{h}"], capture_output=True)
            net.close()


if __name__ == "__main__":
    main()
