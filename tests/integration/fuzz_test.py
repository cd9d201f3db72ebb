#!/usr/bin/python3
"""Random bytes at every door of the mount (issue 26). At least 10,000
operations, drawn from a seed: random bytes (invalid UTF-8, huge and
negative numbers, near-valid configs, over-long text) written to `config`;
random names (any byte but '/' and NUL, up to 300 bytes) made, opened,
created and removed under ckpt/, under steps and ranks being saved and
under their extra/; random bytes written as shards and extra/ files. Every
operation must return a value or an errno, never a dead mount (ENOTCONN,
ECONNABORTED); `status` must stay valid JSON. Afterwards the mount still
serves the committed step's bytes, unmounts cleanly, and `scalai fsck`
passes. Exits 77 only where /dev/fuse is missing."""
import errno
import json
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, synth_store, test_seed  # noqa
from reference import scalai  # noqa

BIN = sys.argv[1]
MODEL = "layers=2,hidden=128,heads=4,vocab=256"
CONFIG = "tp=2,pp=1,dp=1"
OPERATIONS = 10000
DEAD = {errno.ENOTCONN, errno.ECONNABORTED}


def random_bytes(rng, most):
    n = rng.choice([0, 1, 2, rng.randrange(most + 1)])
    return bytes(rng.randrange(256) for _ in range(n))


def random_name(rng):
    kind = rng.randrange(6)
    if kind == 0:
        return b"step-%08d" % rng.randrange(300, 330)
    if kind == 1:
        return b"rank-%05d" % rng.randrange(0, 4)
    if kind == 2:
        return b"extra"
    if kind == 3:
        return b"step-" + str(rng.choice([-1, 10**12, 2**63, rng.randrange(10**9)])).encode()
    n = rng.choice([1, 2, rng.randrange(1, 300)])
    name = bytes(rng.choice([rng.randrange(1, 256), rng.randrange(0x80, 0x100)]) for _ in range(n))
    name = name.replace(b"/", b"_").replace(b"\0", b"_")
    return b"_" + name[1:] if name in (b".", b"..") else name


def random_config(rng):
    kind = rng.randrange(8)
    if kind == 0:
        return random_bytes(rng, 200)
    if kind == 1:
        big = rng.choice([0, -1, 2**31, 2**63, 10**30, 16777216, 65537])
        return b"tp=1,pp=1,dp=%d" % big
    if kind == 2:
        return b"tp=1,pp=1,dp=1," + random_bytes(rng, 40)
    if kind == 3:
        return b"tp=\xff\xfe,pp=\xc0\x80,dp=\xed\xa0\x80"
    if kind == 4:
        return b"stages=" + b":".join(b"%d" % rng.randrange(-2, 3) for _ in range(rng.randrange(5)))
    if kind == 5 and rng.random() < 0.1:
        return rng.choice([b"tp=1,pp=1,dp=2\n", b"tp=2,pp=1,dp=1\n", b"tp=2,pp=2,dp=1\n"])
    return b"tp=%d,pp=%d,dp=%d" % (rng.randrange(-1, 9), rng.randrange(-1, 4), rng.randrange(-1, 9))


class Fuzzer:
    def __init__(self, rng, mnt):
        self.rng = rng
        self.mnt = os.fsencode(mnt)
        self.dirs = [self.mnt + b"/ckpt"]   # directories made so far
        self.files = []
        self.errnos = {}

    def attempt(self, what, fn):
        try:
            fn()
            self.errnos["ok"] = self.errnos.get("ok", 0) + 1
        except OSError as e:
            assert e.errno not in DEAD, f"{what}: the mount died ({e})"
            name = errno.errorcode.get(e.errno, str(e.errno))
            self.errnos[name] = self.errnos.get(name, 0) + 1

    def write_file(self, path, data, flags):
        fd = os.open(path, flags, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def step(self):
        rng = self.rng
        op = rng.randrange(10)
        parent = rng.choice(self.dirs)
        path = parent + b"/" + random_name(rng)
        if op <= 2:
            data = random_config(rng)
            self.attempt("config", lambda: self.write_file(
                self.mnt + b"/config", data, os.O_WRONLY | os.O_TRUNC))
        elif op == 3:
            def mkdir():
                os.mkdir(path)
                self.dirs.append(path)
            self.attempt("mkdir", mkdir)
        elif op == 4:
            data = random_bytes(rng, 4096)
            def create():
                self.write_file(path, data, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                self.files.append(path)
            self.attempt("create", create)
        elif op == 5 and self.files:
            f = rng.choice(self.files)
            data = random_bytes(rng, 4096)
            at = rng.choice([0, rng.randrange(1 << 20), 2**40])
            self.attempt("pwrite", lambda: self.pwrite(f, data, at))
        elif op == 6:
            target = rng.choice(self.files) if self.files and rng.random() < 0.5 else path
            self.attempt("read", lambda: open(target, "rb").read(1 << 16))
        elif op == 7:
            target = rng.choice(self.files) if self.files and rng.random() < 0.5 else path
            def unlink():
                os.unlink(target)
                if target in self.files:
                    self.files.remove(target)
            self.attempt("unlink", unlink)
        elif op == 8:
            target = rng.choice(self.dirs[1:] or [path])
            def rmdir():
                os.rmdir(target)
                if target in self.dirs:
                    self.dirs.remove(target)
            self.attempt("rmdir", rmdir)
        else:
            self.attempt("listdir", lambda: os.listdir(parent))
            self.attempt("truncate", lambda: os.truncate(
                rng.choice(self.files) if self.files else path, rng.choice([0, 7, 2**40])))
        if rng.random() < 0.05:
            with open(self.mnt + b"/status", "rb") as f:
                json.loads(f.read().decode("utf-8"))

    def pwrite(self, path, data, at):
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, at)
        finally:
            os.close(fd)


def main():
    require_fuse()
    rng = random.Random(test_seed())
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, Mounts() as mounts:
        _, store = synth_store(BIN, tmp, CONFIG, MODEL, 256)
        mnt = f"{tmp}/mnt"
        os.makedirs(mnt)
        scalai(BIN, "mount", store, mounts.add(mnt))
        before = {r: open(f"{mnt}/ckpt/step-00000100/rank-{r:05d}/tensors/output_layer.weight",
                          "rb").read() for r in (0, 1)}
        fuzzer = Fuzzer(rng, mnt)
        for _ in range(OPERATIONS):
            fuzzer.step()
        print(f"{OPERATIONS} operations: " +
              ", ".join(f"{k} {v}" for k, v in sorted(fuzzer.errnos.items())))
        with open(f"{mnt}/status", "rb") as f:
            print("status:", json.loads(f.read().decode("utf-8"))["state"])
        with open(f"{mnt}/config", "w") as f:
            f.write(CONFIG + "\n")
        for r in (0, 1):
            with open(f"{mnt}/ckpt/step-00000100/rank-{r:05d}/tensors/output_layer.weight", "rb") as f:
                assert f.read() == before[r], r
        scalai(BIN, "umount", mnt)
        mounts.discard(mnt)
        print(scalai(BIN, "fsck", store).stdout.strip())
    print("fuzz_test: ok")


if __name__ == "__main__":
    main()
