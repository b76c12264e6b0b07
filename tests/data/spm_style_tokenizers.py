#!/usr/bin/env python3
"""Writes two small SentencePiece-style BPE tokenizers, with the pipelines Gemma 2 and Llama 2 /
Mistral 7B v0.1 ship in their tokenizer.json (the real files cannot be committed or fetched), and HF
`tokenizers`' ids of tests/data/tokenizer_corpus.txt and of a few lines with special tokens, which
tests/model/test_tokenizer.cpp requires chunkwise's tokenizer to reproduce exactly.

The pipelines, as those tokenizer.json files have them:
  gemma_style:  normalizer Replace(" " -> "▁"); no pre-tokenizer; model BPE with byte_fallback and
                fuse_unk, unk_token <unk>; decoder Sequence[Replace("▁" -> " "), ByteFallback, Fuse];
                <pad> 0, <eos> 1, <bos> 2, <unk> 3 and <start_of_turn>, <end_of_turn> special added tokens.
  llama2_style: normalizer Sequence[Prepend("▁"), Replace(" " -> "▁")]; no pre-tokenizer; the same
                model; decoder Sequence[Replace("▁" -> " "), ByteFallback, Fuse, Strip(" ", 1, 0)];
                <unk> 0, <s> 1, </s> 2 special added tokens.
Both vocabularies hold the 256 byte tokens <0x00> ... <0xFF> after the special ones, then the
tokens BpeTrainer learns from the corpus with its alphabet limited, so that rarer characters (accents,
CJK, emoji) are not tokens and go through the byte fallback.

Written (one line of ids per text line, lines ending at '\\n', which is not encoded; no special
tokens added, those written in the text recognised, as `chunkwise encode` does):
    tests/data/gemma_style_tokenizer.json, tests/data/llama2_style_tokenizer.json
    tests/data/tokenizer_corpus.gemma_style.ids, tests/data/tokenizer_corpus.llama2_style.ids
    tests/data/tokenizer_special_lines.txt and its .gemma_style.ids, .llama2_style.ids, and HF's
      decode of those ids (special tokens kept) in .gemma_style.decoded, .llama2_style.decoded

The script checks that HF's decode(encode(line)) is the line for every line of the corpus. BpeTrainer breaks some
ties between equally frequent pairs differently from run to run, so running it again may write
another (equally valid) vocabulary; the ids are always those of the files written with them.

    pip install tokenizers   # recorded with tokenizers 0.23.3
    python3 tests/data/spm_style_tokenizers.py
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, normalizers, trainers

# The corpus's lines as chunkwise cuts them (tools/data/text_lines.py, which qwen_style_tokenizer puts
# on the path), and HF's ids written one line per line: as for the Qwen-style tokenizer.
from qwen_style_tokenizer import read_lines, write_ids

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "tokenizer_corpus.txt")
SPECIAL_LINES_FILE = os.path.join(HERE, "tokenizer_special_lines.txt")
VOCAB_SIZE = 500
ALPHABET = 60  # the trainer keeps the 60 most frequent characters; the rest fall back to bytes

STYLES = {
    "gemma_style": dict(specials=["<pad>", "<eos>", "<bos>", "<unk>"], added=["<start_of_turn>", "<end_of_turn>"],
                        prepend=False, strip=False),
    "llama2_style": dict(specials=["<unk>", "<s>", "</s>"], added=[], prepend=True, strip=True),
}

# Lines with special tokens: each stretch between them is normalized on its own (so the Llama 2
# style prepends "▁" to every stretch, as HF does), spaces next to them, and empty stretches.
SPECIAL_LINES = [
    "<bos>Hello<start_of_turn>user Hi there<end_of_turn>",
    "<start_of_turn>model Sure, here it is.<end_of_turn> <eos>",
    "<s>Hello</s> <s> again</s>",
    "a<s>b</s>c <unk> d",
    "  two leading spaces, and trailing  ",
    "Ünïcödé ☃ 日本語 🙂 — all by bytes",
]


def pipeline(tok, style):
    parts = [normalizers.Prepend("▁")] if style["prepend"] else []
    tok.normalizer = normalizers.Sequence(parts + [normalizers.Replace(" ", "▁")])
    if not style["prepend"]:
        tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = None
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if style["strip"]:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)


def build(corpus_lines, style):
    # Learn the merges without special or byte tokens, then lay the vocabulary out as the real files
    # do: the special tokens, the 256 byte tokens, the learned tokens in their order.
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    pipeline(tok, style)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  limit_alphabet=ALPHABET, special_tokens=[])
    tok.train_from_iterator(corpus_lines, trainer=trainer)
    learned = json.loads(tok.to_str())
    order = sorted(learned["model"]["vocab"].items(), key=lambda kv: kv[1])
    names = style["specials"] + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in order] + style["added"]
    vocab = {name: i for i, name in enumerate(names)}
    if len(vocab) != len(names):
        sys.exit("a learned token repeats a special or byte token")
    learned["model"]["vocab"] = vocab
    learned["added_tokens"] = [
        dict(id=vocab[t], content=t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
        for t in style["specials"] + style["added"]]
    return Tokenizer.from_str(json.dumps(learned))


def main():
    corpus = read_lines(CORPUS)
    with open(SPECIAL_LINES_FILE, "w", encoding="utf-8", newline="\n") as f:
        f.write("".join(line + "\n" for line in SPECIAL_LINES))
    if read_lines(SPECIAL_LINES_FILE) != SPECIAL_LINES:
        sys.exit("a special line does not read back")
    for name, style in STYLES.items():
        text = build(corpus, style).to_str(pretty=True)
        path = os.path.join(HERE, f"{name}_tokenizer.json")
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(text + "\n")
        tok = Tokenizer.from_file(path)  # what the C++ test loads
        fallback = 0
        for line in corpus + SPECIAL_LINES:
            ids = tok.encode(line, add_special_tokens=False).ids
            # With Prepend, every stretch between special tokens gains a "▁" (HF normalizes each on
            # its own), which decoding turns into a space: those lines do not read back.
            if line in corpus and tok.decode(ids, skip_special_tokens=False) != line:
                sys.exit(f"{name}: decode(encode(x)) != x for {line!r}: {tok.decode(ids, skip_special_tokens=False)!r}")
            fallback += sum(1 for i in ids if tok.id_to_token(i).startswith("<0x"))
        if fallback == 0:
            sys.exit(f"{name}: no line went through the byte fallback")
        write_ids(tok, corpus, os.path.join(HERE, f"tokenizer_corpus.{name}.ids"))
        write_ids(tok, SPECIAL_LINES, os.path.join(HERE, f"tokenizer_special_lines.{name}.ids"))
        with open(os.path.join(HERE, f"tokenizer_special_lines.{name}.decoded"), "w", encoding="utf-8",
                  newline="\n") as f:
            for line in SPECIAL_LINES:
                f.write(tok.decode(tok.encode(line, add_special_tokens=False).ids, skip_special_tokens=False) + "\n")
        print(f"{name}: {tok.get_vocab_size()} tokens, {fallback} byte-fallback ids over the lines")


if __name__ == "__main__":
    main()
