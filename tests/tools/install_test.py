#!/usr/bin/python3
"""`meson install --destdir` puts what a Debian user expects where they
expect it: scalai in bin, mount.fuse.scalai in /sbin (where mount(8) looks)
running the installed scalai, the bash completion, the Python client where
Debian's python3 finds local packages; and nothing else but those. The
completion names every subcommand and every option `--help` lists."""
import os
import re
import subprocess
import sys
import tempfile

BUILD, SOURCE = sys.argv[1], sys.argv[2]
SCALAI = os.path.join(BUILD, "tools", "scalai")


def main():
    with tempfile.TemporaryDirectory() as dest:
        p = subprocess.run(["meson", "install", "-C", BUILD, "--destdir", dest, "--no-rebuild",
                            "--quiet"], capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        files = sorted(os.path.relpath(os.path.join(d, f), dest)
                       for d, _, fs in os.walk(dest) for f in fs)
        prefix = subprocess.run(["meson", "introspect", BUILD, "--buildoptions"],
                                capture_output=True, text=True, check=True).stdout
        prefix = re.search(r'"name": "prefix", "value": "([^"]+)"', prefix).group(1).lstrip("/")
        want = [f"{prefix}/bin/scalai", "sbin/mount.fuse.scalai",
                f"{prefix}/share/bash-completion/completions/scalai",
                f"{prefix}/lib/python3/dist-packages/scalai/__init__.py",
                f"{prefix}/lib/python3/dist-packages/scalai/_safetensors.py"]
        assert files == sorted(want), files
        helper = open(os.path.join(dest, "sbin/mount.fuse.scalai")).read()
        assert f'@SCALAI@' not in helper and f"/{prefix}/bin/scalai" in helper
        assert os.access(os.path.join(dest, "sbin/mount.fuse.scalai"), os.X_OK)
        print("installed:", ", ".join(files))

    completion = open(os.path.join(SOURCE, "tools", "scalai.bash-completion")).read()
    top = subprocess.run([SCALAI, "--help"], capture_output=True, text=True).stdout
    commands = re.findall(r"^  ([a-z][a-z-]+)\s", top.split("Subcommands:")[-1], re.M)
    assert len(commands) >= 13, commands
    for command in commands:
        assert re.search(rf"\b{command}\)", completion), f"completion lacks {command}"
        text = subprocess.run([SCALAI, command, "--help"], capture_output=True, text=True).stdout
        subs = re.findall(r"^  ([a-z]+)\s", text.split("Subcommands:")[-1], re.M) \
            if "Subcommands:" in text else []
        for sub in subs:
            text += subprocess.run([SCALAI, command, sub, "--help"], capture_output=True,
                                   text=True).stdout
        for option in set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text)):
            assert option in completion, f"completion lacks {command} {option}"
    print(f"completion: {len(commands)} subcommands, every option --help lists")


if __name__ == "__main__":
    main()
