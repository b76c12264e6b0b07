#!/usr/bin/env python3
"""Writes tests/data/rope_scaling_reference.json: RoPE inverse frequencies, attention factors and cos/sin
table rows for YaRN and dynamic-NTK scaling, for tests/engine/test_rope_scaling.cpp.

    python3 tests/data/rope_scaling_reference.py      # needs numpy, torch and transformers

Each case is the part of a Llama config.json that RoPE reads (head_dim, rope_theta,
max_position_embeddings, rope_scaling in the v4 form a file carries) and, for dynamic, the sequence
length. Two sets of expected values per case:

- "hf_*": what transformers' own code computes, in its float32: `_compute_yarn_parameters` and
  `_compute_dynamic_ntk_parameters` of transformers/modeling_rope_utils.py called on
  `LlamaConfig.from_dict(case config)` (inv_freq, attention factor), and LlamaRotaryEmbedding's
  forward over positions 0..P-1 (cos, sin: the attention factor folded in), rows picked at "positions".
- "resolved": the scaling's values as transformers resolves them from the config (defaults filled in,
  a null factor derived, original_max_position_embeddings from max_position_embeddings when absent).
- "inv_freq", "attention_factor", "cos", "sin": the same formulas in float64 (numpy, below, line by
  line as modeling_rope_utils.py writes them), so chunkwise's float64 tables can be held to 1e-14.
  The script checks the two sets agree to float32 precision before writing anything.

Recorded with transformers 5.24.0 and torch 2.15.0, run on the CPU; the versions are written into the file.
"""
import json
import math
import os

import numpy as np
import torch
import transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters, _compute_yarn_parameters
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

# Table rows written per case (those below the table's length P).
POSITIONS = [0, 1, 2, 7, 31, 100, 1000, 4095]


def case(name, head_dim, theta, max_pos, scaling, seq_len=None, rows=1001):
    """rows: the table length P (dynamic: the sequence length, P = seq_len)."""
    return {"name": name, "head_dim": head_dim, "rope_theta": theta, "max_position_embeddings": max_pos,
            "rope_scaling": scaling, "seq_len": seq_len, "rows": seq_len if seq_len else rows}


CASES = [
    case("yarn, defaults (truncate, attention factor 0.1 ln 8 + 1)", 64, 10000.0, 32768,
         {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}, rows=4096),
    case("yarn, truncate false", 64, 10000.0, 32768,
         {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "truncate": False}),
    case("yarn, mscale and mscale_all_dim", 64, 10000.0, 163840,
         {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
          "mscale_all_dim": 0.8}),
    case("yarn, mscale alone (ignored)", 16, 10000.0, 8192,
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "mscale": 0.707}),
    case("yarn, attention_factor and betas given", 96, 500000.0, 8192,
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "beta_fast": 16.0,
          "beta_slow": 2.0, "attention_factor": 1.25}),
    case("yarn, factor null (max_position_embeddings / original)", 32, 10000.0, 16384,
         {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}),
    case("yarn, no original (max_position_embeddings)", 32, 10000.0, 2048, {"type": "yarn", "factor": 4.0}),
    case("yarn, zero-width ramp (HF's 0.001 guard)", 8, 10000.0, 8,
         {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4}, rows=32),
    case("dynamic, shorter than the original (unscaled)", 64, 10000.0, 2048,
         {"rope_type": "dynamic", "factor": 2.0}, seq_len=1000),
    case("dynamic, 5000 tokens over 2048", 64, 10000.0, 2048, {"rope_type": "dynamic", "factor": 2.0}, seq_len=5000),
    case("dynamic, tiny head", 6, 10000.0, 32, {"rope_type": "dynamic", "factor": 4.0}, seq_len=40),
]


def llama_config(c):
    return LlamaConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32, "hidden_size": c["head_dim"] * 2,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": c["head_dim"], "max_position_embeddings": c["max_position_embeddings"],
        "rope_theta": c["rope_theta"], "rope_scaling": dict(c["rope_scaling"])})


# ---- float64, as modeling_rope_utils.py (transformers 5.24) writes it ----

