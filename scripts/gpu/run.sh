#!/usr/bin/env bash
# Runs the CUDA checks on a GPU machine without Rust, from the binaries that
# scripts/gpu/pack.sh put in target-gpu/pack/bin.tar.xz (this file is copied
# there and unpacks them to target-gpu/pack/bin/ first).
# Run from the repository root:
#
#   target-gpu/pack/run.sh [STEP...]     (default: env unit nvrtc runtime chunks engine generate bench)
#
# Steps: env (driver, toolkit, libraries), unit (kestrel-cuda host logic),
# nvrtc (every kernel through the machine's NVRTC), runtime (CPU-vs-CUDA
# greedy parity and CUDA-event timings, the ignored GPU tests included; the
# family fixtures from target-gpu/families when carried, see docs/cuda.md),
# gemma (CPU-vs-CUDA greedy parity on Gemma 3 270M, joined from the carried
# target-gpu/gemma/part.*), chunks (chunked prefill and re-admission through
# the tiled prefill kernel), engine
# (Backend::Cuda through Engine::start), generate (the real model, CPU vs
# CUDA greedy text), stress (the gRPC soak against Backend::Cuda: mixed,
# cancelled, invalid, deadline and near-context-limit requests on a small KV
# pool, then nothing left behind; $STRESS_REQUESTS, default 2000), bench
# (`cargo xtask bench --quick --backend cuda`),
# bench-full (the full CUDA bench), sanitizer (= memcheck initcheck racecheck
# synccheck: compute-sanitizer's four tools, each on the tiny parity test and
# on `kestrel generate --backend cuda` with the real model; racecheck fails
# only on hazards in the project's own kernels, since cuBLAS's GEMM kernels
# report hazards of their own), llama (build llama.cpp's CUDA llama-bench and
# llama-batched-bench from the sdist parts pack.sh --llama made, into
# $KESTREL_CACHE_DIR/llama.cpp), accept (issue 31's acceptance table: Kestrel
# against llama.cpp -ngl 99 on SmolLM2 Q4_1 and synth:llama-1b q4_k_m and f16,
# 1 and 32 streams, % of the HBM floor; models from $ACCEPT_MODELS, space-
# separated, to split the step across calls; llama.cpp from $LLAMA_CPP_DIR or
# the llama step's build; the table covers every model measured so far on
# this machine and lands in $OUT/accept.md), prompt (issue 32's prompt-processing
# table in one run: pp512, pp4096 and the time to first token of a 3072-token
# prompt on $PROMPT_MODEL, default synth:llama-1b:f16, against llama.cpp's
# llama-bench -ngl 99 on the same lengths when the llama step's build or
# $LLAMA_CPP_DIR is there; $OUT/prompt/prompt.md). unit, generate, bench, accept and
# the sanitizers' real-model half need the default model: either
# already in $KESTREL_CACHE_DIR, or all of target-gpu/model/part.* (pack.sh
# --model) joined here with `cat` and checked against target-gpu/model/SHA256.
#
# Each step logs to $OUT/logs/<step>.log (OUT defaults to target-gpu/out);
# $OUT/summary.txt lists every step's exit status. The script exits non-zero
# if any step failed, after running them all. Without a driver every GPU step
# fails fast with the runtime's "CUDA driver library is not available" error.
set -uo pipefail

root=$PWD
pack=$(cd "$(dirname "$0")" && pwd)
bin=$pack/bin
[ -d "$root/crates/kestrel-cuda" ] || {
    echo "run.sh: run me from the repository root (no crates/kestrel-cuda under $root)" >&2
    exit 2
}
OUT=${OUT:-$root/target-gpu/out}
mkdir -p "$OUT/logs"
summary=$OUT/summary.txt
: >"$summary"

# Unpack the binaries (xz, or Python's lzma where xz is missing).
rm -rf "$bin"
if command -v xz >/dev/null; then
    xz -dc "$pack/bin.tar.xz" | tar -C "$pack" -xf -
else
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
        "$pack/bin.tar.xz" "$pack"
fi || {
    echo "run.sh: could not unpack $pack/bin.tar.xz" >&2
    exit 2
}

