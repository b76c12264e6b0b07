#!/usr/bin/env python3
"""Long documents every machine has: the Python standard library's packages as JSON Lines.

Each package (a directory of the standard library holding .py files, with its subpackages) becomes
one document: its files in sorted order, each opened by a line `# file: <path>`, joined. That is
repository-level code, the kind of long document a model must read far back in to predict well.
Packages are split into training and held-out documents by a stable hash of their name, so the
held-out set never shares a file with training and is the same on every machine of one Python version.

    python3 tools/data/stdlib_documents.py --train train.jsonl --eval eval.jsonl [--eval-share 0.15]
                                           [--min-chars 20000] [--root /usr/lib/python3.12]

Records: {"text": ..., "package": name, "chars": n}; `chunkwise tokenize --jsonl FILE --field text`
turns them into a shard with one document each.
"""
import argparse
import hashlib
import json
import os
import sys
import sysconfig


def packages(root):
    """(name, [paths]) for each top-level package directory under root, files sorted."""
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or name in ("site-packages", "dist-packages", "test", "tests", "idlelib") \
                or name.startswith(("__", ".")):
            continue
        files = []
        for d, subdirs, names in os.walk(path):
            subdirs[:] = sorted(s for s in subdirs if s not in ("__pycache__", "test", "tests"))
            files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
        if files:
            yield name, files


def document(root, files):
    parts = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, OSError):
            continue  # a file that is not UTF-8 text is left out
        parts.append(f"# file: {os.path.relpath(f, root)}\n{text}")
    return "\n".join(parts)


def held_out(name, share):
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", required=True, help="JSON Lines of the training documents")
    ap.add_argument("--eval", required=True, help="JSON Lines of the held-out documents")
    ap.add_argument("--eval-share", type=float, default=0.15, help="share of packages held out (by name hash)")
    ap.add_argument("--min-chars", type=int, default=20000, help="leave out packages shorter than this")
    ap.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="the standard library's directory")
    a = ap.parse_args()
    if not os.path.isdir(a.root):
        sys.exit(f"stdlib_documents.py: '{a.root}' is not a directory: give the standard library with --root")
    counts = {"train": [0, 0], "eval": [0, 0]}
    with open(a.train, "w", encoding="utf-8") as train, open(a.eval, "w", encoding="utf-8") as held:
        for name, files in packages(a.root):
            text = document(a.root, files)
            if len(text) < a.min_chars:
                continue
            which = "eval" if held_out(name, a.eval_share) else "train"
            (held if which == "eval" else train).write(json.dumps({"text": text, "package": name, "chars": len(text)}) + "\n")
            counts[which][0] += 1
            counts[which][1] += len(text)
    for which, (n, chars) in counts.items():
        print(f"{which}: {n} packages, {chars / 1e6:.1f} M characters")
    if counts["train"][0] == 0 or counts["eval"][0] == 0:
        sys.exit("stdlib_documents.py: a split is empty: lower --min-chars or change --eval-share")


if __name__ == "__main__":
    main()
