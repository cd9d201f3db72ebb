#!/usr/bin/python3
"""The README and docs/ stand alone: every link in them is relative, points at
a file inside the repository that exists, and every #anchor names a heading of
the file it points at. A link that leaves the repository (an absolute path, a
URL, or a path that climbs out) fails, as does a broken one."""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def documents():
    yield os.path.join(ROOT, "README.md")
    for folder in ("docs", "subprojects"):
        if not os.path.isdir(os.path.join(ROOT, folder)):
            continue
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".md"):
                yield os.path.join(ROOT, folder, name)


def prose(path):
    """The file's lines outside code fences, with inline code removed."""
    fenced = False
    for number, line in enumerate(open(path, encoding="utf-8"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, re.sub(r"`[^`]*`", "", line)


def anchors(path):
    """GitHub's heading slugs: lower case, punctuation dropped, spaces to -."""
    out = set()
    for _, line in prose(path):
        m = re.match(r"#+\s+(.*)", line)
        if m:
            title = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(title.replace(" ", "-"))
    return out


def main():
    problems, checked = [], 0
    for doc in documents():
        rel_doc = os.path.relpath(doc, ROOT)
        for number, line in prose(doc):
            for target in LINK.findall(line):
                checked += 1
                where = f"{rel_doc}:{number}: {target}"
                if re.match(r"[a-z]+:", target) or target.startswith("/"):
                    problems.append(f"{where}: leaves the repository")
                    continue
                path, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
                if not (full + os.sep).startswith(ROOT + os.sep):
                    problems.append(f"{where}: leaves the repository")
                elif not os.path.exists(full):
                    problems.append(f"{where}: no such file")
                elif anchor and full.endswith(".md") and anchor not in anchors(full):
                    problems.append(f"{where}: no heading #{anchor} in {os.path.relpath(full, ROOT)}")
    for p in problems:
        print(p)
    print(f"{checked} links checked, {len(problems)} broken or leaving the repository")
    assert checked > 0, "no links found: the test would check nothing"
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
