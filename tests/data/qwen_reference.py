#!/usr/bin/env python3
"""Qwen2 and Qwen3 reference cases from HF transformers, for tests/model/test_qwen.cpp.

For each case: a small random Qwen2ForCausalLM / Qwen3ForCausalLM (and a LlamaForCausalLM with
attention_bias, whose o_proj has a bias too) in float64 (seeded; biases and norm
weights drawn away from 0 and 1 so every path carries signal), saved with save_pretrained (config.json,
model.safetensors) into tests/data/qwen_reference/<case>/, and beside it expected.safetensors: the
token ids [B, T] (i32), transformers' logits [B*T, V], its causal-LM loss [1] and the gradient of that
loss for every parameter ("grad.<HF name>"), all float64.

transformers computes RMSNorm, RoPE's angles and its causal-LM loss (the logits upcast to float32) in
float32 even in a float64 model; here RMSNorm and RoPE are patched to float64 (the same formulas) and
the loss is that causal-LM loss written out in float64 (cross-entropy of the logits at t against the
id at t + 1, mean over B (T - 1)), so the C++ test can require agreement at float64 rounding.
The unpatched model's logits differ from the patched ones by about 1e-7 relative (printed).

Needs torch and transformers (recorded with transformers 5.24.0, torch 2.15.0, on the CPU):
    python3 tests/data/qwen_reference.py
"""
import json
import os
import sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from hf_reference_common import draw_f64, loss_and_grads, patch, write_case

HERE = os.path.dirname(os.path.abspath(__file__))
B, T = 2, 12

CASES = {
    # Qwen2: q/k/v biases, tied embeddings, head_dim = hidden / heads.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
    # Qwen3: per-head q/k norms, head_dim 8 apart from hidden / heads = 4, untied.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_id=2)),
    # Llama with attention_bias: biases on q, k, v and o_proj.
    "llama_bias": (LlamaConfig, LlamaForCausalLM, dict(
        vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e4,
        tie_word_embeddings=False, attention_bias=True, bos_token_id=1, eos_token_id=2)),
}


PATCHED = [(modeling_llama.LlamaRMSNorm, modeling_llama.LlamaRotaryEmbedding),
           (modeling_qwen2.Qwen2RMSNorm, modeling_qwen2.Qwen2RotaryEmbedding),
           (modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.Qwen3RotaryEmbedding)]


def main():
    for name, (config_cls, model_cls, kw) in CASES.items():
        torch.manual_seed(11)
        model = draw_f64(model_cls(config_cls(**kw)))
        out_dir = os.path.join(HERE, "qwen_reference", name)
        ids = torch.randint(0, kw["vocab_size"], (B, T), dtype=torch.int64)

        patch(PATCHED, False)
        with torch.no_grad():
            hf_logits = model(input_ids=ids).logits
        patch(PATCHED, True)
        logits, loss = loss_and_grads(model, ids)
        write_case(model, out_dir, ids, logits, loss)
        drift = float((hf_logits - logits).norm() / logits.norm())
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, loss {float(loss.detach()):.17g}, "
              f"transformers' own float32 RMSNorm/RoPE move the logits by {drift:.2e} (relative)")
        cfg = json.load(open(os.path.join(out_dir, "config.json")))
        print("  config.json keys:", sorted(cfg))
    print("transformers", transformers.__version__, "torch", torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
