#!/usr/bin/env python3
"""Writes tests/data/gguf_quants.gguf: random blocks of every type chunkwise dequantizes, each with its
reference dequantization by the `gguf` Python package (llama.cpp's own) as an F32 tensor.

For each type T the file holds tensor "T" (2 rows of 512 elements, T's raw blocks: random bytes,
with every f16 scale / min field set to a random finite value so that no block decodes to inf or
NaN) and tensor "T.ref" (the same shape, F32: gguf.quants.dequantize of those bytes).
tests/model/test_gguf.cpp reads both and requires chunkwise's dequantization to equal the reference
bit for bit. Regenerate with `python3 tests/data/make_gguf_quants.py` (pip install gguf numpy); the
seed is fixed, so the file only changes when the package's dequantization does.
"""
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

ROWS, COLS = 2, 512

# Byte offsets of the f16 fields (scales, mins) inside one block of each type (ggml's block_* structs).
HALF_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def random_halfs(rng, n):
    """Finite f16 values of both signs over a wide exponent range (subnormals included)."""
    mant = rng.uniform(1.0, 2.0, n) * rng.choice([-1.0, 1.0], n)
    return (mant * 2.0 ** rng.integers(-26, 6, n)).astype(np.float16)


def main():
    rng = np.random.default_rng(20261125)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gguf_quants.gguf")
    w = gguf.GGUFWriter(out, "test")
    w.add_string("test.purpose", "chunkwise dequantization reference (tests/data/make_gguf_quants.py)")

    plain = {
        "F32": (rng.standard_normal((ROWS, COLS)) * 3).astype(np.float32),
        "F16": random_halfs(rng, ROWS * COLS).reshape(ROWS, COLS),
    }
    for name, values in plain.items():
        w.add_tensor(name, values)
        w.add_tensor(name + ".ref", values.astype(np.float32))
    # BF16: random bit patterns of finite values, stored raw.
    bits = rng.integers(0, 1 << 16, ROWS * COLS, dtype=np.uint32)
    bits = np.where((bits & 0x7F80) == 0x7F80, bits & ~np.uint32(0x4000), bits).astype(np.uint16)
    w.add_tensor("BF16", bits.view(np.uint8).reshape(ROWS, COLS * 2), raw_dtype=Q.BF16)
    w.add_tensor("BF16.ref", (bits.astype(np.uint32) << 16).view(np.float32).reshape(ROWS, COLS))

    for qtype, halves in HALF_FIELDS.items():
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = ROWS * COLS // block_elems
        raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
        for off in halves:
            raw[:, off:off + 2] = random_halfs(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        raw = raw.reshape(ROWS, COLS // block_elems * block_bytes)
        ref = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        assert ref.shape == (ROWS, COLS) and np.isfinite(ref).all()
        w.add_tensor(qtype.name, raw, raw_dtype=qtype)
        w.add_tensor(qtype.name + ".ref", ref)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out} ({os.path.getsize(out)} bytes)")


if __name__ == "__main__":
    main()
