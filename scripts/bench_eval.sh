#!/usr/bin/env bash
# `cpl bench eval` vs transformers forward throughput (issue 5), same checkpoint, sequence length
# and machine. Usage: scripts/bench_eval.sh [f32|bf16]   (needs .venv, see scripts/bench_eval.py;
# PY=... picks another interpreter, SEQ=4096 and REPEATS=3 are the defaults; SKIP_BUILD=1 uses
# target/release/cpl as built)
set -euo pipefail
cd "$(dirname "$0")/.."
dt=${1:-f32}
pyd=float32; [ "$dt" = bf16 ] && pyd=bfloat16
py=${PY:-.venv/bin/python}
seq=${SEQ:-4096}
mkdir -p target/bench
[ -n "${SKIP_BUILD:-}" ] || cargo build --release -p cpl
torch_json=$("$py" scripts/bench_eval.py --dtype "$pyd" --seq-len "$seq" --repeats "${REPEATS:-3}")
echo "transformers: $torch_json"
cpl_json=$(./target/release/cpl bench eval --model target/bench/llama-4l-512 --seq-len "$seq" \
    --repeats "${REPEATS:-3}" --dtype "$dt" --json)
echo "cpl bench eval: $cpl_json"
python3 - "$torch_json" "$cpl_json" <<'PY'
import json, sys
t = json.loads(sys.argv[1]); c = json.loads(sys.argv[2])
best = c["tokens_per_sec_best"]
print(f"dtype {t['dtype']} seq {t['seq_len']}: cpl eval {best:.0f} tok/s, transformers {t['tokens_per_sec']:.0f} tok/s, ratio {best / t['tokens_per_sec']:.2f}x")
PY
