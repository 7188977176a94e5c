#!/usr/bin/env bash
# flash-ring attention benchmark (issue 3): PyTorch CPU SDPA and `cpl bench attention` in the
# same run. Usage: scripts/bench_attention.sh [extra flags of cpl bench attention, e.g. --seqs 2048]
# Needs .venv with scripts/requirements-bench.txt installed:
#   python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-bench.txt
# Writes target/bench/attention_torch.json and target/bench/attention.json, and prints the table.
# PY=... picks another interpreter; REPEATS and TORCH_REPEATS (default 5) the timed runs of each
# side; SKIP_BUILD=1 uses target/release/cpl as built. --seqs, --dtypes, --masks, --heads and
# --head-dim (as `--flag VALUE`) go to the PyTorch side too.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
mkdir -p target/bench
[ -n "${SKIP_BUILD:-}" ] || cargo build --release -p cpl
torch_flags=()
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do
    case ${args[i]} in --seqs|--dtypes|--masks|--heads|--head-dim) torch_flags+=("${args[i]}" "${args[i + 1]}");; esac
done
"$py" scripts/bench_attention_torch.py --repeats "${TORCH_REPEATS:-5}" "${torch_flags[@]}" \
    --out target/bench/attention_torch.json > /dev/null
./target/release/cpl bench attention --repeats "${REPEATS:-5}" \
    --torch target/bench/attention_torch.json --json "$@" > target/bench/attention.json
python3 - target/bench/attention.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
m = d["machine"]
print(f"{m['cpu']}, {m['threads']} threads; f32 matmul: candle {d['matmul_f32_gflops']:.1f} GFLOP/s, "
      f"PyTorch {d['torch_matmul_f32_gflops'] or float('nan'):.1f} GFLOP/s")
ms = lambda x: "-" if x is None else f"{x * 1e3:.1f}"
print("| dtype | S | mask | flash fwd ms | flash fwd+bwd ms | GF/s | % candle mm | naive fwd ms "
      "| naive fwd+bwd ms | torch fwd ms | torch fwd+bwd ms | fwd+bwd vs torch |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in d["results"]:
    x = r["speedup_vs_torch_fwd_bwd"]
    print(f"| {r['dtype']} | {r['seq']} | {r['mask']} | {ms(r['fwd_s'])} | {ms(r['fwd_bwd_s'])} "
          f"| {r['fwd_bwd_gflops']:.1f} | {100 * r['fraction_of_matmul']:.0f}% | {ms(r['naive_fwd_s'])} "
          f"| {ms(r['naive_fwd_bwd_s'])} | {ms(r['torch_fwd_s'])} | {ms(r['torch_fwd_bwd_s'])} "
          f"| {'-' if x is None else f'{x:.2f}x'} |")
PY
