#!/usr/bin/env python3
"""Cuts the long documents of a token shard into short ones: a control for loss by position.

`chunkwise eval --task loss-by-position` gives the mean loss of each position bucket of long
documents. Whether a low loss deep in a document comes from the context before it or from the text
there being easy is not in that figure. This tool writes a shard whose documents are the same text
cut into pieces of PIECE tokens, each opened by the document's first token (its BOS; a piece that
starts the document has it already), so that evaluating it gives the loss of the same tokens with at
most PIECE tokens of context:

    cut_documents.py .cache/longctx/sorted/eval.bin --min-length 65536 --start 32768 --end 65536 \\
        --piece 8192 --out .cache/longctx/sorted/eval-32k-64k-cut8k.bin
    chunkwise eval --task loss-by-position --data .cache/longctx/sorted/eval-32k-64k-cut8k.bin --seq 8192 \\
        --documents --min-document 8192 --buckets 1K,2K,4K ...

Tokens [START, END) of every document of at least MIN-LENGTH tokens (offsets from the document's
first token, its BOS) are taken in pieces of PIECE, [START + k PIECE, START + (k + 1) PIECE); each
piece is written as the BOS and its PIECE tokens, which fill one window of `--seq PIECE` (a piece at
offset 0 begins with the document's own BOS, so it holds one text token less). Bucket 4K-8K of the
pieces is then the text at offsets START + k PIECE + 4K.. with 4K-8K tokens of context, as bucket
4K-8K of the whole document has. The input is a shard with its flags file (`<shard>.flags`, document
starts: chunkwise tokenize writes both; format in tools/data/tokens.h); the output is the same pair.
Standard library only.
"""
import argparse
import array
import os
import struct
import sys

SHARD_MAGIC = {20240520: "H", 20240801: "I"}  # uint16 or uint32 ids
FLAGS_MAGIC = 1179932483  # "CWTF"
FLAG_DOC_START = 2


def fail(message):
    sys.exit(f"cut_documents.py: {message}")


def read_header(path, expected_magics):
    with open(path, "rb") as f:
        header = f.read(1024)
    if len(header) != 1024:
        fail(f"{path}: shorter than its 1024-byte header")
    h = struct.unpack("<256i", header)
    if h[0] not in expected_magics:
        fail(f"{path}: magic {h[0]} is not one of {sorted(expected_magics)}")
    return h


def read_shard(path):
    h = read_header(path, SHARD_MAGIC)
    ids = array.array(SHARD_MAGIC[h[0]])
    with open(path, "rb") as f:
        f.seek(1024)
        ids.frombytes(f.read())
    if sys.byteorder != "little":
        ids.byteswap()
    if len(ids) != h[2]:
        fail(f"{path}: header says {h[2]} tokens, the file holds {len(ids)}")
    flags_path = path + ".flags"
    if not os.path.exists(flags_path):
        fail(f"{flags_path} is missing: tokenize the documents with chunkwise tokenize, which writes it")
    fh = read_header(flags_path, {FLAGS_MAGIC})
    if not fh[3] & FLAG_DOC_START:
        fail(f"{flags_path} carries no document starts (header[3] = {fh[3]})")
    with open(flags_path, "rb") as f:
        f.seek(1024)
        flags = f.read()
    if len(flags) != len(ids):
        fail(f"{flags_path}: {len(flags)} flag bytes for {len(ids)} tokens")
    return h[0], ids, flags


def write_pair(path, magic, ids, starts):
    body = array.array(SHARD_MAGIC[magic], ids)
    if sys.byteorder != "little":
        body.byteswap()
    flags = bytearray(len(ids))
    for s in starts:
        flags[s] = FLAG_DOC_START
    header = [0] * 256
    header[0], header[1], header[2] = magic, 1, len(ids)
    fheader = [0] * 256
    fheader[0], fheader[1], fheader[2], fheader[3] = FLAGS_MAGIC, 1, len(ids), FLAG_DOC_START
    for p, head, data in ((path, header, body.tobytes()), (path + ".flags", fheader, bytes(flags))):
        tmp = p + ".tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<256i", *head))
            f.write(data)
        os.replace(tmp, p)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shard")
    ap.add_argument("--min-length", type=int, required=True, help="documents of at least this many tokens")
    ap.add_argument("--start", type=int, default=0, help="first token of each document taken (default 0)")
    ap.add_argument("--end", type=int, required=True, help="tokens before this offset are taken")
    ap.add_argument("--piece", type=int, required=True, help="tokens per piece, after its BOS")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not (0 <= a.start < a.end <= a.min_length and a.piece >= 1):
        fail("need 0 <= --start < --end <= --min-length and --piece >= 1")
    magic, ids, flags = read_shard(a.shard)
    doc_starts = [i for i, b in enumerate(flags) if b & FLAG_DOC_START] + [len(ids)]
    out_ids, out_starts, documents = [], [], 0
    for begin, end in zip(doc_starts[:-1], doc_starts[1:]):
        if end - begin < a.min_length:
            continue
        documents += 1
        bos = ids[begin]
        for offset in range(a.start, a.end, a.piece):
            out_starts.append(len(out_ids))
            if offset > 0:  # offset 0 is the document's own BOS
                out_ids.append(bos)
            out_ids.extend(ids[begin + offset:begin + min(offset + a.piece, a.end)])
    if not documents:
        fail(f"{a.shard}: no document of at least {a.min_length} tokens")
    write_pair(a.out, magic, out_ids, out_starts)
    print(f"cut_documents.py: {documents} documents, tokens [{a.start}, {a.end}) of each, into {len(out_starts)} "
          f"pieces of at most {a.piece} tokens after a BOS: {a.out} ({len(out_ids)} tokens) and its flags")


if __name__ == "__main__":
    main()
