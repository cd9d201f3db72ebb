#!/usr/bin/python3
"""A full disk on one host of a cluster (two hosts, each in its own network
namespace, one etcd member). h1's store lives on a small tmpfs; a config
that makes h1 write a new stage cannot fit there:
- h1's materialization fails: its `status` says "failed" and why, and so
  does h0's `cluster status`, from what h1 recorded in etcd; h0, whose part
  fits, is ready; both hosts' views stay right meanwhile (each rank read on
  both hosts equals the shard cut from the full model).
- The same config written on h0 changes nothing on h1; written on h1 after
  space is freed, it finishes, and both stores are fsck-clean.
Exits 77 where /dev/fuse, network namespaces or a tmpfs cannot be had."""
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, deadline_in, require_fuse, small_tmpfs, test_seed  # noqa
from netns import Etcd, Network, require_netns, write_cluster_file  # noqa
from reference import random_gpt, rank_shards, scalai, write_safetensors  # noqa
from views import check_bytes, status  # noqa

BIN = sys.argv[1]
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 2, 256, 8, 4, 512, 1001, 8
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}",
          "--param", f"num_query_groups={GROUPS}"]
HOSTS = ["h0", "h1"]
START = "tp=2,pp=1,dp=1,hosts=h0+h1"
# Each host writes its stage anew, unsplit: h1 the second.
TARGET = "tp=1,pp=2,dp=1,hosts=h0+h1"
MIB = 1 << 20


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def wait_state(mnt, config, state, timeout=60):
    deadline = deadline_in(timeout)
    while True:
        s = status(mnt)
        if s["config"] == config and s["state"] == state:
            return s
        assert time.time() < deadline, (mnt, config, state, s)
        time.sleep(0.05)


def write_config(mnt, config):
    fd = os.open(f"{mnt}/config", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, (config + "\n").encode())
    finally:
        os.close(fd)


def cluster_host(mnt, host):
    """`host` as `scalai cluster status` on `mnt` shows it."""
    hosts = json.loads(run("cluster", "status", mnt, "--json").stdout)["hosts"]
    return next(h for h in hosts if h["name"] == host)


def main():
    require_fuse()
    require_netns()
    seed = test_seed()
    full = random_gpt(np.random.default_rng(seed), LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB,
                      gated=True)
    with tempfile.TemporaryDirectory() as tmp, Mounts() as mounts:
        net = Network(["e0"] + HOSTS)
        mnts = {h: f"{tmp}/mnt-{h}" for h in HOSTS}
        try:
            etcd = Etcd(net, ["e0"], tmp)
            etcd.wait_healthy("h0")
            cluster = write_cluster_file(tmp, net, etcd, HOSTS, "gpt")
            src = f"{tmp}/src"
            for rank, shard in rank_shards(full, "tp=2,pp=1,dp=1", True, DIVISOR,
                                           LAYERS).items():
                os.makedirs(f"{src}/rank-{rank:05d}")
                write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", shard)
            step_bytes = sum(os.path.getsize(f"{src}/{r}/model.safetensors")
                             for r in os.listdir(src))
            # h1's disk: room for the imported step and a little more.
            small_tmpfs(f"{tmp}/h1", step_bytes + 16 * MIB, mounts)
            os.makedirs(f"{tmp}/h0")
            for h in HOSTS:
                run("init", f"{tmp}/{h}/store", *LAYOUT)
                run("import", f"{tmp}/{h}/store", src, "--config", "tp=2,pp=1,dp=1",
                    "--step", "7")
                os.makedirs(mnts[h])
                p = net.run(h, BIN, "mount", f"{tmp}/{h}/store", mnts[h], "--cluster", cluster,
                            "--host", h, capture_output=True, text=True)
                assert p.returncode == 0, (h, p.stderr)
                mounts.add(mnts[h])
            deadline = deadline_in(30)
            while not all(cluster_host(mnts["h0"], h)["live"] for h in HOSTS):
                assert time.time() < deadline, [cluster_host(mnts["h0"], h) for h in HOSTS]
                time.sleep(0.1)
            write_config(mnts["h0"], START)
            for m in mnts.values():
                wait_state(m, START, "ready")

            # Fill h1's disk but for a quarter of a step: its stage, more
            # than a third of the model, cannot fit.
            free = shutil.disk_usage(f"{tmp}/h1").free
            with open(f"{tmp}/h1/filler", "wb") as f:
                f.write(b"\0" * (free - step_bytes // 4))
            write_config(mnts["h0"], TARGET)
            wait_state(mnts["h0"], TARGET, "ready")
            failed = wait_state(mnts["h1"], TARGET, "failed")
            assert "No space left" in failed["error"], failed
            assert failed["bytes_to_move"] > failed["bytes_moved"], failed
            deadline = deadline_in(30)
            while cluster_host(mnts["h0"], "h1").get("state") != "failed":
                assert time.time() < deadline, cluster_host(mnts["h0"], "h1")
                time.sleep(0.1)
            seen = cluster_host(mnts["h0"], "h1")
            assert "No space left" in seen["error"], seen
            for m in mnts.values():
                check_bytes(m, full, TARGET, LAYERS, DIVISOR)
            print(f"h1's disk full: h1 failed ({failed['error']}); h0 ready and sees it; "
                  "the views on both hosts stay right")

            # The same config on h0: nothing to do anywhere.
            write_config(mnts["h0"], TARGET)
            time.sleep(1)  # two beats
            assert status(mnts["h1"])["state"] == "failed", status(mnts["h1"])
            os.unlink(f"{tmp}/h1/filler")
            out = run("reconfigure", mnts["h1"], TARGET, "--wait").stdout
            for m in mnts.values():
                s = wait_state(m, TARGET, "ready")
                assert s["error"] is None, s
                check_bytes(m, full, TARGET, LAYERS, DIVISOR)
            print(f"space freed, the config written again on h1: {out.strip()}")

            for h in HOSTS:
                run("umount", mnts[h])
                mounts.discard(mnts[h])
                run("fsck", f"{tmp}/{h}/store")
        finally:
            for h in HOSTS:
                net.run(h, "umount", "-l", mnts[h], capture_output=True)
            net.close()
    print("cluster_full_disk_test: ok")


if __name__ == "__main__":
    main()
