#!/usr/bin/python3
"""The command line refuses what would let one user read another's files,
run a command, or leave the store unusable (issue 26):
- import: a symbolic link under rank-R/extra/ (to /etc/hostname here) is
  refused, naming it, and nothing is imported; so is an extra/ that is
  itself a link;
- import --step -1 is refused; steps are non-negative;
- import of a shard whose scalai.consumed_samples is not a multiple of a
  registered dataset's global batch is refused with the reason, and so is
  registering a dataset (or registering one again, with --replace) whose
  global batch the newest step's position does not fall on: either would
  make the store unmountable;
- mount --config with a dp larger than a dataset's global batch is refused
  and leaves the store's current config unchanged;
- mount on a regular file fails, leaves no mount, and the store is free
  (fsck runs);
- umount of a mount point whose name holds shell syntax runs no shell:
  with the mount busy, so that the fusermount3 fallback runs, no file
  appears, and the mount is still there to unmount once idle.
Exits 77 only where /dev/fuse is missing."""
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, synth_store  # noqa
from reference import read_safetensors, scalai, write_safetensors  # noqa

BIN = os.path.abspath(sys.argv[1])
MODEL = "layers=2,hidden=256,heads=4,vocab=512"
CONFIG = "tp=1,pp=1,dp=1"


def mounted(path):
    """Whether `path` is a mount point; /proc writes ' ' as \\040."""
    def unescape(field):
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
    with open("/proc/self/mounts") as f:
        return any(unescape(line.split()[1]) == path for line in f)


def one_line(p, *words):
    line = p.stderr.strip()
    assert "\n" not in line, line
    for w in words:
        assert w in line, (w, line)
    return line


def main():
    require_fuse()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, Mounts() as mounts:
        src, store = synth_store(BIN, tmp, CONFIG, MODEL, 512, step=None)

        os.makedirs(f"{src}/rank-00000/extra")
        os.symlink("/etc/hostname", f"{src}/rank-00000/extra/host")
        p = scalai(BIN, "import", store, src, "--config", CONFIG, "--step", "100", expect=1)
        print("link in extra/:", one_line(p, "extra/host", "symbolic link"))
        os.unlink(f"{src}/rank-00000/extra/host")
        os.rmdir(f"{src}/rank-00000/extra")
        os.makedirs(f"{tmp}/elsewhere")
        os.symlink(f"{tmp}/elsewhere", f"{src}/rank-00000/extra")
        p = scalai(BIN, "import", store, src, "--config", CONFIG, "--step", "100", expect=1)
        print("extra/ a link:", one_line(p, "extra", "symbolic link"))
        os.unlink(f"{src}/rank-00000/extra")
        assert "steps     0" in scalai(BIN, "inspect", store).stdout

        p = scalai(BIN, "import", store, src, "--config", CONFIG, "--step", "-1", expect=2)
        assert "-1" in p.stderr, p.stderr
        print("import --step -1: refused")

        scalai(BIN, "import", store, src, "--config", CONFIG, "--step", "100")
        with open(f"{tmp}/records.jsonl", "w") as f:
            f.writelines(f'{{"text": "record {i}"}}\n' for i in range(64))
        scalai(BIN, "dataset", "add", store, "web", f"{tmp}/records.jsonl",
               "--format", "jsonl", "--global-batch", "4")
        tensors, _ = read_safetensors(f"{src}/rank-00000/model.safetensors")
        odd = f"{tmp}/odd"
        os.makedirs(f"{odd}/rank-00000")
        write_safetensors(f"{odd}/rank-00000/model.safetensors", tensors,
                          {"scalai.consumed_samples": "7"})
        p = scalai(BIN, "import", store, odd, "--config", CONFIG, "--step", "200", expect=1)
        print("consumed 7 of batches of 4:", one_line(p, "7", "global batch 4"))
        write_safetensors(f"{odd}/rank-00000/model.safetensors", tensors,
                          {"scalai.consumed_samples": "12"})
        scalai(BIN, "import", store, odd, "--config", CONFIG, "--step", "200")
        p = scalai(BIN, "dataset", "add", store, "web8", f"{tmp}/records.jsonl",
                   "--format", "jsonl", "--global-batch", "8", expect=1)
        print("a dataset the newest position (12) does not fit:",
              one_line(p, "12", "global batch 8"))
        p = scalai(BIN, "dataset", "add", store, "web", f"{tmp}/records.jsonl", "--replace",
                   "--format", "jsonl", "--global-batch", "8", expect=1)
        print("web registered again with a batch that position does not fit:",
              one_line(p, "12", "global batch 8"))
        web = [d for d in json.loads(scalai(BIN, "inspect", store, "--json").stdout)["datasets"]
               if d["name"] == "web"]
        assert len(web) == 1 and web[0]["global_batch"] == 4, web

        # mount --config with a dp the dataset's batch of 4 cannot feed:
        # refused, and the store keeps its config (issue 25).
        os.makedirs(f"{tmp}/mnt")
        p = scalai(BIN, "mount", store, f"{tmp}/mnt", "--config", "tp=1,pp=1,dp=8", expect=1)
        mounts.add(f"{tmp}/mnt")
        assert not mounted(f"{tmp}/mnt")
        assert json.loads(scalai(BIN, "inspect", store, "--json").stdout)["config"] == CONFIG
        print("mount --config with an impossible dp:", one_line(p, "dp=8"),
              "- the store's config unchanged")

        with open(f"{tmp}/file", "w") as f:
            f.write("not a directory\n")
        p = scalai(BIN, "mount", store, f"{tmp}/file", expect=1)
        mounts.add(f"{tmp}/file")
        assert not mounted(f"{tmp}/file"), "a mount was left on the file"
        scalai(BIN, "fsck", store)
        print("mount on a regular file:", one_line(p, "not a directory"), "- no mount left")

        os.makedirs(f"{tmp}/work")
        os.chdir(f"{tmp}/work")
        mnt = f"{tmp}/work/job';touch injected;'"
        os.makedirs(mnt)
        scalai(BIN, "mount", store, mounts.add(mnt))
        busy = open(f"{mnt}/status")
        p = scalai(BIN, "umount", mnt, expect=1)
        busy.close()
        assert not os.path.exists(f"{tmp}/work/injected"), "umount ran a shell"
        assert mounted(mnt), ("the busy mount went away", p.stderr)
        scalai(BIN, "umount", mnt)
        mounts.discard(mnt)
        assert not mounted(mnt) and not os.path.exists(f"{tmp}/work/injected")
        os.chdir("/")
        print("umount of a name with shell syntax: no shell, the mount unmounted")
    print("hostile_cli_test: ok")


if __name__ == "__main__":
    main()
