#!/usr/bin/env bash
# CPU-side check of a bundle built by scripts/build_gpu_bundle.sh (no GPU needed; .ci/run runs it
# when a bundle is present): what can be checked of the GPU binaries without a GPU.
# - The bundle is complete (bin/cpl.xz, bin/gpu-tests.xz, BINARIES.sha256, COMMIT, LIBS,
#   SOURCES.sha256, stubs/) and under 60 MiB; the binaries unpack to what BINARIES.sha256 says
#   and are x86-64 executables without debug info.
# - The shared libraries the binaries need (ELF NEEDED) are exactly EXPECTED below, and LIBS says
#   the same.
# - With the bundle's stub CUDA libraries (stubs/, every function failing as NVIDIA's driver stub
#   does) on LD_LIBRARY_PATH, every library and symbol resolves (LD_BIND_NOW) and the binaries
#   start: `cpl --version` works, `gpu-tests --list` lists the suite, and every GPU path of cpl
#   (train, --backend nccl, bench attention on --device cuda) fails cleanly: exit 1, an error
#   naming the device, no panic and no backtrace; on --device cpu it trains. The suite's tests
#   fail with their message that they need a CUDA GPU.
# Usage: scripts/check_gpu_bundle.sh [BUNDLE]   (default $CPL_GPU_BUNDLE, else gpu-bundle)
# Ends with "N passed, N failed"; exits 1 if any check failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

BUNDLE=${1:-${CPL_GPU_BUNDLE:-gpu-bundle}}
# The libraries of a cuda,nccl build: CUDA's (cudarc asks for the driver, cuBLAS, cuBLASLt,
# cuRAND, NVRTC, NCCL and the runtime, and the linker keeps those that are called: cuBLASLt is
# not, and cuBLAS loads its cuBLASLt itself; NVRTC compiles flash-ring's attention kernels; candle-kernels' static kernels need the
# runtime and libstdc++) and glibc's.
EXPECTED="ld-linux-x86-64.so.2
libc.so.6
libcublas.so.13
libcuda.so.1
libcudart.so.13
libcurand.so.10
libgcc_s.so.1
libm.so.6
libnccl.so.2
libnvrtc.so.13
libstdc++.so.6"
MAX_BYTES=$((60 * 1024 * 1024))

PASS=0
FAIL=0
check() { # check NAME COMMAND...
    local name=$1
    shift
    if "$@"; then
        PASS=$((PASS + 1))
        echo "ok    $name"
    else
        FAIL=$((FAIL + 1))
        echo "FAIL  $name"
    fi
}

if [ ! -d "$BUNDLE" ]; then
    echo "no bundle at $BUNDLE (scripts/build_gpu_bundle.sh builds one)" >&2
    exit 1
