#!/usr/bin/env python3
"""chunkwise's training step against HF transformers', side by side on one GPU, one table.

For each case SCHEDULE:TOKENS (default: the short-sequence cases of docs/performance.md, full:4096,
full:8192, checkpointed:16384, checkpointed:32768) this runs, one after the other and each in its own
process (so neither sees the other's allocator state):
  1. `chunkwise bench --model M --seq T --batch B --schedule SCHEDULE --steps S --warmup W --json F [--extra]`
  2. tools/bench/hf_reference.py --model M --seq T --batch B [--checkpointing] ... --peak-tflops P
     HF checkpoints activations for every schedule but `full` (it has no SeCO: layer checkpointing is
     what a user would pick for long sequences).
and prints tokens/s, MFU and peak device memory of each side, with the ratios ours / HF
(tokens/s: > 1 is faster; memory: < 1 is leaner). Writes model_vs_hf.json and model_vs_hf.md to --out.
M (--model) is a preset both sides know (hf_reference.py's: Llama 3.x, Qwen2.5, Qwen3, Mistral 7B,
Gemma 2 and chunkwise's tiny shapes of each family) or a config.json path; the peer builds the
family's transformers class (model_type llama, qwen2, qwen3, mistral or gemma2) and, with Liger,
applies its patch.

Peers (--peers, comma-separated): `hf` (plain HF, as above), `liger` (HF with Liger kernels:
hf_reference.py --liger, what a user picks today for long context), and for LoRA `peft` (HF + PEFT:
hf_reference.py --lora-...) and `peft-liger` (HF + PEFT + Liger). A peer's modules beyond torch and
transformers (liger_kernel; peft and accelerate, which peft imports) that --python does not have come
from their wheels in .whl/ (python3 -m pip download --no-deps -d .whl liger-kernel==0.8.5 peft==0.21.2
accelerate==1.15.0 on a machine with network), installed into --out/site with pip --no-index --no-deps
--target and put on that peer's PYTHONPATH. --long-context runs the SeCO-at-scale table: seco at
16K-256K at its fastest measured settings (one chunk at 16K; chunk 4096 with saved attention outputs,
8192 at 256K) against HF+Liger checkpointed.

LoRA (--lora-rank R > 0, with --lora-alpha, --lora-dropout, --lora-targets, chunkwise bench's flags):
both sides train the same adapters on a frozen base, chunkwise with `bench --lora-rank R ...`, the peer
with hf_reference.py's same flags (PEFT, the base in bf16); only the peft peers take it, and they need
it. --lora-8b runs the LoRA table: llama-3.1-8b, rank 8 (unless --lora-rank), alpha 16 on q_proj,
v_proj, seco at 16K and 64K with chunk 4096 and with the planner's choice (--chunk auto
--offload-window auto), against HF+PEFT+Liger checkpointed.

Packed documents: a case whose chunkwise arguments (its own or --extra) hold `--documents SPEC` (L or
LO:HI, docs/packed_documents.md) hands the same `--documents SPEC` to its peers, so both sides train
the same documents at every step (hf_reference.py draws them as `chunkwise bench` does): the peer then
runs FlexAttention with a document-causal block mask and positions restarting at each document
(hf_reference.py's docstring). A case without it gives its peer none, e.g.
  --peers liger --cases "full:8192:,seco:65536:--chunk auto --offload-window auto --documents 8192"
compares full at 8K on one document, then seco on 64K tokens of 8K documents against HF+Liger on the
same documents. Both sides' MFU count the documents' causal squares (the first timed step's
documents: hf_reference.attention_extent); a note says where chunkwise's own count differs.

Within the peer's memory (--within-peer-memory): per case the first peer runs first, and chunkwise then
runs capped to that peer's measured peak (`bench --device-memory PEAK + 0.5`: the cap counts the CUDA
context, about 0.5 GiB outside the caching pool), so the row compares speed at no more memory than the
peer's. Give the cases `--chunk auto --offload-window auto` to let the planner choose within the cap.

Longest context (--longest SIDES, comma-separated among chunkwise and the peers): instead of the
table, each side runs alone from the first case's TOKENS (chunkwise with that case's schedule and
arguments, a peer checkpointed as above), doubling the tokens until a run is not ok (out of memory,
an error, or longer than --timeout) or past --search-to; the longest that ran is that side's answer.
With --lora-8b the case is seco:16384 with --chunk auto --offload-window auto. Writes longest.json
and longest.md to --out.

MFU: both sides are divided by the SAME bf16 peak, the one chunkwise measured in this run (its JSON's
peak_tflops; also handed to hf_reference.py so it does not measure its own), or --peak-tflops; and
the same FLOP count per token (hf_reference.flops_per_token: 6 per matmul parameter incl. the LM head
plus causal attention, over the documents' squares when packed and within each layer's sliding
window (Mistral's, Gemma 2's sliding layers');
with LoRA 4 per frozen matmul parameter and 6 per adapter parameter; recomputation is not counted as
useful work). A side whose own JSON counted otherwise (chunkwise's for a model this script knows)
gets a note under the table.

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
# seco's fastest measured settings per length (docs/performance.md, 2026-11-27): one chunk at 16K, saved
# attention outputs from 32K (chunk 8192 at 256K).
LONG_CONTEXT_CASES = ("seco:16384:--chunk 16384,seco:32768:--chunk 4096 --save-attention,"
                      "seco:65536:--chunk 4096 --save-attention,seco:131072:--chunk 4096 --save-attention,"
                      "seco:262144:--chunk 8192 --save-attention")
# The 8B LoRA table (docs/performance.md): chunk 4096 (the K/V store fits on the device at both lengths), and what the
# planner picks (`bench --chunk auto --offload-window auto`); both rows share one peer run per length.
LORA_8B_CASES = ("seco:16384:--chunk 4096,seco:16384:--chunk auto --offload-window auto,"
                 "seco:65536:--chunk 4096,seco:65536:--chunk auto --offload-window auto")
# --lora-8b --longest: from 16K, the planner choosing the chunk and the K/V layers moved to the host.
LORA_8B_LONGEST = "seco:16384:--chunk auto --offload-window auto"
PEER_NAMES = {"hf": "HF", "liger": "HF+Liger", "peft": "HF+PEFT", "peft-liger": "HF+PEFT+Liger"}
LIGER_PEERS, LORA_PEERS = ("liger", "peft-liger"), ("peft", "peft-liger")
# What each peer imports beyond torch and transformers, and where each module comes from when --python
# lacks it: its wheel in .whl/ and the requirement that downloads it (peft imports accelerate).
PEER_MODULES = {"hf": (), "liger": ("liger_kernel",), "peft": ("peft", "accelerate"),
                "peft-liger": ("liger_kernel", "peft", "accelerate")}
WHEELS = {"liger_kernel": ("liger_kernel-*.whl", "liger-kernel==0.8.5"), "peft": ("peft-*.whl", "peft==0.21.2"),
          "accelerate": ("accelerate-*.whl", "accelerate==1.15.0")}
TORCH_PY = "/opt/torch/.venv/bin/python3"
# The CUDA context, outside the caching pool, which `bench --device-memory` counts (tools/planner/planner.h).
CUDA_CONTEXT_GIB = 0.5


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


def documents_of(args):
    """The SPEC of `--documents SPEC` (or `--documents=SPEC`) in chunkwise's arguments (one string), the
    last one given; None without one."""
    words, spec = shlex.split(args), None
    for i, w in enumerate(words):
        if w == "--documents" and i + 1 < len(words):
            spec = words[i + 1]
        elif w.startswith("--documents="):
            spec = w.partition("=")[2]
    return spec


def attention_extent_of(documents, batch, seq, warmup, windows=()):
    """E of hf_reference.flops_per_token at one case: seq for one document a sequence, else the
    documents' squares of the first timed step (step `warmup`), as both sides count them; under the
    layers' sliding windows (`windows`, one a layer, 0: none; Mistral's and Gemma 2's) each layer's
    within its window, averaged over the layers."""
    if not documents and not any(windows):
        return seq
    starts = (hf_reference.document_starts(documents, batch, seq, hf_reference.DOCUMENT_SEED + warmup) if documents
              else [[0]] * batch)
    return hf_reference.mean_attention_extent(starts, seq, windows or [0])


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


def peer_envs(python, out_dir, peers):
    """Each peer's environment: None (the inherited one) when --python has the modules the peer imports
    (PEER_MODULES); else the wheels of the missing ones, from .whl/, installed once into OUT/site
    (pip --no-index --no-deps --target) and that directory first on the peer's PYTHONPATH."""
    needed = list(dict.fromkeys(m for p in peers for m in PEER_MODULES[p]))
    if not needed:
        return {p: None for p in peers}
    try:
        r = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))", *needed],
                           capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"--python {python}: {e}")
    if r.returncode != 0:
        sys.exit(f"--python {python} failed: {r.stderr.strip()[-400:]}")
    missing = r.stdout.split()
    wheels = []
    for m in missing:
        found = sorted(glob.glob(os.path.join(HERE, "..", "..", ".whl", WHEELS[m][0])))
        if not found:
            sys.exit(f"{','.join(peers)}: {m} is not installed for {python} and there is no "
                     f".whl/{WHEELS[m][0]}; run `python3 -m pip download --no-deps -d .whl "
                     f"{' '.join(WHEELS[x][1] for x in missing)}` where there is network")
        wheels.append(found[-1])
    env = None
    if wheels:
        site = os.path.join(out_dir, "site")
        r = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, *wheels],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{','.join(peers)}: installing {' '.join(wheels)} failed: {r.stderr.strip()[-400:]}")
        env = dict(os.environ)
        env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return {p: env if set(PEER_MODULES[p]) & set(missing) else None for p in peers}


