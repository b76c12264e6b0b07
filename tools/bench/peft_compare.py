#!/usr/bin/env python3
"""chunkwise's LoRA adapters against HF PEFT on the same base and tokens.

For each case: `chunkwise init` writes a random HF base checkpoint; `chunkwise train` trains LoRA
adapters on it for a few steps (random tokens, so B moves away from PEFT's zero) and writes a
checkpoint holding PEFT's files (adapter_config.json, adapter_model.safetensors); then
  1. PEFT loads them: PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), checkpoint);
     every lora_A / lora_B it holds must equal the file's tensor of the same name (so the names map
     one to one and nothing was left at its initial value), and its logits (float64, eval mode: no
     dropout) are compared with `chunkwise logits --model base --adapter checkpoint` (f64, in chunks
     against the K/V store);
  2. `chunkwise merge` folds the adapters into the base (W + alpha/r B A): transformers loads the
     merged checkpoint without peft, and its logits and weights are compared with PEFT's
     merge_and_unload().
Prints one row per case and exits non-zero when any relative error exceeds --tol.

Expected agreement: HF computes RoPE's angles in float32 even for a float64 model (see
hf_compare.py), so logits agree to ~1e-7 relative, not 1e-15; merged weights to ~1e-16.
Run on a machine with torch and transformers (the GPU machine) and peft, installed or carried as a
wheel in .whl/ (`python3 -m pip download --no-deps -d .whl peft`); the trainer runs on the CPU
unless --train-device cuda. chunkwise itself never imports them.

  python3 tools/bench/peft_compare.py [--chunkwise build/tools/chunkwise] [--train-device cpu|cuda]
"""
import argparse
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))


def import_peft():
    """peft, installed, or from the wheels carried in .whl/ (peft-*.whl, and accelerate-*.whl if peft
    needs it and it is not installed), unpacked into a temporary directory on sys.path."""
    try:
        import peft  # noqa: F401
    except ImportError:
        wheels = [w for pattern in ("peft-*.whl", "accelerate-*.whl")
                  for w in sorted(glob.glob(os.path.join(HERE, "..", "..", ".whl", pattern)))[-1:]]
        if not any(os.path.basename(w).startswith("peft-") for w in wheels):
            sys.exit("peft is not importable and there is no .whl/peft-*.whl; run `python3 -m pip download "
                     "--no-deps -d .whl peft` where there is network and carry .whl")
        site = tempfile.mkdtemp(prefix="peft-site-")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site,
                            *wheels], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"installing {wheels} failed: {r.stderr.strip()[-400:]}")
        sys.path.insert(0, site)
    from peft import PeftModel
    return PeftModel


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def rel(a, b):
    return float((a - b).norm() / b.norm())


