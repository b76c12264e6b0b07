#!/usr/bin/env python3
"""The reference a user would pick instead of chunkwise: HF transformers training steps on one GPU.

Setup (../shared/BENCHMARKS.md, "What a user would pick instead"): the family's transformers class
(LlamaForCausalLM, Qwen2ForCausalLM for Qwen2 and Qwen2.5, Qwen3ForCausalLM, MistralForCausalLM,
Gemma2ForCausalLM: the families chunkwise trains, by the config's model_type, llama without one) built
from a hard-coded config of the named shape with random init; fp32 master weights, the step under bf16
autocast; attn_implementation="sdpa" (Gemma 2: "flex_attention", the one fast path of transformers
that applies its score cap; SDPA drops it, eager keeps T x T scores; Mistral past its window:
"flex_attention", below); fused AdamW (torch.optim.AdamW(fused=True)); random token ids (never
zeros) with labels = input ids (HF shifts them inside the loss); optionally gradient checkpointing
(gradient_checkpointing_enable, use_reentrant=False). Mistral's sliding window is the model's own;
once T passes the window the model runs on "flex_attention": transformers' SDPA path would hand the
window as a [B, 1, T, T] boolean mask (4 GiB at 64K), which sends SDPA to a kernel that visits every
one of the T^2 pairs, while FlexAttention gets the window as a BlockMask and skips the blocks outside
it, as flash-attn's window would. Qwen's windows stay off (use_sliding_window false, as in the
released models); a config that turns them on is refused, as chunkwise refuses it.

LoRA (--lora-rank R > 0): what a PEFT user runs instead. The base is built in bf16 (dtype=torch.bfloat16)
and frozen: no fp32 master copy, no gradients, no optimizer state for it. peft.get_peft_model wraps it
with LoraConfig(r=R, lora_alpha=A, lora_dropout=P, target_modules=--lora-targets, bias="none",
task_type="CAUSAL_LM"); the adapters (lora_A, lora_B) stay fp32 (PEFT's autocast_adapter_dtype=True
upcasts them; anything else is an error), the step runs under bf16 autocast as above, and the fused
AdamW holds the adapters only. With --checkpointing, model.enable_input_require_grads() as PEFT's
recipe does (the embeddings are frozen, so a checkpointed layer's input would not require grad). The
flags are chunkwise bench's (--lora-rank, --lora-alpha, --lora-dropout, --lora-targets), so both sides
run the same adapters; with --liger, Liger is applied before the model is built, as without LoRA.

Liger (--liger): the family's patch (apply_liger_kernel_to_llama, _qwen2, _qwen3, _mistral, _gemma2)
with RoPE, RMSNorm (Qwen3's per-head q/k norms too), SwiGLU (Gemma 2: GeGLU) and the LM head fused
with cross-entropy (Gemma 2: with its logit cap), applied
before the model is built; an option the installed function does not take is left out and named in
the JSON (liger_patch).

One step = forward + backward + optimizer.step() + zero_grad, timed with torch.cuda.synchronize() on
both sides. The figure is the median of --steps timed steps after --warmup untimed ones (the first
step allocates the AdamW state). Peak memory is torch.cuda.max_memory_allocated() (and
max_memory_reserved()) over the timed steps, after a reset at their start: the steady state, with
weights, gradients, optimizer state and activations all live.

Packed documents (--documents L or LO:HI, chunkwise bench's flag): each sequence of T tokens is cut
into documents of L tokens, or of lengths drawn uniformly in [LO, HI] (the last one cut at T), and each
document attends only itself: the model runs with attn_implementation="flex_attention" and gets, per
step, a BlockMask built by torch.nn.attention.flex_attention.create_block_mask from a mask_mod that
is causal and same-document (transformers' create_causal_mask returns a 4-D mask as given), with
position_ids restarting at 0 at each document start and labels of -100 at each start but the first:
HF shifts labels inside the loss, so that removes the target of the position before a start, as
chunkwise's set_documents does (no token is trained to predict across a boundary). Mistral's window
goes into the same mask_mod (a query sees keys of its own document within its window, as chunkwise):
a BlockMask reaches FlexAttention as given, so the model's own window would not apply. The starts are
chunkwise bench's, draw for draw (tools/bench_model.cpp bench_document_starts: engine/random.h's Rng,
splitmix64, seeded 2000 + step, warm-up steps counted), reproduced here by document_starts, so both
sides train the same documents at every step. The mask is built before a step's clock starts, as
chunkwise sets its batch's documents before its clock starts; its seconds are in the JSON (mask_s).
tools/bench/hf_documents_check.py holds the peer to each document run alone.

MFU = tokens/s * flops_per_token / peak, with
  flops_per_token = 6 * P_matmul + 12 * L * H * D * (E / 2)
  E = T for one causal sequence; packed, the documents' squared lengths summed over the batch and
      divided by B * T (attention_extent, chunkwise bench's count), for the first timed step's documents;
      under a sliding window of W keys (Mistral) a sequence or document of n > W tokens counts
      n^2 - (n - W)^2 instead of n^2 (a query sees min(position + 1, W) keys)
  P_matmul = L * (C*H*D [q] + 2*C*Hkv*D [k, v] + H*D*C [o] + 3*C*F [gate, up, down]) + V*C [LM head]
  D = head_dim (Qwen3's is its own, not C / H); Qwen2's q/k/v biases and Qwen3's q/k norms are left
      out (at most a few million FLOPs a token, under 0.1% of the count for every preset)
6 per matmul parameter: 2 forward + 4 backward. Causal attention: QK^T and PV are 2 * 2 * T * D per
query head and token over the T/2 keys a causal row sees on average, times 3 for forward + backward
(12 * H * D * T/2 per layer and token). About 9.0 GFLOP/token for the 1B shape at 8K tokens. Packed, a
token sees the keys of its own document only: E/2 on average (a 64K sequence of 8K documents: E = 8192).
Mistral 7B's window of 4096 at 64K tokens: E = 8192 - 4096^2 / 65536 = 7936, not 65536. Layers of
different windows (Gemma 2's sliding and global layers): E is the layers' mean (mean_attention_extent).
With LoRA (chunkwise's count, tools/bench_model.cpp):
  flops_per_token = 4 * P_matmul + 6 * P_adapter + 12 * L * H * D * (E / 2)
  P_adapter = L * sum over the targeted linears [out, in] of R * (in + out)
4 per frozen matmul parameter (2 forward + 2 for the input gradient; no weight gradient) and 6 per
adapter parameter; dropout is not counted. About 43 GFLOP/token for the 8B shape at 16K, rank 8 on
q_proj, v_proj (P_adapter = 3.4M).
The peak is a measured bf16 matmul (8192^3, median of 10) unless --peak-tflops is given.

Out of memory (anywhere: building the model, a step) is a result, status "oom", not a crash; the
JSON is always written. Exit status 0 for "ok" and "oom", 1 for "error".
Runs on the GPU machine's torch (/opt/torch/.venv/bin/python3); chunkwise never imports torch.
"""
import argparse
import datetime
import json
import math
import re
import statistics
import sys
import time
import traceback

