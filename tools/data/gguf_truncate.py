#!/usr/bin/env python3
"""A Llama GGUF model cut to its first N blocks: the same embedding, final norm, tokenizer and metadata,
blocks 0..N-1 byte for byte, `{arch}.block_count` = N, every later block left out.

Its first N layers compute exactly what the whole model's do, so it is a small real model: for
moving to a machine with a size limit (the GPU machine takes 64 MiB of files; SmolLM2-135M's
Q4_1 file is 98 MB, cut to 2 blocks 35 MB), and for quick end-to-end checks of the import, the
tokenizer and the HF export (tools/bench/run_vs_hf.py) that do not need the model's quality.

    python3 tools/data/gguf_truncate.py .models/SmolLM2-135M-Instruct.Q4_1.gguf 2 .gpu-carry/smollm2-2blocks.gguf

Needs: pip install gguf numpy.
"""
import argparse
import os
import re
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("blocks", type=int)
    ap.add_argument("out")
    args = ap.parse_args()
    import gguf

    reader = gguf.GGUFReader(args.gguf)
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    total = reader.fields[count_key].contents()
    if not 1 <= args.blocks <= total:
        sys.exit(f"{args.gguf}: has {total} blocks; give 1..{total}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    writer = gguf.GGUFWriter(args.out, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # The writer adds the header fields and general.architecture itself.
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = args.blocks if field.name == count_key else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    kept = []
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= args.blocks:
            continue
        kept.append(t)
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    print(f"{args.out}: {args.blocks} of {total} blocks, {len(kept)} of {len(reader.tensors)} tensors, "
          f"{os.path.getsize(args.out) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
