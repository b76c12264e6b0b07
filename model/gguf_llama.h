// Llama models from GGUF files: the metadata mapped onto LlamaConfig, the tensors onto the parameter
// table (model/params.h), dequantized (model/gguf.h) into the model's dtype.
//
// Metadata (general.architecture "llama", "qwen2", "qwen3" or "gemma2", llama.cpp's names; the other
// keys carry it as their prefix, written `llama.` below):
//   llama.block_count                       -> num_hidden_layers (L)
//   llama.embedding_length                  -> hidden_size (C)
//   llama.feed_forward_length               -> intermediate_size (F)
//   llama.attention.head_count              -> num_attention_heads (H)
//   llama.attention.head_count_kv           -> num_key_value_heads (Hkv; default H)
//   llama.attention.key_length              -> head_dim (D; default C / H); value_length and
//                                              rope.dimension_count, when present, must equal it
//   llama.context_length                    -> max_position_embeddings
//   llama.rope.freq_base                    -> rope_theta (default 10000)
//   llama.attention.layer_norm_rms_epsilon  -> rms_norm_eps
//   llama.attention.sliding_window          -> sliding_window (llama.cpp's key of a window; architecture
//                                              llama only, where it makes the model mistral: llama.cpp
//                                              writes Mistral's as llama, and transformers' Llama has
//                                              no window). Absent, as llama.cpp's converter leaves it for
//                                              Mistral 7B: no window, a llama model.
//   gemma2: Gemma 2's blocks (gelu gate, (1 + w) norms, post-norms, sqrt(C) embeddings); the even
//   layers slide through gemma2.attention.sliding_window keys (4096 when absent), the odd ones are
//   global; gemma2.attn_logit_softcapping and final_logit_softcapping (50 and 30 when absent, as
//   llama.cpp reads them); query_pre_attn_scalar = head_dim, but C / H for the 46-layer 27B
//   (llama.cpp's rule: GGUF does not store the scale).
//   llama.vocab_size, else the length of tokenizer.ggml.tokens, else token_embd's rows -> vocab_size
//   tokenizer.ggml.bos_token_id / eos_token_id / padding_token_id -> bos_token_id / eos_token_ids /
//                                              pad_token_id (as transformers' GGUF loader maps them)
//   no output.weight tensor                 -> tie_word_embeddings
//   RoPE scaling: llama.rope.scaling.type "linear" with llama.rope.scaling.factor (or the older
//   llama.rope.scale_linear) -> linear. Llama 3.1-style scaling is stored by llama.cpp's converter as
//   a tensor, rope_freqs.weight [D/2]: the divisor of each rotary frequency. Its parameters are
//   recovered (factor = the largest divisor; low 1, high 4, original context 8192, Llama 3.x's) and
//   every entry checked against them; a table that matches no llama3 scaling is refused.
//   Other scaling types (yarn, ...) and mixtures of experts (llama.expert_count > 0) are refused.
//
// Tensors (GGUF name -> HF name; shapes are the same once GGUF's innermost-first dims are reversed):
//   token_embd.weight         -> model.embed_tokens.weight          [V, C]
//   blk.{l}.attn_norm.weight  -> model.layers.{l}.input_layernorm.weight
//   blk.{l}.attn_q.weight     -> model.layers.{l}.self_attn.q_proj.weight   (rows un-permuted, below)
//   blk.{l}.attn_k.weight     -> model.layers.{l}.self_attn.k_proj.weight   (rows un-permuted, below)
//   blk.{l}.attn_v.weight     -> model.layers.{l}.self_attn.v_proj.weight
//   blk.{l}.attn_output.weight-> model.layers.{l}.self_attn.o_proj.weight
//   blk.{l}.ffn_norm.weight   -> model.layers.{l}.post_attention_layernorm.weight
//   blk.{l}.ffn_gate/up/down.weight -> model.layers.{l}.mlp.gate/up/down_proj.weight
//   output_norm.weight        -> model.norm.weight
//   output.weight             -> lm_head.weight (absent when tied)
//   qwen2: blk.{l}.attn_{q,k,v}.bias -> model.layers.{l}.self_attn.{q,k,v}_proj.bias
//   qwen3: blk.{l}.attn_{q,k}_norm.weight -> model.layers.{l}.self_attn.{q,k}_norm.weight
//   gemma2: blk.{l}.ffn_norm.weight -> model.layers.{l}.pre_feedforward_layernorm.weight;
//           blk.{l}.post_attention_norm.weight, post_ffw_norm.weight ->
//           model.layers.{l}.post_attention_layernorm.weight, post_feedforward_layernorm.weight;
//           every norm weight stored as 1 + w (llama.cpp's converter adds the 1 Gemma's RMSNorm
//           applies), read back as w; no output.weight (tied)
// qwen2, qwen3 and gemma2 rotate as HF does (llama.cpp's NEOX RoPE): their Q/K rows are not permuted;
// architecture llama's are (mistral's too).
// Every tensor of the table must be present with its configured shape; a tensor the table has no
// place for (a bias, say) is refused rather than ignored, since ignoring it would compute another model.
//
// The Q/K row permutation. HF's RoPE rotates the pair (x_i, x_{i+D/2}) of each head (rotate_half);
// ggml's rotates adjacent pairs (x_{2i}, x_{2i+1}). llama.cpp's converter therefore reorders the rows
// of q_proj (per query head) and k_proj (per K/V head) so that HF row h*D + s*D/2 + i (s = 0, 1;
// i < D/2) becomes GGUF row h*D + 2i + s. The loader undoes it: HF row h*D + s*D/2 + i is read from
// GGUF row h*D + 2i + s. (tools/bench/gguf_vs_hf.py checks the result against transformers' loader.)
#pragma once

#include "model/gguf.h"
#include "model/params.h"

#include <string>
#include <vector>

namespace cw {

// True for a regular file whose first four bytes are "GGUF" or whose name ends in ".gguf" (so that
// a damaged .gguf file reaches the GGUF reader and its error, not the config.json parser's).
bool is_gguf_file(const std::string& path);

// The model configuration the file describes (validated; errors name the file and the key).
LlamaConfig llama_config_from_gguf(const GgufReader& file);

// The GGUF tensor name of a parameter-table entry ("blk.3.attn_q.weight").
std::string gguf_tensor_name(const ParamSpec& spec);

// Reads every parameter of `params` (a CPU ParamSet of any float dtype) from the file, which must
// describe params.config() (see above for what is checked).
void load_gguf_weights(ParamSet& params, const GgufReader& file);

// GGUF row of HF row `hf_row` of a q_proj / k_proj weight with `heads` heads of head_dim rows each.
int64_t gguf_qk_row(int64_t hf_row, int64_t head_dim);

}  // namespace cw
