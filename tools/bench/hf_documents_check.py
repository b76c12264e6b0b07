#!/usr/bin/env python3
"""Holds the HF peer of packed documents (hf_reference.py --documents) to its oracle: each document run alone.

A tiny random Llama (hf_reference.py's `tiny` preset with heads of 16 dimensions, the least that
FlexAttention's CUDA kernels take; float32) with attn_implementation="flex_attention"
runs sequences packed from documents with exactly the peer's inputs: hf_reference.document_starts
(chunkwise bench's draws), document_inputs (positions restarting at each document, labels of -100 at
each start) and document_block_mask (FlexAttention's causal same-document BlockMask). The same weights
with eager attention run each document alone, as a sequence of its own from position 0. Checked:
  - logits: each document's packed logits against its own logits (max abs difference),
  - loss: the packed loss (HF's mean over supervised labels) against the documents' own losses
    summed and divided by their count of supervised labels,
  - gradients (--device cuda only: torch's FlexAttention has no backward on the CPU): the packed summed
    loss's gradient against the sum of the documents' gradients (max abs difference over the largest
    gradient), every parameter,
and, so that the check can fail, the packed batch under a plain causal BlockMask (no document rule)
must move the logits by more than the tolerance. First, without torch, the draws of document_starts:
splitmix64's reference words, and the cases chunkwise's tests hold bench_document_starts to. Any of
these off: a FAIL line says which, exit 1.

--liger (a GPU only: Liger's kernels are Triton's) applies Liger's kernels first, as hf_reference.py
--liger does (RoPE, RMSNorm, SwiGLU, and the LM head fused with cross-entropy, which then gives the
loss and its gradient). Run on the CPU: python3 tools/bench/hf_documents_check.py; on the GPU machine
(tools/gpu-check, step documents_peer): python3 tools/bench/hf_documents_check.py --device cuda --liger.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_reference  # noqa: E402

# float32 throughout: the packed and the separate runs differ only by the order of sums (FlexAttention's
# blocks against eager's softmax), about 1e-6 on logits of order 1.
LOGITS_TOLERANCE = 1e-4
# The model: `tiny` with 4 query heads (a power of two, so FlexAttention takes the grouped K/V as the
# 1B shape's 32 heads do) of 16 dimensions over 2 K/V heads.
CHECK_MODEL = dict(hf_reference.PRESETS["tiny"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)
LOSS_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4  # relative to the largest gradient entry


# splitmix64's first two outputs from state 0 (the published reference values): mix64 of one and two
# golden-ratio steps, as engine/random.h's mix64 computes them.
SPLITMIX64_FROM_ZERO = (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4)


def check_draws():
    """The document draws against what chunkwise's own tests hold bench_document_starts to
    (tests/tools/test_documents.cpp) and splitmix64's reference values; a list of what is off."""
    failed = []
    words = (hf_reference.mix64(0), hf_reference.mix64(0x9E3779B97F4A7C15))
    if words != SPLITMIX64_FROM_ZERO:
        failed.append(f"mix64 gives {[hex(w) for w in words]}, splitmix64's reference {[hex(w) for w in SPLITMIX64_FROM_ZERO]}")
    fixed = hf_reference.document_starts("8", 2, 20, 1)
    if fixed != [[0, 8, 16], [0, 8, 16]]:
        failed.append(f"documents 8 of 20 tokens: starts {fixed}, want [[0, 8, 16], [0, 8, 16]]")
    drawn = hf_reference.document_starts("3:5", 3, 100, 7)
    for row in drawn:
        steps = [b - a for a, b in zip(row, row[1:])]
        if row[0] != 0 or min(steps) < 3 or max(steps) > 5 or row[-1] < 95:
            failed.append(f"documents 3:5 of 100 tokens: starts {row} leave [3, 5] or end before 95")
    if drawn != hf_reference.document_starts("3:5", 3, 100, 7) or drawn == hf_reference.document_starts("3:5", 3, 100, 8):
        failed.append("documents 3:5: the draws are not a function of the seed")
    if len({tuple(row) for row in drawn}) != 3:
        failed.append("documents 3:5: the sequences of a batch are cut alike (they draw from one generator in turn)")
    for bad in ("8k", "9:4", "0", ":5", "5:"):
        try:
            hf_reference.parse_documents(bad)
            failed.append(f"--documents '{bad}' was accepted")
        except ValueError:
            pass
    return failed


def causal_block_mask(batch, seq, device):
    """The negative control: every earlier key, whatever its document."""
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(lambda b, h, q, k: k <= q, batch, None, seq, seq, device=device)


def packed_loss_sum(model, ids, inputs):
    """The packed batch's loss summed over its supervised labels (HF's mean times their count)."""
    supervised = int((inputs["labels"][:, 1:] != -100).sum())
    return model(input_ids=ids, use_cache=False, **inputs).loss * supervised


def separate_loss_sum(model, ids, starts):
    """Each document alone (positions from 0, causal), its loss summed over its supervised labels, all added."""
    total = 0
    for b, row in enumerate(starts):
        for start, end in zip(row, row[1:] + [ids.shape[1]]):
            if end - start > 1:  # a one-token document has no label
                doc = ids[b:b + 1, start:end]
                total = total + model(input_ids=doc, labels=doc, use_cache=False).loss * (end - start - 1)
    return total


