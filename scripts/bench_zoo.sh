#!/usr/bin/env bash
# `cpl bench eval|train` vs transformers + PyTorch for every causal-LM family (issue 33): a
# bench-sized random checkpoint of each family, the same sequence length and machine, f32 and
# bf16. Usage: scripts/bench_zoo.sh [--families llama,qwen2,...,gemma3] [--dtypes f32,bf16]
# [--seq-len 4096] [--repeats 3] [--rounds 1] [--json FILE]   (needs .venv, see scripts/bench_zoo.py; PYTHON
# overrides its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target/bench
cargo build --release -p cpl
"${PYTHON:-.venv/bin/python}" scripts/bench_zoo.py \
    --cpl "${CARGO_TARGET_DIR:-target}/release/cpl" "$@"
