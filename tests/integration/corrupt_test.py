#!/usr/bin/python3
"""Corrupt blobs are never served or copied (issue 16). For each kind of
damage to one rank's blob (a flipped byte, a truncated file, a deleted file)
on its own copy of a store:
- the store still mounts; the intact rank reads its exact bytes; the damaged
  rank's reads fail with EIO and `status` names the blob and its step (and
  the chunk, for a flipped byte);
- a reconfiguration that must copy from the damaged blob fails naming it, and
  nothing is committed: switching back serves the intact rank again;
- fsck still fails naming the blob, and export refuses it;
- a byte flipped in any one tensor of a rank makes an export that merges
  the ranks refuse it, whichever way that tensor is copied.
Read from a cold page cache, the intact rank is exact and a flipped byte is
caught. Then a byte flipped under a running mount after its chunk was
verified is caught at the next read that reaches the server. Exits 77 only
where /dev/fuse is missing."""
import errno
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, flip, require_fuse  # noqa
from reference import read_safetensors, scalai  # noqa
from views import status  # noqa

BIN = sys.argv[1]
MODEL = "layers=2,hidden=512,heads=8,vocab=1024"
SAVED = "tp=2,pp=1,dp=1"


def run(*args, expect=0):
    return scalai(BIN, *args, expect=expect)


