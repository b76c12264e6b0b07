#!/usr/bin/env python3
"""chunkwise's tokenizer against llama.cpp's own vocabulary tests.

llama.cpp keeps, in its models/ folder, small GGUF files holding only a model's vocabulary
(ggml-vocab-<name>.gguf) and, beside most, test texts (<file>.inp: texts each followed by the line
"__ggml_vocab_test__") with the ids llama.cpp's tokenizer test expects of each (<file>.out: one line
of ids per text, no BOS, special tokens not parsed). For every such pair this script runs
`chunkwise encode --tokenizer <file> --text-file <file>.inp --separator '\\n__ggml_vocab_test__\\n'`
and compares the ids text by text. A vocabulary chunkwise refuses (a tokenizer model or a
pre-tokenizer this build does not have) is listed with the refusal's first line, and a file that is
not a GGUF file (a git LFS pointer in a checkout without LFS) as such; neither is a failure. Exits 1
when a vocabulary chunkwise reads gives other ids for some text.

  python3 tools/data/llama_cpp_vocab_check.py --llama-cpp ~/src/llama.cpp [--chunkwise build/tools/chunkwise]

Standard library only; the vocabularies stay in the llama.cpp checkout (they are its test data).
"""
import argparse
import glob
import os
import subprocess
import sys

SEPARATOR = "\n__ggml_vocab_test__\n"


def expected_ids(out_path):
    """The ids of each text: one line each, space separated (llama.cpp writes a space first)."""
    with open(out_path, encoding="utf-8") as f:
        return [line.split() for line in f.read().split("\n")[:-1]]


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", required=True, help="a llama.cpp checkout (its models/ folder is read)")
    parser.add_argument("--chunkwise", default=os.path.join(root, "build", "tools", "chunkwise"))
    args = parser.parse_args()

    vocabularies = sorted(glob.glob(os.path.join(args.llama_cpp, "models", "ggml-vocab-*.gguf")))
    if not vocabularies:
        sys.exit(f"{args.llama_cpp}/models holds no ggml-vocab-*.gguf: give the root of a llama.cpp checkout")
    mismatched = 0
    for gguf in vocabularies:
        name = os.path.basename(gguf)[len("ggml-vocab-"):-len(".gguf")]
        if not (os.path.exists(gguf + ".inp") and os.path.exists(gguf + ".out")):
            print(f"{name}: no test texts beside it")
            continue
        with open(gguf, "rb") as f:
            if f.read(4) != b"GGUF":
                print(f"{name}: not a GGUF file (a git LFS pointer?)")
                continue
        run = subprocess.run([args.chunkwise, "encode", "--tokenizer", gguf, "--text-file", gguf + ".inp",
                              "--separator", SEPARATOR], capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{name}: refused: {run.stderr.strip().splitlines()[0] if run.stderr.strip() else run.returncode}")
            continue
        got = [line.split() for line in run.stdout.split("\n")[:-1]]
        want = expected_ids(gguf + ".out")
        with open(gguf + ".inp", encoding="utf-8", newline="") as f:
            texts = f.read().split(SEPARATOR)[:-1]
        if len(got) != len(want):
            print(f"{name}: MISMATCH: {len(got)} texts encoded, {len(want)} expected")
            mismatched += 1
            continue
        differ = [i for i in range(len(want)) if got[i] != want[i]]
        print(f"{name}: {len(want) - len(differ)} of {len(want)} texts give llama.cpp's ids"
              + ("" if not differ else " (MISMATCH)"))
        for i in differ[:3]:
            print(f"  text {i} {texts[i]!r}:\n    chunkwise {' '.join(got[i])}\n    llama.cpp {' '.join(want[i])}")
        mismatched += bool(differ)
    sys.exit(1 if mismatched else 0)


if __name__ == "__main__":
    main()
