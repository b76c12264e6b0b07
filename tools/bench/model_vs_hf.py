#!/usr/bin/env python3
"""chunkwise's training step against HF transformers', side by side on one GPU, one table.

For each case SCHEDULE:TOKENS (default: the issue's targets full:4096, full:8192, checkpointed:16384,
checkpointed:32768) this runs, one after the other and each in its own process (so neither sees the
other's allocator state):
  1. `chunkwise bench --model M --seq T --batch B --schedule SCHEDULE --steps S --warmup W --json F [--extra]`
  2. tools/bench/hf_reference.py --model M --seq T --batch B [--checkpointing] ... --peak-tflops P
     HF checkpoints activations for every schedule but `full` (it has no SeCO: layer checkpointing is
     what a user would pick for long sequences).
and prints tokens/s, MFU and peak device memory of each side, with the ratios ours / HF
(tokens/s: > 1 is faster; memory: < 1 is leaner). Writes model_vs_hf.json and model_vs_hf.md to --out.

Peers (--peers, comma-separated): `hf` (plain HF, as above) and `liger` (HF with Liger kernels:
hf_reference.py --liger, what a user picks today for long context). When liger_kernel is not
importable by --python, the wheel in .whl/ (python3 -m pip download --no-deps -d .whl
liger-kernel==0.8.5 on a machine with network) is installed into --out/site with
pip --no-index --no-deps --target and put on the peer's PYTHONPATH. --long-context runs the
SeCO-at-scale table: seco at 16K-256K (chunk 4096; 8192 at 256K) against HF+Liger checkpointed.

MFU: both sides are divided by the SAME bf16 peak, the one chunkwise measured in this run (its JSON's
peak_tflops; also handed to hf_reference.py so it does not measure its own), or --peak-tflops; and
the same FLOP count per token (hf_reference.flops_per_token: 6 per matmul parameter incl. the LM head
plus causal attention; recomputation is not counted as useful work).

A side that runs out of memory, fails, or exceeds --timeout becomes a row with that status, never a
crash. Run on the GPU machine: python3 tools/bench/model_vs_hf.py --out $OUT (HF runs under
--python, by default the torch venv's interpreter when present).
"""
import argparse
import datetime
import glob
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_reference  # noqa: E402  (presets and the FLOP count; torch is imported only when it runs)

DEFAULT_CASES = "full:4096,full:8192,checkpointed:16384,checkpointed:32768"
LONG_CONTEXT_CASES = ("seco:16384:--chunk 4096,seco:32768:--chunk 4096,seco:65536:--chunk 4096,"
                      "seco:131072:--chunk 4096,seco:262144:--chunk 8192")
PEER_NAMES = {"hf": "HF", "liger": "HF+Liger"}
TORCH_PY = "/opt/torch/.venv/bin/python3"


def parse_cases(text):
    cases = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        sched, _, rest = item.partition(":")
        seq, _, extra = rest.partition(":")
        if sched not in ("full", "checkpointed", "seco", "spaco") or not seq.isdigit():
            sys.exit(f"bad case '{item}': want SCHEDULE:TOKENS[:EXTRA ARGS] with SCHEDULE full | checkpointed | seco | spaco")
        cases.append((sched, int(seq), extra.strip()))
    return cases


def run_side(name, cmd, json_path, log_path, timeout, env=None):
    """Runs one side; returns its result object (from its JSON, or a status row when there is none)."""
    if os.path.exists(json_path):
        os.remove(json_path)
    t0 = time.time()
    status, err, rc = None, "", None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        status, err = "timeout", f"no result after {timeout} s"
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    except OSError as e:  # binary missing or not executable
        status, err, out = "error", f"cannot run {cmd[0]}: {e}", ""
    with open(log_path, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n" + out)
    res = None
    if status is None and os.path.exists(json_path):
        try:
            with open(json_path) as f:
                res = json.load(f)
        except (OSError, ValueError) as e:
            status, err = "error", f"unreadable result JSON: {e}"
    if res is None:
        tail = " | ".join(line for line in out.strip().splitlines()[-3:])
        res = dict(status=status or "error", error=err or f"exit {rc}, no result JSON: {tail}"[:400])
    elif rc not in (0, None) and res.get("status") == "ok":
        res.update(status="error", error=f"exit {rc} after writing an ok result")
    res.setdefault("status", "error")
    res.update(impl=name, rc=rc, wall_s=round(time.time() - t0, 1), log=os.path.basename(log_path))
    return res


def peer_env(python, out_dir):
    """The environment for the Liger peer: liger_kernel importable, from .whl/ if need be."""
    env = dict(os.environ)
    if subprocess.run([python, "-c", "import liger_kernel"], capture_output=True).returncode == 0:
        return env
    wheels = sorted(glob.glob(os.path.join(HERE, "..", "..", ".whl", "liger_kernel-*.whl")))
    if not wheels:
        sys.exit("--peers liger: liger_kernel is not importable and there is no .whl/liger_kernel-*.whl; "
                 "run `python3 -m pip download --no-deps -d .whl liger-kernel==0.8.5` where there is network")
    site = os.path.join(out_dir, "site")
    r = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, wheels[-1]],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"--peers liger: installing {wheels[-1]} failed: {r.stderr.strip()[-400:]}")
    env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def fmt_num(v, spec, suffix=""):
    return "-" if v is None else format(v, spec) + suffix


