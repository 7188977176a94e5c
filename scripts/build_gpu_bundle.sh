#!/usr/bin/env bash
# Builds, on a machine with no GPU, the prebuilt binaries that scripts/gpu_check.sh runs on a GPU
# machine with no Rust and no network (docs/gpu.md, "Running the GPU check"):
#
#   gpu-bundle/bin/cpl.xz        cpl with --features cuda,nccl (release, no debug info, xz: each
#                                binary is about 75 MB, a third of it candle's CUDA kernels)
#   gpu-bundle/bin/gpu-tests.xz  the GPU suite, tests/gpu.rs (--features cuda-tests,nccl,
#                                release, no debug info, xz)
#   gpu-bundle/BINARIES.sha256   sha256 of the unpacked binaries (gpu_check.sh unpacks them)
#   gpu-bundle/stubs/         stub CUDA libraries (scripts/cuda_stubs.py) for the CPU-side check
#                             (scripts/check_gpu_bundle.sh); never put on a GPU machine's path
#   gpu-bundle/COMMIT         the commit built (`git rev-parse HEAD`; "-dirty" if --allow-dirty)
#   gpu-bundle/SOURCES.sha256 sha256 of every tracked build input: gpu_check.sh checks the
#                             checkout against it (`sha256sum -c`), with or without .git, so a
#                             later commit of docs or scripts (or a merge) keeps the bundle valid
#   gpu-bundle/LIBS           the shared libraries the binaries need (ELF NEEDED), one a line
#   gpu-bundle/BUILD.txt      toolchain versions, compute capability, build time
#
# The target is sm_90 (H100/H200; CUDA_COMPUTE_CAP overrides) with CUDA 13.0 from PyPI: nvcc as in
# .ci/run, and for linking (candle's `cuda` feature makes cudarc link the CUDA libraries
# dynamically) cuBLAS, cuRAND, NVRTC and NCCL wheels plus a generated libcuda stub, all under
# ~/.cache/cpl-cuda (CPL_CUDA_CACHE). The binaries then need, at run time, an R580+ driver and the
# CUDA 13 libraries by SONAME (see LIBS), which the GPU machine's Python environment has.
#
# Usage: scripts/build_gpu_bundle.sh [--allow-dirty] [--out DIR]
#   --allow-dirty  build a tree with uncommitted changes to tracked files (COMMIT says -dirty)
#   --out DIR      bundle folder (default gpu-bundle, git-ignored)
# Environment: CARGO_TARGET_DIR (default ~/.cache/cpl-cuda/target-bundle), CUDAFORGE_THREADS
# (nvcc jobs, default 2), CUDA_COMPUTE_CAP (default 90), CARGO_BUILD_JOBS.
# Cold, on 2 cores: see docs/gpu.md for the measured time. The bundle must stay under 60 MiB (what
# the device tool carries, 64 MiB, less room for the rest).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

OUT=gpu-bundle
ALLOW_DIRTY=0
while [ $# -gt 0 ]; do
    case $1 in
    --allow-dirty) ALLOW_DIRTY=1 ;;
    --out) OUT=$2; shift ;;
    -h | --help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

MAX_BYTES=$((60 * 1024 * 1024))
CACHE="${CPL_CUDA_CACHE:-$HOME/.cache/cpl-cuda}"
NVCC_ROOT="$CACHE/13.0"
LIB_ROOT="$CACHE/13.0-libs"
LINK_DIR="$CACHE/13.0-link"
# The same nvcc wheels as .ci/run's CUDA compile check.
CUDA_WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.88
    nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85)
# Link-time libraries: the oldest CUDA 13.0 releases, so that a symbol missing from 13.0 fails the
# link here. Only their SONAMEs go into the binaries.
LIB_WHEELS=(nvidia-cublas==13.0.0.19 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88
    nvidia-nccl-cu13==2.27.7)
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$CACHE/target-bundle}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CUDARC_CUDA_VERSION=13000
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-2}"
export CARGO_TERM_COLOR=never

for tool in xz strip readelf objdump cc python3 git; do
    command -v "$tool" >/dev/null || { echo "$tool not found (xz: apt-get install xz-utils)" >&2; exit 1; }
done

t0=$SECONDS
log() { echo "== [$((SECONDS - t0))s] $*"; }

# 1. The tree: the bundle is stamped with HEAD, so uncommitted changes to tracked files are
# refused (untracked files are not build inputs unless a Cargo.toml names them).
COMMIT=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    if [ "$ALLOW_DIRTY" -eq 1 ]; then
        echo "warning: the tree has uncommitted changes; COMMIT will say $COMMIT-dirty" >&2
        git status --short --untracked-files=no >&2
        COMMIT="$COMMIT-dirty"
    else
        echo "the tree has uncommitted changes (commit them, or pass --allow-dirty):" >&2
        git status --short --untracked-files=no >&2
        exit 1
    fi
fi

# 2. The toolchain: nvcc and the link-time libraries from PyPI (skipped when present).
log "CUDA 13.0 from PyPI into $CACHE"
if [ ! -x "$NVCC_ROOT/nvidia/cu13/bin/nvcc" ]; then
    python3 -m pip install --quiet --no-deps --target "$NVCC_ROOT" "${CUDA_WHEELS[@]}"
