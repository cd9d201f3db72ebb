#!/usr/bin/python3
"""A job across hosts: four hosts, each in its own network namespace with its
own store (every host imported the same checkpoint), agreeing through a
three-member etcd cluster in namespaces of its own. A random walk of configs,
each written to a random host's mount, must become every host's config, with
every rank's bytes equal to numpy slicing of the full tensors on every host.
A config one host refuses changes nothing anywhere; two hosts writing at
once end on one config everywhere; the etcd leader killed, the cluster still
reconfigures; a host that leaves is shown not live and, mounted again,
catches up with the configs it missed; a host cut off by its cable is shown
unreachable and not live, and catches up once it is back; a host with a
forged token reaches no peer and is served nothing; a host with an empty
store fills it from a peer, taking each shard once. Each store passes fsck
at the end.
Exits 77 only where /dev/fuse is missing or namespaces cannot be made."""
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, deadline_in, deleted_files_held, require_fuse, test_seed  # noqa
from netns import Etcd, Network, require_netns, server_pid  # noqa
from reference import (distopt_of, fsdp_of, parse_config, rank_shards, random_gpt,  # noqa
                       scalai, write_safetensors)
from views import check_bytes, status  # noqa

BIN = sys.argv[1]
STEPS = int(os.environ.get("SCALAI_CLUSTER_STEPS", "12"))
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 4, 96, 6, 6, 192, 101, 8
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}",
          "--param", f"num_query_groups={GROUPS}"]
HOSTS = ["h0", "h1", "h2", "h3"]
# A standby host the cluster file lists and that never mounts: no peer
# reaches it, and the keys of committed steps do not wait for it.
SPARE = "h4"
MEMBERS = ["e0", "e1", "e2"]
START = "tp=2,pp=1,dp=1"


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def next_config(r, config, hosts=None, sharded=False):
    """A random config; a third of them name hosts (an ordered choice among
    `hosts`, as many as divide the world size); with `sharded`, one whose
    state is sharded across its dp ranks (fsdp=dp, or distopt=1)."""
    while True:
        tp, pp, dp = r.choice([1, 2, 3, 6]), r.randint(1, 4), r.randint(1, 3)
        if sharded:
            dp = r.randint(2, 3)
        new = f"tp={tp},pp={pp},dp={dp}"
        if sharded:
            new += r.choice([f",fsdp={dp}", ",distopt=1"])
        if hosts and r.random() < 1 / 3:
            counts = [n for n in range(1, len(hosts) + 1) if (tp * pp * dp) % n == 0]
            new += ",hosts=" + "+".join(r.sample(hosts, r.choice(counts)))
        if new != config:
            return new


def write_config(mnt, config):
    """Writes `config` as `echo` would, in one write(); returns the errno, or
    0. (Python's buffered files write again at close what a refused write
    left in their buffer: a second proposal.)"""
    fd = os.open(f"{mnt}/config", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, (config + "\n").encode())
        return 0
    except OSError as e:
        return e.errno
    finally:
        os.close(fd)


def wait_all(mnts, config, timeout=60):
    """Every host shows `config`, materialized; returns their statuses."""
    deadline = deadline_in(timeout)
    while True:
        got = {h: status(m) for h, m in mnts.items()}
        if all(s["config"] == config and s["state"] == "ready" for s in got.values()):
            return got
        assert time.time() < deadline, (config, {h: (s["config"], s["state"], s["error"])
                                                 for h, s in got.items()})
        time.sleep(0.05)


def cluster_status(mnt):
    return json.loads(run("cluster", "status", mnt, "--json").stdout)


def wait_live(mnt, want, timeout=30):
    """`scalai cluster status` on `mnt` shows exactly the hosts `want` live."""
    deadline = deadline_in(timeout)
    while True:
        live = {h["name"] for h in cluster_status(mnt)["hosts"] if h["live"]}
        if live == set(want):
            return
        assert time.time() < deadline, (live, want)
        time.sleep(0.2)


def wait_peers(mnt, reachable, error="", timeout=30):
    """`mnt`'s host reaches exactly the peers in `reachable`, and the others'
    errors contain `error`; returns them."""
    deadline = deadline_in(timeout)
    while True:
        peers = {h: p for h, p in cluster_status(mnt)["peers"].items() if h != SPARE}
        if ({h for h, p in peers.items() if p["reachable"]} == set(reachable) and
                all(error in p["error"] for p in peers.values() if not p["reachable"])):
            return peers
        assert time.time() < deadline, (mnt, peers)
        time.sleep(0.2)


def held_as_stored(mnts, tmp, timeout=30):
    """Each host's `bytes_held`, as every host sees it, is the size of the
    blob files in its store."""
    want = {h: sum(os.path.getsize(f"{tmp}/{h}/store/blobs/{b}")
                   for b in os.listdir(f"{tmp}/{h}/store/blobs")) for h in HOSTS}
    assert all(want.values()), want
    deadline = deadline_in(timeout)
    while True:
        seen = [{h["name"]: h.get("bytes_held") for h in cluster_status(m)["hosts"]
                 if h["name"] != SPARE} for m in mnts.values()]
        if all(s == want for s in seen):
            return
        assert time.time() < deadline, (seen, want)
        time.sleep(0.2)


def hosts_of(config):
    return config.split("hosts=")[1].split("+") if "hosts=" in config else []


