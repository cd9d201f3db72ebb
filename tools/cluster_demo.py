#!/usr/bin/python3
"""A job across four hosts on this machine, for the README's walkthrough:
each host in its own network namespace with its own store, a three-member
etcd cluster in namespaces of its own; then a config that gives each host
its own ranks, a host lost with the only copy of some (a config without it
refused), replicas made, the host lost again and its ranks rebuilt from
them; then a step saved through the mounts of the hosts, committing on
all of them once the last saved its ranks. Needs root
(namespaces, FUSE). Everything it makes is removed at the end.

    sudo /usr/bin/python3 tools/cluster_demo.py build/tools/scalai"""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import Etcd, Network, write_cluster_file  # noqa

BIN = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build/tools/scalai")
HOSTS = ["h0", "h1", "h2", "h3"]
MODEL = "layers=4,hidden=256,heads=8,groups=8,vocab=1000"


def show(cmd, net=None, host=None, cwd=None, fails=False):
    """Runs `cmd` (a shell line) as the walkthrough shows it, on `host`;
    it must succeed, or fail when `fails`."""
    print(f"{host or 'admin'}$ {cmd}")
    args = ["bash", "-c", cmd]
    p = (net.run(host, *args, capture_output=True, text=True, cwd=cwd) if host
         else subprocess.run(args, capture_output=True, text=True, cwd=cwd))
    out = (p.stdout + p.stderr).rstrip()
    if out:
        print(out)
    if (p.returncode != 0) != fails:
        raise SystemExit(f"{'succeeded' if fails else 'failed'}: {cmd}")


def settled(mnt, config, live):
    with open(f"{mnt}/status") as f:
        c = json.load(f)["cluster"]
    up = {h["name"] for h in c["hosts"] if h["live"]}
    reached = {name for name, p in c["peers"].items() if p["reachable"]}
    return (up == set(live) and reached == set(live) - {c["host"]} and
            all(h.get("config") == config and h.get("state") == "ready"
                for h in c["hosts"] if h["live"]))


def settle(tmp, config, live):
    """Waits until every host in `live` sees exactly those hosts live and
    reachable, each having recorded `config` materialized."""
    for _ in range(600):
        if all(settled(f"{tmp}/mnt-{h}", config, live) for h in live):
            return
        time.sleep(0.05)
    raise SystemExit(f"the hosts did not settle on {config} with {live} live")


def released(tmp, config, live):
    """Waits until each host in `live` has recorded `config` materialized and
    let go of what it kept for its peers (one holding per step), so that
    HELD shows what it holds."""
    for _ in range(600):
        with open(f"{tmp}/mnt-{live[0]}/status") as f:
            hosts = {h["name"]: h for h in json.load(f)["cluster"]["hosts"]}
        if all(hosts[h].get("config") == config and hosts[h].get("state") == "ready" and
               hosts[h].get("holds") and
               len({e["step"] for e in hosts[h]["holds"]}) == len(hosts[h]["holds"])
               for h in live):
            return
        time.sleep(0.05)
    raise SystemExit("the hosts kept what they held before")


def saved(tmp, step, hosts):
    return all(os.readlink(f"{tmp}/mnt-{h}/ckpt/latest") == f"step-{step:08d}" for h in hosts)


def save_step(net, tmp, config):
    """Step 200 saved through the mounts, each host's workers writing their
    own dp_rank 0 ranks: nothing commits until the last host saved its own."""
    subprocess.run([BIN, "synth", f"{tmp}/ckpt-200", "--layout", "megatron-core-gpt",
                    "--config", config.split(",hosts=")[0], "--model", MODEL, "--seed", "200"],
                   check=True, capture_output=True)
    print("# workers save step 200 (cut by scalai synth into ckpt-200/) through their own mounts")
    step = "mnt-{h}/ckpt/step-00000200"
    # Under tp=2,pp=2,dp=3 h0 runs ranks 0-3 and h1 ranks 4-7; their
    # dp_rank 0 ranks are 0, 1 (h0) and 6, 7 (h1); h2 runs only replicas.
    for h, ranks in (("h0", [0, 1]), ("h1", [6, 7])):
        line = (f"for r in {' '.join(f'{r:05d}' for r in ranks)}; do "
                f"mkdir -p {step.format(h=h)}/rank-$r && "
                f"cp ckpt-200/rank-$r/model.safetensors {step.format(h=h)}/rank-$r/; done")
        show(line, net, h, cwd=tmp)
        if h == "h0":
            for _ in range(200):
                with open(f"{tmp}/mnt-h2/status") as f:
                    if json.load(f)["cluster"]["saves"]:
                        break
                time.sleep(0.05)
            show("ls -C mnt-h2/ckpt; scalai cluster status mnt-h2 | tail -1", net, "h2",
                 cwd=tmp)
    for _ in range(200):
        if saved(tmp, 200, HOSTS[:3]):
            break
        time.sleep(0.05)
    show("ls -C mnt-h2/ckpt; readlink mnt-h2/ckpt/latest; ls -C mnt-h2/ckpt/latest", net, "h2",
         cwd=tmp)