def check_spec(spec, args, packed_model, separate_model, device):
    """One --documents spec: the line to print and whether it passed."""
    import torch
    starts = hf_reference.document_starts(spec, args.batch, args.seq, hf_reference.DOCUMENT_SEED)
    ids = torch.randint(0, packed_model.config.vocab_size, (args.batch, args.seq), device=device)
    document, positions, labels = hf_reference.document_inputs(starts, ids)
    mask = hf_reference.document_block_mask(document, compiled=device.type == "cuda")
    with torch.no_grad():
        packed = packed_model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        causal = packed_model(input_ids=ids, attention_mask=causal_block_mask(args.batch, args.seq, device),
                              position_ids=positions, use_cache=False).logits
        separate = torch.empty_like(packed)
        for b, row in enumerate(starts):
            for start, end in zip(row, row[1:] + [args.seq]):
                separate[b, start:end] = separate_model(input_ids=ids[b:b + 1, start:end], use_cache=False).logits[0]
    logits_diff = (packed - separate).abs().max().item()
    control_diff = (causal - separate).abs().max().item()

    inputs = dict(attention_mask=mask, position_ids=positions, labels=labels)
    supervised = int((labels[:, 1:] != -100).sum())
    grads = device.type == "cuda"
    with torch.set_grad_enabled(grads):
        packed_sum = packed_loss_sum(packed_model, ids, inputs)
        separate_sum = separate_loss_sum(separate_model, ids, starts)
    loss_diff = abs(packed_sum.item() - separate_sum.item()) / supervised
    failed = []
    if logits_diff > LOGITS_TOLERANCE:
        failed.append(f"logits differ by {logits_diff:.3g}")
    if loss_diff > LOSS_TOLERANCE:
        failed.append(f"loss differs by {loss_diff:.3g}")
    if control_diff <= LOGITS_TOLERANCE:
        failed.append(f"a plain causal mask moves the logits by {control_diff:.3g} only: the check cannot fail")
    grad_text = "gradients: not checked (torch's FlexAttention has no backward on the CPU; --device cuda)"
    if grads:
        packed_sum.backward()
        separate_sum.backward()
        worst, largest = 0.0, 0.0
        for (name, p), q in zip(packed_model.named_parameters(), separate_model.parameters()):
            if p.grad is None or q.grad is None:
                failed.append(f"{name}: no gradient")
                continue
            worst = max(worst, (p.grad - q.grad).abs().max().item())
            largest = max(largest, q.grad.abs().max().item())
            p.grad, q.grad = None, None
        grad_diff = worst / largest if largest > 0 else float("inf")
        grad_text = f"gradients max abs diff / max abs grad {grad_diff:.3g}"
        if grad_diff > GRADIENT_TOLERANCE:
            failed.append(f"gradients differ by {grad_diff:.3g} of the largest")
    counts = ", ".join(str(len(row)) for row in starts)
    line = (f"documents {spec} ({args.batch} x {args.seq} tokens, {counts} documents; starts of the first "
            f"{starts[0][:6]}{' ...' if len(starts[0]) > 6 else ''}): logits max abs diff {logits_diff:.3g}, "
            f"loss diff {loss_diff:.3g}, {grad_text}; a plain causal mask moves the logits by {control_diff:.3g}")
    return line, failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="", help="cpu | cuda (default: cuda when torch sees one, else cpu)")
    ap.add_argument("--documents", default="64,20:90",
                    help="comma list of --documents specs (L or LO:HI), each checked in turn")
    ap.add_argument("--seq", type=int, default=256, help="tokens a sequence")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--liger", action="store_true", help="apply Liger's kernels first, as hf_reference.py --liger")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    specs = [x.strip() for x in args.documents.split(",") if x.strip()]
    try:
        for spec in specs:
            hf_reference.parse_documents(spec)
    except ValueError as e:
        ap.error(str(e))
    failures = [f"draws: {f}" for f in check_draws()]
    print("draws: " + ("ok" if not failures else "FAILED") + " (splitmix64's reference words, bench_document_starts' "
          "cases in tests/tools/test_documents.cpp)", flush=True)
    import torch
    import transformers
    from transformers import LlamaForCausalLM
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":  # float32 products as float32 (no TF32), on both sides
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.liger:
        if device.type != "cuda":
            ap.error("--liger: Liger's kernels are Triton's and need --device cuda")
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(**hf_reference.liger_options("llama"))
    torch.manual_seed(args.seed)
    with torch.device(device):  # a config each: a model keeps its config object, attention choice included
        packed_model = LlamaForCausalLM._from_config(hf_reference.make_config(CHECK_MODEL),
                                                     attn_implementation="flex_attention").float()
        separate_model = LlamaForCausalLM._from_config(hf_reference.make_config(CHECK_MODEL),
                                                       attn_implementation="eager").float()
    if (packed_model.config._attn_implementation, separate_model.config._attn_implementation) != ("flex_attention", "eager"):
        sys.exit("hf_documents_check: the models did not get flex_attention and eager attention; check transformers")
    separate_model.load_state_dict(packed_model.state_dict())
    packed_model.train()  # as the peer trains (no dropout in Llama: train and eval compute the same)
    separate_model.train()
    print(f"hf_documents_check: torch {torch.__version__}, transformers {transformers.__version__}, {device}"
          f"{', Liger' if args.liger else ''}; tiny Llama (head dimension 16), float32; tolerances: logits {LOGITS_TOLERANCE:g}, "
          f"loss {LOSS_TOLERANCE:g}, gradients {GRADIENT_TOLERANCE:g} of the largest")
    for spec in specs:
        line, failed = check_spec(spec, args, packed_model, separate_model, device)
        print(line, flush=True)
        failures += [f"documents {spec}: {f}" for f in failed]
    for f in failures:
        print("FAIL " + f)
    print("hf_documents_check: " + ("FAILED" if failures else "ok: each packed document computes as it does alone"))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
