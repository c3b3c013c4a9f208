#!/usr/bin/env python3
"""Transcribes a `cargo xtask moondream-bench` results.json into the form
docs/bench's JSON files keep and scripts/bench/compare.py reads (`runs` of
`rows`; medians over rounds; `ratio` > 1 where Kestrel is ahead of the
PyTorch floor; the point/detect rows hold the pipelined rate in `kestrel`
and the blocking one beside it).

    moondream_transcribe.py RESULTS_JSON MODEL_LABEL RUN_ID DATE > OUT.json

docs/bench/moondream.json: `results/md-bench/results.json "moondream
synth:bench" moondream-bench-shape 2026-12-07`; moondream-tiny.json:
`results/md-tiny3/results.json "moondream synth:tiny" moondream-tiny-shape
2026-12-07`.
"""
import json
import statistics
import sys


def med(v):
    v=[x for x in v if x is not None]
    return statistics.median(v) if v else None
def r3(x): return None if x is None or x != x else round(x, 4)
def run_rows(path, model, rid, date):
    d=json.load(open(path))
    rounds=d["rounds"]
    k=lambda f: med([f(r["kestrel"]) for r in rounds if r.get("kestrel")])
    p=lambda f: med([f(r["floor"]) for r in rounds if r.get("floor")])
    rows=[]
    def row(metric, kv, pv, higher):
        ratio=None
        if kv and pv:
            ratio = kv/pv if higher else pv/kv
        rows.append({"model": model, "type": "F32", "metric": metric, "kestrel": r3(kv), "pytorch": r3(pv), "ratio": r3(ratio)})
    for i,(crops,w,h) in enumerate(d["encode_images"]):
        row(f"image encode, {crops} crops ({w}x{h}) (ms)", k(lambda f: f["encode"][i]["seconds"]*1e3), p(lambda f: f["encode"][i]["seconds"]*1e3), False)
    row("TTFT, new image (ms)", k(lambda f: f["ttft_cold_s"]*1e3), p(lambda f: f["ttft_cold_s"]*1e3), False)
    row("TTFT, same image again (ms)", k(lambda f: f["ttft_cached_s"]*1e3), p(lambda f: f["ttft_cached_s"]*1e3), False)
    row("decode tokens/s, one sequence", k(lambda f: f["decode_tokens_per_s"]), p(lambda f: f["decode_tokens_per_s"]), True)
    for i,c in enumerate(d["options"]["streams"]):
        row(f"requests/s, {c} in flight", k(lambda f: f["concurrency"][i]["requests_per_s"]), p(lambda f: f["concurrency"][i]["requests_per_s"]), True)
    for c in d["options"]["streams"]:
        for kind in ["Query","Point","Detect"]:
            runs=[r for r in d["spatial"] if r["kind"]==kind and r["streams"]==c]
            if not runs: continue
            def m(mode, f):
                return med([f(r) for r in runs if r["mode"]==mode])
            rate=lambda r: (r["tokens"] if kind=="Query" else r["objects"])/r["wall_s"]
            unit="tokens/s" if kind=="Query" else "objects/s"
            rows.append({"model": model, "type": "F32", "metric": f"{kind.lower()}, {c} in flight: {unit} pipelined",
                "kestrel": r3(m("Pipelined", rate)), "ratio": None,
                "blocking": r3(m("Blocking", rate)),
                "step_ms_blocking_pipelined": [r3(m("Blocking", lambda r: r["step_ms"])), r3(m("Pipelined", lambda r: r["step_ms"]))],
                "idle_ms_blocking_pipelined": [r3(m("Blocking", lambda r: r["idle_ms"])), r3(m("Pipelined", lambda r: r["idle_ms"]))],
                "objects": m("Pipelined", lambda r: r["objects"])})
    return {"id": rid, "machine": {"cpu": "AMD EPYC KVM (AVX2, AVX-512 F/VNNI/BF16, no AMX), shared with three sessions' builds", "isa": "avx512", "cores": d["cores"], "load_average_start_end": [d["load_start"], d["load_end"]]},
            "date": date, "commit": d["commit"], "command": d["command"], "peer": "pytorch 2.15.0+cu132 (cpu, float32, 2 threads): scripts/bench/moondream_torch.py", "rows": rows}


def main():
    path, model, rid, date = sys.argv[1:5]
    out = {"transcribed": "from the runs' results.json (xtask moondream-bench): medians over "
                          "rounds; ratio is Kestrel ahead (> 1) or behind (< 1) the PyTorch floor; "
                          "spatial rows: pipelined rate in kestrel, blocking beside it",
           "runs": [run_rows(path, model, rid, date)]}
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