# HF config.json fields of the shapes chunkwise's presets name (model/config.cpp). Legacy (v4)
# field names, as the Hub's config.json files have them; rope is normalised below for v5.
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)


def llama3(hidden, ffn, layers, heads, head_dim, tied, factor):
    return dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=8, head_dim=head_dim, vocab_size=128256, tie_word_embeddings=tied,
                rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=factor), rms_norm_eps=1e-5,
                max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001)


def qwen(model_type, hidden, ffn, layers, heads, kv_heads, head_dim, tied, vocab=151936, positions=None):
    """Qwen2.5 (model_type qwen2: q/k/v biases, which the type implies) and Qwen3 (qwen3: per-head q/k
    norms, head_dim its own) as chunkwise's qwen_family: RoPE theta 1e6 without scaling, eps 1e-6,
    no sliding window, <|endoftext|> as bos, Qwen3's <|im_end|> as eos."""
    qwen3 = model_type == "qwen3"
    d = dict(model_type=model_type, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
             tie_word_embeddings=tied, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=positions or (40960 if qwen3 else 32768), use_sliding_window=False,
             bos_token_id=151643, eos_token_id=151645 if qwen3 else 151643)
    if qwen3:
        d["attention_bias"] = False
    return d


# A dict without model_type is a Llama's (family_of).
PRESETS = {
    "llama-3.2-1b": llama3(2048, 8192, 16, 32, 64, True, 32.0),
    "llama-3.2-3b": llama3(3072, 8192, 28, 24, 128, True, 32.0),
    "llama-3.1-8b": llama3(4096, 14336, 32, 32, 128, False, 8.0),
    "qwen2.5-0.5b": qwen("qwen2", 896, 4864, 24, 14, 2, 64, True),
    "qwen2.5-7b": qwen("qwen2", 3584, 18944, 28, 28, 4, 128, False, vocab=152064, positions=131072),
    "qwen3-0.6b": qwen("qwen3", 1024, 3072, 28, 16, 8, 128, True),
    "qwen3-8b": qwen("qwen3", 4096, 12288, 36, 32, 8, 128, False),
    # Mistral-7B-v0.1: GQA 32:8, a window of 4096 keys on every layer.
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                       tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=4096,
                       max_position_embeddings=32768, bos_token_id=1, eos_token_id=2),
    # chunkwise's test and demo shapes: for trying the script, not for figures.
    "tiny": dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=6, vocab_size=61, tie_word_embeddings=False, rope_theta=10000.0,
                 rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=32),
                 rms_norm_eps=1e-5, max_position_embeddings=4096),
    "small": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=32, vocab_size=320, tie_word_embeddings=True, rope_theta=10000.0,
                  rms_norm_eps=1e-5, max_position_embeddings=4096),
}
# tiny as each family, as chunkwise's tiny-qwen2 (q/k/v biases, tied), tiny-qwen3 (q/k norms, head_dim 8
# apart from hidden / heads = 6) and tiny-mistral (a window of 5 keys), RoPE without scaling.
_TINY = {k: v for k, v in PRESETS["tiny"].items() if k != "rope_scaling"}
PRESETS["tiny-qwen2"] = dict(_TINY, model_type="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-6,
                             tie_word_embeddings=True, use_sliding_window=False)
