#!/usr/bin/env bash
# flash-ring attention benchmark (issue 3): PyTorch CPU SDPA and flash-ring in the same run.
# Usage: scripts/bench_attention.sh [extra args for bench_attention, e.g. --seqs 2048]
# Needs .venv with scripts/requirements-bench.txt installed:
#   python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-bench.txt
# Writes target/bench/attention_torch.json and target/bench/attention.json.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target/bench
cargo build -p flash-ring --release --example bench_attention
.venv/bin/python scripts/bench_attention_torch.py --repeats "${TORCH_REPEATS:-5}" \
    --out target/bench/attention_torch.json > /dev/null
./target/release/examples/bench_attention --repeats "${REPEATS:-5}" \
    --torch target/bench/attention_torch.json --json target/bench/attention.json "$@"
