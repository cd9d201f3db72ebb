#!/usr/bin/python3
"""With --allow-other, another user may read the mount but not change it
(issue 26). The test makes a second user, mounts a store as root with
--allow-other, and starts saving a step with a shard half written and open.
As the other user: job.json and a committed shard read fine; writing
`config`, making a step in ckpt/, removing the step being saved (its file
and its directories), truncating or rewriting a committed shard and writing
into the half-written one all fail with EACCES (or EROFS), and nothing
changes: root's save then commits. Without --allow-other the other user
cannot even look. Exits 77 where /dev/fuse is missing or users cannot be
made (not root)."""
import errno
import json
import os
import pwd
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Mounts, require_fuse, synth_store  # noqa
from reference import scalai  # noqa

BIN = sys.argv[1]
USER = "scalai-test-other"
MODEL = "layers=2,hidden=256,heads=4,vocab=512"
CONFIG = "tp=1,pp=1,dp=1"

# Run as the other user: each attempt's errno (0: it worked).
ATTEMPTS = r'''
import json, os, sys
mnt = sys.argv[1]
step = f"{mnt}/ckpt/step-00000100/rank-00000/model.safetensors"
saving = f"{mnt}/ckpt/step-00000200"
def attempt(fn):
    try:
        fn()
        return 0
    except OSError as e:
        return e.errno
def write(path, data, flags):
    fd = os.open(path, flags)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
print(json.dumps({
    "read job.json": attempt(lambda: open(f"{mnt}/job.json").read()),
    "read a committed shard": attempt(lambda: open(step, "rb").read()),
    "write config": attempt(lambda: write(f"{mnt}/config", b"tp=1,pp=1,dp=1\n",
                                          os.O_WRONLY | os.O_TRUNC)),
    "mkdir a step": attempt(lambda: os.mkdir(f"{mnt}/ckpt/step-00000300")),
    "unlink the shard being saved": attempt(
        lambda: os.unlink(f"{saving}/rank-00000/model.safetensors")),
    "rmdir the rank being saved": attempt(lambda: os.rmdir(f"{saving}/rank-00000")),
    "rmdir the step being saved": attempt(lambda: os.rmdir(saving)),
    "write into the shard being saved": attempt(
        lambda: write(f"{saving}/rank-00000/model.safetensors", b"x", os.O_WRONLY)),
    "truncate a committed shard": attempt(lambda: os.truncate(step, 0)),
    "rewrite a committed shard": attempt(
        lambda: write(step, b"x", os.O_WRONLY | os.O_TRUNC)),
}))
'''


def make_user():
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    p = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", USER], capture_output=True, text=True)
    if p.returncode != 0:
        print(f"cannot make a user ({p.stderr.strip()}): skipped")
        sys.exit(77)
    return pwd.getpwnam(USER)


def as_other(user, mnt):
    p = subprocess.run([sys.executable, "-c", ATTEMPTS, mnt], capture_output=True,
                       text=True, user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                       cwd="/")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def main():
    require_fuse()
    if os.geteuid() != 0:
        print("not root: skipped")
        sys.exit(77)
    user = make_user()
    try:
        with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, Mounts() as mounts:
            os.chmod(tmp, 0o755)  # the other user must reach the mount point
            src, store = synth_store(BIN, tmp, CONFIG, MODEL, 512)
            mnt = f"{tmp}/mnt"
            os.makedirs(mnt)
            with open(f"{src}/rank-00000/model.safetensors", "rb") as f:
                data = f.read()

            scalai(BIN, "mount", store, mounts.add(mnt))
            got = as_other(user, mnt)
            assert got["read job.json"] == errno.EACCES, got
            print("without --allow-other another user cannot look:", errno.errorcode[got["read job.json"]])
            scalai(BIN, "umount", mnt)
            mounts.discard(mnt)

            scalai(BIN, "mount", store, mounts.add(mnt), "--allow-other")
            os.makedirs(f"{mnt}/ckpt/step-00000200/rank-00000")
            shard = open(f"{mnt}/ckpt/step-00000200/rank-00000/model.safetensors", "wb")
            shard.write(data[:len(data) // 2])
            shard.flush()
            got = as_other(user, mnt)
            for what, err in got.items():
                if what.startswith("read"):
                    assert err == 0, (what, errno.errorcode.get(err))
                else:
                    assert err in (errno.EACCES, errno.EROFS, errno.EPERM), \
                        (what, errno.errorcode.get(err, err))
                print(f"  other user: {what}: {errno.errorcode.get(err, 'ok')}")
            shard.write(data[len(data) // 2:])
            shard.close()
            assert os.readlink(f"{mnt}/ckpt/latest") == "step-00000200"
            with open(f"{mnt}/config") as f:
                assert f.read() == CONFIG + "\n"
            assert sorted(os.listdir(f"{mnt}/ckpt")) == ["latest", "step-00000100", "step-00000200"]
            print("root's save committed; the other user changed nothing")
            scalai(BIN, "umount", mnt)
            mounts.discard(mnt)
    finally:
        subprocess.run(["userdel", USER], capture_output=True)
    print("allow_other_test: ok")


if __name__ == "__main__":
    main()
