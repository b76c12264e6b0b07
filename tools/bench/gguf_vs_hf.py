#!/usr/bin/env python3
"""A GGUF model through chunkwise and through HF transformers' GGUF loader: logits and greedy continuations.

transformers reads the file with its own loader (the `gguf` package dequantizes, its
LlamaTensorProcessor undoes the Q/K row permutation); `chunkwise logits --model FILE.gguf` reads it
with model/gguf.h and model/gguf_llama.h. Both then compute logits on the same token ids:

  1. logits of each prompt, chunkwise f64 against HF float64 and chunkwise f32 against HF float32:
     the worst absolute and relative (to the row's largest |logit|) difference;
  2. greedy continuations of each prompt (argmax, --new-tokens ids), computed step by step by each side
     on its own previous choices: they must be identical. The smallest top-1/top-2 logit gap seen is
     printed (a tie closer than the f32 floor would make a difference legitimate).

Prompts are text, turned into ids by the tokenizer transformers builds from the same GGUF (chunkwise
gets the ids, not the text), or --ids "1,2,3;4,5" directly. Exit status 1 if a continuation differs
or a logit difference exceeds --max-rel.

    python3 tools/bench/gguf_vs_hf.py --gguf .models/SmolLM2-135M-Instruct.Q4_1.gguf

Needs torch, transformers and gguf (tools/bench/README.md); runs on the CPU.
"""
import argparse
import os
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]


def chunkwise_logits(exe, gguf, ids, dtype, tmp):
    tok = os.path.join(tmp, "ids.u32")
    with open(tok, "wb") as f:
        f.write(struct.pack(f"<{len(ids)}I", *ids))
    out = os.path.join(tmp, "logits.safetensors")
    cmd = [exe, "logits", "--model", gguf, "--tokens", tok, "--batch", "1", "--seq", str(len(ids)),
           "--dtype", dtype, "--out", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return load_file(out)["logits"].astype(np.float64)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def greedy(step, ids, n):
    """n argmax steps of step(ids) -> logits rows; returns the new ids and the smallest top-2 gap."""
    ids, gap = list(ids), float("inf")
    for _ in range(n):
        last = step(ids)[-1]
        top2 = np.sort(last)[-2:]
        gap = min(gap, float(top2[1] - top2[0]))
        ids.append(int(np.argmax(last)))
    return ids, gap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--chunkwise", default="build/tools/chunkwise")
    ap.add_argument("--ids", default="", help="token id lists instead of the text prompts: '1,2,3;4,5'")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--max-rel", type=float, default=1e-4,
                    help="largest accepted |difference| / max|logit| of a row (f32 side)")
    args = ap.parse_args()
    gguf = os.path.abspath(args.gguf)
    d, name = os.path.split(gguf)

    t0 = time.perf_counter()
    hf32 = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    t_hf = time.perf_counter() - t0
    hf64 = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).double().eval()
    if args.ids:
        prompts = [[int(x) for x in p.split(",")] for p in args.ids.split(";")]
    else:
        tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=name)
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    print(f"transformers {__import__('transformers').__version__}, torch {torch.__version__}; "
          f"HF GGUF load {t_hf:.1f} s")

    failed = False
    worst = {"f64": (0.0, 0.0), "f32": (0.0, 0.0)}
    with tempfile.TemporaryDirectory() as tmp:
        for ids in prompts:
            row = []
            for dtype, model in (("f64", hf64), ("f32", hf32)):
                ours = chunkwise_logits(args.chunkwise, gguf, ids, dtype, tmp)
                ref = hf_logits(model, ids)
                diff = np.abs(ours - ref)
                abs_err = float(diff.max())
                rel_err = float((diff.max(axis=1) / np.abs(ref).max(axis=1)).max())
                worst[dtype] = (max(worst[dtype][0], abs_err), max(worst[dtype][1], rel_err))
                row.append(f"{dtype}: max abs {abs_err:.2e}, max rel {rel_err:.2e}")
                if dtype == "f32" and rel_err > args.max_rel:
                    failed = True
            print(f"prompt {ids[:8]}{'...' if len(ids) > 8 else ''} ({len(ids)} ids): " + "; ".join(row))

            ours, gap_ours = greedy(lambda s: chunkwise_logits(args.chunkwise, gguf, s, "f32", tmp), ids,
                                    args.new_tokens)
            theirs, gap_hf = greedy(lambda s: hf_logits(hf32, s), ids, args.new_tokens)
            same = ours == theirs
            failed = failed or not same
            print(f"  greedy {args.new_tokens}: {'identical' if same else 'DIFFERENT'} "
                  f"(smallest top-2 gap: ours {gap_ours:.3g}, HF {gap_hf:.3g})")
            print(f"  chunkwise: {ours[len(ids):]}")
            if not same:
                print(f"  HF:        {theirs[len(ids):]}")
            elif not args.ids:
                print(f"  text: {tokenizer.decode(ours[len(ids):])!r}")
    print(f"worst over all prompts: f64 max abs {worst['f64'][0]:.2e} max rel {worst['f64'][1]:.2e}; "
          f"f32 max abs {worst['f32'][0]:.2e} max rel {worst['f32'][1]:.2e}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
