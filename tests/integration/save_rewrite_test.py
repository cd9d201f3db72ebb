#!/usr/bin/python3
"""Shards saved with rewrites before close (issue 27): the recorded chunk
checksums must be those of the bytes as closed, not as first written, or the
verified reads of the mount would refuse a healthy step. Three writers, each
its own step:
- a placeholder header, the tensors streamed, the real header written last
  at offset 0 (a common way to save);
- junk written front to back, then the real bytes in random overlapping
  pieces in random order;
- junk, a truncation to zero, then the real bytes.
Each commits, reads back equal through the mount (also from a fresh mount,
which checks every chunk again) and `scalai fsck` passes. Then names: a
256-byte component under extra/ gets ENAMETOOLONG and nothing is made, as on
any Linux file system; a 255-byte one is saved and exported. Exits 77 only
where /dev/fuse is missing."""
import errno
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, test_seed  # noqa
from reference import random_gpt, read_safetensors, safetensors_bytes, scalai, write_safetensors  # noqa
from views import expected, status  # noqa

BIN = sys.argv[1]
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, DIVISOR = 2, 256, 4, 4, 1024, 1000, 8
SAVED = "tp=1,pp=1,dp=1"
LAYOUT = ["--layout", "megatron-core-gpt", "--param", f"vocab_size={VOCAB}",
          "--param", "gated_linear_unit=1", "--param", f"make_vocab_size_divisible_by={DIVISOR}"]


def header_bytes(data):
    return 8 + int.from_bytes(data[:8], "little")


def pwrite_all(fd, data, offset):
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def save_placeholder_header(path, data, rng):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    h = header_bytes(data)
    pwrite_all(fd, bytes(h), 0)
    for at in range(h, len(data), 1 << 20):
        pwrite_all(fd, data[at:min(len(data), at + (1 << 20))], at)
    pwrite_all(fd, data[:h], 0)
    os.close(fd)


def save_rewritten_in_pieces(path, data, rng):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    pwrite_all(fd, rng.bytes(len(data)), 0)  # in order: hashed as it came
    # Random overlapping pieces, then a shuffled cover of the whole file.
    for _ in range(60):
        at = int(rng.integers(0, len(data)))
        n = int(rng.integers(1, 3 << 20))
        pwrite_all(fd, data[at:at + n], at)
    cuts = sorted(set(int(x) for x in rng.integers(1, len(data), 40)))
    pieces = list(zip([0] + cuts, cuts + [len(data)]))
    rng.shuffle(pieces)
    for a, b in pieces:
        pwrite_all(fd, data[a:b], a)
    os.close(fd)


def save_truncated_and_rewritten(path, data, rng):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    pwrite_all(fd, rng.bytes(len(data) // 2), 0)
    os.ftruncate(fd, 0)
    pwrite_all(fd, data, 0)
    os.close(fd)


def same_tensors(path, want):
    got, _ = read_safetensors(path)
    assert sorted(got) == sorted(want), path
    for name, x in want.items():
        assert np.array_equal(got[name], x), (path, name)


def main():
    require_fuse()
    seed = test_seed()
    rng = np.random.default_rng(seed)
    full = random_gpt(rng, LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, gated=True)
    writers = [(200, save_placeholder_header), (300, save_rewritten_in_pieces),
               (400, save_truncated_and_rewritten)]
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, Mounts() as mounts:
        src, store, mnt, out = f"{tmp}/src", f"{tmp}/store", f"{tmp}/mnt", f"{tmp}/out"
        os.makedirs(mnt)
        os.makedirs(f"{src}/rank-00000")
        write_safetensors(f"{src}/rank-00000/model.safetensors",
                          expected(full, SAVED, LAYERS, DIVISOR)[0])
        scalai(BIN, "init", store, *LAYOUT)
        scalai(BIN, "import", store, src, "--config", SAVED, "--step", "100")
        scalai(BIN, "mount", store, mounts.add(mnt))
        want = {}
        for step, save in writers:
            scaled = {k: (v * (step / 100) + 1).astype(v.dtype) for k, v in full.items()}
            want[step] = expected(scaled, SAVED, LAYERS, DIVISOR)[0]
            data = safetensors_bytes(want[step], {"scalai.step": str(step)})
            assert len(data) > 4 << 20, len(data)  # several chunks
            rank_dir = f"{mnt}/ckpt/step-{step:08d}/rank-00000"
            os.makedirs(rank_dir)
            save(f"{rank_dir}/model.safetensors", data, rng)
            assert os.readlink(f"{mnt}/ckpt/latest") == f"step-{step:08d}", status(mnt)
            same_tensors(f"{mnt}/ckpt/step-{step:08d}/rank-00000/model.safetensors", want[step])
            print(f"step {step} ({save.__name__}): committed, reads back equal")

        scalai(BIN, "umount", mnt)
        mounts.discard(mnt)
        p = scalai(BIN, "fsck", store)
        print(p.stdout.strip())
        scalai(BIN, "mount", store, mounts.add(mnt))
        for step, _ in writers:
            same_tensors(f"{mnt}/ckpt/step-{step:08d}/rank-00000/model.safetensors", want[step])
        print("fsck passes; a fresh mount, which checks every chunk again, reads them back equal")

        # Names: 256 bytes is one too many; 255 is fine and exports.
        step_dir = f"{mnt}/ckpt/step-00000500/rank-00000"
        os.makedirs(f"{step_dir}/extra")
        for make in (lambda p: os.close(os.open(p, os.O_WRONLY | os.O_CREAT)), os.mkdir):
            try:
                make(f"{step_dir}/extra/{'n' * 256}")
                raise AssertionError("a 256-byte name was accepted")
            except OSError as e:
                assert e.errno == errno.ENAMETOOLONG, e
        assert os.listdir(f"{step_dir}/extra") == [], os.listdir(f"{step_dir}/extra")
        with open(f"{step_dir}/extra/{'n' * 255}", "w") as f:
            f.write("255 bytes is a name\n")
        with open(f"{step_dir}/model.safetensors", "wb") as f:
            f.write(safetensors_bytes(want[400], {"scalai.step": "500"}))
        assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000500", status(mnt)

        scalai(BIN, "umount", mnt)
        mounts.discard(mnt)
        scalai(BIN, "export", store, out, "--config", SAVED, "--step", "500")
        with open(f"{out}/rank-00000/extra/{'n' * 255}") as f:
            assert f.read() == "255 bytes is a name\n"
        print("a 256-byte name: ENAMETOOLONG, nothing made; a 255-byte one saved and exported")
    print("save_rewrite_test: ok")


if __name__ == "__main__":
    main()
