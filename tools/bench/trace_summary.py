#!/usr/bin/env python3
"""Where a traced step's time went: a `--trace` file (engine/trace.h) read back as a few lines.

  python3 tools/bench/trace_summary.py step.json [--json out.json]

Prints the step's span, the busy time of the compute stream by phase kind (layer forward /
recompute / backward, LM head), the copy lanes' busy time and bytes (fetch / store), how much of
the copy time ran under compute (overlap), and the compute stream's idle gaps: the time the step
waited (on copies, or on the host). Phases nest (a chunk holds its layers), so kinds are counted on
the innermost events only.

A wait inside a phase (a layer's compute waiting for its copies) is no gap: it lengthens the phase.
So the summary also lists the layers that ran longer than the median of their kind at the same chunk
(the "excess"), summed by kind and layer: the place of a copy wait, or of anything else that slows
one layer of every chunk (at 128K this found the copies waited for at the turns of the reverse sweep:
docs/decisions.md, "The K/V store in host memory").
"""
import argparse
import json
import re
import sys


def merged(intervals):
    out = []
    for b, e in sorted(intervals):
        if out and b <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([b, e])
    return out


def total(intervals):
    return sum(e - b for b, e in intervals)


def intersection(a, b):
    i = j = 0
    s = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            s += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return s


def kind(name):
    m = re.match(r"layer \d+ (\w+)", name)
    if m:
        return "layer " + m.group(1)
    if name.startswith("lm head"):
        return "lm head + loss"
    m = re.match(r"(fetch|store) (\w+)", name)
    if m:
        return f"{m.group(1)} {m.group(2)}"
    return None  # chunk spans


def summarise(events):
    xs = [e for e in events if e.get("ph") == "X"]
    if not xs:
        sys.exit("trace_summary: no complete events in the trace")
    t0 = min(e["ts"] for e in xs)
    t1 = max(e["ts"] + e["dur"] for e in xs)
    compute = [e for e in xs if e.get("cat") == "compute"]
    copies = [e for e in xs if e.get("cat") == "copy"]
    by_kind = {}
    for e in compute + copies:
        k = kind(e["name"])
        if k:
            d = by_kind.setdefault(k, {"events": 0, "us": 0.0, "bytes": 0})
            d["events"] += 1
            d["us"] += e["dur"]
            d["bytes"] += e.get("args", {}).get("bytes", 0)
    busy = merged([[e["ts"], e["ts"] + e["dur"]] for e in compute if kind(e["name"])])
    copy_busy = merged([[e["ts"], e["ts"] + e["dur"]] for e in copies])
    span = t1 - t0
    return {
        "span_s": span / 1e6,
        "compute_busy_s": total(busy) / 1e6,
        "compute_idle_s": (span - total(busy)) / 1e6,
        "copy_busy_s": total(copy_busy) / 1e6,
        "copy_under_compute_s": intersection(busy, copy_busy) / 1e6,
        "copy_gib": sum(e.get("args", {}).get("bytes", 0) for e in copies) / 2**30,
        "kinds": {k: {"events": v["events"], "s": v["us"] / 1e6, "gib": v["bytes"] / 2**30}
                  for k, v in sorted(by_kind.items())},
    }


def excess(events, at_least_ms=0.3):
    """Per (kind, layer): the milliseconds its phases ran beyond the median of their kind at the same
    chunk (only excesses of at least `at_least_ms` counted), largest first."""
    groups = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "compute":
            continue
        m = re.match(r"layer (\d+) (\w+)$", e["name"])
        t1 = e.get("args", {}).get("t1")
        if m and t1 is not None:
            groups.setdefault((m.group(2), t1), []).append((int(m.group(1)), e["dur"] / 1e3))
    out = {}
    for (k, _), runs in groups.items():
        durs = sorted(d for _, d in runs)
        median = durs[len(durs) // 2]
        for layer, d in runs:
            if d - median >= at_least_ms:
                out[(k, layer)] = out.get((k, layer), 0.0) + d - median
    return sorted(out.items(), key=lambda kv: -kv[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--json", help="also write the summary as JSON")
    a = ap.parse_args()
    try:
        with open(a.trace) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"trace_summary: {a.trace}: {e} (want the JSON that --trace writes)")
    s = summarise(doc.get("traceEvents", []))
    print(f"step span {s['span_s']:.3f} s: compute busy {s['compute_busy_s']:.3f} s, "
          f"idle {s['compute_idle_s']:.3f} s ({100 * s['compute_idle_s'] / s['span_s']:.1f}%)")
    if s["copy_busy_s"] > 0:
        print(f"copies: {s['copy_gib']:.1f} GiB in {s['copy_busy_s']:.3f} s with a copy lane busy, "
              f"{s['copy_under_compute_s']:.3f} s of it under compute "
              f"({100 * s['copy_under_compute_s'] / s['copy_busy_s']:.1f}%)")
    for k, v in s["kinds"].items():
        extra = f", {v['gib']:.2f} GiB" if v["gib"] else ""
        print(f"  {k:<18} {v['events']:>6} events {v['s']:9.3f} s{extra}")
    ex = excess(doc.get("traceEvents", []))
    if ex:
        total = sum(ms for _, ms in ex)
        top = ", ".join(f"{k} {layer}: {ms:.1f}" for (k, layer), ms in ex[:6])
        print(f"layers longer than their kind's median at the same chunk: {total:.1f} ms in all (ms; largest: {top})")
    s["excess_ms"] = [{"kind": k, "layer": layer, "ms": ms} for (k, layer), ms in ex]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=2)


if __name__ == "__main__":
    main()
