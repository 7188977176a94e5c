#!/usr/bin/env bash
# GPU measurements beyond scripts/gpu_check.sh, run on the GPU machine right after it in the same
# device call (it reads the LD_LIBRARY_PATH that gpu_check.sh wrote to DIR/env.txt):
#   torch-attention.json    PyTorch SDPA (its fastest CUDA backend) on (1, 32, S, 128), the reference
#   attention.json (.log)   cpl bench attention with flash-ring's CUDA kernels, ratios to PyTorch
#   composite.json          the same with FLASH_RING_CUDA=composite (the candle-ops path), S = 8K
#   train32k.log            cpl bench train on one GPU, 32K tokens a step, bf16: tokens/s and MFU
# The device tool returns at most 8 files of $OUT, and gpu_check.sh and this script write 13: at
# the end every file of DIR goes into DIR/results.tar.gz (the only file left there), and the
# summaries (summary.txt, gpu_bench.txt, the MFU lines of train32k.log) are printed.
# Usage: scripts/gpu_bench.sh --out DIR [--seqs 8192,32768]
# Each command has its own time limit; a failure is reported in DIR/gpu_bench.txt and the rest run.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

OUT=
SEQS=8192,32768
while [ $# -gt 0 ]; do
    case $1 in
    --out) OUT=$2; shift ;;
    --seqs) SEQS=$2; shift ;;
    -h | --help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$OUT" ] || { echo "--out DIR is required" >&2; exit 2; }
[ -f "$OUT/env.txt" ] || { echo "$OUT/env.txt missing: run scripts/gpu_check.sh --out $OUT first" >&2; exit 2; }
BUNDLE=${CPL_GPU_BUNDLE:-gpu-bundle}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
if ! xz -dc "$BUNDLE/bin/cpl.xz" >"$W/cpl"; then
    echo "cannot unpack $BUNDLE/bin/cpl.xz" >&2
    exit 1
fi
chmod +x "$W/cpl"
LD_LIBRARY_PATH=$(sed -n 's/^LD_LIBRARY_PATH=//p' "$OUT/env.txt" | head -n 1)
export LD_LIBRARY_PATH
REPORT="$OUT/gpu_bench.txt"
: >"$REPORT"
step() { # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 t0=$SECONDS rc=0
    shift 2
    timeout "$limit" "$@" || rc=$?
    # To the report only: the caller's stdout may be a result file.
    echo "$name: exit $rc in $((SECONDS - t0)) s" >>"$REPORT"
}

PY=
for p in /opt/torch/.venv/bin/python python3; do
    if "$p" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then PY=$p; break; fi
done
SHAPE=(--heads 32 --head-dim 128)
TORCH_ARG=()
if [ -n "$PY" ]; then
    step torch 90 "$PY" scripts/bench_attention_torch.py --device cuda --heads 32 --head-dim 128 \
        --seqs "$SEQS" --dtypes f32,bf16 --repeats 3 --out "$OUT/torch-attention.json" >/dev/null
    [ -s "$OUT/torch-attention.json" ] && TORCH_ARG=(--torch "$OUT/torch-attention.json")
else
    echo "torch: no Python with CUDA torch found" >>"$REPORT"
fi
SEQ_ARG=(--seqs "$SEQS")
step attention 150 "$W/cpl" bench attention --device cuda "${SHAPE[@]}" "${SEQ_ARG[@]}" \
    --repeats 2 "${TORCH_ARG[@]}" --json >"$OUT/attention.json" 2>>"$OUT/attention.log"
step composite 60 env FLASH_RING_CUDA=composite "$W/cpl" bench attention --device cuda "${SHAPE[@]}" \
    --seqs 8192 --repeats 2 --json >"$OUT/composite.json" 2>&1
step train32k 120 "$W/cpl" bench train --device cuda --seq-len 32768 --steps 3 --dtype bf16 \
    --layers 4 --hidden 1024 --heads 8 --kv-heads 8 --intermediate 2816 --vocab 32000 \
    >"$OUT/train32k.log" 2>&1
cat "$REPORT"
[ -f "$OUT/summary.txt" ] && cat "$OUT/summary.txt"
grep -E "^\||^step seconds|^peak" "$OUT/train32k.log" 2>/dev/null
# One file for the device tool (at most 8 come back).
if tar -C "$OUT" -czf "$W/results.tar.gz" . 2>/dev/null; then
    find "$OUT" -mindepth 1 -delete
    mv "$W/results.tar.gz" "$OUT/results.tar.gz"
fi