def main():
    os.environ["PATH"] = f"{os.path.dirname(BIN)}:{os.environ['PATH']}"
    with tempfile.TemporaryDirectory() as tmp:
        net = Network(["e0", "e1", "e2"] + HOSTS)
        try:
            etcd = Etcd(net, ["e0", "e1", "e2"], tmp)
            etcd.wait_healthy("h0")
            write_cluster_file(tmp, net, etcd, HOSTS, "gpt", indent=1)
            show("cat cluster.json", cwd=tmp)
            subprocess.run([BIN, "synth", f"{tmp}/ckpt", "--layout", "megatron-core-gpt",
                            "--config", "tp=2,pp=1,dp=1", "--model", MODEL], check=True,
                           capture_output=True)
            for h in HOSTS:
                for args in (["init", f"{tmp}/store-{h}", "--layout", "megatron-core-gpt",
                              "--param", "vocab_size=1000"],
                             ["import", f"{tmp}/store-{h}", f"{tmp}/ckpt",
                              "--config", "tp=2,pp=1,dp=1", "--step", "100"]):
                    subprocess.run([BIN, *args], check=True, capture_output=True)
                os.makedirs(f"{tmp}/mnt-{h}")
            print("# every host imported the same checkpoint into its own store")
            for h in HOSTS:
                show(f"scalai mount store-{h} mnt-{h} --cluster cluster.json --host {h}",
                     net, h, cwd=tmp)
            settle(tmp, "tp=2,pp=1,dp=1", HOSTS)
            show("scalai cluster status mnt-h0", cwd=tmp)
            # Each host keeps its own two ranks from here on.
            spread = "tp=4,pp=2,dp=1,hosts=h0+h1+h2+h3"
            show(f"echo {spread} > mnt-h2/config", net, "h2", cwd=tmp)
            settle(tmp, spread, HOSTS)
            released(tmp, spread, HOSTS)
            show("cat mnt-h0/config; ls -C mnt-h3/ckpt/latest", net, "h0", cwd=tmp)
            show("scalai cluster status mnt-h0", cwd=tmp)
            # h3 holds the only copy of ranks 6 and 7.
            show("scalai umount mnt-h3   # h3 is lost", net, "h3", cwd=tmp)
            settle(tmp, spread, HOSTS[:3])
            show("scalai reconfigure mnt-h0 tp=2,pp=2,dp=1,hosts=h0+h1", net, "h0",
                 cwd=tmp, fails=True)
            show("scalai mount store-h3 mnt-h3 --cluster cluster.json --host h3   # back",
                 net, "h3", cwd=tmp)
            settle(tmp, spread, HOSTS)
            replicated = "tp=2,pp=2,dp=2,hosts=h0+h1+h2+h3"
            show(f"scalai reconfigure mnt-h1 {replicated} --wait", net, "h1", cwd=tmp)
            settle(tmp, replicated, HOSTS)
            released(tmp, replicated, HOSTS)
            show("scalai umount mnt-h3   # h3 is lost again", net, "h3", cwd=tmp)
            settle(tmp, replicated, HOSTS[:3])
            show("scalai reconfigure mnt-h0 tp=2,pp=2,dp=3,hosts=h0+h1+h2 --wait", net, "h0",
                 cwd=tmp)
            settle(tmp, "tp=2,pp=2,dp=3,hosts=h0+h1+h2", HOSTS[:3])
            released(tmp, "tp=2,pp=2,dp=3,hosts=h0+h1+h2", HOSTS[:3])
            show("scalai cluster status mnt-h1", cwd=tmp)
            save_step(net, tmp, "tp=2,pp=2,dp=3,hosts=h0+h1+h2")
            for h in HOSTS:
                subprocess.run([BIN, "umount", f"{tmp}/mnt-{h}"], capture_output=True)
        finally:
            for h in HOSTS:
                subprocess.run(["umount", "-l", f"{tmp}/mnt-{h}"], capture_output=True)
            net.close()


if __name__ == "__main__":
    main()