def held_masks(config, host):
    """What `host` holds under `config`, worked out from numpy slicing alone:
    {tensor: boolean mask over its elements, numbered from 1 (0 marks the
    vocabulary's zero padding)}. A host holds the (pp, tp) shards of its
    ranks (under fsdp or distopt, their savers' shards), every one when the
    config names no hosts."""
    tp, pp, dp, stages = parse_config(config)
    if stages is None:
        stages = [LAYERS // pp + (1 if p < LAYERS % pp else 0) for p in range(pp)]
    first = [sum(stages[:p]) for p in range(pp)]
    world, named = tp * pp * dp, hosts_of(config)
    # The saving rank whose shard each of the host's ranks holds.
    shards = dp if distopt_of(config) else fsdp_of(config)
    mine = {((rank // (tp * dp)) * dp + (rank // tp) % dp % shards) * tp + rank % tp
            for rank in range(world)
            if not named or named[rank // (world // len(named))] == host}
    masks = {name: np.zeros(size + 1, bool) for name, size in INDEX_SIZES.items()}
    for rank, shard in rank_shards(INDEX, config, True, DIVISOR, LAYERS).items():
        p = rank // (tp * dp)
        if rank not in mine:
            continue
        for local, arr in shard.items():
            m = re.search(r"layers\.(\d+)\.", local)
            name = (local.replace(f"layers.{m.group(1)}.", f"layers.{int(m.group(1)) + first[p]}.", 1)
                    if m else local)
            masks[name][arr.ravel()] = True
    return masks


def bytes_lacking(old, new, host):
    """The bytes `host` must fetch to hold its shards of `new`, having held
    its shards of `old`: the plan's minimum, by the oracle above."""
    have, want = held_masks(old, host), held_masks(new, host)
    return sum(int(np.count_nonzero(want[n][1:] & ~have[n][1:])) * 4 for n in want)


def fetched(mnts):
    """Tensor bytes each host has brought from its peers so far: fetched, or
    taken by a materialization from what its views had fetched before (not
    fetched twice)."""
    got = {}
    for h, m in mnts.items():
        c = cluster_status(m)
        got[h] = sum(p["bytes_fetched"] for p in c["peers"].values()) + c["bytes_reused"]
    return got


def check_fetched(mnts, before, old, new):
    """Each host fetched exactly what it lacked for `new` since `before`."""
    after = fetched(mnts)
    for h in HOSTS:
        want = bytes_lacking(old, new, h)
        assert after[h] - before[h] == want, (h, old, new, after[h] - before[h], want)
    return {h: after[h] - before[h] for h in HOSTS}


def main():
    require_fuse()
    require_netns()
    seed = test_seed()
    r = random.Random(seed)
    full = random_gpt(np.random.default_rng(seed), LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB,
                      gated=True)
    # Each element's number, for the oracle of the bytes that must move.
    global INDEX, INDEX_SIZES
    INDEX = {n: np.arange(1, x.size + 1, dtype=np.int64).reshape(x.shape) for n, x in full.items()}
    INDEX_SIZES = {n: x.size for n, x in full.items()}
    with tempfile.TemporaryDirectory() as tmp, Mounts() as mounts:
        net = Network(MEMBERS + HOSTS)
        mnts = {h: f"{tmp}/{h}/mnt" for h in HOSTS}
        try:
            etcd = Etcd(net, MEMBERS, tmp)
            etcd.wait_healthy("h0")
            # The job's keys grow as it runs (every step committed stays):
            # 5 MiB of keys no beat needs, more than gRPC takes in one
            # message, so that a beat reading them all fails throughout.
            for i in range(5):
                p = etcd.ctl("h0", "put", f"/scalai/gpt/filler/{i}", input="x" * (1 << 20))
                assert p.returncode == 0, p.stderr
            with open(f"{tmp}/token", "w") as f:
                f.write("cluster-test-token-%d\n" % seed)
            cluster = f"{tmp}/cluster.json"
            with open(cluster, "w") as f:
                # The hosts compact etcd's history older than 2 s (5 min
                # by default): every watch that ends below starts again
                # from a revision compaction has not forgotten.
                json.dump({"job": "gpt", "etcd": etcd.endpoints, "etcd_history_seconds": 2,
                           "token_file": "token",
                           "hosts": [{"name": h, "address": f"{net.address[h]}:7070"}
                                     for h in HOSTS] +
                                    [{"name": SPARE, "address": "127.0.0.1:7079"}]}, f)
            src = f"{tmp}/src"
            for rank, shard in rank_shards(full, START, True, DIVISOR, LAYERS).items():
                os.makedirs(f"{src}/rank-{rank:05d}")
                write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", shard)

            def mount(h, *options):
                p = net.run(h, BIN, "mount", f"{tmp}/{h}/store", mnts[h], "--cluster", cluster,
                            "--host", h, *options, capture_output=True, text=True)
                assert p.returncode == 0, (h, p.stderr)
                mounts.add(mnts[h])

            for h in HOSTS:
                os.makedirs(f"{tmp}/{h}")
                run("init", f"{tmp}/{h}/store", *LAYOUT)
                run("import", f"{tmp}/{h}/store", src, "--config", START, "--step", "7")
                os.makedirs(mnts[h])
                mount(h)
            wait_all(mnts, START)
            for h, m in mnts.items():
                wait_live(m, HOSTS)
                wait_peers(m, set(HOSTS) - {h})
            held_as_stored(mnts, tmp)
            text = run("cluster", "status", mnts["h2"]).stdout
            print(text)
            assert "seen from h2" in text and text.count(" yes ") == 4, text
            for h, m in mnts.items():
                assert cluster_status(m)["etcd_error"] is None, (h, cluster_status(m))

            # Whether a view fetches bytes before the materialization stores
            # them is a race; check_fetched counts both, so that a byte
            # fetched twice fails the walk (peer_test pins the reuse itself).
            config = walk(r, mnts, full)
            blobs_let_go(mnts, tmp)
            p = etcd.ctl("h0", "get", "--rev=2", "/scalai/gpt/filler/0")
            assert p.returncode != 0 and "compacted" in p.stderr, (p.stdout, p.stderr)
            print("etcd's history before the walk: compacted by the hosts")
            config = refused(mnts, config)
            config = hosted(mnts, full, config)
            for _ in range(4):
                config = racing(r, mnts, config)
            config = leader_killed(r, net, etcd, mnts, full, config)
            config = host_killed(r, net, mnts, mount, mounts, full, config, tmp)
            config = partitioned(r, net, mnts, full, config)
            config = cut_while_materializing(net, mnts, full, config)
            config = killed_while_fetching(net, mnts, mount, mounts, full, config, tmp)
            config = host_lost(mnts, mount, mounts, full, config, tmp)
            intruder(net, mnts, mounts, tmp)
            config = host_leaves(r, mnts, mount, mounts, full, config)
            new_host(mnts, mount, mounts, full, config, tmp)
            config = saved_across_hosts(seed, net, etcd, mnts, mount, mounts, tmp)
            datasets_compared(mnts, mount, mounts, tmp)
            config = replicas_kept(seed, net, mnts, mount, mounts, tmp)
            # Step 55 was withdrawn and never saved again: once every host
            # is done with the withdrawal (h1 too, back), its keys go.
            keys_leave(etcd, 55)
            print("step 55's keys left etcd once every host was done with its withdrawal")

            for h in HOSTS:
                run("umount", mnts[h])
                mounts.discard(mnts[h])
            for h in HOSTS:
                run("fsck", f"{tmp}/{h}/store")
                inspect = json.loads(run("inspect", f"{tmp}/{h}/store", "--json").stdout)
                assert inspect["config"] == config, (h, inspect["config"], config)
        finally:
            for h in HOSTS:
                net.run(h, "umount", "-l", mnts[h], capture_output=True)
            net.close()
    print("cluster test: ok")


def walk(r, mnts, full):
    """Each config written to a random host becomes every host's."""
    config = START
    for i in range(STEPS):
        # Every third config shards the state across dp ranks.
        new = next_config(r, config, HOSTS, sharded=i % 3 == 1)
        writer = r.choice(HOSTS)
        before = fetched(mnts)
        assert write_config(mnts[writer], new) == 0, (writer, status(mnts[writer]))
        wait_all(mnts, new)
        moved = check_fetched(mnts, before, config, new)
        config = new
        # Every host's views, every few steps; one random host's otherwise.
        for h in (HOSTS if i % 4 == 0 else [r.choice(HOSTS)]):
            check_bytes(mnts[h], full, config, LAYERS, DIVISOR)
        generations = {cluster_status(m)["generation"] for m in mnts.values()}
        assert len(generations) == 1, generations
        if "hosts=" in new:
            named = new.split("hosts=")[1].split("+")
            per = parse_config(new)[0] * parse_config(new)[1] * parse_config(new)[2] // len(named)
            ranks = {h["name"]: h["ranks"] for h in cluster_status(mnts[writer])["hosts"]}
            for i_host, h in enumerate(named):
                assert ranks[h] == [i_host * per, (i_host + 1) * per - 1], (new, ranks)
            for h in set(HOSTS) - set(named):
                assert ranks[h] is None, (new, ranks)
        print(f"walk {i}: {new} written on {writer}, every host switched; "
              f"bytes fetched {moved}")
    return config


def blobs_let_go(mnts, tmp, timeout=10):
    """Once every host has finished, what each kept for its peers is
    released, and no mount still maps a released blob (a view its peers
    asked for, or one its own readers used): the space comes back."""
    deadline = deadline_in(timeout)
    while True:
        held = {h: deleted_files_held(server_pid(m), f"{tmp}/{h}/store/")
                for h, m in mnts.items()}
        if not any(held.values()):
            return
        assert time.time() < deadline, {h: f"{len(f)} deleted blobs mapped, e.g. {f[:1]}"
                                        for h, f in held.items() if f}
        time.sleep(0.2)


def refused(mnts, config):
    """A config the stores cannot serve (tp=4 does not divide 6 heads) is
    refused on the host it was written to, and no host changes."""
    before = cluster_status(mnts["h0"])["generation"]
    got = write_config(mnts["h2"], "tp=4,pp=1,dp=1")
    assert got == errno.EINVAL, (got, status(mnts["h2"]))
    assert "cannot be split across tp=4" in status(mnts["h2"])["error"], status(mnts["h2"])
    time.sleep(1)
    for h, m in mnts.items():
        assert status(m)["config"] == config, h
        assert cluster_status(m)["generation"] == before, h
    print("refused config: no host changed")
    return config


def hosted(mnts, full, config):
    """A config that names its hosts: every host shows it and the block of
    ranks each runs; one naming a host the cluster file lacks is refused;
    dropping the hosts of the second data-parallel replica moves no byte."""
    config = "tp=2,pp=2,dp=2,hosts=h0+h1+h2+h3"
    assert write_config(mnts["h1"], config) == 0, status(mnts["h1"])
    wait_all(mnts, config)
    check_bytes(mnts["h2"], full, config, LAYERS, DIVISOR)
    ranks = {h["name"]: h["ranks"] for h in cluster_status(mnts["h0"])["hosts"]}
    assert ranks == {"h0": [0, 1], "h1": [2, 3], "h2": [4, 5], "h3": [6, 7], SPARE: None}, ranks
    assert write_config(mnts["h0"], "tp=2,pp=2,dp=2,hosts=h0+h9") == errno.EINVAL
    assert "no host \"h9\"" in status(mnts["h0"])["error"], status(mnts["h0"])
    assert write_config(mnts["h0"], "tp=2,pp=2,dp=2,hosts=h0+h1+h2") == errno.EINVAL
    assert "cannot be split over 3 hosts" in status(mnts["h0"])["error"]
    for m in mnts.values():
        assert status(m)["config"] == config
    # A pure data-parallel change onto hosts that hold the replicas already
    # moves no byte (h0 and h2 ran dp_rank 0 of each stage).
    narrow = "tp=2,pp=2,dp=1,hosts=h0+h2"
    before = fetched(mnts)
    assert write_config(mnts["h3"], narrow) == 0, status(mnts["h3"])
    wait_all(mnts, narrow)
    assert check_fetched(mnts, before, config, narrow) == {h: 0 for h in HOSTS}
    check_bytes(mnts["h1"], full, narrow, LAYERS, DIVISOR)
    print(f"{config}: each host runs its block of ranks; to {narrow}: no byte moved")
    return narrow


def racing(r, mnts, config):
    """Two hosts write different configs at once: the cluster ends on one of
    them everywhere, and a refused writer was told why."""
    a, b = next_config(r, config), None
    while b is None or b == a:
        b = next_config(r, config)
    results = {}

    said = {}

    def write(h, c):
        results[h] = write_config(mnts[h], c)
        if results[h]:
            said[h] = status(mnts[h])["error"]
    threads = [threading.Thread(target=write, args=("h0", a)),
               threading.Thread(target=write, args=("h3", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 in results.values(), results
    errors = said
    # The refused writer's status says why, though the winner's config may
    # have reached its host before it was read.
    for h, why in said.items():
        assert results[h] == errno.EINVAL, results
        assert why and "another host changed the cluster's config meanwhile" in why, said
    # Whichever committed last is the cluster's config.
    deadline = deadline_in(60)
    while True:
        configs = {status(m)["config"] for m in mnts.values()}
        if len(configs) == 1 and configs <= {a, b}:
            break
        assert time.time() < deadline, configs
        time.sleep(0.05)
    final = configs.pop()
    wait_all(mnts, final)
    if results["h0"] != results["h3"]:  # one was refused: the other's stands
        assert final == (a if results["h0"] == 0 else b), (final, a, b, results, errors)
    print(f"racing writes {a} (h0: {results['h0']}) and {b} (h3: {results['h3']}): "
          f"all on {final}; refused: {errors}")
    return final


def leader_killed(r, net, etcd, mnts, full, config):
    """etcd's leader SIGKILLed while a config is being proposed: the cluster
    ends on one config everywhere, the new one if the write succeeded (a
    commit whose answer was lost with the leader may still land: then every
    host has it too). Then, with two members left, a config written reaches
    every host."""
    leader = etcd.leader("h0")
    racing = next_config(r, config)
    result = {}
    writer = threading.Thread(target=lambda: result.update(
        errno=write_config(mnts["h1"], racing)))
    writer.start()
    etcd.kill(leader)
    writer.join()
    deadline = deadline_in(60)
    while True:
        configs = {status(m)["config"] for m in mnts.values()}
        if len(configs) == 1 and all(s["state"] == "ready" for s in map(status, mnts.values())):
            break
        assert time.time() < deadline, configs
        time.sleep(0.1)
    ended = configs.pop()
    assert ended in (config, racing), (ended, config, racing)
    if result["errno"] == 0:
        assert ended == racing, (ended, racing)
    print(f"leader {leader} killed while {racing} was proposed (write: {result['errno']}): "
          f"every host on {ended}")
    config = ended
    new = next_config(r, config)
    deadline = deadline_in(60)
    while write_config(mnts["h1"], new) != 0:  # refused while etcd elects
        assert time.time() < deadline, status(mnts["h1"])
        time.sleep(0.5)
    wait_all(mnts, new)
    check_bytes(mnts["h3"], full, new, LAYERS, DIVISOR)
    print(f"etcd leader {leader} killed: {new} still reached every host")
    return new


def host_killed(r, net, mnts, mount, mounts, full, config, tmp):
    """h1's mount SIGKILLed while the cluster switches: the others end on
    the new config; h1, mounted again, catches up (its store is checked by
    fsck at the end)."""
    pid = server_pid(f"{tmp}/h1/store")
    new = next_config(r, config)
    assert write_config(mnts["h0"], new) == 0
    os.kill(pid, signal.SIGKILL)
    others = {h: m for h, m in mnts.items() if h != "h1"}
    wait_all(others, new)
    # The dead mount goes; the store's lock went with the process.
    subprocess.run(["umount", "-l", mnts["h1"]], check=True)
    mounts.discard(mnts["h1"])
    wait_live(mnts["h0"], ["h0", "h2", "h3"])
    mount("h1")
    wait_all(mnts, new)
    check_bytes(mnts["h1"], full, new, LAYERS, DIVISOR)
    print(f"h1 killed during the switch to {new}: mounted again, it caught up")
    return new


def partitioned(r, net, mnts, full, config):
    """h2's cable cut: the others see it unreachable and, once its lease
    runs out, not live; h2 says it cannot reach etcd; a config written
    meanwhile reaches the others, and h2 once the cable is back."""
    net.link("h2", False)
    try:
        wait_peers(mnts["h0"], ["h1", "h3"], error="h2")
        wait_live(mnts["h0"], ["h0", "h1", "h3"])
        deadline = deadline_in(30)
        while not status(mnts["h2"])["cluster"]["etcd_error"]:
            assert time.time() < deadline, status(mnts["h2"])
            time.sleep(0.2)
        new = next_config(r, config)
        assert write_config(mnts["h0"], new) == 0
        wait_all({h: m for h, m in mnts.items() if h != "h2"}, new)
        assert status(mnts["h2"])["config"] == config
    finally:
        net.link("h2", True)
    wait_all(mnts, new)
    check_bytes(mnts["h2"], full, new, LAYERS, DIVISOR)
    wait_live(mnts["h0"], HOSTS)
    wait_peers(mnts["h0"], ["h1", "h2", "h3"])
    assert status(mnts["h2"])["cluster"]["etcd_error"] is None
    print(f"h2 cut off and back: it caught up to {new}")
    return new


def cut_while_materializing(net, mnts, full, config):
    """h1 holds the only copy of stage 1 when its cable is cut, just as a
    config moving stage 1 to h0 is agreed: h0's materialization fails and
    says why; once the cable is back it is tried again and finishes, each
    host having fetched exactly what it lacked."""
    split = "tp=2,pp=2,dp=1,hosts=h0+h1"  # stage 0: h0; stage 1: h1
    before = fetched(mnts)
    assert write_config(mnts["h0"], split) == 0, status(mnts["h0"])
    wait_all(mnts, split)
    check_fetched(mnts, before, config, split)
    for h in HOSTS:  # nobody keeps a spare copy of stage 1 any more
        wait_released(mnts["h0"], h, split)
    moved = "tp=2,pp=2,dp=1,hosts=h1+h0"  # stage 0: h1; stage 1: h0
    before = fetched(mnts)
    net.link("h1", False)
    try:
        assert write_config(mnts["h2"], moved) == 0, status(mnts["h2"])
        deadline = deadline_in(90)
        while True:
            s = status(mnts["h0"])
            if s["config"] == moved and s["state"] == "failed":
                break
            assert time.time() < deadline, s
            time.sleep(0.2)
        assert "held by no reachable host" in s["error"], s["error"]
    finally:
        net.link("h1", True)
    wait_all(mnts, moved, timeout=90)
    for m in mnts.values():  # h1's lease ran out while it was cut off
        wait_live(m, HOSTS)
    check_fetched(mnts, before, split, moved)
    check_bytes(mnts["h0"], full, moved, LAYERS, DIVISOR)
    print(f"h1 cut off while h0 fetched stage 1 from it: failed ({s['error'][:60]}...), "
          "finished once h1 was back")
    return moved


def killed_while_fetching(net, mnts, mount, mounts, full, config, tmp):
    """h0's mount SIGKILLed halfway through a materialization in which h0
    and h1 swap pipeline stages (each fetching the other's, the links slowed
    so that the kill lands mid-way): h1's fetches from h0 fail and say so;
    h0, mounted again, finishes its own, and h1's is retried and finishes;
    every host ends on the config with the cut bytes (fsck at the end)."""
    assert config == "tp=2,pp=2,dp=1,hosts=h1+h0", config
    for h in HOSTS:
        wait_released(mnts["h0"], h, config)
    swapped = "tp=2,pp=2,dp=1,hosts=h0+h1"
    for h in ("h0", "h1"):
        net.throttle(h, "2mbit")
    try:
        assert write_config(mnts["h3"], swapped) == 0, status(mnts["h3"])
        deadline = deadline_in(60)
        while True:
            s = status(mnts["h0"])
            if s["config"] == swapped and s["state"] == "materializing" and s["bytes_moved"] > 0:
                break
            assert s["state"] != "ready" or s["config"] != swapped, "finished before the kill"
            assert time.time() < deadline, s
            time.sleep(0.02)
        kill_host("h0", mnts, mounts, tmp)
        print(f"h0 killed with {s['bytes_moved']} of {s['bytes_to_move']} bytes materialized")
        deadline = deadline_in(60)
        while True:
            s = status(mnts["h1"])
            if s["state"] == "failed":
                break
            assert s["state"] != "ready", "h1 finished without h0's bytes"
            assert time.time() < deadline, s
            time.sleep(0.1)
        assert "held by no reachable host" in s["error"], s["error"]
    finally:
        for h in ("h0", "h1"):
            net.throttle(h, None)
    wait_live(mnts["h1"], ["h1", "h2", "h3"])
    mount("h0")
    wait_all(mnts, swapped, timeout=90)
    for h in HOSTS:
        check_bytes(mnts[h], full, swapped, LAYERS, DIVISOR)
    print(f"h0 killed while fetching stage 0 from h1: h1 failed ({s['error'][:60]}...); "
          "h0 mounted again, both finished")
    return swapped


def kill_host(h, mnts, mounts, tmp):
    """SIGKILL of `h`'s mount, as when its machine dies; its mountpoint goes."""
    os.kill(server_pid(f"{tmp}/{h}/store"), signal.SIGKILL)
    subprocess.run(["umount", "-l", mnts[h]], check=True)
    mounts.discard(mnts[h])


def wait_released(mnt, host, config, timeout=30):
    """`host`, seen from `mnt`, has recorded `config` materialized and holds
    one set of shards per step: what it kept for its peers after the switch
    has been released."""
    deadline = deadline_in(timeout)
    while True:
        entry = [h for h in cluster_status(mnt)["hosts"] if h["name"] == host][0]
        holds = entry.get("holds", [])
        if (entry.get("config") == config and entry.get("state") == "ready" and holds and
                len({e["step"] for e in holds}) == len(holds)):
            return holds
        assert time.time() < deadline, entry
        time.sleep(0.2)


def host_lost(mnts, mount, mounts, full, config, tmp):
    """Hosts lost for good. With dp=2, h3's replicas are rebuilt on h1 from
    h2's, moving only what h1 lacks; with dp=1, a config without h1 (the only
    host left holding stage 1) is refused, naming a tensor and rank, and no
    host changes. Both come back and catch up."""
    spread = "tp=2,pp=2,dp=2,hosts=h0+h1+h2+h3"  # stage 0: h0, h1; stage 1: h2, h3
    before = fetched(mnts)
    assert write_config(mnts["h0"], spread) == 0, status(mnts["h0"])
    wait_all(mnts, spread)
    check_fetched(mnts, before, config, spread)
    kill_host("h3", mnts, mounts, tmp)
    alive = {h: m for h, m in mnts.items() if h != "h3"}
    wait_live(mnts["h0"], alive)
    rebuilt = "tp=2,pp=2,dp=2,hosts=h0+h1"  # stage 0: h0; stage 1: h1, from h2
    before = fetched(alive)
    assert write_config(mnts["h0"], rebuilt) == 0, status(mnts["h0"])
    wait_all(alive, rebuilt)
    after = fetched(alive)
    for h in alive:
        assert after[h] - before[h] == bytes_lacking(spread, rebuilt, h), h
    assert after["h1"] > before["h1"] and after["h0"] == before["h0"]
    check_bytes(mnts["h1"], full, rebuilt, LAYERS, DIVISOR)
    # h2 keeps stage 1 for its peers only until every live host finished.
    assert all(e["groups"] == [] for e in wait_released(mnts["h0"], "h2", rebuilt)), "h2"
    kill_host("h1", mnts, mounts, tmp)
    wait_live(mnts["h0"], ["h0", "h2"])
    got = write_config(mnts["h0"], "tp=2,pp=2,dp=1,hosts=h0+h2")
    error = status(mnts["h0"])["error"]
    assert got == errno.EINVAL and "no live host holds" in error and "of rank 2" in error, (
        got, error)
    for h in ["h0", "h2"]:
        assert status(mnts[h])["config"] == rebuilt, h
    print(f"h1 lost with the only live copy of stage 1: refused: {error}")
    mount("h1")
    mount("h3")
    wait_all(mnts, rebuilt)
    check_bytes(mnts["h3"], full, rebuilt, LAYERS, DIVISOR)
    wait_live(mnts["h0"], HOSTS)
    print(f"h3 lost under dp=2: its replicas rebuilt on h1 ({after['h1'] - before['h1']} bytes "
          f"from h2); both back on {rebuilt}")
    return rebuilt


def intruder(net, mnts, mounts, tmp):
    """h3 mounted again with another token: it reaches no peer, no peer
    reaches it, every call it made is refused and counted, and nothing is
    served to it."""
    run("umount", mnts["h3"])
    mounts.discard(mnts["h3"])
    with open(f"{tmp}/cluster.json") as f:
        forged = json.load(f)
    with open(f"{tmp}/forged-token", "w") as f:
        f.write("not-the-job-token-0123456789\n")
    forged["token_file"] = "forged-token"
    with open(f"{tmp}/forged.json", "w") as f:
        json.dump(forged, f)
    refused_before = cluster_status(mnts["h0"])["peer_calls_refused"]
    served_before = {h: cluster_status(mnts[h])["bytes_served"].get("h3", 0)
                     for h in ["h0", "h1", "h2"]}
    p = net.run("h3", BIN, "mount", f"{tmp}/h3/store", mnts["h3"], "--cluster",
                f"{tmp}/forged.json", "--host", "h3", capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    mounts.add(mnts["h3"])
    try:
        wait_peers(mnts["h3"], [], error="lacks the job's token")
        wait_peers(mnts["h0"], ["h1", "h2"], error="lacks the job's token")
        deadline = deadline_in(30)
        while cluster_status(mnts["h0"])["peer_calls_refused"] <= refused_before:
            assert time.time() < deadline
            time.sleep(0.2)
        for h in ["h0", "h1", "h2"]:
            served = cluster_status(mnts[h])["bytes_served"].get("h3", 0)
            assert served == served_before[h], (h, served, served_before[h])
    finally:
        run("umount", mnts["h3"])
        mounts.discard(mnts["h3"])
    print("a host with a forged token: refused by every peer, counted, served nothing")


def host_leaves(r, mnts, mount, mounts, full, config):
    """A host unmounted (intruder() left h3 so) is not live for the others,
    and a config may not name it; the configs it missed are its own once it
    is mounted again."""
    wait_live(mnts["h0"], ["h0", "h1", "h2"])
    assert write_config(mnts["h0"], "tp=2,pp=2,dp=2,hosts=h0+h1+h2+h3") == errno.EINVAL
    assert "host h3 is not live" in status(mnts["h0"])["error"], status(mnts["h0"])
    others = {h: m for h, m in mnts.items() if h != "h3"}
    for _ in range(2):
        new = next_config(r, config)
        assert write_config(mnts["h0"], new) == 0
        wait_all(others, new)
        config = new
    mount("h3")
    wait_all(mnts, config)
    check_bytes(mnts["h3"], full, config, LAYERS, DIVISOR)
    wait_live(mnts["h0"], HOSTS)
    print(f"h3 left and came back: it caught up to {config}")
    return config


def new_host(mnts, mount, mounts, full, config, tmp):
    """h3 with an empty store: it takes the layout from etcd and the newest
    step's shards from h0 (the first live peer), exactly once: the bytes h0
    served it are the shards of the dp_rank 0 ranks and h0's job.json."""
    run("umount", mnts["h3"])
    mounts.discard(mnts["h3"])
    store = f"{tmp}/h3/store"
    for name in os.listdir(store):
        p = f"{store}/{name}"
        subprocess.run(["rm", "-rf", p], check=True)
    served_before = {h: cluster_status(mnts[h])["bytes_served"].get("h3", 0)
                     for h in ["h0", "h1", "h2"]}
    mount("h3")
    wait_all(mnts, config)
    check_bytes(mnts["h3"], full, config, LAYERS, DIVISOR)
    tp, pp, dp, _ = parse_config(config)
    latest = f"{mnts['h0']}/ckpt/latest"
    shards = sum(os.stat(f"{latest}/rank-{rank:05d}/model.safetensors").st_size
                 for rank in range(tp * pp * dp) if (rank // tp) % dp == 0)
    job_json = os.stat(f"{mnts['h0']}/job.json").st_size
    served = cluster_status(mnts["h0"])["bytes_served"].get("h3", 0) - served_before["h0"]
    assert served == shards + job_json, (served, shards, job_json)
    for h in ["h1", "h2"]:
        assert cluster_status(mnts[h])["bytes_served"].get("h3", 0) == served_before[h], h
    print(f"h3 joined with an empty store: {served} bytes from h0, the shards once")


SAVE_CONFIG = "tp=2,pp=4,dp=1,hosts=h0+h1+h2+h3"  # two ranks a host, all dp_rank 0


def saves_keys(etcd, step):
    """The keys of `step` under the job's saves/ in etcd."""
    p = etcd.ctl("h0", "get", "--prefix", "--keys-only", f"/scalai/gpt/saves/{step:020d}/")
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def keys_leave(etcd, step, timeout=30):
    deadline = deadline_in(timeout)
    while saves_keys(etcd, step):
        assert time.time() < deadline, saves_keys(etcd, step)
        time.sleep(0.2)


def saved_model(seed, config):
    """A model as a job saves it: its full tensors, and each rank's shard
    (a rank with dp_rank > 0 holds its dp_rank 0 rank's)."""
    full = random_gpt(np.random.default_rng(seed), LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB,
                      gated=True)
    shards = rank_shards(full, config, True, DIVISOR, LAYERS)
    tp, pp, dp, _ = parse_config(config)
    for rank in range(tp * pp * dp):
        t, d, p = rank % tp, rank // tp % dp, rank // (tp * dp)
        shards[rank] = shards[(p * dp) * tp + t]
    return full, shards


def save_ranks(mnt, step, config, shards, ranks):
    """The workers of one host save `ranks` through its mount, as
    Megatron's ranks do: each makes its directory as the save begins, then
    writes its extra/ files, then its shard."""
    for rank in ranks:
        os.makedirs(f"{mnt}/ckpt/step-{step:08d}/rank-{rank:05d}/extra/rng", exist_ok=True)
    for rank in ranks:
        rank_dir = f"{mnt}/ckpt/step-{step:08d}/rank-{rank:05d}"
        with open(f"{rank_dir}/extra/rng/state.bin", "wb") as f:
            f.write(extra_bytes(step, rank))
        write_safetensors(f"{rank_dir}/model.safetensors", shards[rank],
                          {"scalai.config": config})


def extra_bytes(step, rank):
    """An extra file of a few MiB (more than one checksum chunk) per rank."""
    return np.random.default_rng(step * 1000 + rank).bytes((2 << 20) + 12345 * rank)


def check_extras(mnt, step, config=SAVE_CONFIG):
    """Every rank's extra file, saved on its own host, read on this one."""
    tp, pp, dp, _ = parse_config(config)
    for rank in range(tp * pp * dp):
        with open(f"{mnt}/ckpt/step-{step:08d}/rank-{rank:05d}/extra/rng/state.bin", "rb") as f:
            assert f.read() == extra_bytes(step, rank), (mnt, step, rank)


def host_ranks(host, config=SAVE_CONFIG):
    tp, pp, dp, _ = parse_config(config)
    hosts = hosts_of(config)
    per = tp * pp * dp // len(hosts)
    i = hosts.index(host)
    return range(i * per, (i + 1) * per)


def latest(mnt):
    return os.readlink(f"{mnt}/ckpt/latest")


def saves_waiting(mnt):
    return {s["step"]: s["voted"] for s in cluster_status(mnt)["saves"]}


def wait_voted(mnt, step, voters, timeout=30):
    deadline = deadline_in(timeout)
    while sorted(saves_waiting(mnt).get(step, [])) != sorted(voters):
        assert time.time() < deadline, (step, voters, cluster_status(mnt)["saves"])
        time.sleep(0.1)


def wait_latest(mnts, step, timeout=60):
    deadline = deadline_in(timeout)
    want = f"step-{step:08d}"
    while True:
        got = {h: latest(m) for h, m in mnts.items()}
        if all(v == want for v in got.values()):
            return
        assert time.time() < deadline, (want, got, {h: status(m)["error"] for h, m in mnts.items()})
        time.sleep(0.1)


def saved_everywhere(mnts, step, full, shards):
    """Every host saves its ranks of `step`: it commits on every host, each
    rank's bytes and extra files as saved."""
    for h in HOSTS:
        save_ranks(mnts[h], step, SAVE_CONFIG, shards, host_ranks(h))
    wait_latest(mnts, step)
    for m in mnts.values():
        check_bytes(m, full, SAVE_CONFIG, LAYERS, DIVISOR)
        check_extras(m, step)


def mkdir_refused(mnt, path, err, says):
    """mkdir of `path` in the mount fails with `err`, and status's error
    says why."""
    try:
        os.mkdir(f"{mnt}/{path}")
    except OSError as e:
        assert e.errno == err, (path, e)
        assert says in status(mnt)["error"], (path, status(mnt))
        return
    raise AssertionError(f"{path} was made in {mnt}; expected: {says}")


def saved_across_hosts(seed, net, etcd, mnts, mount, mounts, tmp):
    """Steps saved through the four hosts' mounts, each host its own ranks:
    a step commits on every host once every host voted, and not before; a
    rank of another host, or a config naming no hosts, is refused; a host
    SIGKILLed partway leaves the step uncommitted everywhere, and mounted
    again drops it everywhere (earlier steps intact); a host cut off saves
    its part and the step commits when its cable is back."""
    config = SAVE_CONFIG
    wait_live(mnts["h1"], HOSTS)
    assert write_config(mnts["h1"], config) == 0, status(mnts["h1"])
    wait_all(mnts, config)
    before = latest(mnts["h0"])
    # A config without hosts= cannot be saved under in a cluster.
    assert write_config(mnts["h0"], "tp=2,pp=4,dp=1") == 0
    wait_all(mnts, "tp=2,pp=4,dp=1")
    mkdir_refused(mnts["h0"], "ckpt/step-00000019", errno.EROFS, "names its hosts")
    assert write_config(mnts["h0"], config) == 0
    wait_all(mnts, config)

    def model(k):
        return saved_model(seed + k, config)

    # Step 20: three hosts save, nothing commits; the fourth, and it does.
    full, shards = model(20)
    os.makedirs(f"{mnts['h0']}/ckpt/step-00000020")
    mkdir_refused(mnts["h0"], "ckpt/step-00000020/rank-00002", errno.EACCES,
                  "runs on another host")
    for h in ["h0", "h1", "h2"]:
        save_ranks(mnts[h], 20, config, shards, host_ranks(h))
    wait_voted(mnts["h3"], 20, ["h0", "h1", "h2"])
    time.sleep(1)  # two beats: no host may commit without h3
    assert all(latest(m) == before for m in mnts.values()), {h: latest(m) for h, m in mnts.items()}
    save_ranks(mnts["h3"], 20, config, shards, host_ranks("h3"))
    wait_latest(mnts, 20)
    for h, m in mnts.items():
        check_bytes(m, full, config, LAYERS, DIVISOR)
        check_extras(m, 20)
        assert saves_waiting(m) == {}, (h, cluster_status(m)["saves"])
    print(f"step 20 saved across four hosts: committed on all once h3 saved its ranks")

    # Step 30: h3's mount SIGKILLed with one rank of its two saved.
    _, shards30 = model(30)
    for h in ["h0", "h1", "h2"]:
        save_ranks(mnts[h], 30, config, shards30, host_ranks(h))
    save_ranks(mnts["h3"], 30, config, shards30, host_ranks("h3")[:1])
    wait_voted(mnts["h0"], 30, ["h0", "h1", "h2"])
    kill_host("h3", mnts, mounts, tmp)
    time.sleep(1)
    others = {h: m for h, m in mnts.items() if h != "h3"}
    assert all(latest(m) == "step-00000020" for m in others.values())
    mount("h3")
    wait_all(mnts, config)
    deadline = deadline_in(30)
    while any(saves_waiting(m) for m in mnts.values()):
        assert time.time() < deadline, {h: cluster_status(m)["saves"] for h, m in mnts.items()}
        time.sleep(0.1)
    for h, m in mnts.items():
        assert latest(m) == "step-00000020", (h, latest(m))
        assert "step-00000030" not in os.listdir(f"{m}/ckpt"), (h, os.listdir(f"{m}/ckpt"))
        check_bytes(m, full, config, LAYERS, DIVISOR)
    print("h3 killed while saving step 30: no host committed it; mounted again, it was dropped")

    # Step 30 again, with h1 cut off meanwhile: it commits once h1 is back.
    full, shards = model(31)
    net.link("h1", False)
    try:
        for h in HOSTS:
            save_ranks(mnts[h], 30, config, shards, host_ranks(h))
        wait_voted(mnts["h0"], 30, ["h0", "h2", "h3"])
        time.sleep(1)
        assert all(latest(m) == "step-00000020" for m in mnts.values())
    finally:
        net.link("h1", True)
    wait_latest(mnts, 30)
    for m in mnts.values():
        check_bytes(m, full, config, LAYERS, DIVISOR)
        check_extras(m, 30)
    print("step 30 saved while h1 was cut off: committed everywhere once it was back")
    # Every host has recorded step 20, and the spare never mounted: it will
    # need only the newest step. Step 20's keys leave etcd; step 30's stay.
    keys_leave(etcd, 20)
    assert f"/scalai/gpt/saves/{30:020d}/committed" in saves_keys(etcd, 30), saves_keys(etcd, 30)
    print("step 20's keys left etcd once every host that ever mounted had recorded it; "
          "step 30's, the newest, stay for the spare host")

    # Step 35: every host begins it and h3's mount ends before any host has
    # voted. The others vote after h3 is mounted again; their votes say the
    # step began before h3 started, so h3 withdraws them and the step is
    # dropped everywhere rather than waiting for h3 forever.
    _, shards35 = model(35)
    for h in HOSTS:
        save_ranks(mnts[h], 35, config, shards35, host_ranks(h)[:1])
    time.sleep(1)  # two beats: each host has noted when it began the step
    kill_host("h3", mnts, mounts, tmp)
    mount("h3")
    wait_all(mnts, config)
    for h in ["h0", "h1", "h2"]:
        save_ranks(mnts[h], 35, config, shards35, host_ranks(h)[1:])
    deadline = deadline_in(30)
    while any(status(m)["saving"] or saves_waiting(m) for m in mnts.values()):
        assert time.time() < deadline, {
            h: (status(m)["saving"], cluster_status(m)["saves"]) for h, m in mnts.items()}
        time.sleep(0.1)
    for h, m in mnts.items():
        assert latest(m) == "step-00000030", (h, latest(m))
        assert "step-00000035" not in os.listdir(f"{m}/ckpt"), (h, os.listdir(f"{m}/ckpt"))
    # The step number is free again.
    saved_everywhere(mnts, 35, *model(36))
    print("h3 killed before any host voted for step 35: the later votes were withdrawn, "
          "the step dropped everywhere and saved again")
    removed_while_saving(net, mnts, mount, mounts, model, tmp)
    return config


def removed_while_saving(net, mnts, mount, mounts, model, tmp):
    """Step 37: a save that failed on one host (one of its two ranks
    written) is removed there with rm -r, as on a single host. The removal
    withdraws the step: every host drops its part. While h0 is cut off
    from etcd the removal waits, and the step cannot be begun again there.
    Then a host whose part was already pending and voted removes it while
    cut off from etcd, and its mount is killed before it could withdraw
    the step: mounted again, it does. Saved a third time by every host,
    the step commits."""
    def dropped_everywhere():
        deadline = deadline_in(30)
        while any(status(m)["saving"] or saves_waiting(m) or
                  "step-00000037" in os.listdir(f"{m}/ckpt") for m in mnts.values()):
            assert time.time() < deadline, {
                h: (status(m)["saving"], cluster_status(m)["saves"]) for h, m in mnts.items()}
            time.sleep(0.1)
        assert all(latest(m) == "step-00000035" for m in mnts.values())

    _, shards = model(37)
    for h in ["h1", "h2", "h3"]:
        save_ranks(mnts[h], 37, SAVE_CONFIG, shards, host_ranks(h))
    save_ranks(mnts["h0"], 37, SAVE_CONFIG, shards, host_ranks("h0")[:1])
    wait_voted(mnts["h1"], 37, ["h1", "h2", "h3"])
    net.link("h0", False)
    try:
        shutil.rmtree(f"{mnts['h0']}/ckpt/step-00000037")
        mkdir_refused(mnts["h0"], "ckpt/step-00000037", errno.EAGAIN, "being withdrawn")
        time.sleep(1)  # two beats: the step still waits on the others
        assert sorted(saves_waiting(mnts["h1"])[37]) == ["h1", "h2", "h3"]
    finally:
        net.link("h0", True)
    dropped_everywhere()
    print("step 37 removed with rm -r on h0 partway through its save: withdrawn once h0 "
          "reached etcd again (until then not begun again there), dropped on every host")

    for h in ["h0", "h1", "h2"]:
        save_ranks(mnts[h], 37, SAVE_CONFIG, shards, host_ranks(h))
    wait_voted(mnts["h3"], 37, ["h0", "h1", "h2"])
    net.link("h1", False)
    try:
        shutil.rmtree(f"{mnts['h1']}/ckpt/step-00000037")
        kill_host("h1", mnts, mounts, tmp)
    finally:
        net.link("h1", True)
    mount("h1")
    dropped_everywhere()
    print("step 37 removed on h1 after it voted, cut off from etcd, and h1's mount killed "
          "before it withdrew the step: mounted again, it withdrew it; dropped on every host")

    saved_everywhere(mnts, 37, *model(38))
    print("step 37 saved a third time: committed on every host")


def datasets_compared(mnts, mount, mounts, tmp):
    """A dataset registered on every host: three copies agree and are
    served; h3's copy, one sample changed (same lines, same sizes), is
    refused there, and its status says why. With every host unmounted, the
    first one mounted again sets the cluster's copy."""
    lines = [json.dumps({"id": i, "text": "sample %d" % i}) for i in range(64)]
    copies = {"same": lines, "changed": lines[:10] + [lines[10].replace("sample", "SAMPLE")] + lines[11:]}
    for name, text in copies.items():
        with open(f"{tmp}/{name}.jsonl", "w") as f:
            f.write("\n".join(text) + "\n")
    for h in HOSTS:
        run("umount", mnts[h])
        mounts.discard(mnts[h])
        copy = "changed" if h == "h3" else "same"
        run("dataset", "add", f"{tmp}/{h}/store", "tokens", "--format", "jsonl",
            "--global-batch", "8", "--epochs", "8", f"{tmp}/{copy}.jsonl")
        mount(h)
    wait_all(mnts, SAVE_CONFIG)
    for h in ["h0", "h1", "h2"]:
        assert "tokens" in os.listdir(f"{mnts[h]}/data"), h
        assert cluster_status(mnts[h])["datasets_refused"] == {}, h
    assert "tokens" not in os.listdir(f"{mnts['h3']}/data")
    refused = cluster_status(mnts["h3"])["datasets_refused"]
    assert list(refused) == ["tokens"] and "content" in refused["tokens"], refused
    assert "dataset tokens differs from the cluster's" in status(mnts["h3"])["error"], status(mnts["h3"])
    print(f"a differing dataset copy refused on h3: {refused['tokens']}")
    # Every host unmounted, the first mounted again makes its copy the
    # cluster's (a dataset registered again with other content); a host
    # with the other copy is then refused. Mounted again h0 first, every
    # host is as before.
    for h in HOSTS:
        run("umount", mnts[h])
        mounts.discard(mnts[h])
    mount("h3")
    mount("h0")
    wait_all({h: mnts[h] for h in ["h0", "h3"]}, SAVE_CONFIG)
    assert "tokens" in os.listdir(f"{mnts['h3']}/data")
    assert cluster_status(mnts["h3"])["datasets_refused"] == {}
    assert "tokens" not in os.listdir(f"{mnts['h0']}/data")
    refused = cluster_status(mnts["h0"])["datasets_refused"]
    assert list(refused) == ["tokens"] and "live now: h3" in refused["tokens"], refused
    for h in ["h0", "h3"]:
        run("umount", mnts[h])
        mounts.discard(mnts[h])
    for h in HOSTS:
        mount(h)
    wait_all(mnts, SAVE_CONFIG)
    assert "tokens" in os.listdir(f"{mnts['h0']}/data")
    assert list(cluster_status(mnts["h3"])["datasets_refused"]) == ["tokens"]
    print("every host unmounted, the first mounted again made its copy the cluster's")



def holds_of(mnt, host, step, timeout=30):
    """The groups of `step` that `host` holds, as `mnt` sees it reported."""
    deadline = deadline_in(timeout)
    while True:
        entry = [h for h in cluster_status(mnt)["hosts"] if h["name"] == host][0]
        groups = [e["groups"] for e in entry.get("holds", []) if e["step"] == step]
        if groups:
            return groups[0]
        assert time.time() < deadline, entry
        time.sleep(0.2)


def replicas_kept(seed, net, mnts, mount, mounts, tmp):
    """Every host mounted with --replicas 2. Under dp=2, h1 runs stage 0's
    replicas and saves them: the one it saved wrong (one value off) is found
    by checksum against h0's, dropped, and h1 copies h0's instead before the
    step commits. Under dp=1, each host's shards are copied to the next host
    as the step is saved; h1 SIGKILLed while a step waits for its vote, a
    config without it is accepted and materialized from h2's copy, byte for
    byte, and the step is dropped everywhere, h1 included once it is back."""
    for h in HOSTS:
        run("umount", mnts[h])
        mounts.discard(mnts[h])
        mount(h, "--replicas", "2")
    wait_live(mnts["h0"], HOSTS)
    spread = "tp=2,pp=2,dp=2,hosts=h0+h1+h2+h3"  # h1, h3: the replicas of h0, h2
    assert write_config(mnts["h0"], spread) == 0, status(mnts["h0"])
    wait_all(mnts, spread)
    full, shards = saved_model(seed + 40, spread)
    wrong = {n: x.copy() for n, x in shards[3].items()}
    wrong[sorted(wrong)[0]].flat[0] += 1
    for h in HOSTS:
        save_ranks(mnts[h], 40, spread, {**shards, 3: wrong}, host_ranks(h, spread))
    wait_latest(mnts, 40)
    refused = cluster_status(mnts["h1"])["replicas_refused"]
    assert len(refused) == 1 and ("rank-00001/model.safetensors saved on host h1 differs from "
                                  "the one host h0") in refused[0], refused
    error = refused[0]
    for h, m in mnts.items():
        check_bytes(m, full, spread, LAYERS, DIVISOR)
    assert holds_of(mnts["h0"], "h1", 40) == [0, 1]
    print(f"step 40 under dp=2: h1's wrong replica refused ({error}); h1 keeps h0's copy")
    # h1, which runs only replicas and is h0's next host, SIGKILLed: a step
    # saved meanwhile does not wait for its copy.
    kill_host("h1", mnts, mounts, tmp)
    alive = {h: m for h, m in mnts.items() if h != "h1"}
    wait_live(mnts["h0"], alive)
    full, shards = saved_model(seed + 45, spread)
    for h in alive:
        save_ranks(mnts[h], 45, spread, shards, host_ranks(h, spread))
    wait_latest(alive, 45)
    check_bytes(mnts["h0"], full, spread, LAYERS, DIVISOR)
    mount("h1", "--replicas", "2")
    wait_all(mnts, spread)
    wait_latest(mnts, 45)
    for m in mnts.values():
        wait_live(m, HOSTS)  # a config naming h1 is accepted only once it is
    print("step 45 saved while h1, h0's next host, was down: committed without its copy")

    line = "tp=2,pp=4,dp=1,hosts=h0+h1+h2+h3"
    assert write_config(mnts["h2"], line) == 0, status(mnts["h2"])
    wait_all(mnts, line)
    full, shards = saved_model(seed + 50, line)
    for h in HOSTS:
        save_ranks(mnts[h], 50, line, shards, host_ranks(h, line))
    wait_latest(mnts, 50)
    for h, nxt in [("h0", "h1"), ("h1", "h2"), ("h2", "h3"), ("h3", "h0")]:
        own = set(host_ranks(h, line))  # under dp=1, a rank's group has its number
        assert own <= set(holds_of(mnts["h0"], nxt, 50)), (h, nxt)
    # Step 55: h1 saves its ranks cut off from etcd, so it cannot vote, and
    # its mount is SIGKILLed so: the step waits for its vote.
    _, shards55 = saved_model(seed + 55, line)
    net.link("h1", False)
    try:
        for h in HOSTS:
            save_ranks(mnts[h], 55, line, shards55, host_ranks(h, line))
        wait_voted(mnts["h0"], 55, ["h0", "h2", "h3"])
        # Its part is whole: it waits for no rank, only for the commit.
        assert status(mnts["h1"])["saving"] == [{"step": 55, "waiting_for": []}], (
            status(mnts["h1"])["saving"])
        kill_host("h1", mnts, mounts, tmp)
    finally:
        net.link("h1", True)
    alive = {h: m for h, m in mnts.items() if h != "h1"}
    wait_live(mnts["h0"], alive)
    assert sorted(saves_waiting(mnts["h0"])[55]) == ["h0", "h2", "h3"]
    # A config that leaves h1 out says it is lost for good: step 55 would
    # wait for it forever, and is dropped everywhere instead.
    fewer = "tp=2,pp=2,dp=1,hosts=h0+h2"
    assert write_config(mnts["h0"], fewer) == 0, status(mnts["h0"])
    wait_all(alive, fewer)
    for h in ["h0", "h2"]:
        check_bytes(mnts[h], full, fewer, LAYERS, DIVISOR)
    deadline = deadline_in(30)
    while any(saves_waiting(m) for m in alive.values()):
        assert time.time() < deadline, {h: cluster_status(m)["saves"] for h, m in alive.items()}
        time.sleep(0.1)
    # h1 mounted again with its part of step 55 pending: the withdrawal
    # came after that part began, so h1 drops it rather than voting alone.
    mount("h1", "--replicas", "2")
    wait_all(mnts, fewer)
    check_bytes(mnts["h1"], full, fewer, LAYERS, DIVISOR)
    # (From its start on, a host lists the steps it holds a part of.)
    deadline = deadline_in(30)
    while 55 in saves_waiting(mnts["h1"]):
        assert time.time() < deadline, cluster_status(mnts["h1"])["saves"]
        time.sleep(0.1)
    for h, m in mnts.items():
        assert saves_waiting(m) == {}, (h, cluster_status(m)["saves"])
        assert latest(m) == "step-00000050", (h, latest(m))
        assert "step-00000055" not in os.listdir(f"{m}/ckpt"), (h, os.listdir(f"{m}/ckpt"))
    print("step 50 under dp=1 with --replicas 2: h1 SIGKILLed, its shards came from h2's copy; "
          "step 55, waiting for h1's vote, dropped once a config left h1 out, and on h1 when "
          "it came back")
    return fewer


if __name__ == "__main__":
    main()
