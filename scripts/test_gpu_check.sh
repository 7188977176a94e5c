#!/usr/bin/env bash
# CPU-side test of the GPU scripts, in seconds, with no GPU and no bundle (.ci/run runs it):
# - bash -n on every script of the GPU path, and shellcheck where installed;
# - scripts/gpu_check.sh against stub commands: a fake nvidia-smi (an R580 driver, or an older
#   one), fake CUDA libraries found through the Python environment (PYTHONPATH's nvidia/*/lib)
#   and CPL_CUDA_LIB_DIRS, and a fake bundle whose cpl and gpu-tests are shell scripts that
#   print what the real ones print. Its dry run, a full run that passes, CUDA losses off the CPU
#   ones, an old driver, a missing library, a bundle of another commit (with and without git),
#   a hanging stage cut by the time budget, stage selection and bad arguments: exit codes and
#   summary.txt lines.
# Ends with "N passed, N failed"; exits 1 if any check failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

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

SCRIPTS=(scripts/gpu_check.sh scripts/gpu_bench.sh scripts/build_gpu_bundle.sh scripts/check_gpu_bundle.sh
    scripts/test_gpu_check.sh scripts/gpu_zoo.sh scripts/gpu_commands.sh scripts/gpu_common.sh)
for s in "${SCRIPTS[@]}"; do
    check "bash -n $s" bash -n "$s"
done
if command -v shellcheck >/dev/null; then
    for s in "${SCRIPTS[@]}"; do
        check "shellcheck $s" shellcheck "$s"
    done
else
    echo "(shellcheck not installed: skipped)"
fi
check "python3 -m py_compile scripts/cuda_stubs.py" python3 -m py_compile scripts/cuda_stubs.py

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# -- the fakes -----------------------------------------------------------------------------
mkdir -p "$TMP/path" "$TMP/site/nvidia/cu13/lib" "$TMP/site/nvidia/nccl/lib" "$TMP/driver" \
    "$TMP/bundle/bin"
cat >"$TMP/path/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
# fake nvidia-smi: one H100 with driver $FAKE_DRIVER
driver=${FAKE_DRIVER:-580.65.06}
case "$*" in
*--query-gpu*) echo "0, NVIDIA H100 80GB HBM3, $driver, 81559 MiB, 9.0" ;;
*) printf '| NVIDIA-SMI %s   Driver Version: %s   CUDA Version: 13.0 |\n| 0  NVIDIA H100 80GB HBM3 |\n' "$driver" "$driver" ;;
esac
EOF
for l in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
    : >"$TMP/site/nvidia/cu13/lib/$l"
done
: >"$TMP/site/nvidia/nccl/lib/libnccl.so.2"
: >"$TMP/driver/libcuda.so.1"
printf '%s\n' libc.so.6 libcublas.so.13 libcublasLt.so.13 libcuda.so.1 libcudart.so.13 \
    libcurand.so.10 libgcc_s.so.1 libm.so.6 libnccl.so.2 libnvrtc.so.13 >"$TMP/bundle/LIBS"
git rev-parse HEAD >"$TMP/bundle/COMMIT"
git ls-files -z -- '*.rs' '*.toml' Cargo.lock 'third_party/*' | xargs -0 sha256sum \
    >"$TMP/bundle/SOURCES.sha256"
echo "fake bundle (scripts/test_gpu_check.sh)" >"$TMP/bundle/BUILD.txt"
# fake cpl: `train` writes --steps losses to --out/metrics.jsonl (CUDA ones scaled by
# 1 + $FAKE_CUDA_ERR), `bench attention --json` prints a report, `--version` a version.
cat >"$TMP/bundle/bin/cpl" <<'EOF'
#!/usr/bin/env bash
[ "${1:-}" = --version ] && { echo "cpl 0.1.0 (fake)"; exit 0; }
out="" device=cpu steps=1
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
    --out) out=${args[i + 1]} ;;
    --device) device=${args[i + 1]} ;;
    --steps) steps=${args[i + 1]} ;;
    esac
done
case "$1 ${2:-}" in
"train "*)
    [ -d "$(dirname "${args[2]}")" ] || { echo "error: no model dir" >&2; exit 1; }
    mkdir -p "$out"
    for ((s = 1; s <= steps; s++)); do
        python3 -c "import sys; s, d, e = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]); \
l = 7.0 - 0.1 * s; print('{\"step\": %d, \"loss\": %r}' % (s, l * (1 + e) if d != 'cpu' else l))" \
            "$s" "$device" "${FAKE_CUDA_ERR:-0}"
    done >"$out/metrics.jsonl"
    echo "trained $steps steps on $device" ;;
