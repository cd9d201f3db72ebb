#!/usr/bin/python3
"""Crash safety of import: `scalai import` is killed with SIGKILL at random
moments (20 trials). Afterwards the store must open, `fsck` must pass, the
half-imported step must be absent or complete, the earlier step unchanged,
and no blob file may be left without its record."""
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import scalai  # noqa: E402

BIN = sys.argv[1]
TRIALS = 20
MODEL = "layers=4,hidden=512,heads=8,vocab=8000"


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def tree_digest(directory):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for f in sorted(files):
            h.update(f.encode())
            h.update(open(os.path.join(root, f), "rb").read())
    return h.hexdigest()


def export_digest(store, step, out):
    shutil.rmtree(out, ignore_errors=True)
    run("export", store, out, "--config", "tp=1,pp=1,dp=1", "--step", str(step))
    return tree_digest(out)


def main():
    rng = random.Random(11)
    with tempfile.TemporaryDirectory() as tmp:
        base = f"{tmp}/base"
        run("init", base, "--layout", "megatron-core-gpt", "--param", "vocab_size=8000")
        for name, seed, config in (("small", "1", "tp=2,pp=1,dp=1"),
                                   ("large", "2", "tp=2,pp=2,dp=1")):
            run("synth", f"{tmp}/{name}", "--layout", "megatron-core-gpt", "--model", MODEL,
                "--config", config, "--dtype", "f32", "--seed", seed)
        run("import", base, f"{tmp}/small", "--config", "tp=2,pp=1,dp=1", "--step", "1")
        step1 = export_digest(base, 1, f"{tmp}/out")

        # A complete import, to know how long one takes and what step 2 holds.
        ref = f"{tmp}/ref"
        shutil.copytree(base, ref)
        start = time.monotonic()
        run("import", ref, f"{tmp}/large", "--config", "tp=2,pp=2,dp=1", "--step", "2")
        duration = time.monotonic() - start
        step2 = export_digest(ref, 2, f"{tmp}/out")

        outcomes = {"absent": 0, "complete": 0}
        for trial in range(TRIALS):
            store = f"{tmp}/trial-{trial}"
            shutil.copytree(base, store)
            proc = subprocess.Popen([BIN, "import", store, f"{tmp}/large", "--config",
                                     "tp=2,pp=2,dp=1", "--step", "2"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0, duration * 1.2))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            fsck = run("fsck", store)
            inspect = json.loads(run("inspect", store, "--json").stdout)
            steps = [s["step"] for s in inspect["steps"]]
            assert steps in ([1], [1, 2]), (trial, steps)
            assert inspect["blobs"] == len(os.listdir(f"{store}/blobs")), (trial, fsck.stdout)
            assert export_digest(store, 1, f"{tmp}/out") == step1, trial
            if steps == [1, 2]:
                assert export_digest(store, 2, f"{tmp}/out") == step2, trial
                outcomes["complete"] += 1
            else:
                outcomes["absent"] += 1
            shutil.rmtree(store)
        print(f"store kill test: ok over {TRIALS} trials {outcomes}, import takes {duration:.2f} s")


if __name__ == "__main__":
    main()
