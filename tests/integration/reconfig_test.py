#!/usr/bin/python3
"""Reconfiguration on a real mount: a random walk of parallel configs (tp, pp,
dp, stages and the sharding across dp ranks, fsdp or distopt, changing
alone and together, the world growing and shrinking)
over a synthetic GPT with SwiGLU and vocab padding. After every switch, and
again after its materialization, every byte of every rank must equal numpy
slicing of the full tensors; the executor's byte counters must equal what
`scalai plan` says is the minimum. Readers keep reading through handles
opened under older configs the whole time and must never see a wrong byte.
Then switches that supersede running materializations, and at the end the
store must pass fsck with no blob file left that no record names, and the
mount must hold no deleted blob open. Exits 77 only where /dev/fuse is
missing."""
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import require_fuse, serve, test_seed  # noqa
from reference import (distopt_of, fsdp_of, parse_config, rank_shards, random_gpt,  # noqa
                       scalai, write_safetensors)
from views import check_bytes, expected, status, wait_ready  # noqa

BIN = sys.argv[1]
STEPS = int(os.environ.get("SCALAI_RECONFIG_STEPS", "24"))
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 6, 192, 12, 6, 384, 203, 8
MODEL = (f"layers={LAYERS},hidden={HIDDEN},heads={HEADS},groups={GROUPS},ffn={FFN},"
         f"vocab={VOCAB},gated_linear_unit=1")
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]
START = "tp=2,pp=2,dp=2"
TP_CHOICES = [1, 2, 3, 6]  # divide heads, groups, hidden and ffn


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def make_config(tp, pp, dp, stages, fsdp=1):
    """fsdp 0 stands for distopt=1."""
    c = f"tp={tp},pp={pp},dp={dp}" + (f",fsdp={fsdp}" if fsdp > 1 else "")
    c += ",distopt=1" if fsdp == 0 else ""
    return c + ",stages=" + ":".join(map(str, stages)) if stages else c


def random_stages(r, pp):
    """An uneven split of the layers into pp stages, or None for the even one."""
    if pp == 1 or r.random() < 0.5:
        return None
    cuts = sorted(r.sample(range(1, LAYERS), pp - 1))
    bounds = [0] + cuts + [LAYERS]
    return [bounds[i + 1] - bounds[i] for i in range(pp)]


def next_config(r, config):
    """Changes one thing (tp, pp, dp, the stages or the fsdp sharding) or
    several at once."""
    tp, pp, dp, stages = parse_config(config)
    fsdp = 0 if distopt_of(config) else fsdp_of(config)
    while True:
        kind = r.choice(["tp", "pp", "dp", "stages", "fsdp", "all", "all"])
        ntp, npp, ndp, nstages, nfsdp = tp, pp, dp, stages, fsdp
        if kind in ("tp", "all"):
            ntp = r.choice(TP_CHOICES)
        if kind in ("pp", "all"):
            npp = r.randint(1, 4)
            nstages = random_stages(r, npp)
        if kind in ("dp", "all"):
            ndp = r.randint(1, 4)
        if kind == "stages":
            nstages = random_stages(r, pp)
        if kind in ("fsdp", "all") or (nfsdp and ndp % nfsdp):
            nfsdp = r.choice([d for d in range(0, ndp + 1) if d == 0 or ndp % d == 0])
        new = make_config(ntp, npp, ndp, nstages, nfsdp)
        if new != config and ntp * npp * ndp <= 24:
            return new


def planned_bytes(before, after):
    out = run("plan", *LAYOUT, "--model", MODEL, "--dtype", "f32", "--from", before, "--to", after,
              "--json").stdout
    return json.loads(out)["bytes_to_write"]


class HeldReaders:
    """Threads that read, through handles opened under one config, the bytes
    that config promised, until stopped; they count what they checked."""

    def __init__(self):
        self.stop = False
        self.errors, self.reads, self.threads = [], [0], []

    def hold(self, path, data, seed):
        fd = os.open(path, os.O_RDONLY)

        def loop():
            r = random.Random(seed)
            try:
                while not self.stop:
                    off = r.randrange(len(data))
                    got = os.pread(fd, 65536, off)
                    if got != data[off:off + 65536]:
                        self.errors.append((path, off))
                    self.reads[0] += 1
            finally:
                os.close(fd)
        t = threading.Thread(target=loop)
        t.start()
        self.threads.append(t)

    def finish(self):
        self.stop = True
        for t in self.threads:
            t.join()
        assert not self.errors, self.errors[:3]
        return self.reads[0]