"bench attention")
    echo '{"bench": "attention", "device": "cuda:0", "matmul_f32_gflops": 50000.0, "matmul_bf16_gflops": 700000.0, "results": [{"dtype": "bf16", "seq": 8192, "mask": "causal", "fwd_bwd_gflops": 90000.0}]}' ;;
*) echo "error: fake cpl: $*" >&2; exit 1 ;;
esac
EOF
# fake gpu-tests: libtest's output; sleeps when $FAKE_HANG is set.
cat >"$TMP/bundle/bin/gpu-tests" <<'EOF'
#!/usr/bin/env bash
[ -n "${FAKE_HANG:-}" ] && exec sleep 60
[ -d "${CPL_TESTS_DIR:-/nonexistent}/fixtures/llama/gqa" ] || { echo "no fixtures" >&2; exit 101; }
echo "args: $*"
echo "running 3 tests"
echo "test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 1 filtered out; finished in 1.0s"
EOF
chmod +x "$TMP/path/nvidia-smi" "$TMP/bundle/bin/cpl" "$TMP/bundle/bin/gpu-tests"

# gpu NAME [VAR=VALUE...] -- ARGS...: runs gpu_check.sh with the fakes into $TMP/NAME; its exit
# code goes to $TMP/NAME.rc, its output to $TMP/NAME.out.
gpu() {
    local name=$1
    shift
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    rm -rf "${TMP:?}/$name"
    env PATH="$TMP/path:$PATH" PYTHONPATH="$TMP/site" CPL_CUDA_LIB_DIRS="$TMP/driver" \
        "${envs[@]}" bash scripts/gpu_check.sh --bundle "$TMP/bundle" --out "$TMP/$name" "$@" \
        >"$TMP/$name.out" 2>&1
    echo $? >"$TMP/$name.rc"
}
rc_is() { [ "$(cat "$TMP/$1.rc")" = "$2" ] || { echo "  $1: exit $(cat "$TMP/$1.rc"), want $2"; tail -n 30 "$TMP/$1.out"; return 1; }; }
summary_has() { grep -Eq "$2" "$TMP/$1/summary.txt" || { echo "  $1: no /$2/ in summary:"; cat "$TMP/$1/summary.txt"; return 1; }; }
files_at_most() { local n; n=$(find "$TMP/$1" -type f | wc -l); [ "$n" -le "$2" ] || { echo "  $1: $n files"; return 1; }; }

# -- the cases ------------------------------------------------------------------------------
gpu dry -- --dry-run
check "dry run: exit 0" rc_is dry 0
check "dry run: env checked (driver, libraries via PYTHONPATH's nvidia/*/lib, commit)" \
    summary_has dry '^ok .*env: bundle built from these sources; driver 580.65.06 >= R580; CUDA libraries found'
check "dry run: the other stages printed, not run" summary_has dry '^dry-run .*bench: dry-run'
check "dry run: the commands shown" grep -q 'dry-run, limit 180s.*gpu-tests --test-threads=1 --skip nvrtc_compiles_every_kernel_variant --skip nccl_collectives' "$TMP/dry.out"
check "dry run: libraries found in the Python environment" grep -q "libcublas.so.13: $TMP/site/nvidia/cu13/lib" "$TMP/dry/env.txt"

gpu pass -- --steps 3
check "full run with fakes: exit 0" rc_is pass 0
for s in env suite train nccl bench; do
    check "full run: $s ok" summary_has pass "^ok .* $s: "
done
check "full run: at most 8 files" files_at_most pass 8
check "full run: suite skips the 2-GPU NCCL test on 1 GPU" summary_has pass 'NCCL collectives test skipped'
check "full run: losses compared" summary_has pass 'train: .*max relative difference 0.00e\+00'
check "full run: bench digest" summary_has pass 'bf16 S=8192 causal: f\+b 90.00 TFLOP/s'
check "full run: bench.json written" test -s "$TMP/pass/bench.json"
check "full run: the summary's last line" summary_has pass '^result: all selected stages passed'

gpu off FAKE_CUDA_ERR=0.01 -- --stages train,nccl --steps 2
check "CUDA losses 1% off: exit 1" rc_is off 1
check "CUDA losses 1% off: train FAIL" summary_has off '^FAIL .*train: .*1.00e-02'
check "CUDA losses 1% off: nccl FAIL" summary_has off '^FAIL .*nccl: '
check "CUDA losses 1% off: other stages skipped" summary_has off '^skip .*suite: not selected'
check "CUDA losses 1% off: summary says so" summary_has off '^result: 2 stage\(s\) failed'
gpu tol FAKE_CUDA_ERR=0.01 -- --stages train --steps 2 --rtol 0.02
check "--rtol 0.02 accepts 1%" rc_is tol 0

