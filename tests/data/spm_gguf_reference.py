#!/usr/bin/env python3
"""Writes the expected ids of a SentencePiece vocabulary as a GGUF file holds it (tokenizer.ggml.model
"llama": tokens, scores, token types; no merges), computed by an implementation of llama.cpp's
SentencePiece loop written here from its description, independent of chunkwise's (which states the
scores as ranked merges for its BPE loop: model/tokenizer.h). tests/model/test_tokenizer.cpp requires
chunkwise's `BpeTokenizer::from_gguf` to give these ids.

The vocabularies are the two SentencePiece-style test tokenizers (tests/data/spm_style_tokenizers.py)
turned into GGUF metadata as llama.cpp's converter lays a SentencePiece model out:
  - tokens in id order; types: <unk> unknown (2), the other special added tokens control (3), the
    added non-special ones user-defined (4), <0x00> ... <0xFF> byte (6), the rest normal (1);
  - scores: -(id // G) for every token, G = 1 (distinct scores, as a real model's mostly are) and
    G = 64 (tokens in groups of 64 sharing a score, so that the "leftmost among equal scores" rule
    decides most merges and the ids differ from HF's BPE, whose ranks are distinct);
  - add_space_prefix: the Llama 2 style's Prepend (true), the Gemma style's none (false).

llama.cpp's loop, for one stretch of text between added tokens (the unknown, control and
user-defined tokens, matched first, leftmost and longest first, each its own id):
  1. with add_space_prefix, a space in front of the stretch; every space becomes U+2581;
  2. the symbols are the stretch's UTF-8 characters;
  3. every adjacent pair whose joined text is a token (of any type) is a candidate with that token's
     score; repeatedly the candidate of the highest score, the leftmost among equal scores, is merged
     (a candidate whose symbols have changed since is skipped), and the new symbol's pairs with its
     neighbours become candidates;
  4. each symbol left is its token, or (a character without a token) the byte tokens of its bytes,
     or the unknown token where a byte token is missing.

Written: tests/data/spm_gguf_vocab.<style>.g<G>.json (the GGUF metadata) and, for tests/data/
tokenizer_corpus.txt and tests/data/tokenizer_special_lines.txt, one line of ids per line in
tests/data/<corpus>.<style>.gguf-g<G>.ids. Printed: how many lines differ from HF's ids of the
tokenizer.json (tests/data/<corpus>.<style>.ids). Needs only the Python standard library.

    python3 tests/data/spm_gguf_reference.py
"""
import heapq
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "data"))
from text_lines import read_lines  # noqa: E402  (the lines of a text file as chunkwise cuts them)

STYLES = {"gemma_style": False, "llama2_style": True}  # add_space_prefix
GROUPS = (1, 64)  # tokens sharing a score
UNKNOWN, NORMAL, CONTROL, USER_DEFINED, BYTE = 2, 1, 3, 4, 6


def gguf_vocabulary(style, group):
    """The style's tokenizer.json as llama.cpp's converter would write its GGUF metadata."""
    with open(os.path.join(HERE, f"{style}_tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    tokens = [None] * len(tj["model"]["vocab"])
    for text, i in tj["model"]["vocab"].items():
        tokens[i] = text
    types = []
    added = {a["id"]: a for a in tj["added_tokens"]}
    for i, text in enumerate(tokens):
        if text == "<unk>":
            types.append(UNKNOWN)
        elif i in added:
            types.append(CONTROL if added[i]["special"] else USER_DEFINED)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    scores = [-float(i // group) for i in range(len(tokens))]
    bos, eos = ("<bos>", "<eos>") if "<bos>" in tokens else ("<s>", "</s>")
    return {"tokens": tokens, "scores": scores, "token_type": types, "add_space_prefix": STYLES[style],
            "unknown_token_id": tokens.index("<unk>"), "bos_token_id": tokens.index(bos),
            "eos_token_id": tokens.index(eos)}


class SentencePiece:
    def __init__(self, vocab):
        self.tokens = vocab["tokens"]
        self.scores = vocab["scores"]
        self.id_of = {t: i for i, t in enumerate(self.tokens)}
        self.add_space_prefix = vocab["add_space_prefix"]
        self.unk = vocab["unknown_token_id"]
        types = vocab["token_type"]
        # Added tokens (llama.cpp's special-token cache): unknown, control and user-defined, matched
        # leftmost, longest first.
        self.added = sorted((t for t, ty in zip(self.tokens, types) if ty in (UNKNOWN, CONTROL, USER_DEFINED)),
                            key=len, reverse=True)

    def encode(self, text):
        ids, stretch, i = [], "", 0
        while i < len(text):
            match = next((a for a in self.added if text.startswith(a, i)), None)
            if match is None:
                stretch += text[i]
                i += 1
                continue
            ids += self.stretch(stretch)
            stretch = ""
            ids.append(self.id_of[match])
            i += len(match)
        return ids + self.stretch(stretch)

    def stretch(self, text):
        if not text:
            return []
        if self.add_space_prefix:
            text = " " + text
        text = text.replace(" ", "\u2581")
        symbols = list(text)  # Python strings hold characters: one symbol each
        prev = [i - 1 for i in range(len(symbols))]
        nxt = [i + 1 if i + 1 < len(symbols) else -1 for i in range(len(symbols))]
        alive = [True] * len(symbols)
        heap = []

        def candidate(left):
            if left < 0 or nxt[left] < 0:
                return
            right = nxt[left]
            joined = symbols[left] + symbols[right]
            token = self.id_of.get(joined)
            if token is not None:
                # heapq is a min-heap: the highest score first, then the leftmost.
                heapq.heappush(heap, (-self.scores[token], left, joined))

        for i in range(len(symbols) - 1):
            candidate(i)
        while heap:
            _, left, joined = heapq.heappop(heap)
            if not alive[left] or nxt[left] < 0 or symbols[left] + symbols[nxt[left]] != joined:
                continue  # stale: a symbol changed since
            right = nxt[left]
            symbols[left] = joined
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            candidate(prev[left])
            candidate(left)
        ids = []
        for i, s in enumerate(symbols):
            if not alive[i]:
                continue
            if s in self.id_of:
                ids.append(self.id_of[s])
                continue
            for b in s.encode("utf-8"):
                ids.append(self.id_of.get(f"<0x{b:02X}>", self.unk))
        return ids


def main():
    for style in STYLES:
        for group in GROUPS:
            vocab = gguf_vocabulary(style, group)
            with open(os.path.join(HERE, f"spm_gguf_vocab.{style}.g{group}.json"), "w", encoding="utf-8") as f:
                json.dump(vocab, f, ensure_ascii=False)
                f.write("\n")
            sp = SentencePiece(vocab)
            differ = 0
            for corpus in ("tokenizer_corpus", "tokenizer_special_lines"):
                lines = read_lines(os.path.join(HERE, f"{corpus}.txt"))
                hf = read_lines(os.path.join(HERE, f"{corpus}.{style}.ids"))
                with open(os.path.join(HERE, f"{corpus}.{style}.gguf-g{group}.ids"), "w", encoding="utf-8") as f:
                    for line, hf_ids in zip(lines, hf):
                        ids = " ".join(str(i) for i in sp.encode(line))
                        differ += ids != hf_ids
                        f.write(ids + "\n")
            print(f"{style}, scores shared by {group}: {len(vocab['tokens'])} tokens, {differ} lines differ from HF's ids")


if __name__ == "__main__":
    main()
