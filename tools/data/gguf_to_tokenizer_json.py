#!/usr/bin/env python3
"""Export a GGUF model's byte-level BPE tokenizer as an HF tokenizer.json (+ tokenizer_config.json).

The GGUF metadata (tokenizer.ggml.tokens / merges / token_type / pre / bos / eos) is read with the
`gguf` package and the tokenizer is built and saved by HF `tokenizers` itself, so the file is exactly
what HF would load. The pre-tokenizer named by tokenizer.ggml.pre becomes the HF configuration of
those models' own tokenizer.json files:
  gpt2       ByteLevel (GPT-2's regex)
  smollm     Sequence[Digits(individual_digits), ByteLevel]     (SmolLM, SmolLM2, StarCoder)
  llama-bpe  Sequence[Split(Llama 3 regex, Isolated), ByteLevel(use_regex=false)], ignore_merges
Control tokens (type 3) become special added tokens, user-defined ones (type 4) non-special ones.

Usage: python3 tools/data/gguf_to_tokenizer_json.py MODEL.gguf OUT_DIR
Needs: pip install gguf tokenizers
"""
import argparse
import json
import os
import sys

GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CONTROL, USER_DEFINED = 3, 4


def field_value(reader, key):
    """A scalar, string or array field of the GGUF metadata, or None when absent."""
    f = reader.fields.get(key)
    if f is None:
        return None
    kind = f.types[0].name
    if kind == "ARRAY":
        if f.types[-1].name == "STRING":
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if kind == "STRING":
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    args = ap.parse_args()
    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(args.gguf)
    model = field_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        sys.exit(f"{args.gguf}: tokenizer.ggml.model is {model!r}, not 'gpt2' (byte-level BPE)")
    pre = field_value(reader, "tokenizer.ggml.pre")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in field_value(reader, "tokenizer.ggml.merges")]
    types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)

    ignore_merges = pre in ("llama-bpe", "llama3")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=ignore_merges)
    tok = Tokenizer(bpe)
    if pre == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in ("llama-bpe", "llama3"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        sys.exit(f"{args.gguf}: tokenizer.ggml.pre is {pre!r}; this script knows gpt2, smollm, llama-bpe")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in range(len(tokens)) if types[i] == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in range(len(tokens)) if types[i] == USER_DEFINED])

    os.makedirs(args.out_dir, exist_ok=True)
    tok.save(os.path.join(args.out_dir, "tokenizer.json"))
    config = {}
    for key, name in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
                      ("pad_token", "tokenizer.ggml.padding_token_id")):
        i = field_value(reader, name)
        if i is not None:
            config[key] = tokens[i]
    template = field_value(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    with open(os.path.join(args.out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    print(f"{args.out_dir}: {len(tokens)} tokens, {len(merges)} merges, pre-tokenizer {pre}, "
          f"{sum(t in (CONTROL, USER_DEFINED) for t in types)} added tokens, {config.get('bos_token')}/"
          f"{config.get('eos_token')}")


if __name__ == "__main__":
    main()
