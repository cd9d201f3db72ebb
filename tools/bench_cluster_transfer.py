#!/usr/bin/python3
"""How fast a cluster moves state between hosts, against raw TCP between the
same hosts in the same run: two hosts, each in its own network namespace
with its own store, and a one-member etcd (needs root). The hosts first
split the model's two pipeline stages (h0 the first, h1 the second), then
swap them: each host fetches the whole of the other's stage from it while
the other does the same, and writes it into new blobs. Timed from the
config's write() until both hosts have committed it (agreement, switch,
fetch over gRPC, write, fsync, commit). Reference: iperf3 --bidir between
the same two namespaces, and `cp` of a stage's bytes on the same disk (both
"hosts" write to this machine's one disk). Then the network path alone: a
read through h0's mount of a rank only h1 holds, against one-way iperf3.

    sudo /usr/bin/python3 tools/bench_cluster_transfer.py build/tools/scalai [ROUNDS]

It also prints the CPU time both mounts used per GB moved, read from
/proc/PID/stat: steadier than rates on a shared machine, the figure to
compare two builds by.

SCALAI_BENCH_DIR puts the stores elsewhere than /var/tmp (/dev/shm: no
disk); SCALAI_BENCH_READS sets how many times the peer's rank is read.

SCALAI_BENCH_LINK=RATE (tc's units: 1gbit) gives each host a link of that
rate each way (a token bucket on what it sends), for the swaps, the reads
and iperf3 alike. Unshaped, the veth pairs run at memory speed and both
"hosts" share this machine's cores and disk, so the swaps measure the disk;
on a link slower than the disk they measure what the transfer makes of the
network, as between hosts that each have their own."""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import Etcd, Network, server_pid, write_cluster_file  # noqa

BIN = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build/tools/scalai")
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
READS = int(os.environ.get("SCALAI_BENCH_READS", "3"))  # of the peer's rank
HOSTS = ["h0", "h1"]
MODEL = os.environ.get("SCALAI_BENCH_MODEL",
                       "layers=8,hidden=1536,heads=16,groups=16,vocab=32000")
VOCAB = dict(kv.split("=") for kv in MODEL.split(","))["vocab"]
SPLIT = ["tp=1,pp=2,dp=1,hosts=h0+h1", "tp=1,pp=2,dp=1,hosts=h1+h0"]
MB = 1e6
LINK = os.environ.get("SCALAI_BENCH_LINK")


