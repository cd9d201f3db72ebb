#!/usr/bin/python3
"""A full disk on one host of a cluster (two hosts, each in its own network
namespace, one etcd member). h1's store lives on a small tmpfs; a config
that makes h1 write a new stage cannot fit there:
- h1's materialization fails: its `status` says "failed" and why, and so
  does h0's `cluster status`, from what h1 recorded in etcd; h0, whose part
  fits, is ready; both hosts' views stay right meanwhile (each rank read on
  both hosts equals the shard cut from the full model).
- The same config written on h0 changes nothing on h1; written on h1 after
  space is freed, it finishes.
- A step h0 saved and voted for, whose save on h1 fails with ENOSPC, is
  dropped on both hosts by rm -r of it on h1; saved again once space is
  freed, it commits. With h1's mount killed, a read on h0 of its rank 1
  (held by h1 alone) fails with EIO and `status` names the bytes; mounted
  again, h1 serves it. Both stores are fsck-clean at the end.
Exits 77 where /dev/fuse, network namespaces or a tmpfs cannot be had."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Mounts, deadline_in, deleted_files_held, require_fuse,  # noqa
                     small_tmpfs, test_seed)
from netns import Etcd, Network, require_netns, server_pid, write_cluster_file  # noqa
from reference import random_gpt, rank_shards, scalai, write_safetensors  # noqa
from views import check_bytes, status, write_config  # noqa

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


def cluster_host(mnt, host):
    """`host` as `scalai cluster status` on `mnt` shows it."""
    hosts = json.loads(run("cluster", "status", mnt, "--json").stdout)["hosts"]
    return next(h for h in hosts if h["name"] == host)


def wait_live(mnt):
    """`mnt`'s host sees both hosts live."""
    deadline = deadline_in(30)
    while not all(cluster_host(mnt, h)["live"] for h in HOSTS):
        assert time.time() < deadline, [cluster_host(mnt, h) for h in HOSTS]
        time.sleep(0.1)


def held_by_deleted_files(fs):
    """Bytes of the filesystem at `fs` in use but by no file a name reaches:
    files deleted while still open or mapped."""
    named = 0
    for root, dirs, files in os.walk(fs):
        for name in dirs + files:
            named += os.lstat(os.path.join(root, name)).st_blocks * 512
    usage = shutil.disk_usage(fs)
    return usage.total - usage.free - named


def wait_space_settled(tmp, mnts, step_bytes):
    """h1 holds no more than one stage: each host lets go of the shards it
    kept for the other a beat or two after both are ready, and their space
    comes back once no view maps them. Until then h1's free space is not
    what it will be."""
    def blob_bytes():
        d = f"{tmp}/h1/store/blobs"
        return sum(e.stat().st_size for e in os.scandir(d) if e.is_file())

    deadline = deadline_in(30)
    while blob_bytes() > 0.6 * step_bytes:
        assert time.time() < deadline, (blob_bytes(), step_bytes)
        time.sleep(0.1)
    deadline = deadline_in(10)
    while held_by_deleted_files(f"{tmp}/h1") >= 64 * 1024:
        assert time.time() < deadline, deleted_files_held(
            server_pid(mnts["h1"]), f"{tmp}/h1/")
        time.sleep(0.1)


def save_ranks(mnt, step, shards, ranks):
    """Workers save `ranks` of `step` under TARGET through `mnt`."""
    for rank in ranks:
        path = f"{mnt}/ckpt/step-{step:08d}/rank-{rank:05d}"
        os.makedirs(path, exist_ok=True)
        write_safetensors(f"{path}/model.safetensors", shards[rank], {"scalai.config": TARGET})


def saves_waiting(mnt):
    return json.loads(run("cluster", "status", mnt, "--json").stdout)["saves"]