fi
BUNDLE=$(cd "$BUNDLE" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
CPL="$TMP/cpl"
TESTS="$TMP/gpu-tests"

for f in bin/cpl.xz bin/gpu-tests.xz BINARIES.sha256 COMMIT LIBS SOURCES.sha256 BUILD.txt \
    stubs/libcuda.so.1; do
    check "bundle has $f" test -e "$BUNDLE/$f"
done
unpacks() {
    local b
    for b in cpl gpu-tests; do
        xz -dc "$BUNDLE/bin/$b.xz" >"$TMP/$b" && chmod +x "$TMP/$b" || return 1
    done
    (cd "$TMP" && sha256sum -c "$BUNDLE/BINARIES.sha256")
}
check "the binaries unpack to BINARIES.sha256" unpacks
under_limit() {
    local bytes
    bytes=$(du -sb "$BUNDLE" | cut -f1)
    echo "  $BUNDLE: $bytes bytes"
    [ "$bytes" -le "$MAX_BYTES" ]
}
check "bundle under 60 MiB" under_limit
no_debug_info() { readelf -h "$1" | grep -q 'Advanced Micro Devices X86-64' &&
    ! readelf -S -W "$1" | grep -Eq '\.debug_(info|line|abbrev|str|ranges|rnglists|loc)'; }
check "cpl: an x86-64 executable without debug info" no_debug_info "$CPL"
check "gpu-tests: an x86-64 executable without debug info" no_debug_info "$TESTS"

needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*Shared library: \[\(.*\)\]/\1/p'; }
{ needed "$CPL"; needed "$TESTS"; } | sort -u >"$TMP/needed"
same_libs() {
    if ! diff <(echo "$EXPECTED") "$TMP/needed"; then
        echo "  ('<' expected only, '>' needed only)"
        return 1
    fi
}
check "the binaries need exactly the expected libraries" same_libs
check "LIBS lists what the binaries need" diff "$TMP/needed" "$BUNDLE/LIBS"

# The stubs only: nothing of a real CUDA install may leak in.
export LD_LIBRARY_PATH="$BUNDLE/stubs"
# As a user runs it: with RUST_BACKTRACE set, candle's errors carry a backtrace by design.
unset RUST_BACKTRACE
resolves() {
    ldd "$1" >"$TMP/ldd" 2>&1
    if grep -q 'not found' "$TMP/ldd"; then
        grep 'not found' "$TMP/ldd"
        return 1
    fi
    # Every CUDA library from the stubs folder.
    local lib
    while read -r lib; do
        [[ $lib == "$BUNDLE/stubs/"* ]] || { echo "  $lib not from the stubs"; return 1; }
    done < <(grep -E 'lib(cuda|cudart|cublas|cublasLt|curand|nvrtc|nccl)\.so' "$TMP/ldd" | awk '{print $3}')
}
check "with the stubs: every library of cpl resolves" resolves "$CPL"
check "with the stubs: every library of gpu-tests resolves" resolves "$TESTS"
check "with the stubs, LD_BIND_NOW: cpl --version starts" env LD_BIND_NOW=1 "$CPL" --version
lists() {
    env LD_BIND_NOW=1 "$TESTS" --list >"$TMP/list" 2>&1 || { cat "$TMP/list"; return 1; }
    local t
    for t in composite_attention_on_cuda_matches_the_cpu_kernels cuda_kernels_match_the_cpu_kernels \
        cuda_kernels_serve_flash_attention_autograd nvrtc_compiles_every_kernel_variant \
        merge_on_cuda_matches_the_cpu nccl_collectives_match_the_local_backend \
        training_steps_on_cuda_match_the_cpu; do
        grep -q "^$t: test" "$TMP/list" || { echo "  $t not listed"; cat "$TMP/list"; return 1; }
    done
}
check "with the stubs, LD_BIND_NOW: gpu-tests --list lists the 7 GPU tests" lists
# NVRTC needs no GPU: the real library from the build's wheels, ahead of the stubs. All 96
# variants take 242 s on a 2-vCPU AMD Zen 4 and over 300 s on a 2-vCPU Zen 3 (a run compiles only
# the variants it uses, each once per process): a generous limit, for a hung compiler only.
NVRTC_DIR="${CPL_CUDA_CACHE:-$HOME/.cache/cpl-cuda}/13.0-libs/nvidia/cu13/lib"
nvrtc_compiles() {
    [ -f "$NVRTC_DIR/libnvrtc.so.13" ] || { echo "  no libnvrtc.so.13 in $NVRTC_DIR"; return 1; }
    LD_LIBRARY_PATH="$NVRTC_DIR:$LD_LIBRARY_PATH" timeout 900 "$TESTS" --exact \
        nvrtc_compiles_every_kernel_variant >"$TMP/nvrtc" 2>&1 || { tail -n 20 "$TMP/nvrtc"; return 1; }
    echo "  $(grep -E '^test result' "$TMP/nvrtc")"
}
check "no GPU, real NVRTC: flash-ring's CUDA kernels compile for sm_80 and sm_90 (48 variants each)" \
    nvrtc_compiles

# clean_failure NAME NEEDLE ARGS...: cpl ARGS exits 1 with NEEDLE in its error, no panic, no
# backtrace.
clean_failure() {
    local needle=$1 rc=0
    shift
    timeout 120 "$CPL" "$@" >"$TMP/out" 2>&1 || rc=$?
    local last
    last=$(grep -v '^\s*$' "$TMP/out" | tail -n 3)
    echo "  exit $rc: $last"
    [ "$rc" -eq 1 ] || return 1
    grep -q -- "$needle" "$TMP/out" || { echo "  no '$needle'"; return 1; }
    if grep -Eq 'panicked|stack backtrace|RUST_BACKTRACE|^ +0: ' "$TMP/out"; then
        cat "$TMP/out"
        return 1
    fi
}
TRAIN=(train --model assets/default/model --data assets/default/corpus/shakespeare.jsonl
    --seq-len 64 --out "$TMP/run")
check "no GPU: cpl train --device cuda fails cleanly, naming the device" \
    clean_failure "--device cuda:0: cannot open CUDA GPU 0" "${TRAIN[@]}" --steps 1 --device cuda
check "no GPU: cpl train --ranks 4 --ring 4 --device cuda:1 fails cleanly" \
    clean_failure "--device cuda:1: cannot open CUDA GPU 1" "${TRAIN[@]}" --steps 1 --ranks 4 \
    --ring 4 --device cuda:1
check "no GPU: cpl train --backend nccl --ranks 1 fails cleanly" \
    clean_failure "--device cuda:0: cannot open CUDA GPU 0" "${TRAIN[@]}" --steps 1 \
    --backend nccl --ranks 1 --device cuda
check "no GPU: cpl bench attention --device cuda fails cleanly" \
    clean_failure "--device cuda:0: cannot open CUDA GPU 0" bench attention --device cuda \
    --seqs 16
check "no GPU: the error says why (the driver stub)" grep -q 'CUDA_ERROR_STUB_LIBRARY' "$TMP/out"
trains_on_cpu() {
    timeout 300 "$CPL" "${TRAIN[@]}" --steps 2 --device cpu >"$TMP/out" 2>&1 ||
        { tail -n 20 "$TMP/out"; return 1; }
    [ "$(wc -l <"$TMP/run/metrics.jsonl")" -eq 2 ] || { cat "$TMP/run/metrics.jsonl"; return 1; }
    echo "  $(tr '\n' ' ' <"$TMP/run/metrics.jsonl" | cut -c1-160)"
}
check "with the stubs: cpl train --device cpu trains (2 steps)" trains_on_cpu
check "no GPU: cpl bench train --device cuda fails cleanly" \
    clean_failure "--device cuda:0: cannot open CUDA GPU 0" bench train --device cuda --steps 2
suite_fails() {
    local rc=0
    # Without --skip, NVRTC's stub fails the compile test first, before the GPU tests run.
    timeout 120 "$TESTS" --test-threads=1 --skip nvrtc_compiles_every_kernel_variant \
        >"$TMP/suite" 2>&1 || rc=$?
    echo "  exit $rc: $(grep -E '^test result' "$TMP/suite")"
    [ "$rc" -ne 0 ] && grep -q 'the cuda-tests suite needs a CUDA GPU (ordinal 0)' "$TMP/suite"
}
check "no GPU: the GPU suite fails, saying it needs a CUDA GPU" suite_fails

echo "gpu bundle: $PASS passed, $FAIL failed"
[ "$FAIL" -eq 0 ]