PRESETS["tiny-qwen3"] = dict(_TINY, model_type="qwen3", rope_theta=1000000.0, rms_norm_eps=1e-6, head_dim=8,
                             attention_bias=False, use_sliding_window=False)
PRESETS["tiny-mistral"] = dict(_TINY, model_type="mistral", sliding_window=5)


def gemma2(hidden, ffn, layers, heads, kv_heads):
    """Gemma 2 as chunkwise's gemma2_family (model/config.cpp): head_dim 256, scores scaled by
    256^-1/2 and capped at 50, logits capped at 30, the even layers sliding over 4096 keys, gelu (tanh)
    gate, tied embeddings."""
    return dict(model_type="gemma2", hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256, vocab_size=256000,
                tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=4096,
                query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, bos_token_id=2,
                eos_token_id=1, pad_token_id=0,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])


PRESETS["gemma2-2b"] = gemma2(2304, 9216, 26, 8, 4)
PRESETS["gemma2-9b"] = gemma2(3584, 14336, 42, 16, 8)

# Each family chunkwise trains (model/config.cpp's kFamilies), by model_type: its transformers config
# and model classes and Liger's patch for it.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "apply_liger_kernel_to_qwen2"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "apply_liger_kernel_to_qwen3"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "apply_liger_kernel_to_mistral"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "apply_liger_kernel_to_gemma2"),
}
# Liger's options: the LM head fused with cross-entropy (which never materialises the [tokens, vocab]
# logits) rather than Liger's plain cross-entropy, and the gated MLP's kernel: SwiGLU, or Gemma's GeGLU.
LIGER_OPTIONS = dict(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=True)
GATED_MLP_OPTION = {"gemma2": "geglu"}  # else "swiglu"


def liger_options(family):
    """The options Liger's patch for the family is asked for: LIGER_OPTIONS and its gated MLP's."""
    return dict(LIGER_OPTIONS, **{GATED_MLP_OPTION.get(family, "swiglu"): True})


def load_config_dict(spec):
    if spec in PRESETS:
        return dict(PRESETS[spec])
    with open(spec) as f:  # a config.json path (e.g. one `chunkwise init` wrote)
        return json.load(f)


def family_of(d):
    """A config dict's family as chunkwise reads it: model_type; without it the family whose class
    `architectures` names; else llama (the Llama presets carry no model_type). ValueError for another."""
    if "model_type" in d:
        family = d["model_type"]
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r}: chunkwise trains {', '.join(FAMILIES)} models")
        return family
    named = [f for f, (_, cls, _) in FAMILIES.items() if cls in (d.get("architectures") or [])]
    return named[-1] if named else "llama"


def sliding_window_of(d):
    """The keys a query attends at most under the config's sliding window, 0 for none: Mistral's
    sliding_window (absent: MistralConfig's 4096; null: none), Gemma 2's sliding layers' (absent:
    4096). Other families have none (Qwen's windows are refused by make_config, as chunkwise refuses
    them)."""
    if family_of(d) not in ("mistral", "gemma2"):
        return 0
    return (d["sliding_window"] or 0) if "sliding_window" in d else 4096


