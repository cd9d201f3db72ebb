#!/usr/bin/python3
"""The mount with real clients: a store imported from shards written by the
test's own numpy writer is mounted under another config, and ls -lR, stat,
find, du, cat, cmp, tar, numpy (a safetensors parser of its own, memmap) and
torch.frombuffer read it; every rank's tensors must equal numpy slicing of
the full tensors. Then 16 concurrent readers over all ranks, the errors
docs/reference.md and POSIX prescribe, and inspect and plan reading the
store beside the mount. Exits 77 (skip) only where /dev/fuse is missing."""
import errno
import filecmp
import json
import os
import random
import re
import signal
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import require_fuse  # noqa
from reference import read_safetensors, write_safetensors, rank_shards, random_gpt, scalai  # noqa

BIN = sys.argv[1]
READ_SECONDS = float(os.environ.get("SCALAI_READERS_SECONDS", "60"))
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 4, 48, 6, 3, 96, 101, 8
SAVED, MOUNTED = "tp=2,pp=2,dp=1", "tp=3,pp=1,dp=2"


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def sh(*cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, f"{' '.join(cmd)}: {p.stderr}"
    return p.stdout


def expect_errno(code, fn, *args):
    """`code`: an errno, or a set of them (read-only: EACCES or EROFS)."""
    codes = code if isinstance(code, set) else {code}
    try:
        fn(*args)
    except OSError as e:
        assert e.errno in codes, (fn.__name__, args, e)
        return
    raise AssertionError(f"{fn.__name__}{args} did not fail with "
                         f"{' or '.join(errno.errorcode[c] for c in codes)}")


def main():
    require_fuse()
    rng = np.random.default_rng(5)
    full = random_gpt(rng, LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, gated=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, store, mnt = f"{tmp}/src", f"{tmp}/store", f"{tmp}/mnt"
        for rank, shard in rank_shards(full, SAVED, True, DIVISOR, LAYERS).items():
            os.makedirs(f"{src}/rank-{rank:05d}")
            write_safetensors(f"{src}/rank-{rank:05d}/model.safetensors", shard)
        run("init", store, "--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
            "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}")
        run("import", store, src, "--config", SAVED, "--step", "100")
        os.makedirs(mnt)
        p = run("mount", store, mnt, "--config", "tp=5,pp=1,dp=1", expect=1)
        assert "not divisible by tp=5" in p.stderr, p.stderr
        run("mount", store, mnt, "--config", MOUNTED)
        try:
            check_tree(tmp, mnt, full)
            check_kernel_settings(mnt)
            check_errors(mnt)
            p = run("mount", store, f"{tmp}", expect=1)
            assert "in use by another scalai process" in p.stderr, p.stderr
            check_concurrent_readers(mnt, full)
            check_reconfigure(mnt, full)
            check_readers_beside_mount(tmp, store, mnt)
        except BaseException:
            subprocess.run(["umount", "-l", mnt])  # leave no mount behind a failure
            raise
        run("umount", mnt)
        assert not os.path.ismount(mnt)
        inspect = json.loads(run("inspect", store, "--json").stdout)
        assert inspect["config"] == FINAL, inspect  # the last reconfiguration was committed
        # SIGTERM (and SIGINT) end a foreground mount cleanly.
        for sig in (signal.SIGTERM, signal.SIGINT):
            proc = subprocess.Popen([BIN, "mount", store, mnt, "--foreground"],
                                    stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline().startswith("mounted"), sig
            assert open(f"{mnt}/config").read() == FINAL + "\n"
            proc.send_signal(sig)
            assert proc.wait(timeout=30) == 0, (sig, proc.returncode)
            assert not os.path.ismount(mnt), sig
        # The store is free again (fsck takes it as its writer), and intact.
        assert "beside" not in run("fsck", store).stdout
    print("mount test: ok")


def expected_ranks(full):
    """Every rank of the mounted config (dp replicas included): local tensors."""
    base = rank_shards(full, MOUNTED, True, DIVISOR, LAYERS)
    tp, dp = 3, 2
    out = {}
    for rank in range(tp * dp):
        tp_rank = rank % tp
        out[rank] = base[tp_rank]
    return out


def check_tree(tmp, mnt, full):
    assert sorted(os.listdir(mnt)) == ["ckpt", "config", "data", "job.json", "status"]
    assert open(f"{mnt}/config").read() == MOUNTED + "\n"
    # Mounting under another config starts materializing it in the background.
    deadline = time.time() + 60
    while (status := json.load(open(f"{mnt}/status")))["state"] != "ready":
        assert status["state"] == "materializing" and time.time() < deadline, status
        time.sleep(0.02)
    assert status["config"] == MOUNTED and status["error"] is None, status
    assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000100"
    step = f"{mnt}/ckpt/latest"
    ranks = expected_ranks(full)
    assert sorted(os.listdir(step)) == [f"rank-{r:05d}" for r in range(6)]
    listing = sh("ls", "-lR", mnt)
    assert "model.safetensors" in listing and "rank-00005" in listing
    found = sh("find", mnt).split()
    assert f"{mnt}/ckpt/step-00000100/rank-00004/tensors/output_layer.weight" in found
    du = int(sh("du", "-b", "-s", f"{step}/").split()[0])
    assert du > 0
    # df of the mount: the store's file system, where saves land.
    here, there = os.statvfs(mnt), os.statvfs(f"{tmp}/store/blobs")
    assert (here.f_frsize, here.f_blocks) == (there.f_frsize, there.f_blocks), (here, there)
    assert abs(here.f_bavail - there.f_bavail) * here.f_frsize < 256 << 20, (here, there)
    assert sh("df", "--output=target", mnt).split()[-1] == mnt
    for rank, want in ranks.items():
        d = f"{step}/rank-{rank:05d}"
        got, meta = read_safetensors(f"{d}/model.safetensors")
        assert meta == {"scalai.rank": str(rank), "scalai.config": MOUNTED,
                        "scalai.step": "100"}, meta
        assert sorted(got) == sorted(want), (rank, sorted(got))
        info = json.load(open(f"{d}/rank.json"))
        assert (info["rank"], info["tp_rank"], info["dp_rank"], info["pp_rank"]) == (
            rank, rank % 3, rank // 3, 0), info
        for name, x in want.items():
            assert np.array_equal(got[name], x), (rank, name)
            path = f"{d}/tensors/{name}"
            assert os.stat(path).st_size == x.nbytes, (path, os.stat(path).st_size)
            assert info["tensors"][name]["shape"] == list(x.shape)
    # cat / cmp of a tensor file against the same bytes written by numpy.
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    ref = f"{tmp}/ref.bin"
    ranks[1][name].tofile(ref)
    sh("cmp", f"{step}/rank-00001/tensors/{name}", ref)
    assert open(ref, "rb").read() == subprocess.run(
        ["cat", f"{step}/rank-00001/tensors/{name}"], capture_output=True).stdout
    # tar of a rank directory round-trips the files.
    sh("tar", "-C", f"{step}", "-cf", f"{tmp}/rank.tar", "rank-00002")
    with tarfile.open(f"{tmp}/rank.tar") as t:
        member = t.extractfile("rank-00002/model.safetensors").read()
    assert member == open(f"{step}/rank-00002/model.safetensors", "rb").read()
    # Programs that map files: numpy.memmap of model.safetensors and a tensor.
    mm = np.memmap(f"{step}/rank-00001/tensors/{name}", dtype=np.float32, mode="r")
    assert np.array_equal(mm.reshape(ranks[1][name].shape), ranks[1][name])
    whole = np.memmap(f"{step}/rank-00001/model.safetensors", dtype=np.uint8, mode="r")
    assert bytes(whole[:64]) == open(f"{step}/rank-00001/model.safetensors", "rb").read(64)
    n = int.from_bytes(bytes(whole[:8]), "little")
    header = json.loads(bytes(whole[8:8 + n]))
    b, e = header[name]["data_offsets"]
    assert bytes(whole[8 + n + b:8 + n + e]) == ranks[1][name].tobytes()
    del mm, whole  # a mapping keeps the mount busy
    # torch reads a tensor file.
    import torch
    raw = bytearray(open(f"{step}/rank-00000/tensors/output_layer.weight", "rb").read())
    t = torch.frombuffer(raw, dtype=torch.float32).reshape(ranks[0]["output_layer.weight"].shape)
    assert np.array_equal(t.numpy(), ranks[0]["output_layer.weight"])


def check_errors(mnt):
    f = f"{mnt}/ckpt/step-00000100/rank-00000/model.safetensors"
    # A committed shard takes only a whole new copy (O_TRUNC), compared.
    expect_errno({errno.EACCES, errno.EROFS}, open, f, "r+b")
    expect_errno({errno.EACCES, errno.EROFS}, open, f"{mnt}/status", "w")
    expect_errno(errno.ENOENT, open, f"{mnt}/ckpt/step-00000100/rank-00099/model.safetensors")
    expect_errno(errno.ENOENT, os.stat, f"{mnt}/nonexistent")
    size = os.stat(f).st_size
    with open(f, "rb") as fh:
        fh.seek(size - 10)
        assert len(fh.read(100)) == 10  # a read across the end is short
        fh.seek(size + 1000)
        assert fh.read(100) == b""      # past the end: nothing, no error
    fd = os.open(f, os.O_RDONLY)
    assert os.pread(fd, 16, size) == b""
    os.close(fd)


def check_kernel_settings(mnt):
    """What the mount asks of the kernel for fast reads: 4 MiB read ahead of
    each reader, and up to 64 such requests in flight (the kernel's default
    is 12), as its bdi and the FUSE control file system show them."""
    dev = os.stat(mnt).st_dev
    with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
        assert f.read().strip() == "4096"
    ctl = "/sys/fs/fuse/connections"
    mounted_here = not os.path.ismount(ctl)
    if mounted_here:
        subprocess.run(["mount", "-t", "fusectl", "fusectl", ctl], check=True)
    try:
        with open(f"{ctl}/{os.minor(dev)}/max_background") as f:
            assert f.read().strip() == "64"
        with open(f"{ctl}/{os.minor(dev)}/congestion_threshold") as f:
            assert f.read().strip() == "48"
    finally:
        if mounted_here:
            subprocess.run(["umount", ctl], check=True)
    print("kernel: 4096 KiB read ahead, 64 requests in flight")


def check_concurrent_readers(mnt, full):
    ranks = expected_ranks(full)
    files = []
    for rank, want in ranks.items():
        d = f"{mnt}/ckpt/step-00000100/rank-{rank:05d}"
        for name, x in want.items():
            files.append((f"{d}/tensors/{name}", x.tobytes()))
    errors, reads = [], [0]
    deadline = time.monotonic() + READ_SECONDS

    def reader(seed):
        r = random.Random(seed)
        while time.monotonic() < deadline and not errors:
            path, want = r.choice(files)
            fd = os.open(path, os.O_RDONLY)
            try:
                off = r.randrange(len(want)) if want else 0
                n = r.randrange(1, 1 << 16)
                got = os.pread(fd, n, off)
                if got != want[off:off + n]:
                    errors.append((path, off, n))
            finally:
                os.close(fd)
            reads[0] += 1

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    print(f"16 readers, {READ_SECONDS:.0f} s: {reads[0]} reads, all correct")


FINAL = "tp=2,pp=2,dp=1,stages=1:3"
SEQUENCE = ["tp=1,pp=1,dp=1", "tp=6,pp=1,dp=1", "tp=2,pp=4,dp=2", "tp=3,pp=2,dp=3",
            "tp=4,pp=3,dp=1", "tp=1,pp=2,dp=5,stages=3:1", "tp=6,pp=2,dp=2", FINAL]


def expected_any_rank(full, config):
    """{rank: {local name: array}} for every rank of `config`, replicas included."""
    tp, pp, dp = (int(config.split(k + "=")[1].split(",")[0]) for k in ("tp", "pp", "dp"))
    base = rank_shards(full, config, True, DIVISOR, LAYERS)
    return {r: base[((r // (tp * dp)) * dp) * tp + r % tp] for r in range(tp * pp * dp)}


def check_readers_beside_mount(tmp, store, mnt):
    """inspect, plan STORE, export and fsck read the store beside the mount
    that holds it, and write nothing to it; an export under the mounted
    config is the mount's own files. Readers run on while the mount commits
    reconfigurations that retire the step's blobs: each inspect sees one of
    the configs written, each export is the step whole, each fsck passes."""
    deadline = time.monotonic() + 120
    while json.load(open(f"{mnt}/status"))["state"] != "ready":
        assert time.monotonic() < deadline, "materialization did not finish"
        time.sleep(0.05)
    catalog = sorted(os.listdir(f"{store}/catalog"))
    beside = sorted(os.listdir(store))
    inspect = json.loads(run("inspect", store, "--json").stdout)
    assert inspect["config"] == FINAL, inspect
    assert [s["step"] for s in inspect["steps"]] == [100], inspect
    plan = json.loads(run("plan", store, "--to", "tp=1,pp=1,dp=1", "--json").stdout)
    assert (plan["from"], plan["to"]) == (FINAL, "tp=1,pp=1,dp=1"), plan
    assert f"config    {FINAL}\n" in run("inspect", store).stdout  # the table too
    reference = f"{tmp}/export"
    run("export", store, reference, "--config", FINAL)
    ranks = sorted(os.listdir(reference))
    assert ranks == [f"rank-{r:05d}" for r in range(4)], ranks
    for rank in ranks:
        assert filecmp.cmp(f"{reference}/{rank}/model.safetensors",
                           f"{mnt}/ckpt/latest/{rank}/model.safetensors", shallow=False), rank
    fsck = run("fsck", store).stdout
    assert "beside the scalai process that holds the store" in fsck, fsck
    assert (sorted(os.listdir(f"{store}/catalog")), sorted(os.listdir(store))) == (catalog, beside)

    configs = ["tp=1,pp=1,dp=1", "tp=2,pp=1,dp=1"]
    done = threading.Event()

    def switch():
        try:
            for i in range(30):
                with open(f"{mnt}/config", "w") as f:
                    f.write(configs[i % 2] + "\n")
                time.sleep(0.05)
        finally:
            done.set()
    switcher = threading.Thread(target=switch)
    switcher.start()
    seen, reads = set(), 0
    while not done.is_set():
        seen.add(json.loads(run("inspect", store, "--json").stdout)["config"])
        out = f"{tmp}/export-{reads}"
        run("export", store, out, "--config", FINAL)
        for rank in ranks:
            assert filecmp.cmp(f"{reference}/{rank}/model.safetensors",
                               f"{out}/{rank}/model.safetensors", shallow=False), (reads, rank)
        shutil.rmtree(out)
        run("fsck", store)
        reads += 1
    switcher.join()
    assert seen <= set(configs) | {FINAL}, seen
    print(f"readers: {reads} inspects, exports and fscks beside 30 reconfigurations; "
          f"the inspects saw {sorted(seen)}, every export the step whole, every fsck ok")
    assert json.loads(run("inspect", store, "--json").stdout)["config"] == configs[1]
    with open(f"{mnt}/config", "w") as f:
        f.write(FINAL + "\n")


def check_reconfigure(mnt, full):
    """Rewriting config switches every view at once; open handles keep theirs."""
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    old_path = f"{mnt}/ckpt/latest/rank-00001/tensors/{name}"
    old_bytes = expected_ranks(full)[1][name].tobytes()
    held = os.open(old_path, os.O_RDONLY)
    stop, errors = [False], []

    def keep_reading():  # through the handle opened before any switch
        r = random.Random(1)
        while not stop[0]:
            off = r.randrange(len(old_bytes))
            if os.pread(held, 4096, off) != old_bytes[off:off + 4096]:
                errors.append(off)
    reader = threading.Thread(target=keep_reading)
    reader.start()
    try:
        generation = json.load(open(f"{mnt}/status"))["generation"]
        for config in SEQUENCE:
            p = subprocess.run(f"echo {config} > {mnt}/config", shell=True, executable="/bin/bash")
            assert p.returncode == 0, config
            status = json.load(open(f"{mnt}/status"))
            assert status["generation"] > generation, (generation, status)
            generation = status["generation"]
            assert (status["config"], status["error"]) == (config, None), status
            assert open(f"{mnt}/config").read() == config + "\n"
            want = expected_any_rank(full, config)
            step = f"{mnt}/ckpt/latest"
            assert sorted(os.listdir(step)) == [f"rank-{r:05d}" for r in sorted(want)], config
            for rank, tensors in want.items():
                got, meta = read_safetensors(f"{step}/rank-{rank:05d}/model.safetensors")
                assert meta["scalai.config"] == config, meta
                assert sorted(got) == sorted(tensors), (config, rank)
                for n, x in tensors.items():
                    assert np.array_equal(got[n], x), (config, rank, n)
        # A config the layout cannot serve: refused, nothing changes, status says why.
        p = subprocess.run(f"echo tp=5,pp=1,dp=1 > {mnt}/config", shell=True, executable="/bin/bash",
                           capture_output=True, text=True)
        assert p.returncode != 0 and "Invalid argument" in p.stderr, p.stderr
        status = json.load(open(f"{mnt}/status"))
        assert status["config"] == FINAL and "not divisible by tp=5" in status["error"], status
        # A huge, binary config: refused, and status quotes only a short,
        # escaped excerpt of it (it used to echo all of it).
        junk = b"tp=\xff\xfe," + b"x" * (1 << 20)
        fd = os.open(f"{mnt}/config", os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, junk)
            raise AssertionError("a 1 MiB binary config was accepted")
        except OSError as e:
            assert e.errno == errno.EINVAL, e
        finally:
            os.close(fd)
        with open(f"{mnt}/status", "rb") as f:
            text = f.read()
        status = json.loads(text)
        # (the kernel may hand the write over in 1 MiB pieces: the first is refused)
        cut = re.search(r"\.\.\. \((\d+) bytes\)", status["error"])
        assert len(text) < 2000 and cut and int(cut.group(1)) > 1000, status
        assert "\\xff" in status["error"] and status["config"] == FINAL, status
        p = run("reconfigure", mnt, "tp=2,pp=9,dp=1", expect=1)
        assert "pp=9 needs at least 9 layers but the model has 4" in p.stderr, p.stderr
        out = run("reconfigure", mnt, FINAL, "--wait").stdout
        assert FINAL in out, out
        assert json.load(open(f"{mnt}/status"))["error"] is None
    finally:
        stop[0] = True
        reader.join()
        os.close(held)
    assert not errors, errors[:3]
    print(f"{len(SEQUENCE)} reconfigurations: every rank's bytes checked after each switch")


if __name__ == "__main__":
    main()
