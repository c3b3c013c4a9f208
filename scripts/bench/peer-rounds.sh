#!/usr/bin/env bash
# One-stream decode against llama.cpp in alternated rounds, for machines
# whose bandwidth moves within minutes (docs/bench/README.md): per round,
# Kestrel's one-stream bench (pipelined, prefill riding along; its share of
# the DRAM floor read just before and after the run) and then llama.cpp's
# tg128 on the same GGUF and threads, the faster of its weight repacking on
# and off (as `xtask bench --peer` takes). One line per round, then the
# ratios' range and median; judge the spread, not one round.
# With --prompt, the same for pp512: per round Kestrel's prompt table
# (`xtask bench --prompt-table`: pp512, pp4096 and a 3072-token TTFT,
# the ratio taken on pp512) and then llama.cpp's `llama-bench -p 512`,
# the faster of its repacking on and off.
#
#   scripts/bench/peer-rounds.sh [--prompt] MODEL ROUNDS LLAMA_BIN_DIR [VAR=VALUE ...]
#
# MODEL is what `xtask bench --model` takes (a GGUF path or
# synth:SHAPE:TYPE); VAR=VALUE pairs go to Kestrel's runs only (e.g.
# KESTREL_ISA=avx2 against an AVX2-only llama.cpp build). Needs
# `cargo build --release -p xtask` first; results go under results/rounds-*.
set -euo pipefail

prompt=0
if [ "${1:-}" = --prompt ]; then
    prompt=1
    shift
fi
if [ $# -lt 3 ]; then
    sed -n '2,19p' "$0"
    exit 2
fi
model=$1 rounds=$2 llama=$3
shift 3
if ! [ "$rounds" -ge 1 ] 2>/dev/null; then
    echo "ROUNDS must be a whole number of at least 1, not '$rounds'" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/../.." && pwd)
xtask=$root/target/release/xtask
out=$root/results/rounds-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"

case $model in
synth:*)
    IFS=: read -r _ shape type _ <<<"$model"
    gguf=$("$xtask" synth-model --shape "$shape" --type "$type" | tail -n 1)
    ;;
*) gguf=$model ;;
esac

echo "model $gguf, $rounds rounds, llama.cpp from $llama${*:+, Kestrel with $*}"
# llama-bench's best average tokens/s over its repacking on and off.
best_ts() {
    python3 -c 'import json, sys; print(round(max(json.loads(l)["avg_ts"] for l in sys.stdin if l.startswith("{")), 1))'
}
ratios=()
for i in $(seq 1 "$rounds"); do
    dir=$out/kestrel-$i
    if [ $prompt = 1 ]; then
        env "$@" "$xtask" bench --model "$model" --threads 2 --prompt-table --out "$dir" >"$dir.log" 2>&1
        # The table's Kestrel column: pp512, pp4096 (tokens/s), TTFT (ms).
        read -r pp512 pp4096 ttft < <(awk -F'|' '/^\| (pp512|pp4096|TTFT)/ {printf "%s ", $3} END {print ""}' "$dir/prompt.md")
        peer=$("$llama/llama-bench" -m "$gguf" -t 2 -ngl 0 -p 512 -n 0 -r 2 --repack 0,1 -o jsonl 2>/dev/null | best_ts)
        ratio=$(python3 -c "print(round($pp512 / $peer, 2))")
        echo "round $i: Kestrel pp512 $pp512 tokens/s (pp4096 $pp4096, 3072-token TTFT $ttft ms) | llama.cpp pp512 $peer | $ratio x"
        ratios+=("$ratio")
        continue
    fi
    env "$@" "$xtask" bench --model "$model" --streams 1 --threads 2 --reps 1 \
        --requests-per-stream 1 --min-tokens 128 --max-tokens 128 --json-share 0 \
        --out "$dir" >"$dir.log" 2>&1
    # The floor table's pipe/ride row: tokens/s, GB/s beside, share of it.
    read -r tps gbs share < <(sed -n '/read GB\/s beside/,$p' "$dir/results.md" |
        awk -F'|' '/pipe\/ride/ {print $4, $8, $9; exit}')
    peer=$("$llama/llama-bench" -m "$gguf" -t 2 -ngl 0 -p 0 -n 128 -r 2 --repack 0,1 -o jsonl 2>/dev/null | best_ts)
    ratio=$(python3 -c "print(round($tps / $peer, 2))")
    echo "round $i: Kestrel $tps tokens/s ($share of the floor at $gbs GB/s beside) | llama.cpp tg128 $peer | $ratio x"
    ratios+=("$ratio")
done
# The spread, which is what to judge on such a machine.
python3 -c '
import statistics, sys
r = sorted(float(v) for v in sys.argv[1:])
print(f"ratios over {len(r)} rounds: {r[0]}-{r[-1]}, median {statistics.median(r):.2f}")
' "${ratios[@]}"
