#!/usr/bin/env python3
# python3 tests/engine/lm_head_lse_sim.py (numpy): docs/gpu_op_checks.md, "lm_head_loss: the reference given the GPU's lse".
# The op table's lm_head_loss N=7 C=5 V=11 row in bf16, simulated over seeds: the GPU kernel
# (logits rounded to bf16, lse and G in f32 from them, G rounded to bf16, f32 GEMMs, d_x rounded to
# bf16) against the f64 reference's backward given (old) the tested side's lse, (new) its own.
import numpy as np
def bf16(a):
    a = np.asarray(a, np.float32); b = a.view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
N, C, V = 7, 5, 11; norm = 0.75 * N; S = 20000
fail_old = fail_new = 0; worst_old = worst_new = 0
r = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
for seed in range(S):
    rng = np.random.default_rng(seed)
    x = bf16(rng.standard_normal((N, C))).astype(np.float64)
    W = bf16(rng.normal(0, 2 / np.sqrt(C), (V, C))).astype(np.float64)
    y = rng.integers(0, V, N); y[3] = -100; y[0] = 0; y[N - 1] = V - 1
    sup = y >= 0
    oh = np.zeros((N, V)); oh[sup, y[sup]] = 1
    l = x @ W.T
    lse = np.log(np.exp(l).sum(1, keepdims=True))
    lb = bf16(l).astype(np.float32)
    lse_gpu = np.log(np.exp(lb.astype(np.float64)).sum(1, keepdims=True)).astype(np.float32)
    Gb = bf16(((np.exp(lb - lse_gpu) - oh) / norm).astype(np.float32)).astype(np.float64); Gb[~sup] = 0
    dxb, dWb = bf16(Gb @ W).astype(np.float64), Gb.T @ x
    def ref(lse_used):
        G = (np.exp(l - lse_used) - oh) / norm; G[~sup] = 0
        return G @ W, G.T @ x
    dxo, dWo = ref(lse_gpu.astype(np.float64)); dxn, dWn = ref(lse)
    eo, en = max(r(dxb, dxo), r(dWb, dWo)), max(r(dxb, dxn), r(dWb, dWn))
    fail_old += eo > 0.02; fail_new += en > 0.02; worst_old = max(worst_old, eo); worst_new = max(worst_new, en)
print(f"{S} seeds, tolerance 0.02: reference given the tested lse fails {fail_old} ({100*fail_old/S:.2f}%), worst {worst_old:.3g}; "
      f"given its own lse fails {fail_new}, worst {worst_new:.3g}")
