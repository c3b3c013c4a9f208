#!/usr/bin/env python3
"""Issue 31's acceptance table from `cargo xtask bench --backend cuda --peer
llama.cpp DIR` runs: one `results.json` per model under each directory given.

For every model and stream count: Kestrel's and llama.cpp's steady decode
tokens/s (the bench's peer rows: llama-batched-bench S_TG against our
pipelined engine), their ratio, and each engine's share of the HBM floor:
one decode step per token of a stream must read every weight byte once, so
the floor is `bandwidth / weight bytes` steps/s and an engine's share is
`(tokens/s / streams) / floor`. Weight bytes are the Kestrel device's
(`meta.weight_bytes`: the file's tensor bytes, weights kept in the file's
encoding). The bandwidth is `--hbm-bytes-per-s`, else the GPU's datasheet
figure from its nvidia-smi name (H100 SXM 3.35e12, H100 NVL 3.9e12, H100
PCIe 2.0e12, H200 4.8e12), else the table has no floor column.

Usage: accept_table.py [--hbm-bytes-per-s B] [--gpu NAME] DIR...
Prints a Markdown table; exits non-zero if a directory has no results.
"""

import argparse
import json
import re
import sys
from pathlib import Path

DATASHEET = [
    (re.compile(r"H200"), 4.8e12),
    (re.compile(r"H100.*NVL"), 3.9e12),
    (re.compile(r"H100.*PCIe"), 2.0e12),
    (re.compile(r"H100"), 3.35e12),
]

DECODE = re.compile(r"decode tokens/s, (\d+) parallel")


def bandwidth(args):
    if args.hbm_bytes_per_s:
        return args.hbm_bytes_per_s, "given"
    for pat, bw in DATASHEET:
        if args.gpu and pat.search(args.gpu):
            return bw, f"datasheet, {args.gpu}"
    return None, "unknown GPU"


def rows(doc):
    """(streams, kestrel tok/s, llama.cpp tok/s) per peer decode row."""
    peer = doc.get("peer") or {}
    for r in peer.get("rows", []):
        m = DECODE.match(r["metric"])
        if m:
            yield int(m.group(1)), r["kestrel"], r["llama_cpp"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hbm-bytes-per-s", type=float)
    ap.add_argument("--gpu", help="the GPU's name as nvidia-smi prints it")
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    bw, bw_from = bandwidth(args)
    pct = lambda tps, streams, floor: f"{100 * tps / streams / floor:.0f}%" if floor else "-"
    print(f"HBM bandwidth: {f'{bw:.3g} B/s' if bw else '-'} ({bw_from})\n")
    print("| model | weight MB | streams | Kestrel tok/s | llama.cpp tok/s | Kestrel / llama.cpp "
          "| Kestrel % of HBM floor | llama.cpp % of HBM floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    missing = 0
    for d in args.dirs:
        path = Path(d) / "results.json"
        if not path.is_file():
            print(f"| {d} | - | - | no results.json | - | - | - | - |")
            missing += 1
            continue
        doc = json.loads(path.read_text())
        meta = doc["meta"]
        wb = meta["weight_bytes"]
        floor = bw / wb if bw else None
        name = Path(meta["model"]).name
        found = False
        for streams, k, l in rows(doc):
            found = True
            ratio = f"{k / l:.2f}x" if l > 0 else "-"
            print(f"| {name} | {wb / 1e6:.1f} | {streams} | {k:,.0f} | {l:,.0f} | {ratio} "
                  f"| {pct(k, streams, floor)} | {pct(l, streams, floor)} |")
        if not found:
            print(f"| {name} | {wb / 1e6:.1f} | - | no llama.cpp rows (--peer missing?) | - | - | - | - |")
            missing += 1
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
