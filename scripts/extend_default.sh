#!/usr/bin/env bash
# The README's context-extension job: the bundled model (trained at context 128) extended to
# 2048 tokens (16x) on the bundled corpus, with YaRN (`--rope-scaling yarn --rope-factor 16`)
# against the same training with the RoPE unchanged, and the loss by position on the held-out
# plays before and after (`cpl eval --by-position`), drawn as docs/images/extension-by-position.png.
# About 8 minutes on 2 cores. Usage: scripts/extend_default.sh [OUT] (default runs/extend).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/extend}
STEPS=${STEPS:-200}
cargo build --release -p cpl
cpl=target/release/cpl
EVAL=(--data assets/default/corpus/shakespeare-eval.jsonl --seq-len 2048 --dtype f32 --by-position)
mkdir -p "$OUT"
t0=$SECONDS
"$cpl" eval --model assets/default/model "${EVAL[@]}" --json >"$OUT/before.json"
"$cpl" train --seq-len 2048 --steps "$STEPS" --rope-scaling yarn --rope-factor 16 --out "$OUT/yarn"
"$cpl" train --seq-len 2048 --steps "$STEPS" --out "$OUT/plain"
"$cpl" eval --model "$OUT/plain/step-$STEPS" "${EVAL[@]}" --json >"$OUT/plain.json"
"$cpl" eval --model "$OUT/yarn/step-$STEPS" "${EVAL[@]}" --json >"$OUT/yarn.json"
"$cpl" eval --model "$OUT/yarn/step-$STEPS" "${EVAL[@]}" \
    --by-position-plot docs/images/extension-by-position.png \
    --compare "$OUT/before.json" "$OUT/plain.json"
echo "total $((SECONDS - t0)) s"
