#!/usr/bin/python3
"""SIGKILL of the mount while workers save a step through it, at random
moments (from before the first byte to past the commit). After each kill:
fsck passes; the next mount shows only committed steps, each with every
byte right (the killed step either whole or absent, never partial); and no
blob file is left that no record names. Exits 77 only where /dev/fuse is
missing."""
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, serve, test_seed  # noqa
from reference import random_gpt, scalai, write_safetensors  # noqa
from views import check_bytes, expected  # noqa

BIN = sys.argv[1]
MOUNTS = Mounts()
TRIALS = int(os.environ.get("SCALAI_SAVE_KILL_TRIALS", "20"))
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 4, 384, 8, 4, 768, 1001, 8
CONFIG = "tp=2,pp=2,dp=1"
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def save_rank(path, tensors, step):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_safetensors(path, tensors, {"scalai.step": str(step)})
    except OSError:
        pass  # the mount died under us


def model(step):
    return random_gpt(np.random.default_rng(step), LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB,
                      gated=True)


def save(mnt, step, full):
    procs = [multiprocessing.Process(target=save_rank, args=(
        f"{mnt}/ckpt/step-{step:08d}/rank-{rank:05d}/model.safetensors", tensors, step))
        for rank, tensors in expected(full, CONFIG, LAYERS, DIVISOR).items()]
    for p in procs:
        p.start()
    return procs


def main():
    require_fuse()
    seed = test_seed()
    r = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        src, store, mnt = f"{tmp}/src", f"{tmp}/store", f"{tmp}/mnt"
        os.makedirs(mnt)
        MOUNTS.add(mnt)
        first = model(1)
        for rank, tensors in expected(first, CONFIG, LAYERS, DIVISOR).items():
            os.makedirs(f"{src}/rank-{rank:05d}")
            write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", tensors)
        run("init", store, *LAYOUT)
        run("import", store, src, "--config", CONFIG, "--step", "1")
        models = {1: first}
        # How long a save takes here, to spread the kills over it.
        server = serve(BIN, store, mnt)
        models[2] = model(2)
        t0 = time.time()
        for p in save(mnt, 2, models[2]):
            p.join()
        took = time.time() - t0
        assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000002"
        run("umount", mnt)
        server.wait()
        print(f"a save takes {took:.2f} s")
        outcomes = {"committed": 0, "absent": 0}
        for trial in range(TRIALS):
            step = 3 + trial
            models[step] = model(step)
            server = serve(BIN, store, mnt)
            procs = save(mnt, step, models[step])
            time.sleep(r.uniform(0, 1.3 * took))
            server.send_signal(signal.SIGKILL)
            server.wait()
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            subprocess.run(["fusermount3", "-u", "-z", mnt], check=True)
            run("fsck", store)
            server = serve(BIN, store, mnt)
            steps = sorted(os.listdir(f"{mnt}/ckpt"))
            committed = f"step-{step:08d}" in steps
            outcomes["committed" if committed else "absent"] += 1
            names = [int(n[5:]) for n in steps if n.startswith("step-")]
            for n in names:
                assert n in models, steps
            # The newest committed step has every byte right.
            check_bytes(mnt, models[max(names)], CONFIG, LAYERS, DIVISOR)
            run("umount", mnt)
            server.wait()
            info = json.loads(run("inspect", store, "--json").stdout)
            assert info["blobs"] == len(os.listdir(f"{store}/blobs")), (trial, info)
        print(f"{TRIALS} kills during saves: {outcomes['committed']} steps committed whole, "
              f"{outcomes['absent']} absent; fsck clean and no leaked blob each time")
    print("save_kill_test: ok")


if __name__ == "__main__":
    with MOUNTS:
        main()