def deleted_blobs_held(pid):
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "/blobs/" in target and target.endswith("(deleted)"):
            held.append(target)
    return held


def main():
    require_fuse()
    seed = test_seed()
    r = random.Random(seed)
    full = random_gpt(np.random.default_rng(seed), LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB,
                      gated=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, store, mnt = f"{tmp}/src", f"{tmp}/store", f"{tmp}/mnt"
        for rank, shard in rank_shards(full, START, True, DIVISOR, LAYERS).items():
            os.makedirs(f"{src}/rank-{rank:05d}")
            write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", shard)
        run("init", store, *LAYOUT)
        run("import", store, src, "--config", START, "--step", "7")
        os.makedirs(mnt)
        server = serve(BIN, store, mnt)
        readers = HeldReaders()
        try:
            walk(r, mnt, full, readers)
            supersede(r, mnt, full, readers)
            reads = readers.finish()
            print(f"held readers: {reads} reads through handles of older configs, all right")
            # With every handle closed, the old generations go, and with them the
            # last references to freed blobs (the kernel forgets asynchronously).
            deadline = time.time() + 20
            while deleted_blobs_held(server.pid) and time.time() < deadline:
                os.listdir(mnt)
                time.sleep(0.2)
            assert not deleted_blobs_held(server.pid), deleted_blobs_held(server.pid)
        except BaseException:
            readers.stop = True
            subprocess.run(["umount", "-l", mnt])
            raise
        final = status(mnt)["config"]
        run("umount", mnt)
        assert server.wait(timeout=60) == 0
        run("fsck", store)
        inspect = json.loads(run("inspect", store, "--json").stdout)
        assert inspect["config"] == final, inspect
        files = os.listdir(f"{store}/blobs")
        assert inspect["blobs"] == len(files), (inspect["blobs"], files)
    print("reconfig test: ok")


def walk(r, mnt, full, readers):
    config = START
    check_bytes(mnt, full, config, LAYERS, DIVISOR)
    seen_materializing = grown = shrunk = sharded = 0
    for i in range(STEPS):
        new = next_config(r, config)
        if i % 4 == 0:  # a handle under the old config, read while configs change
            rank = r.randrange(len(expected(full, config, LAYERS, DIVISOR)))
            want = expected(full, config, LAYERS, DIVISOR)[rank]
            name = r.choice(sorted(want))
            readers.hold(f"{mnt}/ckpt/latest/rank-{rank:05d}/tensors/{name}",
                         want[name].tobytes(), i)
        planned = planned_bytes(config, new)
        before = status(mnt)["generation"]
        with open(f"{mnt}/config", "w") as f:
            f.write(new + "\n")
        s = status(mnt)
        assert s["config"] == new and s["generation"] > before and s["error"] is None, s
        seen_materializing += s["state"] == "materializing"
        check_bytes(mnt, full, new, LAYERS, DIVISOR)  # right after the switch
        s = wait_ready(mnt, new)
        assert (s["bytes_moved"], s["bytes_to_move"]) == (planned, planned), (config, new, s)
        check_bytes(mnt, full, new, LAYERS, DIVISOR)  # read from the materialized blobs
        old_world, new_world = (np.prod(parse_config(c)[:3]) for c in (config, new))
        grown += new_world > old_world
        shrunk += new_world < old_world
        sharded += fsdp_of(new) > 1 or distopt_of(new)
        print(f"{config:>28} -> {new:<28} moved {planned:>9} bytes (= plan)")
        config = new
    assert grown and shrunk and sharded, (grown, shrunk, sharded)
    print(f"{STEPS} configs: every byte of every rank checked after each switch "
          f"({seen_materializing} seen still materializing) and after materialization")


def supersede(r, mnt, full, readers):
    """Switches in quick succession: each cancels the materialization before it."""
    config = status(mnt)["config"]
    for _ in range(3):
        burst = []
        for _ in range(3):
            config = next_config(r, config)
            burst.append(config)
            with open(f"{mnt}/config", "w") as f:
                f.write(config + "\n")
        check_bytes(mnt, full, config, LAYERS, DIVISOR)
        wait_ready(mnt, config)
        check_bytes(mnt, full, config, LAYERS, DIVISOR)
        print(f"superseded: {' -> '.join(burst)}")


if __name__ == "__main__":
    main()
