#!/usr/bin/env bash
# Expert parallelism (issue 34): `cpl bench train` of the Mixtral-shaped bench checkpoint (4
# layers, hidden 512, 8 experts, top-2; scripts/bench_zoo.py builds it with transformers) at
# SEQ_LEN tokens per sequence on RANKS local ranks (one sequence each: dp RANKS) under --ep 1, 2
# and 4, the same run and machine. Prints one JSON line per run and a table: tokens/s, peak RSS
# of the process and per rank, and the experts' parameters each rank holds.
# Usage: [SEQ_LEN=4096] [RANKS=4] [STEPS=3] [EPS="1 2 4"] [DTYPE=f32] scripts/bench_ep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ_LEN=${SEQ_LEN:-4096}
RANKS=${RANKS:-4}
STEPS=${STEPS:-3}
EPS=${EPS:-1 2 4}
DTYPE=${DTYPE:-f32}
PY=${PYTHON:-.venv/bin/python}
cargo build --release -p cpl
CPL="${CARGO_TARGET_DIR:-target}/release/cpl"
MODEL=$("$PY" -c 'import sys; sys.path.insert(0, "scripts"); import bench_zoo; print(bench_zoo.checkpoint("mixtral", "target/bench", 4096))')
OUT=$(mktemp)
for ep in $EPS; do
    "$CPL" bench train --model "$MODEL" --seq-len "$SEQ_LEN" --ranks "$RANKS" --ep "$ep" \
        --steps "$STEPS" --dtype "$DTYPE" --json | tee -a "$OUT"
done
"$PY" - "$OUT" "$RANKS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ranks = int(sys.argv[2])
m = rows[0]["machine"]
print(f"{m['cpu']}, {m['threads']} threads; {rows[0]['model']['name']}, {rows[0]['dtype']}, seq {rows[0]['seq_len']}")
print("| layout | tokens/s (median) | vs ep 1 | peak RSS MiB (process) | per rank |")
print("|---|---|---|---|---|")
base = rows[0]["tokens_per_sec_median"]
for r in rows:
    t = r["tokens_per_sec_median"]
    print(f"| {r['layout']} | {t:.0f} | {t / base:.2f}x | {r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / ranks:.0f} |")
PY
rm -f "$OUT"
