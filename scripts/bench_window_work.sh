#!/usr/bin/env bash
# Attention work per rank at 64K tokens, window 4096 vs global attention (a Mistral-shaped model
# of one layer, 2 q heads / 1 kv head of dim 32), `cpl train` one step (4 micro-batches of one
# sequence) on ring 4, zigzag and contiguous: `attention_scores` of metrics.jsonl and the step's
# seconds. Needs .venv (scripts/requirements-fixtures.txt) for the two random checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p cpl
mkdir -p target/window-work
.venv/bin/python scripts/make_window_models.py target/window-work
cd target/window-work
for m in window4k global; do
  for layout in zigzag contiguous; do
    rm -rf "out-$m-$layout"
    /usr/bin/time -f "%e s" ../release/cpl train --model "$m" --tokens docs.json --seq-len 65536 --steps 1 \
      --warmup 0 --ranks 4 --ring 4 --ring-layout "$layout" --out "out-$m-$layout" > /dev/null 2> "log-$m-$layout" || { tail -3 "log-$m-$layout"; exit 1; }
    echo "$m $layout $(head -1 out-$m-$layout/metrics.jsonl | python3 -c 'import json,sys; v=json.load(sys.stdin); print(v["attention_scores"], v["seconds"])')"
  done
done