def layer_windows(d):
    """Each layer's sliding window (0: none): Mistral's on every layer; Gemma 2's on its sliding
    layers (layer_types, else the even ones, transformers' rule); none elsewhere."""
    L, window = d["num_hidden_layers"], sliding_window_of(d)
    if family_of(d) != "gemma2":
        return [window] * L
    types = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    return [window if t == "sliding_attention" else 0 for t in types]


def mean_attention_extent(starts, seq, windows):
    """E of flops_per_token for layers of different windows: the layers' attention_extent averaged
    (the attention term is linear in E, so the mean counts every layer's own pairs)."""
    return sum(attention_extent(starts, seq, w) for w in windows) / len(windows)


def make_config(d):
    """The family's transformers config for a config dict (family_of); ValueError for a Qwen config
    with sliding-window layers, which chunkwise does not train."""
    import transformers
    family = family_of(d)
    if family in ("qwen2", "qwen3"):
        # Qwen2Config and Qwen3Config keep the window off unless use_sliding_window; chunkwise refuses it.
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window is true: chunkwise does not train Qwen's sliding-window layers, "
                             "so there is nothing to compare; set it to false")
        if any(t != "full_attention" for t in d.get("layer_types") or []):
            raise ValueError("layer_types has layers other than full_attention: chunkwise's layers are all "
                             "full_attention; leave layer_types out")
    cfg = getattr(transformers, FAMILIES[family][0]).from_dict(d)
    # transformers 5 keeps rope settings in config.rope_parameters; set them explicitly so the model
    # gets exactly this RoPE whatever the legacy-field conversion of the installed version does.
    if hasattr(cfg, "rope_parameters"):
        rp = dict(rope_type="default", rope_theta=float(d.get("rope_theta", 10000.0)))
        if d.get("rope_scaling"):
            rp.update(d["rope_scaling"])
            rp["rope_type"] = rp.pop("type", rp.get("rope_type", "default"))
        cfg.rope_parameters = rp
    return cfg


# A block's linears, in its order: what LoRA may target (PEFT's module names, as chunkwise's lora.targets).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(d):
    """Each block linear's weight shape [out, in] for a config dict. The heads are head_dim wide, which
    Qwen3 sets apart from hidden / heads (Qwen3 0.6B: 128, not 1024 / 16)."""
    C, F, H, Hkv = d["hidden_size"], d["intermediate_size"], d["num_attention_heads"], d["num_key_value_heads"]
    D = d.get("head_dim") or C // H
    return dict(q_proj=(H * D, C), k_proj=(Hkv * D, C), v_proj=(Hkv * D, C), o_proj=(C, H * D), gate_proj=(F, C),
                up_proj=(F, C), down_proj=(C, F))


def flops_per_token(d, extent, lora=None):
    """Useful FLOPs per token of a training step (the module docstring's formula); extent: E, the
    sequence's tokens T for one causal sequence, attention_extent(starts, T, sliding_window_of(d)) for
    packed documents or a sliding window;
    lora: the result's "lora" object (rank, targets) or None for full-parameter training. Qwen2's
    q/k/v biases and Qwen3's per-head q/k norms are not counted: elementwise work of at most a few
    million FLOPs a token, under 0.1% of the count for every preset."""
    C, L, H = d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"]
    D = d.get("head_dim") or C // H
    shapes = linear_shapes(d)
    p_matmul = L * sum(o * i for o, i in shapes.values()) + d["vocab_size"] * C
    attention = 12 * L * H * D * (extent / 2)
    if not lora:
        return 6 * p_matmul + attention
    p_adapter = L * sum(lora["rank"] * (i + o) for name, (o, i) in shapes.items() if name in lora["targets"])
    return 4 * p_matmul + 6 * p_adapter + attention


def add_lora_args(ap):
    """The LoRA flags, named as chunkwise bench's (model_vs_hf.py takes the same and hands them to both sides)."""
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="LoRA adapters of this rank on a frozen bf16 base (PEFT on the HF side); 0: all parameters")
    ap.add_argument("--lora-alpha", type=float, default=16.0,
                    help="LoRA: the adapters' output is scaled by alpha / rank")
    ap.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA: dropout on the adapters' input, in [0, 1)")
    ap.add_argument("--lora-targets", default="q_proj,v_proj",
                    help=f"LoRA: comma list of {', '.join(LORA_TARGETS)}; all (or all-linear): the seven")