def cpu_seconds(pid):
    """User and system CPU time the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status(mnt):
    with open(f"{mnt}/status") as f:
        return json.load(f)


def write_config(mnt, config):
    fd = os.open(f"{mnt}/config", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, (config + "\n").encode())
    except OSError:
        raise SystemExit(f"{config} refused: {status(mnt)['error']}")
    finally:
        os.close(fd)


def settled(mnts, config, released=False):
    """Both hosts have committed `config` (and, with `released`, let go of
    what they kept for each other)."""
    for m in mnts.values():
        s = status(m)
        if s["config"] != config or s["state"] != "ready":
            if s["state"] == "failed":
                raise SystemExit(f"materialization failed: {s['error']}")
            return False
        if released:  # as each host recorded it with the config committed
            for h in s["cluster"]["hosts"]:
                if (h.get("config") != config or h.get("state") != "ready" or
                        len(h.get("holds", [])) != 1):
                    return False
    return True


def wait(mnts, config, released=False, timeout=120):
    deadline = time.time() + timeout
    while not settled(mnts, config, released):
        if time.time() > deadline:
            raise SystemExit(f"the hosts did not settle on {config}: " + "; ".join(
                f"{h}: {s['config']} {s['state']} {s['bytes_moved']}/{s['bytes_to_move']} "
                f"{s['error']}" for h, s in ((h, status(m)) for h, m in mnts.items())))
        time.sleep(0.005)


def fetched(mnts):
    return sum(p["bytes_fetched"] for m in mnts.values()
               for p in status(m)["cluster"]["peers"].values())


def main():
    with tempfile.TemporaryDirectory(dir=os.environ.get("SCALAI_BENCH_DIR", "/var/tmp")) as tmp:
        net = Network(["e0"] + HOSTS)
        mnts = {h: f"{tmp}/mnt-{h}" for h in HOSTS}
        try:
            etcd = Etcd(net, ["e0"], tmp)
            etcd.wait_healthy("h0")
            write_cluster_file(tmp, net, etcd, HOSTS, "bench")
            subprocess.run([BIN, "synth", f"{tmp}/ckpt", "--layout", "megatron-core-gpt",
                            "--config", "tp=1,pp=2,dp=1", "--model", MODEL], check=True,
                           capture_output=True)
            for h in HOSTS:
                subprocess.run([BIN, "init", f"{tmp}/store-{h}", "--layout", "megatron-core-gpt",
                                "--param", f"vocab_size={VOCAB}"], check=True)
                subprocess.run([BIN, "import", f"{tmp}/store-{h}", f"{tmp}/ckpt", "--config",
                                "tp=1,pp=2,dp=1", "--step", "100"], check=True,
                               capture_output=True)
                os.makedirs(mnts[h])
            for h in HOSTS:
                net.run(h, BIN, "mount", f"{tmp}/store-{h}", mnts[h], "--cluster",
                        f"{tmp}/cluster.json", "--host", h, check=True, capture_output=True)
            while not all(h["live"] for m in mnts.values()
                          for h in status(m)["cluster"]["hosts"]):
                time.sleep(0.05)
            write_config(mnts["h0"], SPLIT[0])
            wait(mnts, SPLIT[0], released=True)
            if LINK:
                for h in HOSTS:
                    net.throttle(h, LINK, burst="8mbit", latency="50ms")
            # Reference 1: raw TCP both ways at once between the namespaces.
            server = net.spawn("h1", ["iperf3", "-s", "-1"], stdout=subprocess.DEVNULL)
            time.sleep(0.5)
            p = net.run("h0", "iperf3", "-c", net.address["h1"], "-t", "5", "--bidir", "-J",
                        capture_output=True, text=True, check=True)
            server.wait(10)
            end = json.loads(p.stdout)["end"]
            tcp = (end["sum_received"]["bits_per_second"] +
                   end["sum_received_bidir_reverse"]["bits_per_second"]) / 8
            # Reference 2: the disk, copying one stage's blob, alone and as
            # the hosts write: both at once, to the one disk they share.
            stages = [max((os.path.join(f"{tmp}/store-{h}/blobs", b)
                           for b in os.listdir(f"{tmp}/store-{h}/blobs")), key=os.path.getsize)
                      for h in HOSTS]
            size = os.path.getsize(stages[0])
            disk = copy_rate(stages[:1], tmp)
            disk_both = copy_rate(stages, tmp)
            pids = {h: server_pid(mnts[h]) for h in HOSTS}
            rates, moved, swap_cpu, swap_bytes = [], 0, 0.0, 0
            for i in range(ROUNDS):
                config = SPLIT[(i + 1) % 2]
                before = fetched(mnts)
                cpu_before = sum(cpu_seconds(p) for p in pids.values())
                start = time.perf_counter()
                write_config(mnts[HOSTS[i % 2]], config)
                wait(mnts, config)
                took = time.perf_counter() - start
                moved = fetched(mnts) - before
                rates.append(moved / took)
                swap_cpu += sum(cpu_seconds(p) for p in pids.values()) - cpu_before
                swap_bytes += moved
                wait(mnts, config, released=True)
            rate = statistics.median(rates)
            # The network path alone: h0 reads, through its mount, the rank
            # h1 holds (nothing of it on h0's disk, nor in its page cache),
            # against one-way raw TCP.
            final = SPLIT[ROUNDS % 2]
            remote_rank = 0 if final.endswith("h1+h0") else 1
            path = f"{mnts['h0']}/ckpt/latest/rank-{remote_rank:05d}/model.safetensors"
            views, read_bytes = [], 0
            read_cpu = {h: cpu_seconds(p) for h, p in pids.items()}
            for _ in range(READS):
                before = fetched(mnts)
                start = time.perf_counter()
                with open(path, "rb", buffering=0) as f:
                    # Not from the kernel's cache of the file: each read
                    # asks the mount, which asks h1.
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    while f.read(4 << 20):
                        pass
                views.append((fetched(mnts) - before) / (time.perf_counter() - start))
                read_bytes += fetched(mnts) - before
            read_cpu = {h: cpu_seconds(p) - read_cpu[h] for h, p in pids.items()}
            view = statistics.median(views)
            server = net.spawn("h1", ["iperf3", "-s", "-1"], stdout=subprocess.DEVNULL)
            time.sleep(0.5)
            p = net.run("h0", "iperf3", "-c", net.address["h1"], "-t", "5", "-R", "-J",
                        capture_output=True, text=True, check=True)
            server.wait(10)
            one_way = json.loads(p.stdout)["end"]["sum_received"]["bits_per_second"] / 8
            print(f"model {MODEL} (bf16), {ROUNDS} swaps of {SPLIT[0]} <-> {SPLIT[1]}; "
                  f"{moved / MB:.0f} MB cross the network per swap (both ways); "
                  f"links {LINK + ' each way' if LINK else 'unshaped'}")
            print(f"materialization across hosts:  {rate / MB:7.0f} MB/s both ways together "
                  f"(median; {', '.join(f'{r / MB:.0f}' for r in rates)})")
            print(f"iperf3 --bidir, same hosts:    {tcp / MB:7.0f} MB/s both ways together "
                  f"-> ratio {rate / tcp:.2f}")
            print(f"read of a rank held by the peer: {view / MB:7.0f} MB/s through the mount "
                  f"(median; {', '.join(f'{v / MB:.0f}' for v in views)}); "
                  f"iperf3 one way {one_way / MB:.0f} MB/s -> ratio {view / one_way:.2f}")
            # CPU per byte moved varies less than rates on a shared machine:
            # the figure to compare two builds by.
            print(f"CPU of both mounts per GB moved: swaps {swap_cpu / (swap_bytes / 1e9):.2f} s; "
                  f"reads: serving host {read_cpu['h1'] / (read_bytes / 1e9):.2f} s, "
                  f"reading host {read_cpu['h0'] / (read_bytes / 1e9):.2f} s")
            print(f"cp + sync of a {size / MB:.0f} MB blob:   {disk / MB:7.0f} MB/s "
                  f"(each host writes what it fetches) -> ratio {rate / 2 / disk:.2f} per host")
            print(f"two cp + sync at once (one per host's blob): {disk_both / MB:7.0f} MB/s "
                  f"together -> ratio {rate / disk_both:.2f}")
        finally:
            for h in HOSTS:
                subprocess.run(["umount", "-l", mnts[h]], capture_output=True)
            net.close()
    shutil.rmtree(f"{tmp}", ignore_errors=True)


def copy_rate(sources, tmp):
    """Bytes a second that `cp` + `sync` of every file of `sources` at once
    write together."""
    start = time.perf_counter()
    copies = [subprocess.Popen(["sh", "-c", 'cp "$1" "$2" && sync "$2"', "copy", src,
                                f"{tmp}/copy-{i}"]) for i, src in enumerate(sources)]
    for c in copies:
        assert c.wait() == 0
    took = time.perf_counter() - start
    for i in range(len(sources)):
        os.unlink(f"{tmp}/copy-{i}")
    return sum(os.path.getsize(src) for src in sources) / took


if __name__ == "__main__":
    main()
