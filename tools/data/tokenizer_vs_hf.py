#!/usr/bin/env python3
"""Agreement of chunkwise's BPE tokenizer with HF `tokenizers` on one vocabulary, line by line.

Every line of the corpus (lines end at '\\n', which is not encoded; no special tokens are added, but
special tokens written in the text are recognised, as HF does by default) is encoded by
`chunkwise encode --tokenizer T --text-file F` and by HF tokenizers loading the same tokenizer.json;
the script reports the lines and ids compared and every line whose ids differ (the first few in
full), and exits 1 on any mismatch.

The corpus: the files given (default tests/data/tokenizer_corpus.txt, the hand-made hard cases), and
with --debian the Debian text on this machine (/usr/share/common-licenses/*, /usr/share/doc/*/copyright),
and with --unicode-sweep every code point (but the surrogates and '\\n') in lines of 32 consecutive
ones, each line in three spellings: run together, space separated, and inside letters and digits.

  python3 tools/data/tokenizer_vs_hf.py --tokenizer .models/smollm2 --debian --unicode-sweep
  python3 tools/data/tokenizer_vs_hf.py --tokenizer .models/smollm2 --write-ids tests/data/tokenizer_corpus.smollm2.ids

--variant gpt2 / llama3 replaces the file's pre-tokenizer by GPT-2's (ByteLevel) or Llama 3's (its
Split regex, ByteLevel without regex, ignore_merges) on the same vocabulary, so those pre-tokenizers
are checked against HF without their (large, licensed) vocabularies.

--write-ids writes HF's ids of the corpus, one line of ids per line: the expected ids that
tests/model/test_tokenizer.cpp checks when the exported tokenizer is present.
Needs: pip install tokenizers; a built chunkwise (build/tools/chunkwise).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import text_lines  # noqa: E402  (the corpus's lines as chunkwise cuts them)

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
VARIANTS = {
    "gpt2": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "llama3": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tokenizer_json(spec):
    return os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec


def debian_lines():
    lines = []
    paths = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright"))
    for path in paths:
        if os.path.isfile(path):
            try:
                lines += open(path, encoding="utf-8").read().split("\n")
            except UnicodeDecodeError:
                pass  # not UTF-8: HF cannot take it as text
    return lines


def unicode_sweep_lines():
    points = [cp for cp in range(0x110000) if not (0xD800 <= cp <= 0xDFFF) and cp != 0x0A]
    lines = []
    for i in range(0, len(points), 32):
        chars = [chr(cp) for cp in points[i:i + 32]]
        lines.append("".join(chars))
        lines.append(" " + " ".join(chars))
        lines.append(" ".join(f"a{c}1 {c}{c}b" for c in chars))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, help="an HF tokenizer.json, or a directory holding one")
    ap.add_argument("--chunkwise", default=os.path.join(ROOT, "build", "tools", "chunkwise"))
    ap.add_argument("corpus", nargs="*", default=[os.path.join(ROOT, "tests", "data", "tokenizer_corpus.txt")])
    ap.add_argument("--debian", action="store_true", help="add the Debian license and copyright texts")
    ap.add_argument("--unicode-sweep", action="store_true", help="add every code point in three contexts")
    ap.add_argument("--write-ids", help="write HF's ids of the corpus here (one line per corpus line)")
    ap.add_argument("--variant", choices=["as-is", "gpt2", "llama3"], default="as-is",
                    help="the pre-tokenizer: the file's, or GPT-2's or Llama 3's on the same vocabulary")
    ap.add_argument("--show", type=int, default=5, help="mismatching lines printed in full")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    lines = []
    for path in args.corpus:
        lines += text_lines.read_lines(path)
    if args.debian:
        lines += debian_lines()
    if args.unicode_sweep:
        lines += unicode_sweep_lines()

    tmp_dir = tempfile.TemporaryDirectory()
    spec = args.tokenizer
    if args.variant != "as-is":
        spec = os.path.join(tmp_dir.name, f"tokenizer-{args.variant}.json")
        with open(tokenizer_json(args.tokenizer), encoding="utf-8") as f:
            j = json.load(f)
        j["pre_tokenizer"] = VARIANTS[args.variant]
        j["model"]["ignore_merges"] = args.variant == "llama3"
        with open(spec, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
    hf = Tokenizer.from_file(tokenizer_json(spec))
    t0 = time.perf_counter()
    expected = [e.ids for e in hf.encode_batch(lines, add_special_tokens=False)]
    hf_seconds = time.perf_counter() - t0
    if args.write_ids:
        with open(args.write_ids, "w") as f:
            f.writelines(" ".join(map(str, ids)) + "\n" for ids in expected)

    with tempfile.TemporaryDirectory() as tmp:
        text_file = os.path.join(tmp, "corpus.txt")
        with open(text_file, "w", encoding="utf-8", newline="") as f:
            f.writelines(line + "\n" for line in lines)
        t0 = time.perf_counter()
        run = subprocess.run([args.chunkwise, "encode", "--tokenizer", spec, "--text-file", text_file],
                             capture_output=True, text=True)
        cw_seconds = time.perf_counter() - t0
    if run.returncode != 0:
        sys.exit(f"chunkwise encode failed: {run.stderr.strip()}")
    got_lines = run.stdout.split("\n")[:-1]
    if len(got_lines) != len(lines):
        sys.exit(f"chunkwise encode printed {len(got_lines)} lines for {len(lines)} input lines")
    got = [[int(x) for x in line.split()] for line in got_lines]

    mismatches = [i for i in range(len(lines)) if got[i] != expected[i]]
    n_ids = sum(len(ids) for ids in expected)
    n_bytes = sum(len(line.encode("utf-8")) for line in lines)
    print(f"tokenizer {tokenizer_json(args.tokenizer)} (pre-tokenizer: {args.variant}): {len(lines)} lines, {n_bytes} bytes, {n_ids} HF ids compared; "
          f"{len(mismatches)} lines differ")
    print(f"(wall time with process start and id printing, not a benchmark: HF {hf_seconds:.2f} s, "
          f"chunkwise {cw_seconds:.2f} s)")
    for i in mismatches[:args.show]:
        print(f"line {i + 1}: {lines[i]!r}\n  HF:        {expected[i]}\n  chunkwise: {got[i]}\n"
              f"  HF tokens: {hf.encode(lines[i], add_special_tokens=False).tokens}")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