def lora_settings(args):
    """The result's "lora" object {rank, alpha, dropout, targets} from the LoRA flags, or None for rank 0.
    Targets come out as a list in the block's order, as chunkwise's JSON has them; ValueError names the bad flag."""
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank {args.lora_rank}: want >= 0 (0: no adapters)")
    if args.lora_rank == 0:
        return None
    if not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        raise ValueError(f"--lora-alpha {args.lora_alpha}: want > 0 (the scale is alpha / rank)")
    if not 0 <= args.lora_dropout < 1:
        raise ValueError(f"--lora-dropout {args.lora_dropout}: want a value in [0, 1)")
    names = {t.strip() for t in args.lora_targets.split(",") if t.strip()}
    if names & {"all", "all-linear"}:
        names = (names - {"all", "all-linear"}) | set(LORA_TARGETS)
    unknown = sorted(names - set(LORA_TARGETS))
    if unknown or not names:
        what = "unknown " + ", ".join(unknown) if unknown else "empty"
        raise ValueError(f"--lora-targets {args.lora_targets!r}: {what}; want a comma list of "
                         f"{', '.join(LORA_TARGETS)}, or all")
    return dict(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                targets=[t for t in LORA_TARGETS if t in names])


def lora_argv(lora):
    """The LoRA flags for a "lora" object (none for None): chunkwise bench and this script read the same."""
    if not lora:
        return []
    return ["--lora-rank", str(lora["rank"]), "--lora-alpha", format(lora["alpha"], "g"),
            "--lora-dropout", format(lora["dropout"], "g"), "--lora-targets", ",".join(lora["targets"])]


# Packed documents, drawn as chunkwise bench draws them (tools/bench_model.cpp bench_document_starts).
U64 = (1 << 64) - 1
DOCUMENT_SEED = 2000  # chunkwise bench seeds step s's documents with 2000 + s (warm-up steps counted)


def mix64(x):
    """splitmix64's finaliser on a 64-bit word, as engine/random.h's mix64."""
    x = (x + 0x9E3779B97F4A7C15) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


class Rng:
    """engine/random.h's Rng: word i of seed s is mix64(s ^ mix64(i)); below(n) by rejection, exactly uniform."""

    def __init__(self, seed):
        self.seed, self.counter = seed & U64, 0

    def next_u64(self):
        x = mix64(self.seed ^ mix64(self.counter))
        self.counter += 1
        return x

    def below(self, n):
        limit = U64 - U64 % n
        while True:
            x = self.next_u64()
            if x < limit:
                return x % n


def parse_documents(spec):
    """(LO, HI) from --documents L or LO:HI; ValueError in chunkwise bench's words."""
    lo, sep, hi = spec.partition(":")
    if not re.fullmatch(r"[0-9]+", lo) or (sep and not re.fullmatch(r"[0-9]+", hi)):
        raise ValueError(f"--documents '{spec}' is not a length or a range LO:HI; give e.g. --documents 8192 "
                         "(documents of 8192 tokens) or --documents 512:8192 (lengths drawn in that range)")
    lo, hi = int(lo), int(hi) if sep else int(lo)
    if lo < 1 or hi < lo:
        raise ValueError(f"--documents '{spec}': lengths must be at least 1 and LO <= HI; give e.g. --documents 512:8192")
    return lo, hi


def document_starts(spec, batch, seq, seed):
    """Per sequence, the offsets where its documents start (the first 0): lengths LO + Rng(seed).below(HI - LO + 1)
    drawn one after the other, the sequences in turn from one generator, the last document cut at seq."""
    lo, hi = parse_documents(spec)
    rng, starts = Rng(seed), []
    for _ in range(batch):
        row, at = [], 0
        while at < seq:
            row.append(at)
            at += lo + rng.below(hi - lo + 1)
        starts.append(row)
    return starts


def attention_extent(starts, seq, window=0):
    """E of the FLOP count: the documents' squared lengths summed over the batch, over batch * seq
    (seq itself for one document a sequence, starts [[0]] * batch), as chunkwise bench's
    attention_extent. Under a sliding window of `window` keys (0: none) a query sees min(its position
    in its document + 1, window) keys, so a document of n > window tokens counts n^2 - (n - window)^2
    (twice its query-key pairs, as n^2 is twice a causal document's n^2 / 2)."""
    def square(n):
        return n * n - (max(0, n - window) ** 2 if window > 0 else 0)
    squares = sum(square(end - start) for row in starts for start, end in zip(row, row[1:] + [seq]))
    return squares / (seq * len(starts))


