#!/usr/bin/env python3
"""Mistral reference cases from HF transformers, for tests/model/test_mistral.cpp.

For each case: a small random MistralForCausalLM in float64 with a sliding window much shorter than
the sequence (seeded; norm weights drawn away from 1 so every path carries signal), with eager
attention (transformers' sliding-window mask: a query at i sees keys j with i - W < j <= i), saved
with save_pretrained (config.json, model.safetensors) into tests/data/mistral_reference/<case>/, and
beside it expected.safetensors: the token ids [B, T] (i32), transformers' logits [B*T, V], its
causal-LM loss [1] and the gradient of that loss for every parameter ("grad.<HF name>"), all float64.

As tests/data/qwen_reference.py: transformers' float32 RMSNorm and RoPE angles are patched to
float64 (the same formulas), and here also eager attention's softmax, which transformers computes in
float32 whatever the model's dtype (the Qwen cases run sdpa, which keeps float64); the loss is its
causal-LM loss written out in float64, so the C++ test can require agreement at float64 rounding. Printed per case: how far the unpatched model's
logits are from the patched ones, and how far the same weights without the window are (the window's
effect the test relies on).

Needs torch and transformers (recorded with transformers 5.24.0, torch 2.15.0, on the CPU):
    python3 tests/data/mistral_reference.py
"""
import json
import os
import sys

import torch
import transformers
from transformers import MistralConfig, MistralForCausalLM
from transformers.models.mistral import modeling_mistral

from hf_reference_common import draw_f64, loss_and_grads, patch, patch_eager, write_case

HERE = os.path.dirname(os.path.abspath(__file__))
B, T = 2, 24

CASES = {
    # A window of 5 on 24 tokens, head_dim 8 apart from hidden / heads = 4, GQA 2:1, untied.
    "window5": dict(
        vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e4,
        sliding_window=5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # A window of 7, head_dim = hidden / heads (absent from the config), one K/V head for 4, tied.
    "window7": dict(
        vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4,
        sliding_window=7, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}


PATCHED = [(modeling_mistral.MistralRMSNorm, modeling_mistral.MistralRotaryEmbedding)]


def main():
    for name, kw in CASES.items():
        torch.manual_seed(13)
        config = MistralConfig(**kw)
        config._attn_implementation = "eager"
        model = draw_f64(MistralForCausalLM(config))
        out_dir = os.path.join(HERE, "mistral_reference", name)
        ids = torch.randint(0, kw["vocab_size"], (B, T), dtype=torch.int64)

        patch(PATCHED, False)
        patch_eager(modeling_mistral, False)
        with torch.no_grad():
            hf_logits = model(input_ids=ids).logits
        patch(PATCHED, True)
        patch_eager(modeling_mistral, True)
        with torch.no_grad():
            model.config.sliding_window = None  # the same weights attending every earlier key
            unwindowed = model(input_ids=ids).logits
            model.config.sliding_window = kw["sliding_window"]
        logits, loss = loss_and_grads(model, ids)
        write_case(model, out_dir, ids, logits, loss)
        drift = float((hf_logits - logits).norm() / logits.norm())
        window_effect = float((unwindowed - logits).norm() / logits.norm())
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, loss {float(loss.detach()):.17g}, "
              f"transformers' own float32 RMSNorm/RoPE/softmax move the logits by {drift:.2e}, "
              f"no window moves them by {window_effect:.2e} (relative)")
        cfg = json.load(open(os.path.join(out_dir, "config.json")))
        print("  config.json:", {k: cfg[k] for k in ("model_type", "sliding_window", "head_dim") if k in cfg})
    print("transformers", transformers.__version__, "torch", torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