# The CUDA runtime's environment. libcuda comes with the driver (on the loader
# path); NVRTC and cuBLAS come from the toolkit, whose lib directory is added
# to the loader path (libnvrtc opens its builtins by name) and named to the
# runtime (KESTREL_CUDA_LIB_DIR preloads by absolute path).
export KESTREL_REQUIRE_NVRTC=1
export KESTREL_CACHE_DIR=${KESTREL_CACHE_DIR:-/tmp/kestrel-gpu-cache}
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}
mkdir -p "$KESTREL_CACHE_DIR"
cuda_lib=
for d in ${KESTREL_CUDA_LIB_DIR:-} ${CUDA_HOME:+$CUDA_HOME/lib64} /usr/local/cuda/lib64 \
    /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
    /usr/local/cuda-13*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    if compgen -G "$d/libnvrtc.so.13*" >/dev/null; then
        cuda_lib=$d
        break
    fi
done
if [ -n "$cuda_lib" ]; then
    export KESTREL_CUDA_LIB_DIR=$cuda_lib
    export LD_LIBRARY_PATH=$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export PATH=${cuda_lib:+$(dirname "$cuda_lib")/bin:}/usr/local/cuda/bin:$PATH

# Family fixtures written here by scripts/reference/synthetic_fixtures.py
# (the GPU machine has no Python packages), for gpu_greedy_parity_families.
if [ -d "$root/target-gpu/families" ]; then
    export KESTREL_FAMILY_FIXTURES=$root/target-gpu/families
fi

model_name=SmolLM2-135M-Instruct.Q4_1.gguf
model=$KESTREL_CACHE_DIR/$model_name

# The default model, joined from the carried parts if needed; empty if absent.
find_model() {
    local parts=$root/target-gpu/model
    if [ ! -f "$model" ] && compgen -G "$parts/part.*" >/dev/null; then
        echo "joining $(cd "$parts" && echo part.*) into $model" >&2
        cat "$parts"/part.* >"$model.tmp" && mv "$model.tmp" "$model"
        if [ -f "$parts/SHA256" ]; then
            (cd "$KESTREL_CACHE_DIR" && sha256sum -c "$parts/SHA256" >&2) || {
                echo "the joined model does not match SHA256: a part is missing?" >&2
                rm -f "$model"
            }
        fi
    fi
    [ -f "$model" ] && echo "$model"
}

failed=0
# step NAME DIR CMD...: run CMD in DIR, log to $OUT/logs/NAME.log, record the status.
step() {
    local name=$1 dir=$2
    shift 2
    local log=$OUT/logs/$name.log start=$SECONDS
    echo "== $name: $*" >"$log"
    (cd "$dir" && "$@") >>"$log" 2>&1
    local rc=$?
    tail -n 25 "$log"
    echo "$name: rc=$rc ($((SECONDS - start)) s)" | tee -a "$summary"
    [ "$rc" = 0 ] || failed=1
}

run_env() {
    echo "date: $(date -u)"
    echo "pack: $(head -n 4 "$pack/MANIFEST.txt" 2>/dev/null | tr '\n' ';')"
    echo "KESTREL_CUDA_LIB_DIR=${KESTREL_CUDA_LIB_DIR:-<unset: no libnvrtc.so.13 found>}"
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    if ldconfig -p | grep -q 'libcuda\.so\.1'; then
        echo "driver: $(ldconfig -p | grep -m1 'libcuda\.so\.1')"
    else
        echo "driver: libcuda.so.1 is not on the loader path: every CUDA step will fail with"
        echo "        the runtime's 'the CUDA driver library is not available' error"
    fi
    nvidia-smi || echo "nvidia-smi: not available"
    nvcc --version || echo "nvcc: not available"
    ldconfig -p | grep -E 'libcuda\.|libnvrtc|libcublas' || echo "ldconfig: no CUDA libraries"
    ls -l "${cuda_lib:-/nonexistent}" 2>/dev/null | grep -E 'nvrtc|cublas' || true
    nproc
    free -g
}

step_generate() {
    local m
    m=$(find_model) || {
        echo "no model: carry target-gpu/model/part.* (pack.sh --model) or put $model_name in $KESTREL_CACHE_DIR"
        return 1
    }
    local prompt="The capital of France is"
    local args=(generate --model "$m" --max-new-tokens 48 --temperature 0 --stats)
    "$bin/kestrel" "${args[@]}" --backend cpu "$prompt" >"$OUT/generate-cpu.txt" || return 1
    "$bin/kestrel" "${args[@]}" --backend cuda "$prompt" >"$OUT/generate-cuda.txt" || return 1
    echo "--- cpu:"
    cat "$OUT/generate-cpu.txt"
    echo "--- cuda:"
    cat "$OUT/generate-cuda.txt"
    if cmp -s "$OUT/generate-cpu.txt" "$OUT/generate-cuda.txt"; then
        echo "greedy text: identical"
    else
        echo "greedy text: DIFFERS (int8 activations in a different sum order, f16 tiles in prefill; see docs/cuda.md on precision)"
        return 1
    fi
}

