#!/usr/bin/env python3
"""merge.py - line and branch coverage of pqcache.h and examples/tiny_llama by the test suite,
from gcov's JSON files of every program that `make coverage` built and ran.

usage: merge.py ROOT OUT_DIR JSON.gz...   ROOT: the tree that was built (paths are made
       relative to it); writes OUT_DIR/summary.txt (also printed) and OUT_DIR/lines.txt
       (every executable line: FILE:LINE COVERED(0/1)), which `merge.py --compare OLD NEW`
       reads to list the lines OLD covered and NEW does not; `--compare OLD NEW OLD_TREE
       NEW_TREE` matches the lines of files that changed in between by their content.

A line is executable when any program's gcov data lists it, covered when any run executed
it; a branch (line, index within the line) is taken when any run took it.
"""
import gzip
import json
import os
import sys

def tracked(rel):
    return rel == "pqcache.h" or (rel.startswith("examples/tiny_llama/") and not rel.startswith("examples/tiny_llama/test_"))


def merge(root, paths):
    lines = {}     # (file, line) -> covered
    branches = {}  # (file, line, i) -> taken
    for p in paths:
        with gzip.open(p, "rt") as f:
            d = json.load(f)
        cwd = d.get("current_working_directory", root)
        for fe in d["files"]:
            path = os.path.normpath(os.path.join(cwd, fe["file"]))
            rel = os.path.relpath(path, root)
            if not tracked(rel):
                continue
            for ln in fe["lines"]:
                key = (rel, ln["line_number"])
                lines[key] = lines.get(key, False) or ln["count"] > 0
                for i, b in enumerate(ln.get("branches", [])):
                    bk = key + (i,)
                    branches[bk] = branches.get(bk, False) or b["count"] > 0
    return lines, branches


def summary(lines, branches):
    out = []
    groups = [("pqcache.h", lambda f: f == "pqcache.h"),
              ("examples/tiny_llama", lambda f: f.startswith("examples/tiny_llama/"))]
    for name, sel in groups:
        ls = [v for (f, _), v in lines.items() if sel(f)]
        bs = [v for (f, _, _), v in branches.items() if sel(f)]
        lc, bc = sum(ls), sum(bs)
        out.append("%-20s lines %6d of %6d (%5.1f%%)   branches %6d of %6d (%5.1f%%)" % (
            name, lc, len(ls), 100.0 * lc / max(1, len(ls)), bc, len(bs), 100.0 * bc / max(1, len(bs))))
    return "\n".join(out)


def line_map(old_tree, new_tree, files):
    """FILE:LINE of the old tree -> FILE:LINE of the new one, for the lines of unchanged
    stretches of each file (difflib); a changed line has no counterpart."""
    import difflib
    m = {}
    for fn in files:
        try:
            with open(os.path.join(old_tree, fn)) as f:
                a = f.read().splitlines()
            with open(os.path.join(new_tree, fn)) as f:
                b = f.read().splitlines()
        except OSError:
            continue
        for blk in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
            for i in range(blk.size):
                m["%s:%d" % (fn, blk.a + i + 1)] = "%s:%d" % (fn, blk.b + i + 1)
    return m


def compare(old, new, old_tree=None, new_tree=None):
    def load(p):
        m = {}
        with open(p) as f:
            for line in f:
                k, v = line.rsplit(" ", 1)
                m[k] = v.strip() == "1"
        return m
    a, b = load(old), load(new)
    if old_tree and new_tree:  # the files changed between the runs: compare by content
        mp = line_map(old_tree, new_tree, sorted({k.rsplit(":", 1)[0] for k in a}))
        changed = sum(1 for k, v in a.items() if v and k not in mp)
        print("covered before in lines changed since: %d" % changed)
        a = {mp[k]: v for k, v in a.items() if k in mp}
    lost = sorted((k for k, v in a.items() if v and not b.get(k, False)),
                  key=lambda k: (k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])))
    gained = sum(1 for k, v in b.items() if v and not a.get(k, False))
    print("covered before and not after: %d lines; covered after and not before: %d lines" % (len(lost), gained))
    for k in lost:
        print("  " + k)
    return 1 if lost else 0


def main(argv):
    if len(argv) in (4, 6) and argv[1] == "--compare":
        return compare(*argv[2:])
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    root, out = os.path.abspath(argv[1]), argv[2]
    lines, branches = merge(root, argv[3:])
    os.makedirs(out, exist_ok=True)
    text = summary(lines, branches)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "lines.txt"), "w") as f:
        for (fn, ln), v in sorted(lines.items()):
            f.write("%s:%d %d\n" % (fn, ln, 1 if v else 0))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
