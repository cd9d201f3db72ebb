"""Hosts on one machine for the cluster tests: each in its own network
namespace, joined by veth pairs to a bridge in a namespace of its own, with
addresses only inside those namespaces; etcd members run the same way.
Everything made is torn down by `close`, however the test ends."""
import json
import os
import signal
import subprocess
import sys
import time


def sh(*args, check=True):
    p = subprocess.run(list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {p.stderr.strip()}")
    return p


class Network:
    """A /24 of namespaces: Network(names) gives each name an address."""

    def __init__(self, names):
        tag = os.getpid() % 10000
        self.prefix = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self.switch = f"sc{tag}sw"
        self.ns = {name: f"sc{tag}{name}" for name in names}
        self.address = {name: f"{self.prefix}.{i + 1}" for i, name in enumerate(names)}
        self.procs = []
        self.made = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self):
        sh("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        self.run_in = None
        self.ip(self.switch, "link", "add", "br0", "type", "bridge")
        self.ip(self.switch, "link", "set", "br0", "up")
        for i, (name, ns) in enumerate(self.ns.items()):
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            # The veth is made inside the host's namespace, its peer moved to
            # the switch: no interface ever appears in the caller's.
            self.ip(ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}")
            self.ip(ns, "link", "set", f"p{i}", "netns", self.switch)
            self.ip(self.switch, "link", "set", f"p{i}", "master", "br0")
            self.ip(self.switch, "link", "set", f"p{i}", "up")
            self.ip(ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
            self.ip(ns, "link", "set", "eth0", "up")
            self.ip(ns, "link", "set", "lo", "up")

    @staticmethod
    def ip(ns, *args):
        return sh("ip", "-n", ns, *args)

    def exec_args(self, name, args):
        """`args` run in `name`'s network only: mounts stay visible."""
        return ["nsenter", f"--net=/run/netns/{self.ns[name]}", *args]

    def run(self, name, *args, **kw):
        return subprocess.run(self.exec_args(name, list(args)), **kw)

    def spawn(self, name, args, **kw):
        p = subprocess.Popen(self.exec_args(name, list(args)), **kw)
        self.procs.append(p)
        return p

    def link(self, name, up):
        """Cuts or restores `name`'s cable."""
        self.ip(self.ns[name], "link", "set", "eth0", "up" if up else "down")

    def throttle(self, name, rate, burst="32kbit", latency="400ms"):
        """Limits what `name` sends to `rate` (tc's units: "2mbit"), so that
        a test can act while bytes are on their way; None lifts it. A
        link of gigabits needs a burst of a megabyte or so (tc's token
        bucket refills on a timer) and a short queue (`latency`)."""
        if rate is None:
            sh("tc", "-n", self.ns[name], "qdisc", "del", "dev", "eth0", "root", check=False)
        else:
            sh("tc", "-n", self.ns[name], "qdisc", "replace", "dev", "eth0", "root", "tbf",
               "rate", rate, "burst", burst, "latency", latency)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        for ns in reversed(self.made):
            sh("ip", "netns", "del", ns, check=False)
        self.made = []


def server_pid(path):
    """The pid of the `scalai mount` process given `path` (its store or its
    mountpoint)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"mount" in argv and path.encode() in argv:
            return int(pid)
    raise AssertionError(f"no mount process of {path}")


def require_netns():
    """Exits 77 with the reason where network namespaces cannot be made."""
    probe = f"scprobe{os.getpid()}"
    p = sh("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        print(f"SKIP: cannot make network namespaces here ({p.stderr.strip()})")
        sys.exit(77)
    sh("ip", "netns", "del", probe, check=False)


class Etcd:
    """A cluster of etcd members, one per namespace in `names`."""

    def __init__(self, net, names, tmp):
        self.net, self.names, self.members = net, names, {}
        initial = ",".join(f"{n}=http://{net.address[n]}:2380" for n in names)
        for n in names:
            a = net.address[n]
            log = open(f"{tmp}/{n}.log", "w")
            self.members[n] = net.spawn(n, [
                "etcd", f"--name={n}", f"--data-dir={tmp}/{n}.etcd",
                f"--listen-client-urls=http://{a}:2379", f"--advertise-client-urls=http://{a}:2379",
                f"--listen-peer-urls=http://{a}:2380", f"--initial-advertise-peer-urls=http://{a}:2380",
                f"--initial-cluster={initial}", "--initial-cluster-state=new",
                "--heartbeat-interval=100", "--election-timeout=1000"],
                stdout=log, stderr=subprocess.STDOUT)
        self.endpoints = [f"http://{net.address[n]}:2379" for n in names]

    def ctl(self, via, *args, **kw):
        return self.net.run(via, "etcdctl", f"--endpoints={','.join(self.endpoints)}", *args,
                            capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"},
                            **kw)

    def wait_healthy(self, via, timeout=60):
        deadline = time.time() + timeout
        while True:
            p = self.ctl(via, "endpoint", "health")
            if p.returncode == 0:
                return
            assert time.time() < deadline, p.stdout + p.stderr
            time.sleep(0.3)

    def leader(self, via):
        """The name of the member that leads now."""
        import json
        p = self.ctl(via, "endpoint", "status", "-w", "json")
        for e in json.loads(p.stdout):
            if e["Status"]["leader"] == e["Status"]["header"]["member_id"]:
                host = e["Endpoint"].split("//")[1].split(":")[0]
                return next(n for n in self.names if self.net.address[n] == host)
        raise AssertionError(p.stdout)

    def kill(self, name):
        p = self.members[name]
        p.send_signal(signal.SIGKILL)
        p.wait()


def write_cluster_file(tmp, net, etcd, hosts, job, token=None, indent=None):
    """Writes `tmp`/cluster.json for `hosts` (each at its namespace's
    address, port 7070) and `etcd`, with a token (random unless given) in
    `tmp`/token; returns the cluster file's path."""
    with open(f"{tmp}/token", "w") as f:
        f.write((token or os.urandom(24).hex()) + "\n")
    path = f"{tmp}/cluster.json"
    with open(path, "w") as f:
        json.dump({"job": job, "etcd": etcd.endpoints, "token_file": "token",
                   "hosts": [{"name": h, "address": f"{net.address[h]}:7070"} for h in hosts]},
                  f, indent=indent)
    return path
