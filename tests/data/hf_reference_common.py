"""What tests/data/qwen_reference.py, mistral_reference.py and gemma2_reference.py share: transformers'
float32 RMSNorm, RoPE angles and eager attention's softmax patched to float64 (the same formulas), a
model drawn in float64 with norm weights away from 1, and a case written as the C++ tests read it
(tests/model/hf_reference.h): save_pretrained's config.json and model.safetensors, and
expected.safetensors with the ids, the logits, the causal-LM loss written out in float64 and every
parameter's gradient.
"""
import os

import torch
from safetensors.torch import save_file


def rmsnorm_f64(self, x):
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def rotary_f64(self, x, position_ids):
    D = self.config.head_dim if getattr(self.config, "head_dim", None) else \
        self.config.hidden_size // self.config.num_attention_heads
    theta = self.config.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = position_ids[..., None].to(torch.float64) * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def patch(classes, on):
    """classes: (RMSNorm class, rotary embedding class) pairs whose forward becomes float64 (on) or
    transformers' own (off)."""
    for norm, rotary in classes:
        for cls, fn in ((norm, rmsnorm_f64), (rotary, rotary_f64)):
            if not hasattr(cls, "_hf_forward"):
                cls._hf_forward = cls.forward
            cls.forward = fn if on else cls._hf_forward


def eager_attention_f64(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, **kwargs):
    """transformers' eager_attention_forward (the same lines; Gemma 2's with its score cap) with its
    softmax in the query's dtype (float64) rather than float32."""
    def repeat_kv(x, n_rep):
        b, h, s, d = x.shape
        return x if n_rep == 1 else x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if softcap is not None:
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=query.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def patch_eager(modeling_module, on):
    """A modeling module's eager_attention_forward becomes eager_attention_f64 (on) or its own (off)."""
    if not hasattr(modeling_module, "_hf_eager"):
        modeling_module._hf_eager = modeling_module.eager_attention_forward
    modeling_module.eager_attention_forward = eager_attention_f64 if on else modeling_module._hf_eager


def draw_f64(model):
    """Norm weights near 1, biases near 0, the rest at 0.2: every path carries signal."""
    model = model.to(torch.float64)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or "layernorm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def loss_and_grads(model, ids):
    """Logits, HF's causal-LM loss in float64 (cross-entropy of the logits at t against the id at
    t + 1, mean over B (T - 1)) and its gradient in every parameter."""
    model.zero_grad()
    out = model(input_ids=ids)
    V = out.logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    loss.backward()
    return out.logits.detach(), loss


def write_case(model, out_dir, ids, logits, loss):
    """save_pretrained's files (without generation_config.json) and expected.safetensors."""
    model.save_pretrained(out_dir, safe_serialization=True)
    os.remove(os.path.join(out_dir, "generation_config.json"))
    B, T = ids.shape
    tensors = {"ids": ids.to(torch.int32).contiguous(),
               "logits": logits.reshape(B * T, -1).contiguous(),
               "loss": loss.detach().reshape(1)}
    for pname, p in model.named_parameters():
        tensors["grad." + pname] = p.grad.detach().contiguous()
    save_file(tensors, os.path.join(out_dir, "expected.safetensors"))
    for f in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, f), 0o644)
