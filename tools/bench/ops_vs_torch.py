#!/usr/bin/env python3
"""Op-level benchmark: chunkwise's GPU ops against torch's on identical shapes, one table.

Runs `chunkwise bench-ops --json` and then the torch equivalents (torch.nn.functional.rms_norm,
rotate-half RoPE written in torch ops, silu(gate) * up, add, embedding, F.linear) on the same shapes
and dtype, each the median of CUDA-event timings after a warm-up, on random data. Ratios > 1 mean
chunkwise is faster. The copy row is the bandwidth ceiling both are measured against.
"""
import argparse
import json
import subprocess
import sys

import torch
import torch.nn.functional as F


def median_ms(fn, repeat=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunkwise", default="build/tools/chunkwise")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default="ops_vs_torch.json")
    a = ap.parse_args()
    N, C, Fd, H, D, V = a.tokens, 2048, 8192, 32, 64, 128256
    r = subprocess.run([a.chunkwise, "bench-ops", "--tokens", str(N), "--json", "/tmp/ours.json"], capture_output=True,
                       text=True)
    if r.returncode:
        sys.exit(r.stdout + r.stderr)
    print(r.stdout)
    ours = {row["op"]: row for row in json.load(open("/tmp/ours.json"))}

    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(N, C, device=dev, dtype=dt)
    w = torch.randn(C, device=dev, dtype=dt) + 1
    dy = torch.randn(N, C, device=dev, dtype=dt)
    q = torch.randn(1, N, H, D, device=dev, dtype=dt)
    pos = torch.arange(N, device=dev, dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    ang = torch.outer(pos, inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :].to(dt)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :].to(dt)
    gate = torch.randn(N, Fd, device=dev, dtype=dt)
    up = torch.randn(N, Fd, device=dev, dtype=dt)
    dact = torch.randn(N, Fd, device=dev, dtype=dt)
    table = torch.randn(V, C, device=dev, dtype=dt)
    ids = torch.randint(0, V, (N,), device=dev)
    wsq = torch.randn(C, C, device=dev, dtype=dt)
    wup = torch.randn(Fd, C, device=dev, dtype=dt)

    def rot(t):
        h = t.shape[-1] // 2
        return torch.cat([-t[..., h:], t[..., :h]], -1)

    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    yr = F.rms_norm(xr, (C,), wr, 1e-5)
    g_r, u_r = gate.clone().requires_grad_(), up.clone().requires_grad_()
    a_r = F.silu(g_r) * u_r
    tbl = table.clone().requires_grad_()
    e_r = F.embedding(ids, tbl)
    xl = x.clone().requires_grad_()
    wl = wsq.clone().requires_grad_()
    yl = F.linear(xl, wl)
    torch_ms = {
        "copy (d2d)": median_ms(lambda: x.clone()),
        "rmsnorm fwd": median_ms(lambda: F.rms_norm(x, (C,), w, 1e-5)),
        "rmsnorm bwd": median_ms(lambda: torch.autograd.grad(yr, (xr, wr), dy, retain_graph=True)),
        "rope fwd (q)": median_ms(lambda: q * cos + rot(q) * sin),
        "swiglu fwd": median_ms(lambda: F.silu(gate) * up),
        "swiglu bwd": median_ms(lambda: torch.autograd.grad(a_r, (g_r, u_r), dact, retain_graph=True)),
        "residual add": median_ms(lambda: x + dy),
        "embedding fwd": median_ms(lambda: F.embedding(ids, table)),
        "embedding bwd": median_ms(lambda: torch.autograd.grad(e_r, tbl, x, retain_graph=True)),
        "linear fwd NxCxC": median_ms(lambda: F.linear(x, wsq)),
        "linear bwd NxCxC": median_ms(lambda: torch.autograd.grad(yl, (xl, wl), dy, retain_graph=True)),
        "linear fwd NxCxF": median_ms(lambda: F.linear(x, wup)),
    }
    print(f"{'op':<20} {'chunkwise ms':>13} {'torch ms':>10} {'speedup':>8} {'ours % copy':>12}")
    rows = []
    for op, tm in torch_ms.items():
        o = ours[op]
        share = f"{100 * o['copy_share']:.0f}%" if o["gb_s"] > 0 else ""
        print(f"{op:<20} {o['ms']:>13.4f} {tm:>10.4f} {tm / o['ms']:>7.2f}x {share:>12}")
        rows.append(dict(op=op, chunkwise_ms=o["ms"], torch_ms=tm, speedup=tm / o["ms"], copy_share=o["copy_share"],
                         tflop_s=o["tflop_s"]))
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, tokens=N, rows=rows),
              open(a.out, "w"), indent=2)


if __name__ == "__main__":
    main()
