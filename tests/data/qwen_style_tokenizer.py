#!/usr/bin/env python3
"""Writes tests/data/qwen_style_tokenizer.json, a small byte-level BPE tokenizer with the pipeline
Qwen2, Qwen2.5 and Qwen3 ship (the real file cannot be committed or fetched), and HF `tokenizers`'
ids of tests/data/tokenizer_corpus.txt and tests/data/tokenizer_corpus_decomposed.txt with it, which
tests/model/test_tokenizer.cpp requires chunkwise's tokenizer to reproduce exactly.

The pipeline, as Qwen's tokenizer.json has it: normalizer NFC; pre_tokenizer a Sequence of a Split
(Qwen2's regex, behavior Isolated, invert false) and ByteLevel (add_prefix_space false, use_regex
false); model BPE; decoder and post-processor ByteLevel; <|endoftext|>, <|im_start|> and <|im_end|>
special added tokens (normalized false). The vocabulary (about 800 tokens: the 256 byte characters,
the three special tokens and the merges) is trained here with tokenizers' BpeTrainer on
tokenizer_corpus.txt and a few accented lines in NFC, so that merges over composed letters (é, Å,
각) exist and the NFC normalizer changes the ids of decomposed text.

Written (one line of ids per text line, lines ending at '\\n', which is not encoded; no special
tokens added, those written in the text recognised, as `chunkwise encode` does):
    tests/data/qwen_style_tokenizer.json
    tests/data/tokenizer_corpus.qwen_style.ids               HF's ids of tokenizer_corpus.txt
    tests/data/tokenizer_corpus_decomposed.txt               lines written decomposed (NFD, jamo, U+212B...)
    tests/data/tokenizer_corpus_decomposed.qwen_style.ids    HF's ids of those lines

The script checks that decode(encode(line)) is NFC(line) for every line, that every decomposed line
is not NFC and encodes to the ids of its NFC form, and that training again gives the same file.

    pip install tokenizers   # recorded with tokenizers 0.23.3
    python3 tests/data/qwen_style_tokenizer.py
"""
import json
import os
import sys
import unicodedata

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "data"))
from text_lines import read_lines  # noqa: E402  (the corpus's lines as chunkwise cuts them)

CORPUS = os.path.join(HERE, "tokenizer_corpus.txt")
DECOMPOSED = os.path.join(HERE, "tokenizer_corpus_decomposed.txt")
OUT_JSON = os.path.join(HERE, "qwen_style_tokenizer.json")
OUT_CORPUS_IDS = os.path.join(HERE, "tokenizer_corpus.qwen_style.ids")
OUT_DECOMPOSED_IDS = os.path.join(HERE, "tokenizer_corpus_decomposed.qwen_style.ids")

# Qwen2's Split regex (Llama 3's with every digit a piece of its own), as in Qwen2/2.5/3's tokenizer.json.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 800

# Training text besides the corpus, in NFC (the trainer normalizes its input too): accented words
# often enough that their composed letters are merged with their neighbours.
ACCENTED = [
    "Café au lait, café crème, le café.",
    "Ångström, ångström; Åland; Ås.",
    "résumé, résumés, résumé; naïve, naïveté, Noël, Zoë.",
    "각 각각 가 가각; 한국어.",
    "Việt Nam, tiếng Việt; São Paulo, ação, coração; señor, mañana, niño.",
    "élève, été, école, émigré, élan, éclair.",
]

# Lines written decomposed: combining marks after their letters (NFD), Hangul as conjoining jamo,
# singletons NFC replaces (U+212B ANGSTROM SIGN, U+212A KELVIN SIGN), marks out of canonical order,
# and special tokens among them (nothing composes across a special token: HF matches those on the
# raw text and normalizes each stretch between them on its own).
DECOMPOSED_LINES = [
    "Cafe\u0301 au lait",
    "A\u030angstro\u0308m",
    "\u1100\u1161\u11a8",
    "\u1100\u1161\u11a8 \u1100\u1161\u11a8\u1100\u1161\u11a8 \u1100\u1161",
    "\u212b",
    "\u212bngstr\u00f6m \u212a",
    "re\u0301sume\u0301 <|im_end|> na\u0131\u0308ve",
    "re\u0301sume\u0301, re\u0301sume\u0301s; nai\u0308ve, Noe\u0308l",
    "<|im_start|>user Cafe\u0301<|im_end|>e\u0301<|im_start|>\u0301e<|endoftext|>e\u0301\u0301",
    "Vie\u0323\u0302t Nam, tie\u0302\u0301ng Vie\u0323\u0302t",
    "Vie\u0302\u0323t Nam",
    "Sa\u0303o Paulo, ac\u0327a\u0303o, corac\u0327a\u0303o; sen\u0303or, man\u0303ana",
    "e\u0301le\u0300ve, e\u0301te\u0301, e\u0301cole 12\u0301 \u0301",
    unicodedata.normalize("NFD", "Accents: café naïve résumé façade Ångström Øresund Đakovo Łódź İstanbul"),
    unicodedata.normalize("NFD", "한국어 텍스트입니다."),
]