def document_inputs(starts, ids):
    """For input ids [B, T] cut at starts: (document, position_ids, labels), each [B, T] on ids' device.
    document: each token's document index in its sequence; position_ids: each token's offset in its
    document; labels: the ids with -100 at each start but the first (HF shifts labels inside the loss,
    so this drops the target of the position before a start, as chunkwise's set_documents does)."""
    import torch
    B, T = ids.shape
    document = torch.empty(B, T, dtype=torch.int64, device=ids.device)
    positions = torch.empty_like(document)
    labels = ids.clone()
    for b, row in enumerate(starts):
        if len(row) == 0 or row[0] != 0 or any(x >= y for x, y in zip(row, row[1:])) or row[-1] >= T:
            raise ValueError(f"sequence {b}: document starts {row[:8]}... must ascend within [0, {T}) from 0")
        at = torch.tensor(row, dtype=torch.int64, device=ids.device)
        opens = torch.zeros(T, dtype=torch.int64, device=ids.device)
        opens[at] = 1
        document[b] = opens.cumsum(0) - 1
        positions[b] = torch.arange(T, device=ids.device) - at[document[b]]
        labels[b, at[1:]] = -100
    return document, positions, labels


_compiled_create_block_mask = None  # torch.compile(create_block_mask), made once at its first use


def document_block_mask(document, compiled, window=0):
    """FlexAttention's BlockMask for document [B, T]: query q sees key k when k <= q in q's document,
    and with a sliding window (window > 0 keys) when q - k < window too: the model's own window does
    not reach FlexAttention past a given BlockMask. compiled: build it through
    torch.compile(create_block_mask), tile by tile; otherwise the [B, 1, T, T] boolean mask is made
    first (4 GiB a sequence at 64K tokens)."""
    from torch.nn.attention.flex_attention import create_block_mask
    global _compiled_create_block_mask
    B, T = document.shape

    def same_document_causal(b, h, q, k):
        return (k <= q) & (document[b, q] == document[b, k])

    def same_document_window(b, h, q, k):
        return (k <= q) & (q - k < window) & (document[b, q] == document[b, k])

    if compiled and _compiled_create_block_mask is None:
        import torch
        _compiled_create_block_mask = torch.compile(create_block_mask)
    make = _compiled_create_block_mask if compiled else create_block_mask
    mask_mod = same_document_window if window > 0 else same_document_causal
    return make(mask_mod, B, None, T, T, device=document.device)


def measure_peak_tflops(n=8192, repeat=10):
    """bf16 GEMM n^3 through torch.matmul (cuBLAS): the ceiling MFU is measured against."""
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(repeat):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(a, b)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n ** 3 / statistics.median(times) / 1e12


def add_lora(model, lora, checkpointing):
    """PEFT's LoRA on the built (bf16) model: the base frozen, the adapters trainable in fp32."""
    import torch
    from peft import LoraConfig, get_peft_model
    if checkpointing:
        # PEFT's recipe (prepare_model_for_kbit_training, TRL): the frozen embedding's output is made to
        # require grad, so every checkpointed layer's input does. transformers 5.17's
        # gradient_checkpointing_enable registers the same hook; a second one changes nothing.
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                             target_modules=lora["targets"], bias="none", task_type="CAUSAL_LM"),
                           autocast_adapter_dtype=True)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    wrong = [f"{n} ({p.dtype})" for n, p in trainable if "lora_" not in n or p.dtype != torch.float32]
    if not trainable or wrong:
        raise RuntimeError(f"PEFT's trainable parameters should be the fp32 adapters alone; got {len(trainable)}, "
                           f"unexpected: {', '.join(wrong[:4]) or 'none'}")
    return model


def apply_liger(liger_transformers, family):
    """Liger's patch for the family with its options (liger_options), those its function takes (all of
    them in liger-kernel 0.8.5, for every family here); returns what was applied, for the JSON:
    {function, options, not_taken} (not_taken: the options the function has no parameter for)."""
    import inspect
    name = FAMILIES[family][2]
    wanted = liger_options(family)
    apply = getattr(liger_transformers, name, None)
    if apply is None:
        raise RuntimeError(f"--liger: liger_kernel.transformers has no {name}; this liger-kernel does not patch "
                           f"{family} models")
    params = inspect.signature(apply).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    options = {k: v for k, v in wanted.items() if takes_any or k in params}
    apply(**options)
    return dict(function=name, options=options, not_taken=sorted(set(wanted) - set(options)))


