#!/usr/bin/env bash
# Build, here (x86-64, with Rust), everything a GPU session runs without Rust,
# and put it in target-gpu/pack/ (git-ignored) for the device tool to carry:
# run.sh, MANIFEST.txt and bin.tar.xz holding (run.sh unpacks it to bin/):
#
#   bin/kestrel-cuda-unit        kestrel-cuda's unit tests (host-side logic)
#   bin/kestrel-cuda-nvrtc       every kernel through NVRTC (tests/nvrtc.rs)
#   bin/kestrel-cuda-runtime     CPU-vs-CUDA parity, CUDA-event timings (tests/runtime.rs)
#   bin/kestrel-engine-cuda_backend  Backend::Cuda through Engine::start
#   bin/kestrel                  the server/CLI (release)
#   bin/xtask                    `cargo xtask bench` without cargo (release)
#
# Test binaries are the `test` profile (opt-level 3, debug assertions on), as
# `cargo test` builds them; everything is stripped of debug info (symbols stay
# for backtraces) and xz-compressed: about 11 MiB in all.
#
# --model: also split the default GGUF (98 MB; a device call carries 64 MiB
# with the working tree) into target-gpu/model/part.1 (the room left beside
# the pack, so it travels with it) and part.2, ... (KESTREL_CARRY_MIB each,
# default 56, leaving room for the working tree); run.sh joins them with
# `cat` there. The plan is printed at the end; see docs/cuda.md, "Running on
# a GPU machine".
#
# --llama SDIST: also write target-gpu/llama/llama-src.tar.xz from a
# llama-cpp-python sdist (e.g. from `pip download --no-deps --no-binary
# :all: llama-cpp-python==0.3.36`, 77 MB, over a call's 64 MiB): its
# vendor/llama.cpp without the models, docs, tests, examples, git history
# and web UI the benchmark build does not read (about 6 MB), for run.sh's
# `llama-prep` call (carry ["target-gpu/llama"], command
# "scripts/gpu/run.sh llama-prep"), which builds llama.cpp's CUDA
# benchmarks there and returns them as $OUT/llama-cuda.*.
#
# --quick: also write the family fixtures (scripts/reference/
# synthetic_fixtures.py, with $KESTREL_PYTHON or python3, from the default
# GGUF) into target-gpu/pack/families, and copy llama-prep's returned files
# from target-gpu/llama-cuda (when there) into target-gpu/pack/llama-cuda,
# so the one folder target-gpu/pack (at most 60 MiB, checked) is all
# `run.sh quick` needs: one carry, one call.
#
# Builds go to $CARGO_TARGET_DIR (default: target/).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
pack=$root/target-gpu/pack
with_model=0
quick=0
llama_sdist=
while [ $# -gt 0 ]; do
    a=$1
    shift
    case $a in
        --model) with_model=1 ;;
        --quick) quick=1 ;;
        --llama)
            llama_sdist=${1:?--llama takes the sdist path}
            shift
            [ -f "$llama_sdist" ] || { echo "pack.sh: no file $llama_sdist" >&2; exit 2; }
            ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "pack.sh: unknown argument $a (try --help)" >&2
            exit 2
            ;;
    esac
done

# Executables a cargo invocation builds, as "name<TAB>path" lines: a binary is
# its name, the unit-test binary of a library <package>-unit, an integration
# test <package>-<test name>.
exes_of() {
    cargo "$@" --message-format=json |
        python3 -c '
import json, os, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    pkg = os.path.basename(os.path.dirname(m["manifest_path"]))
    t = m["target"]
    if "bin" in t["kind"]:
        name = t["name"]
    elif "lib" in t["kind"]:
        name = pkg + "-unit"
    else:
        name = pkg + "-" + t["name"]
    print(name + "\t" + m["executable"])
'
}

echo "pack.sh: building test binaries (kestrel-cuda, kestrel-engine cuda_backend, kestrel-server soak)" >&2
exes=$(exes_of test --no-run -p kestrel-cuda)
exes+=$'\n'$(exes_of test --no-run -p kestrel-engine --test cuda_backend)
exes+=$'\n'$(exes_of test --no-run -p kestrel-server --test soak)
echo "pack.sh: building kestrel and xtask (release)" >&2
exes+=$'\n'$(exes_of build --release -p kestrel-server --bin kestrel)
exes+=$'\n'$(exes_of build --release -p xtask --bin xtask)

stage=$root/target-gpu/pack-stage
rm -rf "$pack" "$stage"
mkdir -p "$pack" "$stage/bin"
while IFS=$'\t' read -r name path; do
    [ -n "$name" ] || continue
    [ -x "$path" ] || { echo "pack.sh: $path is missing" >&2; exit 1; }
    objcopy --strip-debug "$path" "$stage/bin/$name"
    echo "pack.sh: bin/$name <- $path" >&2
done <<<"$exes"
tar -C "$stage" -cf - bin | xz -T0 -6 >"$pack/bin.tar.xz"
install -m 0755 scripts/gpu/run.sh "$pack/run.sh"
install -m 0755 scripts/gpu/accept_table.py "$pack/accept_table.py"

{
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(rustc --version)"
    echo "build root: $root"
    dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | awk '{print $2}' | tr '\n' ' ')
    echo "uncommitted changes in: ${dirty:-none}"
    echo
    (cd "$stage" && find bin -type f | sort | xargs sha256sum)
    (cd "$pack" && sha256sum run.sh accept_table.py bin.tar.xz)
} >"$pack/MANIFEST.txt"
rm -rf "$stage"

