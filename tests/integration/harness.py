"""How every integration test starts and ends: it is skipped (exit 77) where
FUSE is missing, it prints the seed it draws so that a failure can be run
again, and whatever it mounted is unmounted however it ends, since a failed
check must not leave a mount behind and a mounted directory cannot be
removed with its temporary parent."""
import os
import random
import subprocess
import sys
import time


def require_fuse():
    if not os.path.exists("/dev/fuse"):
        print("no /dev/fuse: skipped")
        sys.exit(77)


def small_tmpfs(path, size, mounts):
    """A tmpfs of `size` bytes at `path` (made if missing), held by `mounts`,
    for tests of a full disk; exits 77 where one cannot be mounted (not
    root)."""
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                      stderr=subprocess.DEVNULL).returncode != 0:
        print("cannot mount a tmpfs (not root?): skipped")
        sys.exit(77)
    return mounts.add(path)


def synth_store(binary, tmp, config, model, vocab, step=100, seed=1):
    """A store at TMP/store of a random megatron-core-gpt checkpoint, written
    by `scalai synth` under `config` (f32) to TMP/src and imported as `step`
    (None: not imported). Returns (src, store)."""
    src, store = f"{tmp}/src", f"{tmp}/store"
    for args in (["synth", src, "--layout", "megatron-core-gpt", "--config", config,
                  "--model", model, "--dtype", "f32", "--seed", str(seed)],
                 ["init", store, "--layout", "megatron-core-gpt", "--param", f"vocab_size={vocab}"],
                 ["import", store, src, "--config", config, "--step", str(step)]):
        if args[0] == "import" and step is None:
            break
        p = subprocess.run([binary, *args], capture_output=True, text=True)
        assert p.returncode == 0, f"scalai {' '.join(args)}: {p.stderr}"
    return src, store


def deadline_in(seconds):
    """The time `seconds` from now, times SCALAI_TEST_SLOW (default 1): a
    build under the sanitizers runs several times slower, and its waits
    must be too."""
    return time.time() + seconds * float(os.environ.get("SCALAI_TEST_SLOW", "1"))


def test_seed():
    """SCALAI_TEST_SEED if set, else a fresh seed; printed either way."""
    seed = int(os.environ.get("SCALAI_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (SCALAI_TEST_SEED={seed} repeats this run)")
    return seed


def serve(binary, store, mnt, preexec_fn=None):
    """`scalai mount --foreground` as a child, returned once it has mounted,
    for tests that kill the server, watch its process or limit it
    (`preexec_fn` runs in the child before the exec)."""
    server = subprocess.Popen([binary, "mount", store, mnt, "--foreground"],
                              stdout=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    line = server.stdout.readline()
    assert line.startswith("mounted"), line
    return server


def deleted_files_held(pid, under):
    """Files under `under` that process `pid` still maps or holds open after
    they were deleted: space in use that no name reaches."""
    held = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[5:]
                if path and path[0].startswith(under) and path[0].endswith(" (deleted)"):
                    held.add(path[0])
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith(under) and target.endswith(" (deleted)"):
                held.add(target)
    except FileNotFoundError:
        pass  # the process is gone, and so is what it held
    return sorted(held)


class Mounts:
    """The mountpoints a test holds (FUSE or other), detached lazily, newest
    first, when its `with` block ends."""

    def __init__(self):
        self._points = []

    def add(self, path):
        self._points.append(path)
        return path

    def discard(self, path):
        """`path` was unmounted by the test itself."""
        if path in self._points:
            self._points.remove(path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        while self._points:
            # Root may detach any mount with umount; fusermount3 serves others.
            path = self._points.pop()
            if subprocess.run(["umount", "-l", path], stderr=subprocess.DEVNULL).returncode:
                subprocess.run(["fusermount3", "-u", "-z", "-q", path],
                               stderr=subprocess.DEVNULL)
        return False


def flip(path, offset):
    """Inverts the byte at `offset` of the file at `path`, as damage on the
    disk would; a second flip puts it back."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