gpu old FAKE_DRIVER=570.86.15 -- --stages env
check "driver R570: exit 1" rc_is old 1
check "driver R570: env FAIL naming R580" summary_has old '^FAIL .*driver 570.86.15 < R580'

gpu nolib CPL_CUDA_LIB_DIRS= -- --stages env
check "no libcuda: env FAIL naming it" summary_has nolib '^FAIL .*libraries not found: libcuda.so.1'

echo 0000000000000000000000000000000000000000 >"$TMP/bundle/COMMIT.new"
mv "$TMP/bundle/COMMIT" "$TMP/bundle/COMMIT.head"
mv "$TMP/bundle/COMMIT.new" "$TMP/bundle/COMMIT"
gpu stale -- --stages env
check "bundle of another commit, same sources: env ok" summary_has stale '^ok .*env: bundle built from these sources'
check "bundle of another commit: both commits in env.txt" grep -q 'commit: bundle built at 0000000000000000000000000000000000000000, checkout at' "$TMP/stale/env.txt"
gpu nogit CPL_GPU_CHECK_NO_GIT=1 -- --stages env
check "no git, same sources: env ok by SOURCES.sha256" summary_has nogit '^ok .*env: bundle built from these sources'
cp "$TMP/bundle/SOURCES.sha256" "$TMP/sources.bak"
sed -i '1s/^[0-9a-f]\{8\}/00000000/' "$TMP/bundle/SOURCES.sha256"
gpu nogit2 CPL_GPU_CHECK_NO_GIT=1 -- --stages env
check "no git, a source changed: env FAIL" summary_has nogit2 '^FAIL .*env: the bundle was built from other sources'
check "no git, a source changed: the file named" grep -q 'FAILED' "$TMP/nogit2/env.txt"
gpu changed -- --stages env
check "git, a source changed: env FAIL" summary_has changed '^FAIL .*env: the bundle was built from other sources'
cp "$TMP/sources.bak" "$TMP/bundle/SOURCES.sha256"
mv "$TMP/bundle/COMMIT.head" "$TMP/bundle/COMMIT"

t0=$SECONDS
gpu hang FAKE_HANG=1 GPU_CHECK_BUDGET_S=12 -- --stages suite
check "a hanging stage is cut by the budget: exit 1" rc_is hang 1
check "a hanging stage: suite FAIL, summary written" summary_has hang '^FAIL .*suite: no test result'
check "a hanging stage: done within 30 s" test $((SECONDS - t0)) -lt 30

gpu rerun -- --skip env,suite,bench --steps 2
check "rerun (--skip env,suite,bench): exit 0" rc_is rerun 0
check "rerun: nccl ok without the env stage" summary_has rerun '^ok .*nccl: '
check "rerun: env skipped" summary_has rerun '^skip .*env: not selected'

# The real bundle's form: xz-packed binaries checked against BINARIES.sha256.
mkdir -p "$TMP/xzbundle/bin"
cp "$TMP/bundle/LIBS" "$TMP/bundle/COMMIT" "$TMP/bundle/SOURCES.sha256" "$TMP/bundle/BUILD.txt" \
    "$TMP/xzbundle/"
(cd "$TMP/bundle/bin" && sha256sum cpl gpu-tests) >"$TMP/xzbundle/BINARIES.sha256"
for b in cpl gpu-tests; do
    python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.compress(open(sys.argv[1], "rb").read()))' \
        "$TMP/bundle/bin/$b" "$TMP/xzbundle/bin/$b.xz"
done
gpu xz -- --bundle "$TMP/xzbundle" --steps 2
check "xz bundle: unpacked, checked and run: exit 0" rc_is xz 0
check "xz bundle: every stage ok" test "$(grep -c '^ok ' "$TMP/xz/summary.txt")" = 5
sed -i '1s/^[0-9a-f]\{8\}/00000000/' "$TMP/xzbundle/BINARIES.sha256"
gpu xzbad -- --bundle "$TMP/xzbundle" --stages env
check "xz bundle, a binary not the one built: env FAIL" summary_has xzbad '^FAIL .*cpl differs from BINARIES.sha256'

gpu badstage -- --stages env,gpu
check "unknown stage: exit 2" rc_is badstage 2
gpu badarg -- --frobnicate
check "unknown argument: exit 2" rc_is badarg 2
gpu nobundle -- --bundle "$TMP/none"
check "no bundle: exit 1 and a summary" rc_is nobundle 1
check "no bundle: summary names it" summary_has nobundle 'bundle: .* not found'

echo "gpu scripts: $PASS passed, $FAIL failed"
[ "$FAIL" -eq 0 ]