fi
if [ ! -e "$LIB_ROOT/nvidia/nccl/lib/libnccl.so.2" ] ||
    [ ! -e "$LIB_ROOT/nvidia/cu13/lib/libcublasLt.so.13" ]; then
    python3 -m pip install --quiet --no-deps --target "$LIB_ROOT" "${LIB_WHEELS[@]}"
fi
CUDARC_SRC=$(cargo metadata --format-version 1 --features cpl/nccl | python3 -c '
import json, os, sys
m = json.load(sys.stdin)
print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"] == "cudarc"))')
# The link directory: the wheels ship versioned names only (libcublas.so.13), the linker looks
# for libcublas.so; libcuda comes from no wheel, so a stub of cudarc's driver functions stands in.
mkdir -p "$LINK_DIR"
for l in cu13/lib/libcublas.so.13 cu13/lib/libcublasLt.so.13 cu13/lib/libcurand.so.10 \
    cu13/lib/libnvrtc.so.13 nccl/lib/libnccl.so.2; do
    name=$(basename "$l")
    ln -sfn "$LIB_ROOT/nvidia/$l" "$LINK_DIR/${name%%.so*}.so"
done
ln -sfn "$NVCC_ROOT/nvidia/cu13/lib/libcudart.so.13" "$LINK_DIR/libcudart.so"
python3 scripts/cuda_stubs.py driver --cudarc "$CUDARC_SRC" --out "$LINK_DIR"

export PATH="$NVCC_ROOT/nvidia/cu13/bin:$PATH"
export CUDA_HOME="$NVCC_ROOT/nvidia/cu13"
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$LINK_DIR"
nvcc --version | tail -n 2

# 3. The binaries. Both in the release profile, so candle and its CUDA kernels are built once.
log "cargo build --release -p cpl --features cuda,nccl"
cargo build --release -p cpl --features cuda,nccl
CPL_BIN="$CARGO_TARGET_DIR/release/cpl"
# candle-parallel/clap (a feature cpl turns on) keeps the shared crates' features, and so their
# builds, the same as cpl's.
log "cargo test --release -p cpl-integration-tests --features cuda-tests,nccl --test gpu --no-run"
GPU_TESTS=$(cargo test --release -p cpl-integration-tests \
    --features cuda-tests,nccl,candle-parallel/clap --test gpu \
    --no-run --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and \
            m["target"]["name"] == "gpu" and m["profile"]["test"]:
        print(m["executable"])')
if [ ! -x "$CPL_BIN" ] || [ ! -x "$GPU_TESTS" ]; then
    echo "binaries not found ($CPL_BIN, $GPU_TESTS)" >&2
    exit 1
fi

# 4. The bundle.
log "bundle $OUT"
rm -rf "$OUT"
mkdir -p "$OUT/bin"
UNPACKED=$(mktemp -d)
trap 'rm -rf "$UNPACKED"' EXIT
# Debug info goes, the symbol table stays (function names in backtraces: 0.7 MB packed).
strip --strip-debug -o "$UNPACKED/cpl" "$CPL_BIN"
strip --strip-debug -o "$UNPACKED/gpu-tests" "$GPU_TESTS"
python3 scripts/cuda_stubs.py binaries --out "$OUT/stubs" "$UNPACKED/cpl" "$UNPACKED/gpu-tests"
for b in "$UNPACKED"/*; do
    readelf -d "$b" | sed -n 's/.*(NEEDED).*Shared library: \[\(.*\)\]/\1/p'
done | sort -u >"$OUT/LIBS"
(cd "$UNPACKED" && sha256sum cpl gpu-tests) >"$OUT/BINARIES.sha256"
ls -l "$UNPACKED"
log "xz the binaries"
for b in cpl gpu-tests; do
    xz -T"${XZ_THREADS:-2}" -6 -c "$UNPACKED/$b" >"$OUT/bin/$b.xz"
done
echo "$COMMIT" >"$OUT/COMMIT"
# Build inputs: sources, manifests, the lock file, the vendored crate (not docs, data or scripts).
git ls-files -z -- '*.rs' '*.toml' Cargo.lock 'third_party/*' |
    xargs -0 sha256sum >"$OUT/SOURCES.sha256"
{
    echo "commit: $COMMIT"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(nproc) cores, in $((SECONDS - t0)) s"
    echo "rustc: $(rustc --version)"
    echo "nvcc: $(nvcc --version | tail -n 1)"
    echo "CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION"
    echo "linked against: ${LIB_WHEELS[*]} nvidia-cuda-runtime==13.0.88, libcuda stub"
    echo "features: cpl cuda,nccl; gpu-tests cuda-tests,nccl (release profile, debug info stripped, xz)"
    echo "unpacked: $(cd "$UNPACKED" && du -b cpl gpu-tests | tr '\t\n' ' ')"
} >"$OUT/BUILD.txt"

bytes=$(du -sb "$OUT" | cut -f1)
log "done: $OUT is $((bytes / 1024 / 1024)) MiB ($bytes bytes)"
cat "$OUT/BUILD.txt"
echo "-- LIBS:"
cat "$OUT/LIBS"
ls -l "$OUT/bin" "$OUT/stubs"
if [ "$bytes" -gt "$MAX_BYTES" ]; then
    echo "error: $OUT is over 60 MiB ($bytes bytes)" >&2
    exit 1
fi
