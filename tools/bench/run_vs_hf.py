#!/usr/bin/env python3
"""A training run's exported checkpoint in HF transformers and in chunkwise: the same model.

For a run directory's checkpoint (the newest complete one, or --step N), an HF model directory
(config.json, model.safetensors and, for a BPE tokenizer, tokenizer.json + tokenizer_config.json):

  1. config: transformers reads config.json; when the run started from a .gguf file (model.source in
     the run's config.toml), the fields that decide the computation must equal those of the config
     transformers' GGUF loader makes of that file (AutoConfig.from_pretrained(dir, gguf_file=...)); where
     the run's [rope] section chose a RoPE scaling (a context extension), the RoPE type is that one and
     max_position_embeddings the original's times the factor.
  2. tokenizer (when the checkpoint has one): AutoTokenizer.from_pretrained(checkpoint) and
     `chunkwise encode --tokenizer checkpoint` give the same ids for every line of the text.
  3. logits: AutoModelForCausalLM.from_pretrained(checkpoint, dtype=float32) and `chunkwise logits
     --model checkpoint --dtype f32` on the same tokens (the text's ids, or seeded random ids without
     a tokenizer): max_abs_err, and the largest |difference| relative to its row's largest |logit|.

Exit status 1 if a config field or a token id differs, or the relative logit error exceeds --max-rel.

    /opt/torch/.venv/bin/python tools/bench/run_vs_hf.py runs/finetune-smollm2 [--chunkwise build/tools/chunkwise]

Needs torch, transformers, safetensors, numpy (and gguf for step 1 with a GGUF source); CPU is enough.
"""
import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

# One line each (chunkwise encode reads lines); the logits batch is their ids, joined by blank lines.
TEXT = [
    "The Jargon File is a comprehensive compendium of hacker slang illuminating many aspects of hackish tradition.",
    ":kluge: /klooj/ n. A clever programming trick intended to solve a particular nasty case in an expedient way.",
    "    def fibonacci(n):  return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\t# spaces, a tab",
    "Numbers 12345 and 3.14159, symbols <|im_start|> and <|endoftext|>, accents: café, naïve, Zürich.",
]

# Fields of LlamaConfig that decide what the model computes or how it is driven.
FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
          "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act"]


def checkpoint_of(run_dir, step):
    if step:
        path = os.path.join(run_dir, f"step-{step:06d}")
    else:
        steps = sorted(d for d in os.listdir(run_dir) if re.fullmatch(r"step-\d+", d)
                       and os.path.exists(os.path.join(run_dir, d, "manifest.json")))
        if not steps:
            sys.exit(f"{run_dir}: no complete checkpoint (step-N/ with manifest.json)")
        path = os.path.join(run_dir, steps[-1])
    if not os.path.exists(os.path.join(path, "config.json")):
        sys.exit(f"{path}: no config.json")
    return path


def model_source(run_dir):
    """model.source of the run's config.toml."""
    text = open(os.path.join(run_dir, "config.toml")).read()
    try:
        import tomllib
        return tomllib.loads(text)["model"]["source"]
    except ImportError:
        m = re.search(r'^\[model\][^\[]*?^source = "((?:[^"\\]|\\.)*)"', text, re.M | re.S)
        return m.group(1) if m else ""


def run_rope(run_dir):
    """The run's [rope] section (config.toml): RoPE scaling the run chose over the model's own."""
    try:
        import tomllib
        return tomllib.loads(open(os.path.join(run_dir, "config.toml")).read()).get("rope", {})
    except ImportError:
        return {}


def rope(c):
    """RoPE settings in either transformers form (v4 rope_theta / rope_scaling, v5 rope_parameters)."""
    p = getattr(c, "rope_parameters", None)
    if p:
        return {"rope_theta": float(p.get("rope_theta")), "rope_type": p.get("rope_type", "default")}
    scaling = getattr(c, "rope_scaling", None) or {}
    return {"rope_theta": float(c.rope_theta), "rope_type": scaling.get("rope_type", "default")}


def compare_configs(ours, theirs, chosen_rope):
    """Fields that differ. chosen_rope: the run's [rope] section; where it sets a type, the checkpoint's
    RoPE type is that one and its context the original's times the factor (what the run trained for),
    not the GGUF's."""
    bad = []
    expected_rope = rope(theirs)
    expected_context = getattr(theirs, "max_position_embeddings", None)
    if chosen_rope.get("type"):
        expected_rope = dict(expected_rope, rope_type=chosen_rope["type"])
        original = chosen_rope.get("original_max_position_embeddings", expected_context)
        expected_context = int(original * chosen_rope.get("factor", 1.0))
    for f in FIELDS:
        a, b = getattr(ours, f, None), getattr(theirs, f, None)
        if f == "max_position_embeddings":
            b = expected_context
        if f == "head_dim" and b is None:
            b = theirs.hidden_size // theirs.num_attention_heads
        if isinstance(a, list) and len(a) == 1:
            a = a[0]
        if isinstance(b, list) and len(b) == 1:
            b = b[0]
        if a != b:
            bad.append(f"{f}: checkpoint {a!r}, expected {b!r}")
    if rope(ours) != expected_rope:
        bad.append(f"rope: checkpoint {rope(ours)}, expected {expected_rope}")
    return bad


