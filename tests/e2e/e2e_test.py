#!/usr/bin/python3
"""The mission end to end (scenario.py): a PyTorch GPT with tensor, pipeline
and data parallelism trains through a Scalai mount while its config changes
five times (the world shrinks, shrinks again, grows; tp, pp, dp and the
sharding of its state across dp ranks, FSDP/HSDP and Megatron's distributed
optimizer, each change), restarting from checkpoints saved through the mount each time. Every
global batch's sample ids must equal the uninterrupted job's, every loss and
the final parameters must match it within 1e-9 relative (float64), and the
store must pass fsck. Exits 77 only where /dev/fuse is missing."""
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scenario  # noqa


def main():
    if not os.path.exists("/dev/fuse"):
        print("no /dev/fuse: skipped")
        sys.exit(77)
    configs = [c for c, _ in scenario.PHASES]
    worlds = [scenario.world_size(c) for c in configs]
    assert len(configs) >= 4, configs  # three reconfigurations at least
    assert any(b < a for a, b in zip(worlds, worlds[1:])), worlds  # shrinks
    assert any(b > a for a, b in zip(worlds, worlds[1:])), worlds  # grows
    for key in ("tp", "pp", "dp"):
        values = [dict(p.split("=") for p in c.split(","))[key] for c in configs]
        assert len(set(values)) > 1, (key, values)
    # The sharding mode changes too: replicas, FSDP, HSDP.
    keys = [dict(p.split("=") for p in c.split(",")) for c in configs]
    sharding = [int(k.get("fsdp", 1)) for k in keys]
    assert len(set(sharding)) > 1, sharding
    assert any(1 < s < int(k["dp"]) for s, k in zip(sharding, keys)), configs  # HSDP
    assert any(k.get("distopt") == "1" and int(k["dp"]) > 1 for k in keys), configs  # ZeRO-1
    work = tempfile.mkdtemp(prefix="scalai-e2e.", dir="/var/tmp")
    try:
        result = scenario.run(os.path.abspath(sys.argv[1]), work)
    finally:
        for m in ("uninterrupted-mnt", "elastic-mnt"):
            os.system(f"fusermount3 -u -q {work}/{m} 2>/dev/null")
        shutil.rmtree(work, ignore_errors=True)
    print(scenario.report(result))
    assert len(result["reconfigurations"]) == len(configs) - 1, result["reconfigurations"]
    assert len(result["elastic_log"]) == sum(n for _, n in scenario.PHASES)
    for problem in result["problems"]:
        print(problem, file=sys.stderr)
    assert not result["problems"], f"{len(result['problems'])} differences"
    print("e2e_test: ok")


if __name__ == "__main__":
    main()