step_bench() {
    local m
    m=$(find_model) || {
        echo "no model (see the generate step)"
        return 1
    }
    "$bin/xtask" bench --backend cuda --model "$m" --out "$OUT/$1" "${@:2}"
}

# Gemma 3 270M (the pinned `gemma3-270m`), joined from the carried parts;
# the test hashes it against its pinned SHA-256 before loading it.
step_gemma() {
    local parts=$root/target-gpu/gemma gguf=$KESTREL_CACHE_DIR/gemma-3-270m-q4_k_m.gguf
    if [ ! -f "$gguf" ]; then
        compgen -G "$parts/part.*" >/dev/null || {
            echo "no $gguf and no $parts/part.*: carry the split GGUF (docs/cuda.md)"
            return 1
        }
        cat "$parts"/part.* >"$gguf.tmp" && mv "$gguf.tmp" "$gguf" || return 1
    fi
    (cd "$root/crates/kestrel-cuda" && "$bin/kestrel-cuda-runtime" gpu_greedy_parity_gemma3_270m \
        --include-ignored --exact --nocapture)
}

llama_build=$KESTREL_CACHE_DIR/llama.cpp

step_llama() {
    local parts=$root/target-gpu/llama sdist=$KESTREL_CACHE_DIR/llama-sdist.tar.gz
    compgen -G "$parts/sdist.tar.gz.part.*" >/dev/null || {
        echo "no $parts/sdist.tar.gz.part.*: pack.sh --llama SDIST, and carry every part"
        return 1
    }
    cat "$parts"/sdist.tar.gz.part.* >"$sdist" || return 1
    rm -rf "$llama_build"
    mkdir -p "$llama_build"
    tar -C "$llama_build" -xzf "$sdist" || {
        echo "the joined sdist does not unpack: a part is missing?"
        return 1
    }
    local src arch
    src=$(compgen -G "$llama_build/*/vendor/llama.cpp" | head -n 1)
    [ -n "$src" ] || { echo "no vendor/llama.cpp in the sdist"; return 1; }
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '. ')
    cmake -S "$src" -B "$src/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF || return 1
    cmake --build "$src/build" --target llama-bench llama-batched-bench -j "$(nproc)" || return 1
    ln -sfn "$src/build/bin" "$llama_build/bin"
    ls -l "$llama_build/bin/"
}

step_accept() {
    local m dir=${LLAMA_CPP_DIR:-$llama_build/bin} rc=0 spec out
    local results=$KESTREL_CACHE_DIR/accept
    m=$(find_model) || {
        echo "no model (see the generate step)"
        return 1
    }
    [ -x "$dir/llama-batched-bench" ] || {
        echo "no llama-batched-bench in $dir: run the llama step or set LLAMA_CPP_DIR"
        return 1
    }
    for spec in ${ACCEPT_MODELS:-"$m" synth:llama-1b:q4_k_m synth:llama-1b:f16}; do
        out=$results/$(basename "${spec//:/-}")
        rm -rf "$out"
        echo "== $spec"
        "$bin/xtask" bench --backend cuda --model "$spec" --streams 1,32 --reps 1 \
            --json-share 0 --requests-per-stream 1 --peer llama.cpp "$dir" --out "$out" || rc=1
    done
    python3 "$pack/accept_table.py" \
        --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" \
        "$results"/* | tee "$OUT/accept.md" || rc=1
    return $rc
}

step_prompt() {
    local dir=${LLAMA_CPP_DIR:-$llama_build/bin} peer=()
    if [ -x "$dir/llama-bench" ]; then
        peer=(--peer llama.cpp "$dir")
    else
        echo "no llama-bench in $dir (run the llama step or set LLAMA_CPP_DIR): Kestrel's column only"
    fi
    "$bin/xtask" bench --backend cuda --prompt-table --model "${PROMPT_MODEL:-synth:llama-1b:f16}" \
        "${peer[@]}" --out "$OUT/prompt"
}

