#!/usr/bin/env bash
# `cpl train` vs transformers + PyTorch training throughput (issue 6): same checkpoint, tokens,
# sequence length and machine. Usage: scripts/bench_train.sh [f32|bf16] (needs .venv, see
# scripts/bench_eval.py, which this runs first to build the checkpoint and tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
dt=${1:-f32}
pyd=float32; [ "$dt" = bf16 ] && pyd=bfloat16
seq=${SEQ:-4096}
mkdir -p target/bench
cargo build --release -p cpl
[ -f target/bench/llama-4l-512/model.safetensors ] || .venv/bin/python scripts/bench_eval.py --seq-len "$seq" --repeats 1 > /dev/null
torch_json=$(.venv/bin/python scripts/bench_train.py --dtype "$pyd" --seq-len "$seq" --repeats "${REPEATS:-3}")
echo "transformers: $torch_json"
out=target/bench/train-run
rm -rf "$out"
# The --tokens file holds one sequence of $seq tokens: windows of $seq - 1 (inputs) + 1 (label).
/usr/bin/time -f "%M" -o target/bench/cpl_train_rss ./target/release/cpl train --model target/bench/llama-4l-512 \
    --tokens target/bench/eval_tokens.json --seq-len $((seq - 1)) --steps $((${REPEATS:-3} + 1)) --batch 1 --grad-accum 1 \
    --warmup 0 --lr 1e-4 --min-lr 1e-4 --dtype "$dt" --no-shuffle --out "$out" 2>/dev/null
python3 - "$torch_json" "$out/metrics.jsonl" target/bench/cpl_train_rss <<'PY'
import json, sys
t = json.loads(sys.argv[1])
lines = [json.loads(l) for l in open(sys.argv[2])][1:]  # first step warms up
best = max(l["tokens_per_sec"] for l in lines)
rss = int(open(sys.argv[3]).read().split()[-1]) / 1024
print(f"dtype {t['dtype']} seq {t['seq_len']}: cpl train {best:.0f} tok/s (peak RSS {rss:.0f} MiB), "
      f"transformers {t['tokens_per_sec']:.0f} tok/s (peak RSS {t['peak_rss_mib']:.0f} MiB), ratio {best / t['tokens_per_sec']:.2f}x")
PY