def write_u32(path, ids):
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{len(ids)}I", *ids))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunkwise", default="build/tools/chunkwise")
    ap.add_argument("--train-device", default="cpu", choices=["cpu", "cuda"],
                    help="where chunkwise trains the adapters (cpu: f64; cuda: bf16 with f32 master adapters)")
    ap.add_argument("--tol", type=float, default=1e-5, help="largest relative error allowed")
    args = ap.parse_args()
    PeftModel = import_peft()
    torch.manual_seed(0)
    # name, preset, targets, rank, alpha, dropout, tied
    cases = [
        ("q_proj,v_proj r8 a16 (the papers')", "tiny", "q_proj,v_proj", 8, 16, 0.05, 0),
        ("all-linear r4 a8, tied", "tiny", "all-linear", 4, 8, 0.0, 1),
        ("k_proj,o_proj,down_proj r2 (small shape)", "small", "k_proj,o_proj,down_proj", 2, 4, 0.1, -1),
    ]
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name, preset, targets, rank, alpha, dropout, tie in cases:
            base = os.path.join(tmp, f"base-{preset}-{tie}")
            cmd = [args.chunkwise, "init", "--model", preset, "--out", base, "--dtype", "f64", "--seed", "7",
                   "--norm-jitter", "0.1"]
            if tie >= 0:
                cmd += ["--tie-embeddings", str(tie)]
            run(cmd)
            vocab = json.load(open(os.path.join(base, "config.json")))["vocab_size"]
            train_tokens = os.path.join(tmp, "train.u32")
            write_u32(train_tokens, torch.randint(0, vocab, (4096,)).tolist())
            run_dir = os.path.join(tmp, f"run-{len(rows)}")
            steps = 6
            sets = {
                "model.source": base, "model.dtype": "f64" if args.train_device == "cpu" else "bf16",
                "train.device": args.train_device, "lora.rank": rank, "lora.alpha": alpha,
                "lora.dropout": dropout, "lora.targets": targets, "lora.seed": 5,
                "data.train": train_tokens, "data.format": "u32", "data.seq_len": 32, "data.batch_size": 2,
                "data.eval_fraction": 0, "eval.every": 0, "train.steps": steps, "optimizer.lr": 2e-2,
                "optimizer.warmup_steps": 0, "checkpoint.every": 0, "sample.tokens": 0, "log.plot": "false",
                "schedule.name": "seco", "schedule.chunk": 8,
            }
            cmd = [args.chunkwise, "train", "--run-dir", run_dir]
            for k, v in sets.items():
                cmd += ["--set", f"{k}={v}"]
            run(cmd)
            adapter = os.path.join(run_dir, f"step-{steps:06d}")

            B, T = 2, 40
            ids = torch.randint(0, vocab, (B, T), dtype=torch.int64)
            tok = os.path.join(tmp, "eval.u32")
            write_u32(tok, ids.flatten().tolist())
            lg = os.path.join(tmp, "logits.safetensors")
            run([args.chunkwise, "logits", "--model", base, "--adapter", adapter, "--tokens", tok, "--batch", str(B),
                 "--seq", str(T), "--dtype", "f64", "--chunk", "7", "--out", lg])
            ours = load_file(lg)["logits"].view(B, T, -1)

            hf = LlamaForCausalLM.from_pretrained(base, dtype=torch.float64, attn_implementation="eager")
            peft_model = PeftModel.from_pretrained(hf, adapter)
            peft_model.eval()
            # Every adapter tensor PEFT holds is the file's (PEFT inserts the adapter name "default").
            file_tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
            held = {k.replace(".default.", "."): v for k, v in peft_model.state_dict().items() if "lora_" in k}
            if set(held) != set(file_tensors):
                sys.exit(f"{name}: PEFT holds {sorted(set(held) ^ set(file_tensors))[:4]} that the file does not, or "
                         f"the reverse")
            tensor_err = max(rel(held[k].double(), file_tensors[k].double()) if file_tensors[k].norm() > 0 else
                             float(held[k].norm()) for k in file_tensors)
            with torch.no_grad():
                theirs = peft_model(input_ids=ids).logits
            logit_err = rel(ours, theirs)

            merged_dir = os.path.join(tmp, f"merged-{len(rows)}")
            run([args.chunkwise, "merge", "--model", base, "--adapter", adapter, "--out", merged_dir, "--dtype", "f64"])
            merged = LlamaForCausalLM.from_pretrained(merged_dir, dtype=torch.float64, attn_implementation="eager")
            with torch.no_grad():
                merged_logits = merged(input_ids=ids).logits
            merged_logit_err = rel(merged_logits, theirs)
            peft_merged = peft_model.merge_and_unload()
            theirs_w = dict(peft_merged.named_parameters())
            weight_err = max(rel(p.double(), theirs_w[n].double()) for n, p in merged.named_parameters())

            case_worst = max(tensor_err, logit_err, merged_logit_err, weight_err)
            worst = max(worst, case_worst)
            rows.append((name, tensor_err, logit_err, merged_logit_err, weight_err))

    print(f"{'case':<44} {'adapter tensors':>15} {'logits vs PEFT':>15} {'merged logits':>14} {'merged W':>10}")
    for name, t, l, m, w in rows:
        print(f"{name:<44} {t:>15.2e} {l:>15.2e} {m:>14.2e} {w:>10.2e}")
    print(f"worst relative error {worst:.2e} (tolerance {args.tol:.0e})")
    if worst > args.tol:
        sys.exit(1)


if __name__ == "__main__":
    main()