# The project's kernel entry points (kernels/*.cu), as a regex alternation.
our_kernels() {
    grep -hoE '__global__ void (__launch_bounds__\([^)]*\) )?[A-Za-z_0-9]+\(' "$root"/kernels/*.cu |
        sed -E 's/.* ([A-Za-z_0-9]+)\($/\1/' | paste -sd'|'
}

# step_sanitize TOOL: compute-sanitizer TOOL on the tiny parity test, then on
# the real model's greedy generation (skipped, and said so, without it).
# memcheck, initcheck and synccheck fail on any error they report; racecheck
# fails on a hazard reported in one of our kernels (cuBLAS's are not ours).
step_sanitize() {
    local tool=$1 rc=0 log=$OUT/logs/$1-detail.log
    command -v compute-sanitizer >/dev/null || {
        echo "compute-sanitizer: not on PATH (it ships with the CUDA toolkit)"
        return 1
    }
    local cs=(compute-sanitizer --tool "$tool" --print-limit 100)
    [ "$tool" = racecheck ] || cs+=(--error-exitcode 3)
    : >"$log"
    (cd "$root/crates/kestrel-cuda" && "${cs[@]}" "$bin/kestrel-cuda-runtime" \
        gpu_greedy_parity_tiny --include-ignored --test-threads=1) >>"$log" 2>&1 || rc=1
    local m
    if m=$(find_model); then
        "${cs[@]}" "$bin/kestrel" generate --model "$m" --max-new-tokens 8 --temperature 0 \
            --backend cuda "The capital of France is" >>"$log" 2>&1 || rc=1
    else
        echo "$tool: no model, the real-model run is SKIPPED (see the generate step)" | tee -a "$log"
    fi
    grep -E '^========= (ERROR SUMMARY|RACECHECK SUMMARY)' "$log" || true
    # Without --error-exitcode racecheck exits with the program's status, so
    # rc already says whether the tests and generation passed.
    if [ "$tool" = racecheck ]; then
        local ours
        ours=$(our_kernels)
        if grep -E "^=========.*\b($ours)\b" "$log"; then
            echo "racecheck: hazards in our kernels (above)"
            rc=1
        else
            echo "racecheck: no hazard in our kernels ($ours); any counted above are cuBLAS's"
        fi
    fi
    return "$rc"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env unit nvrtc runtime chunks engine generate bench)
for s in "${steps[@]}"; do
    case $s in
        env) step env "$root" run_env ;;
        unit)
            # One unit test holds the default model's upload plan against its file.
            find_model >/dev/null
            step unit "$root/crates/kestrel-cuda" "$bin/kestrel-cuda-unit"
            ;;
        nvrtc) step nvrtc "$root/crates/kestrel-cuda" "$bin/kestrel-cuda-nvrtc" --nocapture ;;
        runtime)
            # Gemma 3 270M has a step of its own (its model is carried apart).
            step runtime "$root/crates/kestrel-cuda" \
                "$bin/kestrel-cuda-runtime" --include-ignored --nocapture --test-threads=1 \
                --skip gemma3_270m
            ;;
        gemma) step gemma "$root" step_gemma ;;
        chunks)
            step chunks "$root/crates/kestrel-cuda" \
                "$bin/kestrel-cuda-prefill_chunks" --include-ignored --nocapture --test-threads=1
            ;;
        engine)
            step engine "$root/crates/kestrel-engine" \
                "$bin/kestrel-engine-cuda_backend" --nocapture
            ;;
        generate) step generate "$root" step_generate ;;
        stress)
            # Issue 32's stress run: the gRPC soak (plain, streamed,
            # constrained, cancelled, invalid, deadline and near-context-limit
            # requests on a KV pool small on purpose) against Backend::Cuda,
            # then no KV page, running sequence or request left behind.
            find_model >/dev/null
            step stress "$root/crates/kestrel-server" env KESTREL_SOAK_BACKEND=cuda \
                KESTREL_SOAK_REQUESTS="${STRESS_REQUESTS:-2000}" \
                KESTREL_SOAK_CLIENTS="${STRESS_CLIENTS:-48}" \
                "$bin/kestrel-server-soak" soak_mixed_requests_leave_nothing_behind --nocapture
            ;;
        bench) step bench "$root" step_bench bench-quick --quick ;;
        bench-full) step bench-full "$root" step_bench bench-full ;;
        llama) step llama "$root" step_llama ;;
        accept) step accept "$root" step_accept ;;
        prompt) step prompt "$root" step_prompt ;;
        memcheck | initcheck | racecheck | synccheck) step "$s" "$root" step_sanitize "$s" ;;
        sanitizer)
            for t in memcheck initcheck racecheck synccheck; do
                step "$t" "$root" step_sanitize "$t"
            done
            ;;
        *)
            echo "run.sh: unknown step $s" >&2
            exit 2
            ;;
    esac
done
echo "== summary ($summary)"
cat "$summary"
exit "$failed"
