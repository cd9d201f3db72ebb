#!/usr/bin/python3
"""SIGKILL of the mount while it materializes a new config, at random moments
(from right after the switch to past the end of the materialization). After
each kill: fsck passes; the next mount comes up under the new config and
shows every rank's right bytes at once, finishes the materialization, and
shows them again; at the end no blob file is left that no record names.
Exits 77 only where /dev/fuse is missing."""
import json
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
from harness import require_fuse, serve, test_seed  # noqa
from reference import rank_shards, random_gpt, scalai, write_safetensors  # noqa
from views import check_bytes, status, wait_ready  # noqa

BIN = sys.argv[1]
TRIALS = int(os.environ.get("SCALAI_KILL_TRIALS", "12"))
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 4, 512, 8, 4, 1024, 1001, 8
CONFIGS = ["tp=2,pp=2,dp=1", "tp=4,pp=1,dp=2", "tp=1,pp=4,dp=1", "tp=2,pp=1,dp=2,stages=4",
           "tp=4,pp=2,dp=1,stages=3:1"]


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def blob_files(store):
    return len(os.listdir(f"{store}/blobs"))


def main():
    require_fuse()
    seed = test_seed()
    r = random.Random(seed)
    full = random_gpt(np.random.default_rng(seed), LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB,
                      gated=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, store, mnt = f"{tmp}/src", f"{tmp}/store", f"{tmp}/mnt"
        for rank, shard in rank_shards(full, CONFIGS[0], True, DIVISOR, LAYERS).items():
            os.makedirs(f"{src}/rank-{rank:05d}")
            write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", shard)
        run("init", store, "--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
            "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}")
        run("import", store, src, "--config", CONFIGS[0], "--step", "3")
        os.makedirs(mnt)
        config, window, outcomes = CONFIGS[0], None, []
        server = serve(BIN, store, mnt)
        try:
            for trial in range(TRIALS + 1):
                # The mount (re)started: it serves the config last switched to at
                # once, with the right bytes, and catches up on materializing it.
                assert status(mnt)["config"] == config
                check_bytes(mnt, full, config, LAYERS, DIVISOR)
                wait_ready(mnt, config)
                check_bytes(mnt, full, config, LAYERS, DIVISOR)
                if trial == TRIALS:
                    break
                config = r.choice([c for c in CONFIGS if c != config])
                started = time.time()
                with open(f"{mnt}/config", "w") as f:
                    f.write(config + "\n")
                if window is None:  # the first trial measures how long it takes
                    wait_ready(mnt, config)
                    window = 1.3 * (time.time() - started)
                    print(f"materialization takes about {window / 1.3:.3f} s")
                elif trial >= TRIALS - 3 and "materializing" not in outcomes:
                    pass  # no kill has landed inside one yet: kill at once
                else:
                    time.sleep(r.uniform(0, window))
                state = status(mnt)["state"]
                server.send_signal(signal.SIGKILL)
                server.wait()
                subprocess.run(["umount", "-l", mnt], check=True)
                outcomes.append(state)
                fsck = run("fsck", store)
                print(f"trial {trial}: killed while {state} -> {config}; fsck ok; "
                      f"{blob_files(store)} blob files before the next mount")
                server = serve(BIN, store, mnt)
        except BaseException:
            server.kill()
            subprocess.run(["umount", "-l", mnt])
            raise
        run("umount", mnt)
        server.wait(timeout=60)
        fsck = run("fsck", store)
        inspect = json.loads(run("inspect", store, "--json").stdout)
        assert inspect["config"] == config, inspect
        assert inspect["blobs"] == blob_files(store), (inspect["blobs"], blob_files(store))
        killed_during = outcomes.count("materializing")
        print(f"{TRIALS} kills, {killed_during} during materialization; {fsck.stdout.strip()}")
        assert killed_during >= 1, outcomes
    print("materialize kill test: ok")


if __name__ == "__main__":
    main()