def ratio(a, b):
    return a / b if a and b else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunkwise", default="build/tools/chunkwise")
    ap.add_argument("--python", default=TORCH_PY if os.path.exists(TORCH_PY) else sys.executable,
                    help="interpreter with torch + transformers for the HF side")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="SCHEDULE:TOKENS[:OUR EXTRA ARGS],... (schedule full | checkpointed | seco), "
                    "e.g. checkpointed:16384:--recompute selective")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 peak for MFU; 0 = the one chunkwise measured")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    ap.add_argument("--extra", default="",
                    help="more arguments for `chunkwise bench`, as one string: --extra=\"--chunk 2048\"")
    ap.add_argument("--hf-extra", default="", help="more arguments for hf_reference.py")
    ap.add_argument("--out", default="model_vs_hf-out")
    ap.add_argument("--peers", default="hf", help="comma-separated: hf (plain HF) and/or liger (HF + Liger kernels)")
    ap.add_argument("--long-context", action="store_true",
                    help=f"the SeCO-at-scale table: cases {LONG_CONTEXT_CASES} against HF+Liger")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.long_context:
        a.cases, a.peers = LONG_CONTEXT_CASES, "liger"
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    if not peers or any(p not in PEER_NAMES for p in peers):
        sys.exit(f"--peers {a.peers}: choose from {', '.join(PEER_NAMES)}")
    envs = {p: (peer_env(a.python, a.out) if p == "liger" else None) for p in peers}
    cases = parse_cases(a.cases)
    try:
        cfg = hf_reference.load_config_dict(a.model)
    except OSError:
        cfg = None  # a model only chunkwise knows: MFU then comes from each side's own JSON

    rows = []
    peak = a.peak_tflops or None
    hf_done = {}  # (HF schedule, tokens) -> result: cases differing only in our options share one HF run
    for sched, seq, case_extra in cases:
        tag = f"{sched}-{seq}" + ("-" + "".join(ch for ch in case_extra if ch.isalnum() or ch == "-").strip("-")
                                   if case_extra else "")
        print(f"== {tag}: chunkwise", flush=True)
        ours_json = os.path.join(a.out, f"ours-{tag}.json")
        cmd = [a.chunkwise, "bench", "--model", a.model, "--seq", str(seq), "--batch", str(a.batch), "--schedule",
               sched, "--steps", str(a.steps), "--warmup", str(a.warmup), "--json", ours_json] + shlex.split(a.extra) + shlex.split(case_extra)
        ours = run_side("chunkwise", cmd, ours_json, os.path.join(a.out, f"ours-{tag}.log"), a.timeout)
        if peak is None and ours.get("peak_tflops"):
            peak = float(ours["peak_tflops"])
        hf_sched = "full" if sched == "full" else "checkpointed"
        for peer in peers:
            hf_key = (peer, hf_sched, seq)
            if hf_key not in hf_done:
                print(f"== {tag}: {PEER_NAMES[peer]} ({hf_sched})", flush=True)
                hf_json = os.path.join(a.out, f"{peer}-{tag}.json")
                cmd = [a.python, os.path.join(HERE, "hf_reference.py"), "--model", a.model, "--seq", str(seq),
                       "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup), "--json", hf_json]
                cmd += ["--checkpointing"] if hf_sched == "checkpointed" else []
                cmd += ["--liger"] if peer == "liger" else []
                cmd += ["--peak-tflops", str(peak)] if peak else []
                hf_done[hf_key] = run_side(peer, cmd + shlex.split(a.hf_extra), hf_json,
                                           os.path.join(a.out, f"{peer}-{tag}.log"), a.timeout, envs[peer])
            rows.append(dict(case=tag, schedule=sched, seq=seq, peer=peer, hf_schedule=hf_sched, ours=ours,
                             hf=dict(hf_done[hf_key])))

    # One FLOP count and one peak for both sides' MFU: --peak-tflops, else chunkwise's measurement,
    # else (chunkwise produced none) HF's.
    peak_source = "--peak-tflops" if peak else "chunkwise"
    if peak is None:
        peak = next((float(r["hf"]["peak_tflops"]) for r in rows if r["hf"].get("peak_tflops")), None)
        peak_source = "hf_reference.py" if peak else "nobody"
    for r in rows:
        fpt = hf_reference.flops_per_token(cfg, r["seq"]) if cfg else None
        for side in ("ours", "hf"):
            s = r[side]
            f = fpt or s.get("flops_per_token")
            ok = s.get("status") == "ok" and s.get("tokens_per_s")
            s["mfu_common"] = s["tokens_per_s"] * f / (peak * 1e12) if ok and f and peak else None
            if s.get("peak_gib") is None and s.get("peak_bytes"):
                s["peak_gib"] = s["peak_bytes"] / 2 ** 30
        both = r["ours"].get("status") == "ok" and r["hf"].get("status") == "ok"
        r["tokens_ratio"] = ratio(r["ours"].get("tokens_per_s"), r["hf"].get("tokens_per_s")) if both else None
        r["memory_ratio"] = ratio(r["ours"].get("peak_gib"), r["hf"].get("peak_gib")) if both else None

    device = next((r[s]["device"] for r in rows for s in ("ours", "hf") if r[s].get("device")), "unknown device")
    date = datetime.date.today().isoformat()
    head = ["case", "peer", "peer ckpt", "ours tok/s", "peer tok/s", "ours/peer tok/s", "ours MFU", "peer MFU",
            "ours peak GiB", "peer peak GiB", "ours/peer mem"]

    def cell(s, key, spec, suffix=""):
        if s.get("status") != "ok":
            # out of memory on one side is the result for memory too: say so in the side's cells
            return s.get("status", "error").upper() if key != "peak_gib" else "-"
        v = s.get(key)
        return fmt_num(v * 100 if key == "mfu_common" and v is not None else v, spec, suffix)

    table = []
    for r in rows:
        o, h = r["ours"], r["hf"]
        table.append([r["case"], PEER_NAMES[r["peer"]], "yes" if r["hf_schedule"] == "checkpointed" else "no",
                      cell(o, "tokens_per_s", ",.0f"), cell(h, "tokens_per_s", ",.0f"),
                      fmt_num(r["tokens_ratio"], ".2f", "x"), cell(o, "mfu_common", ".1f", "%"),
                      cell(h, "mfu_common", ".1f", "%"), cell(o, "peak_gib", ".1f"), cell(h, "peak_gib", ".1f"),
                      fmt_num(r["memory_ratio"], ".2f", "x")])
    widths = [max(len(str(x[i])) for x in table + [head]) for i in range(len(head))]
    title = (f"chunkwise vs {' and '.join(PEER_NAMES[p] for p in peers)}: {a.model}, batch {a.batch}, median of {a.steps} steps; {device}, {date}; "
             f"MFU of {fmt_num(peak, '.0f')} TFLOP/s (bf16 peak measured by "
             f"{peak_source} in this run) for both sides")
    print("\n" + title)
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for t in table:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(t, widths))))
    notes = []
    for r in rows:
        for side in ("ours", "hf"):
            s = r[side]
            if s.get("status") != "ok":
                who = "chunkwise" if side == "ours" else PEER_NAMES[r["peer"]]
                notes.append(f"{r['case']} {who}: {s.get('status')}: {s.get('error', '')} (log {s.get('log')})")
    for n in notes:
        print("  " + n)

    md = [f"{title}.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(str(c) for c in t) + " |" for t in table]
    if notes:
        md += [""] + [f"- {n}" for n in notes]
    with open(os.path.join(a.out, "model_vs_hf.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, "model_vs_hf.json"), "w") as f:
        json.dump(dict(model=a.model, batch=a.batch, steps=a.steps, device=device, date=date, peak_tflops=peak, peers=peers,
                       peak_source=peak_source,
                       extra=a.extra, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
