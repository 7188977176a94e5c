#!/usr/bin/env bash
# `cpl eval` vs transformers forward throughput (issue 5), same checkpoint, tokens and machine.
# Usage: scripts/bench_eval.sh [f32|bf16]   (needs .venv, see scripts/bench_eval.py)
set -euo pipefail
cd "$(dirname "$0")/.."
dt=${1:-f32}
pyd=float32; [ "$dt" = bf16 ] && pyd=bfloat16
mkdir -p target/bench
cargo build --release -p cpl
torch_json=$(.venv/bin/python scripts/bench_eval.py --dtype "$pyd" --repeats "${REPEATS:-3}")
echo "transformers: $torch_json"
best=""
for _ in $(seq "${REPEATS:-3}"); do
    out=$(./target/release/cpl eval --model target/bench/llama-4l-512 --tokens target/bench/eval_tokens.json --dtype "$dt" --json)
    tps=$(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_sec"])')
    if [ -z "$best" ] || python3 -c "import sys; sys.exit(0 if $tps > $best else 1)"; then best=$tps; fi
done
echo "cpl eval: $out"
python3 - "$torch_json" "$best" <<'PY'
import json, sys
t = json.loads(sys.argv[1]); c = float(sys.argv[2])
print(f"dtype {t['dtype']} seq {t['seq_len']}: cpl eval {c:.0f} tok/s, transformers {t['tokens_per_sec']:.0f} tok/s, ratio {c / t['tokens_per_sec']:.2f}x")
PY