def build(corpus_lines):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIAL)
    tok.train_from_iterator(corpus_lines + ACCENTED * 3, trainer=trainer)
    return tok


def write_ids(tok, lines, path):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(" ".join(str(i) for i in tok.encode(line, add_special_tokens=False).ids) + "\n")


def main():
    corpus = read_lines(CORPUS)
    tok = build(corpus)
    text = tok.to_str(pretty=True)
    if build(corpus).to_str(pretty=True) != text:
        sys.exit("training twice gave two different tokenizers")
    with open(OUT_JSON, "w", encoding="utf-8", newline="\n") as f:
        f.write(text + "\n")
    with open(DECOMPOSED, "w", encoding="utf-8", newline="\n") as f:
        f.write("".join(line + "\n" for line in DECOMPOSED_LINES))
    if read_lines(DECOMPOSED) != DECOMPOSED_LINES:
        sys.exit("a decomposed line holds a '\\n' or does not read back")

    tok = Tokenizer.from_file(OUT_JSON)  # what the C++ test loads
    for line in corpus + DECOMPOSED_LINES:
        ids = tok.encode(line, add_special_tokens=False).ids
        if tok.decode(ids, skip_special_tokens=False) != unicodedata.normalize("NFC", line):
            sys.exit(f"decode(encode(x)) != NFC(x) for {line!r}")
    changed = 0
    for line in DECOMPOSED_LINES:
        composed = unicodedata.normalize("NFC", line)
        if composed == line:
            sys.exit(f"decomposed line already in NFC: {line!r}")
        ids = tok.encode(line, add_special_tokens=False).ids
        if ids != tok.encode(composed, add_special_tokens=False).ids:
            sys.exit(f"a decomposed line and its NFC form encode differently: {line!r}")
        # Without the normalizer (the same tokenizer otherwise) the ids are those of the raw bytes.
        changed += ids != raw_ids(line)
    if changed != len(DECOMPOSED_LINES):
        sys.exit(f"only {changed} of {len(DECOMPOSED_LINES)} decomposed lines change ids with NFC")
    write_ids(tok, corpus, OUT_CORPUS_IDS)
    write_ids(tok, DECOMPOSED_LINES, OUT_DECOMPOSED_IDS)

    with open(OUT_JSON, encoding="utf-8") as f:
        merges = len(json.load(f)["model"]["merges"])
    composed_merges = sorted(t for t in tok.get_vocab() if any(c in t for c in ("Ã©", "Ãħ", "ê°")))
    print(f"tokenizers {tokenizers.__version__}: {OUT_JSON} ({os.path.getsize(OUT_JSON)} bytes), "
          f"vocabulary {tok.get_vocab_size()} ({merges} merges)")
    print(f"  tokens over é, Å, 각 (byte-level spelling): {' '.join(composed_merges[:12])} ...")
    print(f"  {len(corpus)} corpus lines -> {OUT_CORPUS_IDS}")
    print(f"  {len(DECOMPOSED_LINES)} decomposed lines -> {DECOMPOSED}, {OUT_DECOMPOSED_IDS}")
    print("  decode(encode(x)) == NFC(x) on every line; each decomposed line gives its NFC form's ids, "
          "other ids than without the normalizer")


def raw_ids(line):
    """The ids of `line` with the same vocabulary and no normalizer."""
    tok = Tokenizer.from_file(OUT_JSON)
    tok.normalizer = None
    return tok.encode(line, add_special_tokens=False).ids


if __name__ == "__main__":
    main()
