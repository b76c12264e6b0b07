#!/usr/bin/env python3
"""Tokenizer throughput on one core: chunkwise's BPE against HF's fast tokenizer (a benchmark, not a test).

Both encode the same lines (the corpus of tokenizer_vs_hf.py: tests/data/tokenizer_corpus.txt, with
--debian the Debian license and copyright texts) with the same tokenizer.json, no special tokens
added, pinned to one CPU core (taskset), each for --passes passes in one process; only the encoding
is timed (not loading, not printing). HF runs `encode_batch` with TOKENIZERS_PARALLELISM=false (its
Rust loop, serial) and, for reference, `encode` per line from Python. The first pass of each starts
with an empty word cache; the best pass is reported as well. Both must produce the same number of
tokens (agreement itself is tokenizer_vs_hf.py's job).

  python3 tools/data/tokenizer_bench.py --tokenizer .models/smollm2 --debian
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import text_lines  # noqa: E402
import tokenizer_vs_hf  # noqa: E402  (its corpus)

HF_CHILD = r"""
import json, os, sys, time
from tokenizers import Tokenizer
path, text_file, passes, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tok = Tokenizer.from_file(path)
text = open(text_file, encoding="utf-8", newline="").read()
lines = text[:-1].split("\n") if text.endswith("\n") else text.split("\n")
out = []
for _ in range(passes):
    t0 = time.perf_counter()
    if mode == "batch":
        tokens = sum(len(e.ids) for e in tok.encode_batch(lines, add_special_tokens=False))
    else:
        tokens = sum(len(tok.encode(line, add_special_tokens=False).ids) for line in lines)
    out.append((time.perf_counter() - t0, tokens))
print(json.dumps(out))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--chunkwise", default=os.path.join(tokenizer_vs_hf.ROOT, "build", "tools", "chunkwise"))
    ap.add_argument("corpus", nargs="*",
                    default=[os.path.join(tokenizer_vs_hf.ROOT, "tests", "data", "tokenizer_corpus.txt")])
    ap.add_argument("--debian", action="store_true")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--core", default="0", help="the CPU core both run on (taskset -c)")
    args = ap.parse_args()

    lines = []
    for path in args.corpus:
        lines += text_lines.read_lines(path)
    if args.debian:
        lines += tokenizer_vs_hf.debian_lines()
    n_bytes = sum(len(line.encode("utf-8")) for line in lines)
    pin = ["taskset", "-c", args.core]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        text_file = os.path.join(tmp, "corpus.txt")
        with open(text_file, "w", encoding="utf-8", newline="") as f:
            f.writelines(line + "\n" for line in lines)
        run = subprocess.run(pin + [args.chunkwise, "encode", "--tokenizer", args.tokenizer, "--text-file", text_file,
                                    "--bench", str(args.passes)], capture_output=True, text=True, check=True)
        cw = json.loads(run.stdout)
        results["chunkwise"] = [(p["seconds"], cw["tokens"]) for p in cw["passes"]]
        for mode in ("batch", "per-line"):
            run = subprocess.run(pin + [sys.executable, "-c", HF_CHILD, tokenizer_vs_hf.tokenizer_json(args.tokenizer),
                                        text_file, str(args.passes), mode],
                                 capture_output=True, text=True, check=True, env=env)
            results[f"HF {mode}"] = json.loads(run.stdout)
    print(f"{len(lines)} lines, {n_bytes / 1e6:.2f} MB, one core ({' '.join(pin)}), {args.passes} passes")
    print(f"{'':22s} {'first pass':>28s} {'best pass':>28s}")
    for name, passes in results.items():
        tokens = passes[0][1]
        best = min(p[0] for p in passes)
        cells = [f"{tokens / s / 1e6:6.2f} M tok/s {n_bytes / 1e6 / s:6.2f} MB/s" for s in (passes[0][0], best)]
        print(f"{name:22s} {cells[0]:>28s} {cells[1]:>28s}   ({tokens} tokens)")
    counts = {name: passes[0][1] for name, passes in results.items()}
    if len(set(counts.values())) != 1:
        sys.exit(f"token counts differ: {counts}")


if __name__ == "__main__":
    main()
