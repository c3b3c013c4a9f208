#!/usr/bin/env python3
"""Compare two benchmark result files, figure by figure (as llama.cpp's
scripts/compare-llama-bench.py compares two llama-bench runs).

Reads any of the files the benches write or the docs keep:
  - `cargo xtask bench`'s results.json: tokens/s per workload and
    configuration, and, with `--peer`, each Kestrel / llama.cpp row;
  - `cargo xtask bench --prompt-table`'s prompt.json: its rows;
  - the figures transcribed beside docs/bench/*.md (`{"runs": [{"machine":
    {...}, "rows": [...]}]}`): each run's rows, keyed by machine.

Prints one Markdown table of the figures both files hold: A's value, B's,
and B / A (for Kestrel / llama.cpp ratios, the two ratios). Figures only one
file holds are listed below it.

    python3 scripts/bench/compare.py OLD.json NEW.json
"""

import argparse
import json
import sys


def figures(doc):
    """{key: (kestrel value, Kestrel / llama.cpp ratio or None)} of one file."""
    out = {}
    if "results" in doc and "meta" in doc:  # xtask bench's results.json
        for r in doc["results"]:
            key = f"{r['workload']}; {r['config']}; tokens/s"
            out[key] = (r["tokens_per_s"], None)
        for r in (doc.get("peer") or {}).get("rows", []):
            out[f"vs llama.cpp; {r['metric']}"] = (r["kestrel"], r.get("ratio"))
        return out
    if "runs" in doc:  # figures transcribed beside a docs page
        for run in doc["runs"]:
            m = run.get("machine", {})
            where = " ".join(str(m[k]) for k in ("cpu", "isa") if m.get(k))
            for r in run["rows"]:
                what = " ".join(str(r[k]) for k in ("model", "type") if r.get(k))
                key = "; ".join(x for x in (where, what, r["metric"]) if x)
                out[key] = (r.get("kestrel"), r.get("ratio"))
        return out
    if "rows" in doc:  # the prompt table's prompt.json
        for r in doc["rows"]:
            out[r["metric"]] = (r["kestrel"], r.get("ratio"))
        return out
    raise ValueError("neither results.json, prompt.json nor transcribed figures")


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def compare(a, b):
    """The comparison's Markdown lines."""
    fa, fb = figures(a), figures(b)
    both = [k for k in fa if k in fb]
    lines = [
        "| figure | A | B | B / A | ratio A | ratio B |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k in both:
        (va, ra), (vb, rb) = fa[k], fb[k]
        change = vb / va if va and vb is not None else None
        lines.append(f"| {k} | {fmt(va)} | {fmt(vb)} | {fmt(change)} | {fmt(ra)} | {fmt(rb)} |")
    for name, only in (("A", [k for k in fa if k not in fb]), ("B", [k for k in fb if k not in fa])):
        if only:
            lines.append("")
            lines.append(f"Only in {name}: " + "; ".join(only))
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="the baseline (results.json, prompt.json or transcribed figures)")
    p.add_argument("b", help="the file compared with it")
    args = p.parse_args(argv)
    with open(args.a) as f:
        a = json.load(f)
    with open(args.b) as f:
        b = json.load(f)
    print("\n".join(compare(a, b)))


if __name__ == "__main__":
    sys.exit(main())
