#!/usr/bin/python3
"""The wraps in subprojects/ are fallbacks that stay put: each names one
release (its version in the directory and the archive's name) and the
SHA-256 of every archive it would fetch, so a fallback build gets exactly
the bytes WrapDB published or fails. Each wrap is wired to the dependency()
calls it stands in for, and every fallback named in a meson.build has its
wrap. The project's default is wrap_mode=nodownload (a build never fetches
anything), and a build configured so took every library from the system:
no subproject was built, and nothing was unpacked into the source tree."""
import configparser
import glob
import json
import os
import re
import subprocess
import sys

BUILD, SOURCE = sys.argv[1], sys.argv[2]
SHA256 = re.compile(r"[0-9a-f]{64}")
VERSION = re.compile(r"\d+(\.\d+)+")


def check_wrap(path):
    """Returns the wrap's name and the dependency names it provides."""
    name = os.path.basename(path)[:-len(".wrap")]
    wrap = configparser.ConfigParser(interpolation=None)
    wrap.read(path)
    assert wrap.sections()[0] == "wrap-file", f"{name}: only [wrap-file] wraps are pinned by hash"
    fields = wrap["wrap-file"]
    version = VERSION.search(fields["directory"])
    assert version, f"{name}: directory {fields['directory']!r} names no version"
    version = version.group(0)
    for key in ("source_filename", "source_url"):
        assert version in fields[key], f"{name}: {key} is not version {version}"
    assert SHA256.fullmatch(fields["source_hash"]), f"{name}: source_hash is not a SHA-256"
    if "patch_url" in fields:
        assert SHA256.fullmatch(fields.get("patch_hash", "")), f"{name}: patch_hash missing"
        assert fields["wrapdb_version"].startswith(version + "-"), f"{name}: wrapdb_version"
        assert fields["wrapdb_version"] in fields["patch_url"], f"{name}: patch_url"
    assert "patch_directory" not in fields, f"{name}: patch files are not kept in the repository"
    provide = wrap["provide"]
    names = [n for n in provide if n != "dependency_names"]
    names += [n.strip() for n in provide.get("dependency_names", "").split(",") if n.strip()]
    assert names, f"{name}: provides nothing"
    return name, names


def fallbacks_in_build_files():
    """(dependency name, wrap name) for every dependency() with a fallback."""
    found = []
    for path in glob.glob(os.path.join(SOURCE, "**", "meson.build"), recursive=True):
        top = os.path.relpath(path, SOURCE).split(os.sep)[0]
        if top == "subprojects" or top.startswith("build"):
            continue
        text = open(path).read()
        for call in re.finditer(r"dependency\('([^']+)'([^)]*)\)", text):
            fallback = re.search(r"fallback\s*:\s*\[?\s*'([^']+)'", call.group(2))
            if fallback:
                found.append((call.group(1), fallback.group(1)))
    return found


def main():
    wraps = dict(check_wrap(p) for p in sorted(glob.glob(os.path.join(SOURCE, "subprojects", "*.wrap"))))
    assert len(wraps) >= 5, wraps
    project = open(os.path.join(SOURCE, "meson.build")).read()
    defaults = re.search(r"default_options\s*:\s*\[([^\]]*)\]", project).group(1)
    assert "'wrap_mode=nodownload'" in defaults, "meson.build must default to wrap_mode=nodownload"
    fallbacks = fallbacks_in_build_files()
    for dep, wrap in fallbacks:
        assert wrap in wraps, f"dependency('{dep}') falls back on {wrap}, which has no wrap"
        provided = [n.lower() for n in wraps[wrap]]
        assert dep.lower() in provided, f"{wrap}.wrap does not provide {dep}"
    for wrap in wraps:
        assert any(w == wrap for _, w in fallbacks), f"{wrap}.wrap is not a fallback of any dependency()"

    options = json.loads(subprocess.run(["meson", "introspect", BUILD, "--buildoptions"],
                                        capture_output=True, text=True, check=True).stdout)
    wrap_mode = next(o["value"] for o in options if o["name"] == "wrap_mode")
    info = json.loads(subprocess.run(["meson", "introspect", BUILD, "--projectinfo"],
                                     capture_output=True, text=True, check=True).stdout)
    used = [s["name"] for s in info["subprojects"]]
    if wrap_mode == "nodownload":
        assert used == [], f"built from wraps: {used}"
        fetched = [d for d in os.listdir(os.path.join(SOURCE, "subprojects"))
                   if os.path.isdir(os.path.join(SOURCE, "subprojects", d))]
        assert fetched == [], f"downloaded into subprojects/: {fetched}"
    print(f"{len(wraps)} wraps pinned: {', '.join(sorted(wraps))}; "
          f"{len(fallbacks)} fallbacks wired; wrap_mode={wrap_mode}, subprojects built: {used}")


if __name__ == "__main__":
    main()