def ours_cmd(a, sched, seq, case_extra, json_path, lora):
    """`chunkwise bench` at one case; the LoRA flags (if any) before --extra and the case's own arguments."""
    return ([a.chunkwise, "bench", "--model", a.model, "--seq", str(seq), "--batch", str(a.batch), "--schedule", sched,
             "--steps", str(a.steps), "--warmup", str(a.warmup), "--json", json_path]
            + hf_reference.lora_argv(lora) + shlex.split(a.extra) + shlex.split(case_extra))


def peer_cmd(a, peer, hf_sched, seq, json_path, lora, peak, documents=None):
    """hf_reference.py as `peer` at one case: --liger for the Liger peers, the LoRA flags for the PEFT ones,
    --documents SPEC where the case's chunkwise arguments pack documents."""
    cmd = [a.python, os.path.join(HERE, "hf_reference.py"), "--model", a.model, "--seq", str(seq),
           "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup), "--json", json_path]
    cmd += ["--checkpointing"] if hf_sched == "checkpointed" else []
    cmd += ["--documents", documents] if documents else []
    cmd += ["--liger"] if peer in LIGER_PEERS else []
    cmd += hf_reference.lora_argv(lora) if peer in LORA_PEERS else []
    cmd += ["--peak-tflops", str(peak)] if peak else []
    return cmd + shlex.split(a.hf_extra)


def case_tag(sched, seq, case_extra):
    return f"{sched}-{seq}" + ("-" + "".join(ch for ch in case_extra if ch.isalnum() or ch == "-").strip("-")
                               if case_extra else "")


def fmt_num(v, spec, suffix=""):
    return "-" if v is None else format(v, spec) + suffix


def ratio(a, b):
    return a / b if a and b else None


def planner_choice(args, ours):
    """What `chunkwise bench` resolved an `auto` in its arguments (--extra and the case's) to: the plan's
    settings in its JSON (an older binary's: its chunk and offload_window); None without one."""
    if "auto" not in args or "chunk" not in ours:
        return None
    settings = ours.get("plan", {}).get("settings")
    return settings or f"chunk {ours['chunk']}, offload window {ours.get('offload_window', 0)}"


def lora_text(lora):
    return (f"LoRA rank {lora['rank']}, alpha {lora['alpha']:g}, dropout {lora['dropout']:g} on "
            f"{','.join(lora['targets'])} (base frozen)")


def render(title, head, table, notes, md_path):
    """Prints the table (first column left-aligned) with its notes, and writes it as Markdown to md_path."""
    widths = [max(len(str(x[i])) for x in table + [head]) for i in range(len(head))]
    print("\n" + title)
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for t in table:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(t, widths))))
    for n in notes:
        print("  " + n)
    md = [f"{title}.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(str(c) for c in t) + " |" for t in table]
    if notes:
        md += [""] + [f"- {n}" for n in notes]
    with open(md_path, "w") as f:
        f.write("\n".join(md) + "\n")


def longest(a, sides, cases, lora, envs):
    """--longest: each side alone from the first case's tokens, doubling while its runs are ok and within
    --search-to; one row per side (the longest that ran, its tokens/s and peak), longest.json/.md."""
    sched, seq0, case_extra = cases[0]
    hf_sched = "full" if sched == "full" else "checkpointed"
    results = []
    for side in sides:
        tries, seq = [], seq0
        while seq <= a.search_to:
            tag = f"longest-{side}-" + case_tag(sched if side == "chunkwise" else hf_sched, seq,
                                                  case_extra if side == "chunkwise" else "")
            print(f"== {tag}", flush=True)
            json_path, log_path = os.path.join(a.out, tag + ".json"), os.path.join(a.out, tag + ".log")
            if side == "chunkwise":
                cmd, env = ours_cmd(a, sched, seq, case_extra, json_path, lora), None
            else:
                cmd, env = peer_cmd(a, side, hf_sched, seq, json_path, lora, a.peak_tflops or None,
                                    documents_of(f"{a.extra} {case_extra}")), envs[side]
            tries.append(dict(run_side(side, cmd, json_path, log_path, a.timeout, env), seq=seq))
            if tries[-1]["status"] != "ok":
                break
            seq *= 2
        ok = [t for t in tries if t["status"] == "ok"]
        results.append(dict(side=side, schedule=(f"{sched} {case_extra}".strip() if side == "chunkwise" else hf_sched),
                            longest=ok[-1]["seq"] if ok else None, tries=tries))

    device = next((t["device"] for r in results for t in r["tries"] if t.get("device")), "unknown device")
    date = datetime.date.today().isoformat()
    head = ["side", "schedule", "longest tokens", "tok/s there", "peak GiB there", "stopped by"]
    table, notes = [], []
    for r in results:
        who = "chunkwise" if r["side"] == "chunkwise" else PEER_NAMES[r["side"]]
        last_ok = next((t for t in reversed(r["tries"]) if t["status"] == "ok"), {})
        stop = r["tries"][-1] if r["tries"] and r["tries"][-1]["status"] != "ok" else None
        if stop:
            notes.append(f"{who} at {stop['seq']:,}: {stop['status']}: {stop.get('error', '')} (log {stop.get('log')})")
        choice = planner_choice(f"{a.extra} {case_extra}", last_ok) if r["side"] == "chunkwise" else None
        table.append([who, r["schedule"] + (f" ({choice})" if choice else ""), fmt_num(r["longest"], ","),
                      fmt_num(last_ok.get("tokens_per_s"), ",.0f"),
                      fmt_num(last_ok.get("peak_gib"), ".1f"),
                      f"{stop['status'].upper()} at {stop['seq']:,}" if stop else f"--search-to {a.search_to:,}"])
    title = (f"Longest context: {a.model}, batch {a.batch}" + (f", {lora_text(lora)}" if lora else "") +
             f"; tokens doubled from {seq0:,}, median of {a.steps} steps, at most {a.timeout:g} s a run; "
             f"{device}, {date}")
    render(title, head, table, notes, os.path.join(a.out, "longest.md"))
    with open(os.path.join(a.out, "longest.json"), "w") as f:
        json.dump(dict(model=a.model, batch=a.batch, steps=a.steps, device=device, date=date, lora=lora, start=seq0,
                       search_to=a.search_to, timeout=a.timeout, extra=a.extra, sides=results), f, indent=2)


def write_chart(a, rows, device, date):
    """The table as a picture: model_vs_hf.csv in `chunkwise chart`'s format (a series per side and
    setting, a row per measured run) and model_vs_hf.svg drawn from it."""
    seen, lines = set(), ["series,tokens,tokens_per_s,peak_gib,source"]
    for r in rows:
        sides = [("ours", f"chunkwise {r['schedule']} {r['ours_args']}".strip()),
                 ("hf", f"{PEER_NAMES[r['peer']]} ({r['hf_schedule']})")]
        for side, series in sides:
            s = r[side]
            key = (series, r["seq"])
            if s.get("status") != "ok" or key in seen:
                continue
            seen.add(key)
            peak = s.get("peak_gib")
            lines.append(",".join([series.replace(",", ";"), str(r["seq"]), f"{s['tokens_per_s']:.0f}",
                                   f"{peak:.2f}" if peak is not None else "",
                                   f"model_vs_hf.py on {device}, {date}"]))
    csv_path = os.path.join(a.out, "model_vs_hf.csv")
    with open(csv_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    if len(lines) > 1 and os.path.exists(a.chunkwise):
        svg = os.path.join(a.out, "model_vs_hf.svg")
        done = subprocess.run([a.chunkwise, "chart", csv_path, "--out", svg, "--title",
                               f"{a.model}: chunkwise against {', '.join(sorted({PEER_NAMES[r['peer']] for r in rows}))}"],
                              capture_output=True, text=True)
        print(done.stdout.strip() or done.stderr.strip(), flush=True)


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
    ap.add_argument("--peers", default="hf", help=f"comma-separated: {' | '.join(PEER_NAMES)} (peft peers: with LoRA)")
    hf_reference.add_lora_args(ap)
    preset = ap.add_mutually_exclusive_group()
    preset.add_argument("--long-context", action="store_true",
                        help=f"the SeCO-at-scale table: cases {LONG_CONTEXT_CASES} (unless --cases) against HF+Liger")
    preset.add_argument("--lora-8b", action="store_true",
                        help=f"the LoRA table: llama-3.1-8b, rank 8 unless --lora-rank, cases {LORA_8B_CASES} (unless --cases) "
                        f"against HF+PEFT+Liger (with --longest: from {LORA_8B_LONGEST})")
    ap.add_argument("--longest", metavar="SIDES",
                    help="instead of the table: per side (chunkwise and/or peers, comma-separated), the longest "
                    "sequence that runs, doubling from the first case's tokens")
    ap.add_argument("--search-to", type=int, default=1 << 20, help="--longest: tokens not to go beyond")
    ap.add_argument("--within-peer-memory", action="store_true",
                    help="run each case's first peer first, then chunkwise capped to its measured peak "
                    "(bench --device-memory)")
    a = ap.parse_args()
    # The presets' cases unless --cases was given.
    own_cases = a.cases != DEFAULT_CASES
    if a.long_context:
        a.peers = "liger"
        a.cases = a.cases if own_cases else LONG_CONTEXT_CASES
    if a.lora_8b:
        a.model, a.peers = "llama-3.1-8b", "peft-liger"
        a.cases = a.cases if own_cases else LORA_8B_LONGEST if a.longest is not None else LORA_8B_CASES
        a.lora_rank = a.lora_rank or 8
    try:
        lora = hf_reference.lora_settings(a)
    except ValueError as e:
        ap.error(str(e))
    if a.longest is None:
        peers = [p.strip() for p in a.peers.split(",") if p.strip()]
        if not peers or any(p not in PEER_NAMES for p in peers):
            sys.exit(f"--peers {a.peers}: choose from {', '.join(PEER_NAMES)}")
    else:
        sides = list(dict.fromkeys(x.strip() for x in a.longest.split(",") if x.strip()))
        if not sides or any(x != "chunkwise" and x not in PEER_NAMES for x in sides):
            sys.exit(f"--longest {a.longest}: choose from chunkwise, {', '.join(PEER_NAMES)}")
        peers = [x for x in sides if x != "chunkwise"]
    if not lora and any(p in LORA_PEERS for p in peers):
        sys.exit(f"{', '.join(p for p in peers if p in LORA_PEERS)}: a PEFT peer trains LoRA adapters; give their "
                 "settings, which chunkwise gets too: --lora-rank R [--lora-alpha A] [--lora-dropout P] "
                 "[--lora-targets q_proj,v_proj] (or --lora-8b)")
    if lora and any(p not in LORA_PEERS for p in peers):
        full = ", ".join(p for p in peers if p not in LORA_PEERS)
        sys.exit(f"--lora-rank {lora['rank']}: chunkwise trains LoRA adapters, {full} every parameter; "
                 f"compare with {' or '.join(LORA_PEERS)}")
    os.makedirs(a.out, exist_ok=True)
    envs = peer_envs(a.python, a.out, peers)
    cases = parse_cases(a.cases)
    for _, _, case_extra in cases:  # a spec chunkwise would refuse: said here, before any run
        try:
            spec = documents_of(f"{a.extra} {case_extra}")
            if spec is not None:
                hf_reference.parse_documents(spec)
        except ValueError as e:
            sys.exit(f"case '{case_extra}': {e}")
    if a.longest is not None:
        longest(a, sides, cases, lora, envs)
        return
    try:
        cfg = hf_reference.load_config_dict(a.model)
        window = hf_reference.sliding_window_of(cfg)
        windows = hf_reference.layer_windows(cfg)
    except (OSError, ValueError):
        cfg, window, windows = None, 0, ()  # a model only chunkwise knows: MFU then from each side's own JSON

    rows = []
    peak = a.peak_tflops or None
    # (peer, HF schedule, tokens, documents) -> result: cases differing only in our options share one HF run
    hf_done = {}
    def run_peer(peer, hf_sched, seq, documents, tag):
        hf_key = (peer, hf_sched, seq, documents)
        if hf_key not in hf_done:
            print(f"== {tag}: {PEER_NAMES[peer]} ({hf_sched}{', documents ' + documents if documents else ''})",
                  flush=True)
            hf_json = os.path.join(a.out, f"{peer}-{tag}.json")
            hf_done[hf_key] = run_side(peer, peer_cmd(a, peer, hf_sched, seq, hf_json, lora, peak, documents), hf_json,
                                       os.path.join(a.out, f"{peer}-{tag}.log"), a.timeout, envs[peer])
        return hf_done[hf_key]

    for sched, seq, case_extra in cases:
        tag = case_tag(sched, seq, case_extra)
        hf_sched = "full" if sched == "full" else "checkpointed"
        extra = case_extra
        documents = documents_of(f"{a.extra} {case_extra}")
        if a.within_peer_memory:
            first = run_peer(peers[0], hf_sched, seq, documents, tag)
            cap = first.get("peak_gib") or (first.get("peak_bytes") or 0) / 2 ** 30
            if first.get("status") != "ok" or not cap:
                print(f"== {tag}: chunkwise skipped: {PEER_NAMES[peers[0]]} has no peak to stay within", flush=True)
                continue
            extra = f"{case_extra} --device-memory {cap + CUDA_CONTEXT_GIB:.2f}".strip()
        print(f"== {tag}: chunkwise", flush=True)
        ours_json = os.path.join(a.out, f"ours-{tag}.json")
        ours = run_side("chunkwise", ours_cmd(a, sched, seq, extra, ours_json, lora), ours_json,
                        os.path.join(a.out, f"ours-{tag}.log"), a.timeout)
        if peak is None and ours.get("peak_tflops"):
            peak = float(ours["peak_tflops"])
        for peer in peers:
            rows.append(dict(case=tag, schedule=sched, seq=seq, ours_args=extra, peer=peer, hf_schedule=hf_sched,
                             documents=documents, ours=ours, hf=dict(run_peer(peer, hf_sched, seq, documents, tag))))

    # One FLOP count and one peak for both sides' MFU: --peak-tflops, else chunkwise's measurement,
    # else (chunkwise produced none) HF's.
    peak_source = "--peak-tflops" if a.peak_tflops else "chunkwise"
    if peak is None:
        peak = next((float(r["hf"]["peak_tflops"]) for r in rows if r["hf"].get("peak_tflops")), None)
        peak_source = "hf_reference.py" if peak else "nobody"
    counted_otherwise = []  # a side's own FLOP count that is not this script's (for documents: other draws)
    for r in rows:
        extent = attention_extent_of(r["documents"], a.batch, r["seq"], a.warmup, windows)
        fpt = hf_reference.flops_per_token(cfg, extent, lora) if cfg else None
        for side in ("ours", "hf"):
            s = r[side]
            # spaco's own count is of the chunks it backpropagated (bench's visited fraction): not comparable
            own = s.get("flops_per_token") if side == "hf" or r["schedule"] != "spaco" else None
            if fpt and own and abs(own - fpt) > 1e-6 * fpt:
                who = "chunkwise" if side == "ours" else PEER_NAMES[r["peer"]]
                why = [w for w, on in (("its documents were drawn otherwise", r["documents"]),
                                       (f"it counts the sliding window of {window} keys otherwise", window)) if on]
                counted_otherwise.append(f"{r['case']} {who}: its own count is {own / 1e9:.4f} GFLOP/token, this "
                                         f"table's {fpt / 1e9:.4f}" + (f" ({' or '.join(why)}?)" if why else ""))
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
    title = (f"chunkwise vs {' and '.join(PEER_NAMES[p] for p in peers)}: {a.model}"
             + (f", {lora_text(lora)}" if lora else "")
             + f", batch {a.batch}, median of {a.steps} steps; {device}, {date}; "
             f"MFU of {fmt_num(peak, '.0f')} TFLOP/s (bf16 peak measured by "
             f"{peak_source} in this run) for both sides")
    notes = []
    for r in rows:
        choice = planner_choice(f"{a.extra} {r['ours_args']}", r["ours"]) if r["peer"] == peers[0] else None
        if choice:
            notes.append(f"{r['case']} chunkwise: the planner chose {choice}")
    notes += list(dict.fromkeys(counted_otherwise))
    for r in rows:
        for side in ("ours", "hf"):
            s = r[side]
            if s.get("status") != "ok":
                who = "chunkwise" if side == "ours" else PEER_NAMES[r["peer"]]
                notes.append(f"{r['case']} {who}: {s.get('status')}: {s.get('error', '')} (log {s.get('log')})")
    render(title, head, table, notes, os.path.join(a.out, "model_vs_hf.md"))
    write_chart(a, rows, device, date)
    with open(os.path.join(a.out, "model_vs_hf.json"), "w") as f:
        json.dump(dict(model=a.model, batch=a.batch, steps=a.steps, device=device, date=date, peak_tflops=peak, peers=peers,
                       peak_source=peak_source, lora=lora,
                       extra=a.extra, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