def save_on_full_disk(tmp, mnts, full, step_bytes):
    """Step 8: h0 saves rank 0 and votes; h1's worker gets ENOSPC saving
    rank 1. The failed save removed on h1 with rm -r is dropped on both
    hosts; with space freed, the step is saved again and commits."""
    shards = rank_shards(full, TARGET, True, DIVISOR, LAYERS)
    # Filled before the shards kept from before the switch are let go, h1
    # would have room again by the time rank 1 is saved.
    wait_space_settled(tmp, mnts, step_bytes)
    save_ranks(mnts["h0"], 8, shards, [0])
    deadline = deadline_in(30)
    while [s["voted"] for s in saves_waiting(mnts["h0"])] != [["h0"]]:
        assert time.time() < deadline, saves_waiting(mnts["h0"])
        time.sleep(0.1)
    free = shutil.disk_usage(f"{tmp}/h1").free
    with open(f"{tmp}/h1/filler", "wb") as f:
        f.write(b"\0" * (free - MIB))
    try:
        save_ranks(mnts["h1"], 8, shards, [1])
        raise AssertionError("rank 1 was saved on a full disk")
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    shutil.rmtree(f"{mnts['h1']}/ckpt/step-00000008")
    deadline = deadline_in(30)
    while any(saves_waiting(m) or status(m)["saving"] or
              "step-00000008" in os.listdir(f"{m}/ckpt") for m in mnts.values()):
        assert time.time() < deadline, {h: (saves_waiting(m), status(m)["saving"])
                                        for h, m in mnts.items()}
        time.sleep(0.1)
    print("step 8: ENOSPC on h1 while saving rank 1; rm -r there dropped it on both hosts")
    os.unlink(f"{tmp}/h1/filler")
    save_ranks(mnts["h0"], 8, shards, [0])
    save_ranks(mnts["h1"], 8, shards, [1])
    deadline = deadline_in(30)
    while any(os.readlink(f"{m}/ckpt/latest") != "step-00000008" for m in mnts.values()):
        assert time.time() < deadline, {h: status(m)["error"] for h, m in mnts.items()}
        time.sleep(0.1)
    print("step 8 saved again with space freed: committed on both hosts")


def read_with_peer_gone(mnts, mount, full):
    """Rank 1's bytes of step 8 are on h1 alone: with h1's mount killed, a
    read of them on h0 fails with EIO and `status` names them. Mounted
    again, h1 serves them: every rank reads right on both hosts."""
    os.kill(server_pid(mnts["h1"]), signal.SIGKILL)
    try:
        with open(f"{mnts['h0']}/ckpt/step-00000008/rank-00001/model.safetensors", "rb") as f:
            f.read()
        raise AssertionError("rank 1 read on h0 with h1 gone")
    except OSError as e:
        assert e.errno == errno.EIO, e
    error = status(mnts["h0"])["error"]
    assert "held by no reachable host" in error, error
    print(f"h1's mount killed: rank 1 of step 8 read on h0 fails: {error}")
    subprocess.run(["umount", "-l", mnts["h1"]], check=True)
    mount("h1")
    # h0 dials h1 again within a second of its return.
    deadline = deadline_in(10)
    while True:
        try:
            check_bytes(mnts["h0"], full, TARGET, LAYERS, DIVISOR)
            break
        except OSError as e:
            assert time.time() < deadline, (e, status(mnts["h0"])["error"])
            time.sleep(0.2)
    check_bytes(mnts["h1"], full, TARGET, LAYERS, DIVISOR)
    print("h1 mounted again: every rank of step 8 reads right on both hosts")


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

            def mount(h):
                p = net.run(h, BIN, "mount", f"{tmp}/{h}/store", mnts[h], "--cluster", cluster,
                            "--host", h, capture_output=True, text=True)
                assert p.returncode == 0, (h, p.stderr)
                mounts.add(mnts[h])
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
                mount(h)
            wait_live(mnts["h0"])
            write_config(mnts["h0"], START)
            for m in mnts.values():
                wait_state(m, START, "ready")
            wait_space_settled(tmp, mnts, step_bytes)

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
            wait_state(mnts["h1"], TARGET, "failed", timeout=10)

            os.unlink(f"{tmp}/h1/filler")
            out = run("reconfigure", mnts["h1"], TARGET, "--wait").stdout
            deadline = deadline_in(30)
            while not json.loads(run("cluster", "status", mnts["h0"], "--json").stdout)[
                    "peers"]["h1"]["reachable"]:
                assert time.time() < deadline
                time.sleep(0.1)
            for m in mnts.values():
                s = wait_state(m, TARGET, "ready")
                assert s["error"] is None, s
                check_bytes(m, full, TARGET, LAYERS, DIVISOR)
            print(f"space freed, the config written again on h1: {out.strip()}")

            save_on_full_disk(tmp, mnts, full, step_bytes)
            read_with_peer_gone(mnts, mount, full)

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