default_model() {
    python3 - <<'EOF'
import os
d = os.environ.get("KESTREL_CACHE_DIR") or (
    os.path.join(os.environ["XDG_CACHE_HOME"], "kestrel") if os.environ.get("XDG_CACHE_HOME")
    else os.path.join(os.environ["HOME"], ".cache", "kestrel"))
print(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf"))
EOF
}

mib=$((1024 * 1024))
if [ "$quick" = 1 ]; then
    m=$(default_model)
    [ -f "$m" ] || { echo "pack.sh: $m is missing (the fixtures start from it)" >&2; exit 1; }
    "${KESTREL_PYTHON:-python3}" scripts/reference/synthetic_fixtures.py "$m" "$pack/families"
    if compgen -G "$root/target-gpu/llama-cuda/llama-cuda.tar.xz.part.*" >/dev/null; then
        mkdir -p "$pack/llama-cuda"
        cp "$root"/target-gpu/llama-cuda/llama-cuda.* "$pack/llama-cuda/"
    else
        echo "pack.sh: no target-gpu/llama-cuda (llama-prep's files): accept-rounds will fail" >&2
    fi
    size=$(du -sb "$pack" | cut -f1)
    echo "pack.sh: the quick folder target-gpu/pack: $((size / mib)) MiB" >&2
    [ "$size" -le $((60 * mib)) ] || { echo "pack.sh: over 60 MiB" >&2; exit 1; }
    echo "Carry plan: one call, carry [\"target-gpu/pack\"], command \"target-gpu/pack/run.sh quick\";" >&2
    echo "then (same machine) \"target-gpu/pack/run.sh quick-sanitizers\"." >&2
fi
budget=$((${KESTREL_CARRY_MIB:-56} * mib))
size=$(du -sb "$pack" | cut -f1)
echo "pack.sh: $pack: $((size / mib)) MiB ($size bytes)" >&2
# A quick pack is carried alone (its own 60 MiB check above, with the
# working tree's few MiB under a call's 64); the 56 MiB budget leaves room
# for the model's parts beside a pack.
if [ "$quick" = 0 ] && [ "$size" -ge "$budget" ]; then
    echo "pack.sh: over the ${KESTREL_CARRY_MIB:-56} MiB a device call can carry" >&2
    exit 1
fi

if [ "$with_model" = 1 ]; then
    model=$(default_model)
    [ -f "$model" ] || {
        echo "pack.sh: $model is missing: run the CPU tests (or kestrel serve) once to fetch it" >&2
        exit 1
    }
    mdir=$root/target-gpu/model
    rm -rf "$mdir"
    mkdir -p "$mdir"
    (cd "$(dirname "$model")" && sha256sum "$(basename "$model")") >"$mdir/SHA256"
    # part.1 fills the room beside the pack (if a MiB or more), the rest
    # goes in budget-sized parts; `cat part.*` restores the file.
    first=$((budget - size - 4096))
    [ "$first" -ge "$mib" ] || first=0
    next=1
    if [ "$first" -gt 0 ]; then
        head -c "$first" "$model" >"$mdir/part.1"
        next=2
    fi
    tail -c +"$((first + 1))" "$model" |
        split -b "$budget" -a 1 --numeric-suffixes="$next" - "$mdir/part."
    echo "pack.sh: model split into $(cd "$mdir" && echo part.*) under $mdir" >&2
    echo >&2
    echo "Carry plan (device tool, one call each, the machine kept warm between them):" >&2
    n=1
    for p in "$mdir"/part.*; do
        p=${p#"$root"/}
        if [ "$p" = target-gpu/model/part.1 ]; then
            echo "  call $n: carry [\"target-gpu/pack\", \"$p\", \"target-gpu/model/SHA256\"]" >&2
        elif [ "$first" = 0 ] && [ "$n" = 1 ]; then
            echo "  call $n: carry [\"target-gpu/pack\", \"target-gpu/model/SHA256\"]" >&2
            n=$((n + 1))
            echo "  call $n: carry [\"$p\"]" >&2
        else
            echo "  call $n: carry [\"$p\"]" >&2
        fi
        n=$((n + 1))
    done
    echo "  run.sh joins the parts when a step needs the model (all of them present)." >&2
fi

if [ -n "$llama_sdist" ]; then
    ldir=$root/target-gpu/llama
    lstage=$root/target-gpu/llama-stage
    rm -rf "$ldir" "$lstage"
    mkdir -p "$ldir" "$lstage"
    tar -C "$lstage" -xzf "$llama_sdist"
    src=$(cd "$lstage" && compgen -G "*/vendor/llama.cpp" | head -n 1 || true)
    [ -n "$src" ] || { echo "pack.sh: no */vendor/llama.cpp in $llama_sdist" >&2; exit 1; }
    # What a CUDA build of the two benchmarks does not read (run.sh's llama
    # step turns tests, examples, the server and the app off).
    (cd "$lstage/$src" && rm -rf models docs .github .devops media gguf-py conversion benches \
        tests examples pocs app tools/ui)
    tar -C "$lstage" -cf - "$src" | xz -T0 -6 >"$ldir/llama-src.tar.xz"
    rm -rf "$lstage"
    echo >&2
    echo "pack.sh: $ldir/llama-src.tar.xz: $(($(stat -c %s "$ldir/llama-src.tar.xz") / mib)) MiB." >&2
    echo "Build call: carry [\"target-gpu/llama\"], command \"scripts/gpu/run.sh llama-prep\"," >&2
    echo "then copy the returned llama-cuda.* files into target-gpu/llama-cuda/ and pack --quick." >&2
fi
