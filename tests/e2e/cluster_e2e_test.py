#!/usr/bin/python3
"""The mission across hosts: the PyTorch GPT of train.py (gloo on CPU) runs
its ranks on four hosts, each in its own network namespace with its own
store and mount, agreeing through etcd; every worker reads its checkpoint
shard and its data, and saves, only through its own host's mount. The job
changes config three times, moving ranks between hosts and changing tp, pp
and dp:

  1. tp=2,pp=2,dp=1 on h0+h1, saved at iteration 4;
  2. tp=2,pp=1,dp=2 on h1+h2: h2's mount and workers are SIGKILLed midway,
     the job's other workers die with them, and the iterations since the
     last checkpoint are lost;
  3. tp=1,pp=2,dp=1 on h0+h1, from the checkpoint of iteration 4, without
     the lost host, saved at iteration 8;
  4. tp=2,pp=1,dp=2 on h3+h0, h3 a fresh host that joined with an empty
     store, saved at iteration 12.

Every global batch's sample ids, every loss and the final parameters must
equal the uninterrupted single-host job's (1e-9 relative, float64), and
every store must pass fsck. Exits 77 only where /dev/fuse is missing or
namespaces cannot be made."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import scenario  # noqa
from netns import Etcd, Network, require_netns, server_pid, write_cluster_file  # noqa

HOSTS = ["h0", "h1", "h2", "h3"]
FIRST = ("tp=2,pp=2,dp=1,hosts=h0+h1", 4)
KILLED_PHASE = "tp=2,pp=1,dp=2,hosts=h1+h2"  # h2 dies during it
AFTER_LOSS = ("tp=1,pp=2,dp=1,hosts=h0+h1", 4)
WITH_NEW_HOST = ("tp=2,pp=1,dp=2,hosts=h3+h0", 4)
TOTAL = FIRST[1] + AFTER_LOSS[1] + WITH_NEW_HOST[1]


def hosts_of(config):
    return dict(p.split("=") for p in config.split(","))["hosts"].split("+")


class Cluster:
    def __init__(self, binary, work, net, cluster_file):
        self.binary, self.work, self.net, self.cluster_file = binary, work, net, cluster_file
        self.mnt = {h: f"{work}/mnt-{h}" for h in HOSTS}
        self.mounted = set()

    def store(self, h):
        return f"{self.work}/store-{h}"

    def mount(self, h):
        p = self.net.run(h, self.binary, "mount", self.store(h), self.mnt[h],
                         "--cluster", self.cluster_file, "--host", h,
                         capture_output=True, text=True)
        assert p.returncode == 0, (h, p.stderr)
        self.mounted.add(h)

    def umount(self, h):
        scenario.scalai(self.binary, "umount", self.mnt[h])
        self.mounted.discard(h)

    def kill(self, h):
        """SIGKILL of `h`'s mount, as when its machine dies."""
        os.kill(server_pid(self.store(h)), signal.SIGKILL)
        subprocess.run(["umount", "-l", self.mnt[h]], check=True)
        self.mounted.discard(h)

    def status(self, h):
        with open(f"{self.mnt[h]}/status") as f:
            return json.load(f)

    def settle(self, config, timeout=120):
        """Every mounted host on `config`, materialized, and live to the
        others."""
        deadline = time.time() + timeout
        while True:
            states = {h: self.status(h) for h in self.mounted}
            ok = all(s["config"] == config and s["state"] == "ready" for s in states.values())
            live = {h["name"] for h in states[min(self.mounted)]["cluster"]["hosts"] if h["live"]}
            if ok and live == self.mounted:
                return
            assert time.time() < deadline, (config, {h: (s["config"], s["state"], s["error"])
                                                     for h, s in states.items()}, live)
            time.sleep(0.05)

    def reconfigure(self, via, config):
        t0 = time.time()
        fd = os.open(f"{self.mnt[via]}/config", os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, (config + "\n").encode())
        except OSError as e:
            raise AssertionError(f"{config} refused: {self.status(via)['error']}") from e
        finally:
            os.close(fd)
        self.settle(config)
        return time.time() - t0

    def wait_latest(self, step, timeout=60):
        deadline = time.time() + timeout
        want = f"step-{step:08d}"
        while any(os.readlink(f"{self.mnt[h]}/ckpt/latest") != want for h in self.mounted):
            assert time.time() < deadline, {
                h: (os.readlink(f"{self.mnt[h]}/ckpt/latest"), self.status(h)["error"])
                for h in self.mounted}
            time.sleep(0.05)

    def workers(self, config, iterations, port):
        """Starts the job's processes: each host's block of ranks in its
        own namespace, reading and saving through its own mount."""
        world = scenario.world_size(config)
        hosts = hosts_of(config)
        per = world // len(hosts)
        env = dict(os.environ, MASTER_ADDR=self.net.address[hosts[0]], MASTER_PORT=str(port),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
        procs = []
        for r in range(world):
            h = hosts[r // per]
            cmd = ["/usr/bin/python3", os.path.join(HERE, "train.py"), "--mount", self.mnt[h],
                   "--config", config, "--model", scenario.model_arg(), "--dataset", "tokens",
                   "--iterations", str(iterations), "--log", f"{self.work}/cluster.log", "--save"]
            procs.append((h, self.net.spawn(h, cmd, env=dict(env, RANK=str(r)),
                                            stderr=subprocess.PIPE, text=True)))
        return procs


def finish(procs, config, timeout=300):
    errors = []
    for r, (h, p) in enumerate(procs):
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for _, q in procs:
                q.kill()
            raise AssertionError(f"{config}: rank {r} on {h} timed out")
        if p.returncode != 0:
            errors.append(f"rank {r} on {h} exited {p.returncode}: {err.strip()[-2000:]}")
    assert not errors, f"{config}: " + "\n".join(errors)


def logged(work):
    path = f"{work}/cluster.log"
    return scenario.read_log(path) if os.path.exists(path) else []


def main():
    if not os.path.exists("/dev/fuse"):
        print("no /dev/fuse: skipped")
        sys.exit(77)
    require_netns()
    binary = os.path.abspath(sys.argv[1])
    work = tempfile.mkdtemp(prefix="scalai-cluster-e2e.", dir="/var/tmp")
    net = Network(["e0"] + HOSTS)
    c = None
    try:
        scenario.write_safetensors(f"{work}/initial.safetensors", scenario.initial_model(),
                                   {"scalai.step": "0"})
        scenario.write_megatron(f"{work}/tokens", scenario.token_sequences(), np.int32)
        secs, ref_final = scenario.uninterrupted(binary, work, TOTAL)
        print(f"uninterrupted: {TOTAL} iterations under {scenario.UNINTERRUPTED} in {secs:.1f} s")
        etcd = Etcd(net, ["e0"], work)
        etcd.wait_healthy("h0")
        c = Cluster(binary, work, net, write_cluster_file(work, net, etcd, HOSTS, "gpt"))
        first = FIRST[0].split(",hosts=")[0]
        for h in ["h0", "h1", "h2"]:
            scenario.scalai(binary, "init", c.store(h), "--layout", "megatron-core-gpt",
                            "--param", f"vocab_size={scenario.MODEL['vocab']}",
                            "--param", "gated_linear_unit=1",
                            "--param", f"make_vocab_size_divisible_by={scenario.DIVISOR}")
            scenario.scalai(binary, "import", c.store(h), f"{work}/initial.safetensors",
                            "--config", first, "--step", "0")
            add_dataset(binary, work, c.store(h))
        for h in HOSTS:
            os.makedirs(c.mnt[h])
        for h in ["h0", "h1", "h2"]:
            c.mount(h)
        c.settle(first)
        reconfigurations = []

        # 1. Two hosts run the job's four ranks.
        reconfigurations.append((first, FIRST[0], c.reconfigure("h2", FIRST[0])))
        finish(c.workers(FIRST[0], FIRST[1], 29500), FIRST[0])
        c.wait_latest(FIRST[1])
        print(f"{FIRST[0]}: iterations 1-{FIRST[1]}, saved through h0's and h1's mounts")

        # 2. Moved to h1+h2; h2 dies midway, and the job with it.
        reconfigurations.append((FIRST[0], KILLED_PHASE, c.reconfigure("h0", KILLED_PHASE)))
        procs = c.workers(KILLED_PHASE, 4, 29501)
        deadline = time.time() + 120
        while len(logged(work)) < FIRST[1] + 2:
            assert time.time() < deadline, logged(work)
            assert all(p.poll() is None for _, p in procs), [p.returncode for _, p in procs]
            time.sleep(0.05)
        for h, p in procs:
            if h == "h2":
                p.kill()
        c.kill("h2")
        for _, p in procs:
            p.kill()
            p.wait()
        lost = [e["iteration"] for e in logged(work) if e["iteration"] > FIRST[1]]
        print(f"{KILLED_PHASE}: h2's mount and workers SIGKILLed after iterations {lost}; "
              f"the job restarts from step {FIRST[1]}")
        # The iterations after the last checkpoint are done again.
        kept = [e for e in logged(work) if e["iteration"] <= FIRST[1]]
        with open(f"{work}/cluster.log", "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in kept)
        for h in ["h0", "h1"]:
            assert os.readlink(f"{c.mnt[h]}/ckpt/latest") == f"step-{FIRST[1]:08d}", h

        # 3. Without the lost host (h1 holds every byte the config needs).
        deadline = time.time() + 30
        while any(h["live"] for h in c.status("h0")["cluster"]["hosts"] if h["name"] == "h2"):
            assert time.time() < deadline
            time.sleep(0.1)
        reconfigurations.append((KILLED_PHASE, AFTER_LOSS[0],
                                 c.reconfigure("h1", AFTER_LOSS[0])))
        finish(c.workers(AFTER_LOSS[0], AFTER_LOSS[1], 29502), AFTER_LOSS[0])
        done = FIRST[1] + AFTER_LOSS[1]
        c.wait_latest(done)
        print(f"{AFTER_LOSS[0]}: iterations {FIRST[1] + 1}-{done}, without h2")

        # 4. A fresh host joins with an empty store, and the job uses it.
        os.makedirs(c.store("h3"))
        c.mount("h3")  # fills its store from a peer
        c.umount("h3")
        add_dataset(binary, work, c.store("h3"))
        c.mount("h3")
        c.settle(AFTER_LOSS[0])
        reconfigurations.append((AFTER_LOSS[0], WITH_NEW_HOST[0],
                                 c.reconfigure("h0", WITH_NEW_HOST[0])))
        finish(c.workers(WITH_NEW_HOST[0], WITH_NEW_HOST[1], 29503), WITH_NEW_HOST[0])
        c.wait_latest(TOTAL)
        print(f"{WITH_NEW_HOST[0]}: iterations {done + 1}-{TOTAL}, h3 joined with an empty store")
        for a, b, s in reconfigurations:
            print(f"  {a} -> {b}: every host switched and materialized in {s:.2f} s")

        # Every parameter, under the uninterrupted job's config, on h3.
        c.reconfigure("h0", scenario.UNINTERRUPTED)
        final = scenario.final_params(c.mnt["h3"], scenario.UNINTERRUPTED)
        for h in sorted(c.mounted):
            c.umount(h)
        for h in HOSTS:
            scenario.scalai(binary, "fsck", c.store(h))
        ref_log = scenario.read_log(f"{work}/uninterrupted.log")
        result = scenario.compare(ref_log, logged(work), ref_final, final, TOTAL)
        print(f"losses within {result['worst_loss_rel']:.1e}, final parameters within "
              f"{result['worst_param_rel']:.1e} (relative) of the uninterrupted job")
        for problem in result["problems"]:
            print(problem, file=sys.stderr)
        assert not result["problems"], f"{len(result['problems'])} differences"
    finally:
        if c is not None:
            for h in HOSTS:
                subprocess.run(["umount", "-l", c.mnt[h]], capture_output=True)
        net.close()
        shutil.rmtree(work, ignore_errors=True)
    print("cluster_e2e_test: ok")


def add_dataset(binary, work, store):
    scenario.scalai(binary, "dataset", "add", store, "tokens", "--format", "megatron",
                    "--global-batch", str(scenario.BATCH), "--epochs", str(scenario.EPOCHS),
                    "--seed", "7", f"{work}/tokens")


if __name__ == "__main__":
    main()
