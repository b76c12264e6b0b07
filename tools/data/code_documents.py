#!/usr/bin/env python3
"""Long documents every machine that builds chunkwise has: repository-level code as JSON Lines.

Two sources, each directory of files joined into one document (its files in sorted order, each opened
by a line naming it), the kind of long document a model must read far back in to predict well:
- the Python standard library: each package (a directory holding .py files, with its subpackages)
  is a document; the packages named by --eval-packages are held out for evaluation, the rest train;
- the C++ standard library's headers (--headers, by default the newest /usr/include/c++/N, which
  every machine with g++ has): each directory's own files are a training document.
The `encodings` package is left out: nearly all of it is the codecs' generated character tables,
which a model predicts almost exactly and which teach nothing of long-range use.

    python3 tools/data/code_documents.py --train train.jsonl --eval eval.jsonl
        [--eval-orders orders.jsonl [--orders 8] [--seed 0]]
        [--eval-packages asyncio,email,...] [--headers auto|none|DIR] [--min-chars 20000] [--root DIR]

--eval-orders writes each held-out package again, --orders times, its files in a random order each time
(drawn from --seed and the package's name). In sorted order a package's position says which of its files
a token is in (its first files sit at the start, its last ones past 32K tokens), so loss by position
compares different text as much as different context; over many random orders every position averages
the same files, and what is left of the difference is the context.

Records: {"text": ..., "source": "python" | "c++", "name": name, "chars": n}; `chunkwise tokenize
--jsonl FILE --field text` turns them into a shard with one document each.
"""
import argparse
import glob
import json
import os
import random
import re
import sys
import sysconfig

# Held out by default: four packages long enough to fill a 64K-token window each (so every position
# bucket to 64K averages the same documents) and four shorter ones.
EVAL_PACKAGES = "asyncio,email,tkinter,multiprocessing,importlib,logging,json,collections"
# Packages left out, with the reason.
LEFT_OUT = {"encodings": "the codecs' generated character tables",
            "site-packages": "installed packages, not the standard library",
            "dist-packages": "installed packages, not the standard library",
            "test": "the test suite", "tests": "the test suite", "idlelib": "an application"}


def python_packages(root):
    """(name, [paths]) for each top-level package directory under root, files sorted."""
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or name in LEFT_OUT or name.startswith(("__", ".", "config-")):
            continue
        files = []
        for d, subdirs, names in os.walk(path):
            subdirs[:] = sorted(s for s in subdirs if s not in ("__pycache__", "test", "tests"))
            files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
        if files:
            yield name, files


def header_directories(root):
    """(name, [paths]) for root and each directory below it: its own files, sorted."""
    for d, subdirs, names in os.walk(root):
        subdirs.sort()
        files = [os.path.join(d, n) for n in sorted(names) if os.path.isfile(os.path.join(d, n))]
        if files:
            yield os.path.relpath(d, os.path.dirname(root)), files


def file_parts(root, files, comment):
    """Each file's text opened by a line naming it, in the order given."""
    parts = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, OSError):
            continue  # a file that is not UTF-8 text is left out
        parts.append(f"{comment} file: {os.path.relpath(f, root)}\n{text}")
    return parts


def document(root, files, comment):
    return "\n".join(file_parts(root, files, comment))


def newest_cxx_headers():
    """The newest /usr/include/c++/N, or None."""
    found = [d for d in glob.glob("/usr/include/c++/*") if re.fullmatch(r"\d+", os.path.basename(d))]
    return max(found, key=lambda d: int(os.path.basename(d))) if found else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", required=True, help="JSON Lines of the training documents")
    ap.add_argument("--eval", required=True, help="JSON Lines of the held-out documents")
    ap.add_argument("--eval-packages", default=EVAL_PACKAGES, help="standard-library packages held out, comma-separated")
    ap.add_argument("--headers", default="auto", help="C++ headers to train on: auto (the newest /usr/include/c++/N), "
                    "none, or a directory")
    ap.add_argument("--eval-orders", help="JSON Lines of the held-out packages, each in --orders random file orders")
    ap.add_argument("--orders", type=int, default=8, help="random file orders of each held-out package (--eval-orders)")
    ap.add_argument("--seed", type=int, default=0, help="the seed of the file orders (--eval-orders)")
    ap.add_argument("--min-chars", type=int, default=20000, help="leave out documents shorter than this")
    ap.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="the Python standard library's directory")
    a = ap.parse_args()
    if not os.path.isdir(a.root):
        sys.exit(f"code_documents.py: '{a.root}' is not a directory: give the standard library with --root")
    held = {p for p in a.eval_packages.split(",") if p}
    if a.orders < 1:
        sys.exit(f"code_documents.py: --orders {a.orders}: give one or more orders")
    headers = newest_cxx_headers() if a.headers == "auto" else None if a.headers == "none" else a.headers
    if a.headers == "auto" and headers is None:
        print("code_documents.py: no /usr/include/c++/N here: training on the Python standard library alone")
    if headers is not None and not os.path.isdir(headers):
        sys.exit(f"code_documents.py: --headers '{headers}' is not a directory: give one, or --headers none")
    counts = {}
    with open(a.train, "w", encoding="utf-8") as train, open(a.eval, "w", encoding="utf-8") as evaluation:
        def write(which, source, name, text):
            if len(text) < a.min_chars:
                return
            (evaluation if which == "eval" else train).write(
                json.dumps({"text": text, "source": source, "name": name, "chars": len(text)}) + "\n")
            n, chars = counts.get((which, source), (0, 0))
            counts[(which, source)] = (n + 1, chars + len(text))

        found = set()
        orders = open(a.eval_orders, "w", encoding="utf-8") if a.eval_orders else None
        for name, files in python_packages(a.root):
            found.add(name)
            parts = file_parts(a.root, files, "#")
            text = "\n".join(parts)
            write("eval" if name in held else "train", "python", name, text)
            if orders is not None and name in held and len(text) >= a.min_chars:
                for i in range(a.orders):
                    shuffled = list(parts)  # the files read once; only their order is drawn
                    random.Random(f"{a.seed}:{name}:{i}").shuffle(shuffled)
                    order = "\n".join(shuffled)
                    orders.write(json.dumps({"text": order, "source": "python", "name": name, "order": i,
                                             "chars": len(order)}) + "\n")
        if orders is not None:
            orders.close()
            print(f"eval orders: {a.orders} random file orders of each held-out package in {a.eval_orders}")
        if held - found:
            sys.exit(f"code_documents.py: --eval-packages names {', '.join(sorted(held - found))}, not packages of "
                     f"{a.root}: name packages it has")
        if headers is not None:
            for name, files in header_directories(headers):
                write("train", "c++", name, document(os.path.dirname(headers), files, "//"))
    for (which, source), (n, chars) in sorted(counts.items()):
        print(f"{which}: {n} {source} documents, {chars / 1e6:.1f} M characters")
    if not any(w == "train" for w, _ in counts) or not any(w == "eval" for w, _ in counts):
        sys.exit("code_documents.py: a split is empty: lower --min-chars or name other --eval-packages")


if __name__ == "__main__":
    main()