def run(args, res):
    import torch
    import transformers
    res["transformers"] = transformers.__version__
    d = load_config_dict(args.model)
    family = res["family"] = family_of(d)
    window = sliding_window_of(d)
    if window:
        res["sliding_window"] = window
    if family == "gemma2" and args.documents:
        raise ValueError("--documents with gemma2: the document mask here is one for every layer, and Gemma 2's "
                         "sliding and global layers need two; compare Gemma 2 without --documents")
    cfg = make_config(d)  # here, so a config chunkwise would refuse fails before any GPU work
    lora = res.get("lora")
    if lora:
        try:
            import peft
        except ImportError as e:
            raise RuntimeError(f"--lora-rank: peft is not importable ({e}); install the wheels: python3 -m pip "
                               "install --no-index --no-deps --target DIR .whl/peft-*.whl .whl/accelerate-*.whl and "
                               "set PYTHONPATH=DIR (tools/bench/model_vs_hf.py --peers peft-liger does it)")
        res["peft"] = peft.__version__
    # The first timed step's documents, as chunkwise bench counts them; without, one a sequence.
    starts = (document_starts(args.documents, args.batch, args.seq, DOCUMENT_SEED + args.warmup) if args.documents
              else [[0]] * args.batch)
    extent = mean_attention_extent(starts, args.seq, layer_windows(d))
    if args.documents or window:
        res["attention_extent"] = extent
    res["flops_per_token"] = flops_per_token(d, extent, lora)
    res["peak_tflops"] = args.peak_tflops if args.peak_tflops > 0 else measure_peak_tflops()
    torch.manual_seed(args.seed)
    if args.liger:
        # The long-context peer: Liger's Triton kernels patched into the family's HF modules before the
        # model is built (liger_options).
        try:
            import liger_kernel
            import liger_kernel.transformers as liger_transformers
        except ImportError as e:
            raise RuntimeError(f"--liger: liger_kernel is not importable ({e}); install the wheel: python3 -m pip "
                               "install --no-index --no-deps --target DIR .whl/liger_kernel-*.whl and set "
                               "PYTHONPATH=DIR (tools/bench/model_vs_hf.py --peers liger does it)")
        res["liger"] = getattr(liger_kernel, "__version__", None) or "installed"
        res["liger_patch"] = apply_liger(liger_transformers, family)
    res["rope"] = getattr(cfg, "rope_parameters", None) or dict(rope_theta=getattr(cfg, "rope_theta", None),
                                                              rope_scaling=getattr(cfg, "rope_scaling", None))
    # Packed documents need a mask that keeps them apart: FlexAttention's, given per step. Gemma 2's
    # score cap: transformers' SDPA path drops it (only eager and FlexAttention apply it), and eager
    # materialises every layer's T x T scores, so FlexAttention, as transformers advises for Gemma 2.
    # Mistral past its window: SDPA would get a T x T mask and visit every pair; FlexAttention skips
    # the blocks outside the window.
    windowed = family == "mistral" and 0 < window < args.seq
    attention = "flex_attention" if args.documents or family == "gemma2" or windowed else "sdpa"
    model_class = getattr(transformers, FAMILIES[family][1])
    with torch.device("cuda"):  # initialise on the device: the 8B shape would take minutes on the CPU
        if lora:  # the frozen base in bf16, as a PEFT user loads it
            model = model_class._from_config(cfg, attn_implementation=attention, dtype=torch.bfloat16)
        else:
            model = model_class._from_config(cfg, attn_implementation=attention)
            model.float()  # fp32 master weights whatever default dtype the installed version picks
    model.train()
    res["attn_implementation"] = model.config._attn_implementation
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        model = add_lora(model, lora, args.checkpointing)
    res["params"] = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    res["trainable_params"] = sum(p.numel() for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-5, fused=True)
    ids = torch.randint(0, d["vocab_size"], (args.batch, args.seq), device="cuda")
    mask_s = []

    def inputs_of_step(s):
        """The model's inputs at step s (warm-up counted): the ids as labels, or with documents step s's
        document mask, restarting positions and labels."""
        if not args.documents:
            return dict(labels=ids)
        t0 = time.perf_counter()
        starts = document_starts(args.documents, args.batch, args.seq, DOCUMENT_SEED + s)
        document, positions, labels = document_inputs(starts, ids)
        mask = document_block_mask(document, compiled=True, window=window)
        torch.cuda.synchronize()
        mask_s.append(time.perf_counter() - t0)
        return dict(attention_mask=mask, position_ids=positions, labels=labels)

    def step(inputs):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, use_cache=False, **inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for s in range(args.warmup):
        step(inputs_of_step(s))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for s in range(args.warmup, args.warmup + args.steps):
        inputs = inputs_of_step(s)  # before the clock, as chunkwise bench sets its batch's documents
        torch.cuda.synchronize()
        torch.cuda.profiler.start()  # a profiler's range: the timed steps (tools/kernel_profile)
        t0 = time.perf_counter()
        loss = step(inputs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        torch.cuda.profiler.stop()
        losses.append(float(loss))
    step_s = statistics.median(times)
    tps = args.batch * args.seq / step_s
    res.update(step_s=step_s, step_times=times, tokens_per_s=tps, loss=losses[-1],
               mfu=tps * res["flops_per_token"] / (res["peak_tflops"] * 1e12),
               peak_bytes=torch.cuda.max_memory_allocated(), reserved_bytes=torch.cuda.max_memory_reserved())
    res["peak_gib"] = res["peak_bytes"] / 2 ** 30
    res["reserved_gib"] = res["reserved_bytes"] / 2 ** 30
    if args.documents:
        res["mask_s"] = mask_s
    if not all(math.isfinite(x) for x in losses):
        res.update(status="error", error=f"non-finite loss {losses}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b",
                    help=f"{' | '.join(PRESETS)} or a config.json path (model_type {', '.join(FAMILIES)}; none: llama)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing (use_reentrant=False)")
    ap.add_argument("--liger", action="store_true",
                    help="apply Liger kernels first (the family's apply_liger_kernel_to_llama, _qwen2, _qwen3 or "
                    "_mistral, with the fused linear cross-entropy)")
    add_lora_args(ap)
    ap.add_argument("--documents", default="", metavar="SPEC",
                    help="packed documents of L tokens (L) or of lengths drawn in [LO, HI] (LO:HI), as chunkwise bench "
                    "--documents: FlexAttention with a document mask, positions restarting at each document")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 peak for MFU; 0 = measure (8192^3 matmul)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the result object here")
    args = ap.parse_args()
    try:
        lora = lora_settings(args)
        if args.documents:
            parse_documents(args.documents)
    except ValueError as e:
        ap.error(str(e))
    import torch  # here, not at the top: model_vs_hf.py imports this file's presets without torch

    res = dict(impl="hf", model=args.model, seq=args.seq, batch=args.batch,
               schedule="checkpointed" if args.checkpointing else "full", step_s=None, tokens_per_s=None, mfu=None,
               peak_bytes=None, peak_gib=None, reserved_gib=None, flops_per_token=None, peak_tflops=None,
               device=None, torch=torch.__version__, transformers=None, status="ok", error="",
               date=datetime.date.today().isoformat())
    if lora:
        res["lora"] = lora
    if args.documents:
        res["documents"] = args.documents
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible to torch")
        res["device"] = torch.cuda.get_device_name()
        run(args, res)
    except torch.OutOfMemoryError as e:
        res.update(status="oom", error=str(e).split("\n")[0][:300], step_s=None, tokens_per_s=None, mfu=None)
        try:  # how far it got: the peak before the failing allocation
            res["peak_bytes"] = torch.cuda.max_memory_allocated()
            res["peak_gib"] = res["peak_bytes"] / 2 ** 30
            res["reserved_gib"] = torch.cuda.max_memory_reserved() / 2 ** 30
        except Exception:
            pass
    except Exception as e:  # a result row, not a crash: the caller tabulates it
        res.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
        traceback.print_exc()
    text = json.dumps(res, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    if res["status"] == "ok":
        what = f"{res['schedule']}, LoRA rank {lora['rank']}" if lora else res["schedule"]
        what += f", documents {args.documents}" if args.documents else ""
        print(f"hf {args.model} seq {args.seq} {what}: {res['step_s']:.3f} s/step, "
              f"{res['tokens_per_s']:,.0f} tok/s, MFU {100 * res['mfu']:.1f}% of {res['peak_tflops']:.0f} TFLOP/s, "
              f"peak {res['peak_gib']:.1f} GiB", file=sys.stderr)
    sys.exit(1 if res["status"] == "error" else 0)


if __name__ == "__main__":
    main()
