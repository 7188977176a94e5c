#!/usr/bin/env bash
# The model zoo on a GPU: for every family fixture (tests/fixtures/zoo, tests/fixtures/moe),
# `cpl train` on --device cuda and on --device cpu with the same flags (4 steps, 32 tokens,
# f32 and bf16, one rank and a sequence-parallel layout on local ranks sharing the GPU; MoE
# fixtures also under --ep 2), and the losses compared step by step. Run after
# scripts/gpu_check.sh (its env.txt gives the CUDA libraries' path), in the same device call:
#
#   bash scripts/gpu_zoo.sh --out $OUT
#
# Writes $OUT/zoo.txt (one line per run: family, layout, dtype, the largest relative loss
# difference, ok/FAIL against the tolerance) and $OUT/zoo/*.jsonl (each run's metrics).
# Tolerances: f32 1e-4 (the kernels differ from the CPU's in summation order only), bf16 3e-2
# (two bf16 runs with different roundings; a lost term moves the loss by far more).
# Options: --cpl PATH (a cpl binary instead of the bundle's), --device DEV (default cuda),
# --limit S (seconds per run, default 60). Exit status: the number of failed runs (at most 100).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

OUT=
CPL=
DEVICE=cuda
LIMIT=60
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
# shellcheck source=scripts/gpu_common.sh disable=SC1091
. scripts/gpu_common.sh
gpu_compare_setup "$@"
mkdir -p "$OUT/zoo"
REPORT=$OUT/zoo.txt
: >"$REPORT"
FAILS=0

# pair NAME MODEL DTYPE LAYOUT_FLAGS...: the same run on the CPU and on $DEVICE, losses compared.
pair() {
    local name=$1 model=$2 dtype=$3 tol rc=0
    shift 3
    tol=1e-4
    [ "$dtype" = bf16 ] && tol=3e-2
    local flags=(train --model "$model" --tokens tests/fixtures/llama/tokens.json --seq-len 32
        --steps 4 --warmup 1 --lr 1e-2 --min-lr 1e-3 --grad-accum 1 --log-every 1 --dtype "$dtype" "$@")
    for dev in cpu "$DEVICE"; do
        timeout "$LIMIT" "$CPL" "${flags[@]}" --device "$dev" --out "$W/$name-$dev" \
            >"$W/$name-$dev.log" 2>&1 || rc=$?
        cp "$W/$name-$dev/metrics.jsonl" "$OUT/zoo/$name-$dev.jsonl" 2>/dev/null
    done
    local line
    if [ "$rc" -ne 0 ]; then
        line="FAIL $name: exit $rc: $(grep -i error "$W/$name-"*.log | tail -n 1)"
    else
        line=$(python3 - "$name" "$W/$name-cpu/metrics.jsonl" "$W/$name-$DEVICE/metrics.jsonl" "$tol" <<'PY'
import json, math, sys
name, a, b, tol = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
la = [json.loads(l)["loss"] for l in open(a) if l.strip()]
lb = [json.loads(l)["loss"] for l in open(b) if l.strip()]
ok = len(la) == len(lb) == 4 and all(x is not None and math.isfinite(x) for x in la + lb)
rel = max((abs(x - y) / abs(x) for x, y in zip(la, lb)), default=float("nan")) if ok else float("nan")
ok = ok and rel <= tol
print(f"{'ok  ' if ok else 'FAIL'} {name}: max relative loss difference {rel:.2e} (tolerance {tol:g}); "
      f"cpu {[round(x, 6) for x in la]} vs {[round(x, 6) for x in lb]}")
PY
)
    fi
    echo "$line" | tee -a "$REPORT"
    [[ $line == ok* ]] || FAILS=$((FAILS + 1))
}

for dir in tests/fixtures/zoo/*/ tests/fixtures/moe/*/; do
    fam=$(basename "$dir")
    [ -f "$dir/config.json" ] || continue
    for dtype in f32 bf16; do
        pair "$fam-1rank-$dtype" "$dir" "$dtype"
        pair "$fam-zigzag2-$dtype" "$dir" "$dtype" --ranks 2 --ring 2
    done
    pair "$fam-ulysses2-f32" "$dir" f32 --ranks 2 --ulysses 2
    case $dir in */moe/*) pair "$fam-ep2-f32" "$dir" f32 --ranks 2 --ep 2 ;; esac
done
echo "zoo: $FAILS failed" | tee -a "$REPORT"
exit $((FAILS > 100 ? 100 : FAILS))
