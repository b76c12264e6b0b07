#!/usr/bin/env python3
"""Gemma 2 reference cases from HF transformers, for tests/model/test_gemma2.cpp.

For each case: a small random Gemma2ForCausalLM in float64 (seeded; norm weights drawn away from 0, so
the (1 + w) of Gemma's RMSNorm is not the identity and every path carries signal), with eager
attention (transformers' Gemma 2 eager attention: scores scaled by query_pre_attn_scalar^-1/2 and
capped, cap tanh(s / cap), before the mask; sliding layers masked as Mistral's window), saved with
save_pretrained (config.json, model.safetensors) into tests/data/gemma2_reference/<case>/, and beside
it expected.safetensors: the token ids [B, T] (i32), transformers' logits [B*T, V] (capped), its
causal-LM loss [1] and the gradient of that loss for every parameter ("grad.<HF name>"), all float64.
The ids avoid pad_token_id (0, as Gemma's): transformers gives that embedding row no gradient from the
input (nn.Embedding's padding_idx), a rule of its own that chunkwise does not follow for any family.

As tests/data/mistral_reference.py (hf_reference_common.py): transformers' float32 RoPE angles and
eager softmax are patched to float64 (the same formulas), and here Gemma2RMSNorm, which computes in
float32 whatever the model's dtype, as x rsqrt(mean x^2 + eps) (1 + w) in float64. The embedding's
normaliser is a float32 buffer in transformers (sqrt(hidden_size) rounded to float32, then cast to the
weights' dtype); it is set to the float64 root here, as chunkwise multiplies by it in f64. Printed per
case: how far the unpatched model's logits are from the patched ones (its float32 norms, angles,
softmax and normaliser), and how far the same weights are without the caps and without the window
(the effects the test relies on).

Needs torch and transformers (recorded with transformers 5.24.0, torch 2.15.0, on the CPU):
    python3 tests/data/gemma2_reference.py
"""
import json
import os
import sys

import torch
import transformers
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.models.gemma2 import modeling_gemma2

from hf_reference_common import draw_f64, loss_and_grads, patch_eager, rotary_f64, write_case

HERE = os.path.dirname(os.path.abspath(__file__))
B, T = 2, 24

CASES = {
    # Both caps on and small (5 against scores of about 3, 3 against logits of about 2: tanh far from
    # linear), a window of 5 on 24 tokens on layer 0 (transformers' rule without layer_types: the
    # even layers slide), layer 1 global; head_dim 8 apart from hidden / heads = 6 and
    # query_pre_attn_scalar 6 apart from head_dim; GQA 2:1; tied embeddings (Gemma's default). A width
    # of 24, whose root is no float32 number (the normaliser's rounding shows).
    "caps_window": dict(
        vocab_size=48, hidden_size=24, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=6, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1e4, sliding_window=5, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # layer_types given (global, sliding, sliding) with a window of 3, attention_bias (q, k, v and
    # o_proj biases, o's before the post-norm), untied, caps 5 and 3, head_dim 4 apart from hidden /
    # heads = 5.
    "layer_types": dict(
        vocab_size=40, hidden_size=20, intermediate_size=20, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, query_pre_attn_scalar=4, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1e4, sliding_window=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], attention_bias=True,
        tie_word_embeddings=False, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, bos_token_id=1,
        eos_token_id=2, pad_token_id=0),
    # No caps (null, as a config.json may give them): Gemma 2's norms, gelu, scaled embeddings,
    # query_pre_attn_scalar and a window of 9 on layer 0; one K/V head for four query heads.
    # (transformers' Gemma 2 needs a window: null is refused in its mask, and by chunkwise's reader.)
    "no_caps": dict(
        vocab_size=48, hidden_size=24, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1e4, sliding_window=9, attn_logit_softcapping=None,
        final_logit_softcapping=None, bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def gemma_rmsnorm_f64(self, x):
    """Gemma2RMSNorm (x r (1 + w)) in the input's dtype rather than float32."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return x * r * (1.0 + self.weight)


def patch_gemma(on):
    for cls, fn in ((modeling_gemma2.Gemma2RMSNorm, gemma_rmsnorm_f64),
                    (modeling_gemma2.Gemma2RotaryEmbedding, rotary_f64)):
        if not hasattr(cls, "_hf_forward"):
            cls._hf_forward = cls.forward
        cls.forward = fn if on else cls._hf_forward
    patch_eager(modeling_gemma2, on)


def logits_with(model, ids, **config):
    """The logits with the model's config changed for one forward (no gradients), then restored."""
    saved = {k: getattr(model.config, k) for k in config}
    for k, v in config.items():
        setattr(model.config, k, v)
    for layer in model.model.layers:  # Gemma2Attention copies these when it is built
        if "attn_logit_softcapping" in config:
            layer.self_attn.attn_logit_softcapping = config["attn_logit_softcapping"]
    with torch.no_grad():
        out = model(input_ids=ids).logits
    for k, v in saved.items():
        setattr(model.config, k, v)
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = model.config.attn_logit_softcapping
    return out


def main():
    for name, kw in CASES.items():
        torch.manual_seed(13)
        config = Gemma2Config(**kw)
        config._attn_implementation = "eager"
        model = draw_f64(Gemma2ForCausalLM(config))
        f32_scale = model.model.embed_tokens.embed_scale.clone()
        out_dir = os.path.join(HERE, "gemma2_reference", name)
        # Ids from 1 on: transformers' embedding gives the row of pad_token_id (0, Gemma's) no gradient
        # from its input (nn.Embedding's padding_idx), which chunkwise does not single out.
        ids = torch.randint(1, kw["vocab_size"], (B, T), dtype=torch.int64)

        patch_gemma(False)
        with torch.no_grad():
            hf_logits = model(input_ids=ids).logits
        patch_gemma(True)
        with torch.no_grad():
            model.model.embed_tokens.embed_scale.fill_(kw["hidden_size"] ** 0.5)
        effects = {}
        if kw.get("attn_logit_softcapping") or kw.get("final_logit_softcapping"):
            effects["no caps"] = logits_with(model, ids, attn_logit_softcapping=None, final_logit_softcapping=None)
        if kw.get("sliding_window"):
            effects["no window"] = logits_with(model, ids, sliding_window=10 ** 6)
        logits, loss = loss_and_grads(model, ids)
        write_case(model, out_dir, ids, logits, loss)
        drift = float((hf_logits - logits).norm() / logits.norm())
        effect = ", ".join(f"{what} moves them by {float((l - logits).norm() / logits.norm()):.2e}"
                           for what, l in effects.items())
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, loss {float(loss.detach()):.17g}, "
              f"transformers' own float32 norms/RoPE/softmax and normaliser ({float(f32_scale):.9g}) move the "
              f"logits by {drift:.2e}" + (f", {effect}" if effect else "") + " (relative)")
        cfg = json.load(open(os.path.join(out_dir, "config.json")))
        print("  config.json:", {k: cfg[k] for k in ("model_type", "sliding_window", "layer_types", "head_dim",
                                                     "query_pre_attn_scalar", "attn_logit_softcapping",
                                                     "final_logit_softcapping") if k in cfg})
    print("transformers", transformers.__version__, "torch", torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