def yarn_f64(c):
    s, dim, base = c["rope_scaling"], c["head_dim"], c["rope_theta"]
    original = s.get("original_max_position_embeddings", c["max_position_embeddings"])
    factor = s["factor"]
    if factor is None:
        factor = c["max_position_embeddings"] / original

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


def dynamic_f64(c):
    s, dim, base = c["rope_scaling"], c["head_dim"], c["rope_theta"]
    max_pos, factor = c["max_position_embeddings"], s["factor"]
    seq_len = max(c["seq_len"], max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)), 1.0


# ---- transformers itself, float32 ----

def hf_values(c):
    cfg = llama_config(c)
    if c["rope_scaling"].get("rope_type", c["rope_scaling"].get("type")) == "yarn":
        inv, a = _compute_yarn_parameters(cfg)
    else:
        inv, a = _compute_dynamic_ntk_parameters(cfg, seq_len=c["seq_len"])
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rope(x, torch.arange(c["rows"])[None, :])  # a forward over P positions (dynamic: its length)
    half = c["head_dim"] // 2
    return inv.double().numpy(), float(a), cos[0, :, :half].double().numpy(), sin[0, :, :half].double().numpy()


def resolved(c):
    """The scaling's values as transformers resolves them from the case's config (its standardized
    rope_parameters, the defaults _compute_*_parameters applies): what chunkwise's RopeScaling holds."""
    p = llama_config(c).rope_parameters
    if p["rope_type"] == "dynamic":
        return {"rope_type": "dynamic", "factor": p["factor"], "original_max_position_embeddings": c["max_position_embeddings"]}
    original = p["original_max_position_embeddings"]
    return {"rope_type": "yarn", "factor": p["factor"] or c["max_position_embeddings"] / original,
            "original_max_position_embeddings": original, "beta_fast": p.get("beta_fast") or 32,
            "beta_slow": p.get("beta_slow") or 1, "truncate": bool(p.get("truncate", True)),
            "attention_factor": p.get("attention_factor"), "mscale": p.get("mscale"),
            "mscale_all_dim": p.get("mscale_all_dim")}


def main():
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": []}
    for c in CASES:
        is_yarn = c["rope_scaling"].get("rope_type", c["rope_scaling"].get("type")) == "yarn"
        inv, a = yarn_f64(c) if is_yarn else dynamic_f64(c)
        hf_inv, hf_a, hf_cos, hf_sin = hf_values(c)
        positions = [p for p in POSITIONS if p < c["rows"]] + ([c["rows"] - 1] if c["rows"] - 1 not in POSITIONS else [])
        angles = np.outer(np.array(positions, dtype=np.float64), inv)
        cos, sin = a * np.cos(angles), a * np.sin(angles)
        # The float64 mirror agrees with transformers' float32 (its pow and angles rounded to 2^-24).
        assert np.max(np.abs(hf_inv - inv) / inv) < 1e-6, (c["name"], np.max(np.abs(hf_inv - inv) / inv))
        assert abs(hf_a - a) < 1e-15 * a, (c["name"], hf_a, a)
        bound = a * (np.abs(angles) * 5e-7 + 1e-6)
        assert np.all(np.abs(hf_cos[positions] - cos) <= bound), c["name"]
        assert np.all(np.abs(hf_sin[positions] - sin) <= bound), c["name"]
        out["cases"].append({**c, "resolved": resolved(c), "positions": positions, "inv_freq": inv.tolist(), "attention_factor": a,
                             "cos": cos.tolist(), "sin": sin.tolist(), "hf_inv_freq": hf_inv.tolist(),
                             "hf_attention_factor": hf_a, "hf_cos": hf_cos[positions].tolist(),
                             "hf_sin": hf_sin[positions].tolist()})
    dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rope_scaling_reference.json")
    with open(dst, "w") as f:  # one line per case
        head = {k: v for k, v in out.items() if k != "cases"}
        f.write(json.dumps(head)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(c) for c in out["cases"]))
        f.write("\n]}\n")
    print(f"wrote {dst}: {len(out['cases'])} cases")


if __name__ == "__main__":
    main()