def blob_of_rank(store, rank):
    """The blob file that holds `rank`'s shard: imported shards keep their
    header, whose metadata names the rank."""
    for name in os.listdir(f"{store}/blobs"):
        with open(f"{store}/blobs/{name}", "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        if header.get("__metadata__", {}).get("scalai.rank") == str(rank):
            return name
    raise AssertionError(f"no blob of rank {rank} in {store}")


def tensor_ranges(path):
    """(name, begin, end) of each tensor's bytes in the safetensors file at
    `path`, as offsets in the file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return [(name, 8 + n + t["data_offsets"][0], 8 + n + t["data_offsets"][1])
            for name, t in header.items() if name != "__metadata__"]


def read(path):
    with open(path, "rb") as f:
        return f.read()


def tensors(path):
    """A shard's tensors as raw bytes: the header's metadata (scalai.config,
    scalai.step) differs between a source shard and a view of it."""
    got, _ = read_safetensors(path)
    return {name: x.tobytes() for name, x in got.items()}


def read_errno(path):
    try:
        read(path)
    except OSError as e:
        return e.errno
    return 0


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def expect_rank_1_damaged(mnt, blob, rank_0, kind):
    """The intact rank 0 reads exactly (`rank_0`, its tensors); rank 1,
    whose `blob` has damage of `kind`, fails with EIO, named in status."""
    step = f"{mnt}/ckpt/latest"
    assert tensors(f"{step}/rank-00000/model.safetensors") == rank_0, kind
    assert read_errno(f"{step}/rank-00001/model.safetensors") == errno.EIO, kind
    err = status(mnt)["error"] or ""
    assert blob in err and "step 100" in err, (kind, err)
    if kind == "flip":
        assert "chunk" in err and "checksum" in err, err


def damage(kind, path):
    size = os.path.getsize(path)
    if kind == "flip":
        flip(path, size // 2)
    elif kind == "truncate":
        os.truncate(path, size // 2)
    else:
        os.unlink(path)


def main():
    require_fuse()
    with tempfile.TemporaryDirectory() as tmp, Mounts() as mounts:
        src = f"{tmp}/src"
        run("synth", src, "--layout", "megatron-core-gpt", "--config", SAVED,
            "--model", MODEL, "--dtype", "f32", "--seed", "3")
        want = {r: tensors(f"{src}/rank-{r:05d}/model.safetensors") for r in (0, 1)}
        pristine = f"{tmp}/pristine"
        run("init", pristine, "--layout", "megatron-core-gpt", "--param", "vocab_size=1024")
        run("import", pristine, src, "--config", SAVED, "--step", "100")

        for kind in ("flip", "truncate", "delete"):
            store, mnt = f"{tmp}/{kind}", f"{tmp}/{kind}-mnt"
            shutil.copytree(pristine, store)
            blob = blob_of_rank(store, 1)
            damage(kind, f"{store}/blobs/{blob}")
            os.makedirs(mnt)
            run("mount", store, mounts.add(mnt))
            step = f"{mnt}/ckpt/latest"
            expect_rank_1_damaged(mnt, blob, want[0], kind)
            # A reconfiguration that must copy from it fails, naming it.
            p = run("reconfigure", mnt, "tp=1,pp=1,dp=1", "--wait", expect=1)
            assert blob in p.stderr, (kind, p.stderr)
            st = status(mnt)
            assert blob in (st["error"] or ""), (kind, st)
            assert read_errno(f"{step}/rank-00000/model.safetensors") == errno.EIO, kind
            # Nothing was committed: back under the saved config, the intact
            # rank is served from its blob again.
            run("reconfigure", mnt, SAVED, "--wait")
            assert tensors(f"{step}/rank-00000/model.safetensors") == want[0], kind
            assert read_errno(f"{step}/rank-00001/model.safetensors") == errno.EIO, kind
            p = run("fsck", store, expect=1)  # beside the mount
            assert blob in p.stderr, (kind, p.stdout, p.stderr)
            run("umount", mnt)
            mounts.discard(mnt)
            p = run("fsck", store, expect=1)
            assert blob in p.stdout + p.stderr, (kind, p.stdout, p.stderr)
            for config in (SAVED, "tp=1,pp=1,dp=1"):
                p = run("export", store, f"{tmp}/{kind}-out", "--config", config, expect=1)
                assert blob in p.stderr, (kind, config, p.stderr)
                assert not os.path.exists(f"{tmp}/{kind}-out"), "a refused export left files"
            info = json.loads(run("inspect", store, "--json").stdout)
            assert [s["config"] for s in info["steps"]] == [SAVED], (kind, info["steps"])
            print(f"{kind}: EIO on the damaged rank, named in status; reconfigure, fsck "
                  f"and export refuse it; the intact rank reads exactly")

        # A byte flipped in any one tensor, each in turn: an export that
        # merges the ranks refuses it, whichever way it copies that tensor
        # (whole shards, runs of rows, or boxes of a dim-1 split).
        store = f"{tmp}/each"
        shutil.copytree(pristine, store)
        path = f"{store}/blobs/{blob_of_rank(store, 1)}"
        ranges = tensor_ranges(path)
        for name, begin, end in ranges:
            flip(path, (begin + end) // 2)
            p = run("export", store, f"{tmp}/each-out", "--config", "tp=1,pp=1,dp=1", expect=1)
            assert os.path.basename(path) in p.stderr, (name, p.stderr)
            assert not os.path.exists(f"{tmp}/each-out"), name
            flip(path, (begin + end) // 2)  # back as it was
        run("export", store, f"{tmp}/each-out", "--config", "tp=1,pp=1,dp=1")
        print(f"a byte flipped in each of rank 1's {len(ranges)} tensors: export refuses it")

        # From a cold page cache: the chunks are checked as they come from
        # the disk.
        store, mnt = f"{tmp}/cold", f"{tmp}/cold-mnt"
        shutil.copytree(pristine, store)
        blob = blob_of_rank(store, 1)
        damage("flip", f"{store}/blobs/{blob}")
        os.makedirs(mnt)
        run("mount", store, mounts.add(mnt))
        drop_caches()
        expect_rank_1_damaged(mnt, blob, want[0], "flip")
        run("umount", mnt)
        mounts.discard(mnt)
        print("cold: the intact rank exact, the flipped byte caught")

        # Verified once, changed afterwards: the change is seen.
        store, mnt = f"{tmp}/live", f"{tmp}/live-mnt"
        shutil.copytree(pristine, store)
        os.makedirs(mnt)
        run("mount", store, mounts.add(mnt))
        path = f"{mnt}/ckpt/latest/rank-00001/model.safetensors"
        assert tensors(path) == want[1]
        time.sleep(0.05)  # past the file clock's tick, so that mtime moves
        blob = blob_of_rank(store, 1)
        flip(f"{store}/blobs/{blob}", os.path.getsize(f"{store}/blobs/{blob}") - 7)
        # The kernel may still hold the pages read before: drop them so that
        # the next read reaches the server.
        drop_caches()
        assert read_errno(path) == errno.EIO
        assert blob in (status(mnt)["error"] or "")
        run("umount", mnt)
        mounts.discard(mnt)
        print("a byte flipped under a running mount: EIO at the next read")
    print("corrupt_test: ok")


if __name__ == "__main__":
    main()