def chunkwise(exe, *args):
    r = subprocess.run([exe, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {exe} {' '.join(args)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--step", type=int, default=0, help="checkpoint step (default: the newest complete)")
    ap.add_argument("--chunkwise", default="build/tools/chunkwise")
    ap.add_argument("--tokens", type=int, default=96, help="tokens of the logits batch")
    ap.add_argument("--max-rel", type=float, default=1e-4,
                    help="largest accepted |difference| / max|logit| of a row (both f32)")
    args = ap.parse_args()
    ckpt = checkpoint_of(args.run_dir, args.step)
    print(f"checkpoint {ckpt}; transformers {__import__('transformers').__version__}, torch {torch.__version__}")
    failed = False

    ours = AutoConfig.from_pretrained(ckpt)
    source = model_source(args.run_dir)
    if source.endswith(".gguf"):
        path = source if os.path.isabs(source) else os.path.join(os.getcwd(), source)
        try:
            theirs = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
            chosen_rope = run_rope(args.run_dir)
            bad = compare_configs(ours, theirs, chosen_rope)
            chosen = f" (RoPE as the run's [rope] chose: {chosen_rope})" if chosen_rope.get("type") else ""
            print(f"config against transformers' GGUF loader on {source}{chosen}: "
                  + ("the same " + ", ".join(FIELDS) + ", rope" if not bad else "DIFFERENT: " + "; ".join(bad)))
            failed = failed or bool(bad)
        except Exception as e:  # the gguf package missing, or the file moved: say so, do not fail the rest
            print(f"config against the GGUF loader: skipped ({type(e).__name__}: {e})")

    with tempfile.TemporaryDirectory() as tmp:
        tok = None
        if os.path.exists(os.path.join(ckpt, "tokenizer.json")):
            try:
                tok = AutoTokenizer.from_pretrained(ckpt)
            except Exception as e:  # the checkpoint's tokenizer must load: a failure, but the logits still run
                print(f"tokenizer: AutoTokenizer cannot load {ckpt}: FAILED ({type(e).__name__}: {e})")
                failed = True
        if tok is not None:
            lines = os.path.join(tmp, "lines.txt")
            with open(lines, "w") as f:
                f.write("\n".join(TEXT) + "\n")
            ours_ids = [[int(x) for x in line.split()] for line in
                        chunkwise(args.chunkwise, "encode", "--tokenizer", ckpt, "--text-file", lines).splitlines()]
            hf_ids = [tok(line, add_special_tokens=False)["input_ids"] for line in TEXT]
            same = ours_ids == hf_ids
            failed = failed or not same
            print(f"tokenizer: AutoTokenizer and chunkwise encode on {len(TEXT)} lines: "
                  f"{'identical ids' if same else 'DIFFERENT ids'}")
            reps = 4  # the text repeated until it fills --tokens (past a short model's context, for RoPE scaling)
            ids = tok("\n\n".join(TEXT * reps), add_special_tokens=True)["input_ids"]
            while len(ids) < args.tokens:
                reps *= 2
                ids = tok("\n\n".join(TEXT * reps), add_special_tokens=True)["input_ids"]
            ids = ids[:args.tokens]
        else:
            ids = np.random.default_rng(7).integers(0, ours.vocab_size, args.tokens).tolist()
            print("logits batch: seeded random ids (no tokenizer in the checkpoint, or none that loads)")

        path = os.path.join(tmp, "ids.u32")
        with open(path, "wb") as f:
            f.write(struct.pack(f"<{len(ids)}I", *ids))
        out = os.path.join(tmp, "logits.safetensors")
        chunkwise(args.chunkwise, "logits", "--model", ckpt, "--tokens", path, "--batch", "1", "--seq",
                  str(len(ids)), "--dtype", "f32", "--out", out)
        mine = load_file(out)["logits"].astype(np.float64)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double().numpy()
    diff = np.abs(mine - ref)
    max_abs = float(diff.max())
    max_rel = float((diff.max(axis=1) / np.abs(ref).max(axis=1)).max())
    failed = failed or max_rel > args.max_rel
    print(f"logits on {len(ids)} tokens, f32 both: max_abs_err={max_abs:.3e} max_rel_err={max_rel:.3e} "
          f"(limit {args.max_rel:g}); tied embeddings: {model.config.tie_word_embeddings}")
    print(json.dumps({"checkpoint": ckpt, "max_abs_err": max_abs, "max_rel_err": max_rel, "ok": not failed}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
