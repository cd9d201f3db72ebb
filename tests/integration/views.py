"""What a mount's views must show, for the integration tests: every rank's
tensors of a config, cut from the full tensors by the numpy reference, and
the mount's status."""
import json
import os
import time

import numpy as np

from reference import distopt_of, fsdp_of, parse_config, read_safetensors, rank_shards


def expected(full, config, layers, divisor):
    """{rank: {local name: array}} for every rank of `config`, replicas included."""
    tp, pp, dp, _ = parse_config(config)
    s = dp if distopt_of(config) else fsdp_of(config)
    base = rank_shards(full, config, True, divisor, layers)
    return {r: base[((r // (tp * dp)) * dp + (r // tp) % dp % s) * tp + r % tp]
            for r in range(tp * pp * dp)}


def status(mnt):
    with open(f"{mnt}/status") as f:
        return json.load(f)


def write_config(mnt, config):
    """Writes `config` as `echo` does, in one write(). (Python's buffered
    files write again at close what a refused write left in their buffer.)"""
    fd = os.open(f"{mnt}/config", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, (config + "\n").encode())
    finally:
        os.close(fd)


def check_bytes(mnt, full, config, layers, divisor):
    """Every rank's model.safetensors and tensors/ files against slicing."""
    want = expected(full, config, layers, divisor)
    step = f"{mnt}/ckpt/latest"
    ranks = sorted(os.listdir(step))
    assert ranks == [f"rank-{r:05d}" for r in sorted(want)], (config, ranks)
    for rank, tensors in want.items():
        got, meta = read_safetensors(f"{step}/rank-{rank:05d}/model.safetensors")
        assert meta["scalai.config"] == config, (config, meta)
        assert sorted(got) == sorted(tensors), (config, rank)
        for name, x in tensors.items():
            assert np.array_equal(got[name], x), (config, rank, name)
            with open(f"{step}/rank-{rank:05d}/tensors/{name}", "rb") as f:
                assert f.read() == x.tobytes(), (config, rank, name)


def wait_ready(mnt, config, timeout=120):
    deadline = time.time() + timeout
    while True:
        s = status(mnt)
        if s["state"] == "ready":
            assert s["config"] == config and s["error"] is None, s
            return s
        assert time.time() < deadline, s
        time.sleep(0.02)
