#!/usr/bin/env python3
"""chunkwise against HF transformers on the same checkpoint and tokens.

For each case: `chunkwise init` writes a random HF checkpoint; transformers loads it
(AutoModelForCausalLM.from_pretrained: Llama, Qwen2 with its q/k/v biases, Qwen3 with its per-head norms,
Mistral with its sliding window, Gemma 2 with its caps, sliding and global layers and post-norms) and computes logits, the causal-LM loss and its gradients in
float64; `chunkwise logits` and `chunkwise gradcheck --save-grads` compute the same on the CPU in f64
(the gradients through SeCO). Prints one row per case: the worst relative logit and gradient errors.
The cases cover llama3, yarn (truncated or not, with mscale) and dynamic-NTK RoPE scaling; for dynamic
HF's single forward over T tokens recomputes its frequencies for T, as chunkwise's tables of length T.

Expected agreement: HF computes RoPE's angles in float32 even for a float64 model, so agreement is at
float32 precision of the angles (~1e-6 relative), not 1e-15. Run on a machine with torch and
transformers (the GPU machine); chunkwise itself never imports them.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def rel(a, b):
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunkwise", default="build/tools/chunkwise")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    torch.manual_seed(0)
    # (name, preset, tie, B, T, RoPE): RoPE, when given, replaces the config.json's max_position_embeddings
    # and rope_scaling after `chunkwise init` (RoPE has no weights), with scalings that bite at T tokens.
    cases = [
        ("tiny untied, llama3 rope", "tiny", 0, 2, 40, None),
        ("tiny tied", "tiny", 1, 2, 40, None),
        ("small (byte demo shape)", "small", -1, 1, 96, None),
        ("small, yarn rope", "small", -1, 1, 96,
         {"max_position_embeddings": 256,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
        ("small, yarn untruncated, mscale", "small", -1, 1, 96,
         {"max_position_embeddings": 256,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0}}),
        ("tiny, dynamic rope", "tiny", 0, 2, 40,
         {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
        ("qwen2: q/k/v biases, tied", "tiny-qwen2", -1, 2, 40, None),
        ("qwen3: per-head q/k norms", "tiny-qwen3", -1, 2, 40, None),
        ("qwen3, tied", "tiny-qwen3", 1, 2, 40, None),
        ("mistral: a window of 5 keys", "tiny-mistral", -1, 2, 40, None),
        ("mistral, tied", "tiny-mistral", 1, 2, 40, None),
        ("gemma2: caps, window, post-norms", "tiny-gemma2", -1, 2, 40, None),
        ("gemma2, untied", "tiny-gemma2", 0, 2, 40, None),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, model, tie, B, T, rope) in enumerate(cases):
            d = os.path.join(tmp, f"m{i}-{model}-{tie}")
            cmd = [args.chunkwise, "init", "--model", model, "--out", d, "--dtype", "f64", "--seed", "7",
                   "--norm-jitter", "0.1"]
            if tie >= 0:
                cmd += ["--tie-embeddings", str(tie)]
            run(cmd)
            cfg = json.load(open(os.path.join(d, "config.json")))
            if rope:
                cfg.update(rope)
                with open(os.path.join(d, "config.json"), "w") as f:
                    json.dump(cfg, f, indent=2)
            # Ids other than the padding id as transformers resolves it (Gemma2Config's default is 0 when
            # config.json has none): its nn.Embedding gives that row no gradient from the input, and
            # chunkwise does not single it out (docs/model_families.md).
            pad = AutoConfig.from_pretrained(d).pad_token_id
            ids = torch.randint(0, cfg["vocab_size"] - (pad is not None), (B, T), dtype=torch.int64)
            if pad is not None:
                ids[ids >= pad] += 1
            tok = os.path.join(tmp, "tokens.u32")
            with open(tok, "wb") as f:
                f.write(struct.pack(f"<{B*T}I", *ids.flatten().tolist()))
            lg = os.path.join(tmp, "logits.safetensors")
            run([args.chunkwise, "logits", "--model", d, "--tokens", tok, "--batch", str(B), "--seq", str(T),
                 "--dtype", "f64", "--chunk", "7", "--out", lg])
            gr = os.path.join(tmp, "grads.safetensors")
            run([args.chunkwise, "gradcheck", "--model", d, "--tokens", tok, "--batch", str(B), "--seq", str(T),
                 "--dtype", "f64", "--schedule", "seco", "--chunk", "7", "--bwd-chunk", "5", "--save-grads", gr])
            ours_logits = load_file(lg)["logits"].view(B, T, -1)
            ours_grads = load_file(gr)

            hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager")
            out = hf(input_ids=ids, labels=ids)
            out.loss.backward()
            logit_err = rel(ours_logits, out.logits.detach())
            loss_err = abs(float(ours_grads["loss"][0]) - float(out.loss)) / float(out.loss)
            grad_err, worst = 0.0, ""
            for pname, p in hf.named_parameters():
                key = pname if pname in ours_grads else None
                if key is None:
                    continue
                e = rel(ours_grads[key], p.grad)
                if e > grad_err:
                    grad_err, worst = e, key
            missing = [n for n, _ in hf.named_parameters() if n not in ours_grads]
            rows.append((name, logit_err, loss_err, grad_err, worst, missing))
    print(f"{'case':<32} {'logits rel':>11} {'loss rel':>10} {'grads rel':>10}  worst tensor")
    for name, le, lo, ge, worst, missing in rows:
        print(f"{name:<32} {le:>11.2e} {lo:>10.2e} {ge:>10.2e}  {worst}" + (f"  MISSING {missing}" if missing else ""))
    ok = all(le < 1e-5 and ge < 1e-5 and not m for _, le, _, ge, _, m in rows)
    print("hf_compare:", "PASS" if ok else "FAIL", "(tolerance 1e-5: HF's float32 RoPE angles)")
    with open(os.path.join(args.out, "hf_compare.json"), "w") as f:
        json.dump([dict(case=r[0], logits_rel=r[1], loss_rel=r[2], grads_rel=r[3], worst=r[4]) for r in rows], f,
                  indent=2)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
