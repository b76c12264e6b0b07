#!/usr/bin/env python3
"""Long documents every machine that builds chunkwise has: repository-level code as JSON Lines.

Two sources, each directory of files joined into one document (each file opened by a line naming it),
the kind of long document a model must read far back in to predict well:
- the Python standard library: each package (a directory holding .py files, with its subpackages)
  is a document; the packages named by --eval-packages are held out for evaluation, the rest train;
- the C++ standard library's headers (--headers, by default the newest /usr/include/c++/N, which
  every machine with g++ has): each directory's own files are a training document.
The `encodings` package is left out: nearly all of it is the codecs' generated character tables,
which a model predicts almost exactly and which teach nothing of long-range use.

A document's files come in sorted order of their paths, or with --order dependency each after the
files of its document it imports (Python's `import` and `from ... import`, relative or absolute) or
includes (`#include`), ties and import cycles broken by the sorted order: a module's definitions come
before their uses, as repository-level code corpora join a repository's files.

    python3 tools/data/code_documents.py --train train.jsonl --eval eval.jsonl [--order sorted|dependency]
        [--eval-orders orders.jsonl [--orders 8] [--seed 0]]
        [--eval-packages asyncio,email,...] [--headers auto|none|DIR] [--min-chars 20000] [--root DIR]

--eval-orders writes each held-out package again, --orders times, its files in a random order each time
(drawn from --seed and the package's name). In one fixed order a package's position says which of its
files a token is in (its first files sit at the start, its last ones past 32K tokens), so loss by
position compares different text as much as different context; over many random orders every position
averages the same files, and what is left of the difference is the context.

Records: {"text": ..., "source": "python" | "c++", "name": name, "chars": n}; `chunkwise tokenize
--jsonl FILE --field text` turns them into a shard with one document each.
"""
import argparse
import ast
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


def python_module(root, path):
    """The dotted module name of a .py file under root: asyncio/tasks.py -> asyncio.tasks."""
    parts = os.path.relpath(path, root)[:-len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_imports(root, path, modules):
    """The files of `modules` (name -> path) that the file at path imports, at any depth of its code."""
    me = python_module(root, path)
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from ..a import b` climbs level - 1 packages from this one
                outer = package.split(".")
                outer = outer[:max(0, len(outer) - (node.level - 1))]
                base = ".".join(outer + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]  # `from p import m`: m may be a module
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` where c is a name in a.b
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(modules[name])
    return found


def header_includes(path, include_root, files):
    """The files of the set `files` that the header at path includes: `#include <a/b>` or "a/b" names
    include_root/a/b or, beside the header, a/b."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (UnicodeDecodeError, OSError):
        return set()
    found = set()
    for name in re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', text, re.M):
        for target in (os.path.join(include_root, name), os.path.join(os.path.dirname(path), name)):
            if target in files and target != path:
                found.add(target)
    return found


def dependency_order(files, depends_on):
    """files (in sorted order) with each after the ones it depends on; a cycle is broken where the
    sorted order first enters it."""
    done, active, order = set(), set(), []

    def visit(f):
        if f in done or f in active:
            return
        active.add(f)
        for g in sorted(depends_on(f)):
            visit(g)
        active.discard(f)
        done.add(f)
        order.append(f)

    for f in files:
        visit(f)
    return order


def python_order(root, files, order):
    if order == "sorted":
        return files
    modules = {python_module(root, f): f for f in files}
    return dependency_order(files, lambda f: python_imports(root, f, modules))


def header_order(include_root, files, order):
    if order == "sorted":
        return files
    members = set(files)
    return dependency_order(files, lambda f: header_includes(f, include_root, members))


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
    ap.add_argument("--order", choices=("sorted", "dependency"), default="sorted",
                    help="the order of a document's files: sorted, or each after the files it imports or includes")
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
            parts = file_parts(a.root, python_order(a.root, files, a.order), "#")
            text = "\n".join(parts)
            write("eval" if name in held else "train", "python", name, text)
            if orders is not None and name in held and len(text) >= a.min_chars:
                # Drawn from the sorted order whatever --order is, so every --order evaluates the same
                # random orders.
                in_sorted = parts if a.order == "sorted" else file_parts(a.root, files, "#")
                for i in range(a.orders):
                    shuffled = list(in_sorted)  # the files read once; only their order is drawn
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
                files = header_order(headers, files, a.order)
                write("train", "c++", name, document(os.path.dirname(headers), files, "//"))
    for (which, source), (n, chars) in sorted(counts.items()):
        print(f"{which}: {n} {source} documents, {chars / 1e6:.1f} M characters")
    if not any(w == "train" for w, _ in counts) or not any(w == "eval" for w, _ in counts):
        sys.exit("code_documents.py: a split is empty: lower --min-chars or name other --eval-packages")


if __name__ == "__main__":
    main()
