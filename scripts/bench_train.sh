#!/usr/bin/env bash
# `cpl bench train` vs transformers + PyTorch training throughput (issue 6): same checkpoint,
# sequence length and machine. Usage: scripts/bench_train.sh [f32|bf16] (needs .venv, see
# scripts/bench_eval.py, which this runs first to build the checkpoint; PY=... picks another
# interpreter, SEQ=4096 and REPEATS=3 are the defaults; SKIP_BUILD=1 uses target/release/cpl as built;
# ROUNDS=N runs both sides N times in turn and reports the best of each).
set -euo pipefail
cd "$(dirname "$0")/.."
dt=${1:-f32}
pyd=float32; [ "$dt" = bf16 ] && pyd=bfloat16
py=${PY:-.venv/bin/python}
seq=${SEQ:-4096}
mkdir -p target/bench
[ -n "${SKIP_BUILD:-}" ] || cargo build --release -p cpl
[ -f target/bench/llama-4l-512/model.safetensors ] || "$py" scripts/bench_eval.py --seq-len "$seq" --repeats 1 > /dev/null
# ROUNDS=N (default 1): transformers then cpl, N times in turn; the best of each is reported (on a VM
# whose speed drifts over minutes one block of each side is not a fair comparison:
# docs/benchmarks.md, "bf16 training rows after P and dS were rounded").
rounds=${ROUNDS:-1}
torch_all=()
cpl_all=()
for r in $(seq "$rounds"); do
    t=$("$py" scripts/bench_train.py --dtype "$pyd" --seq-len "$seq" --repeats "${REPEATS:-3}")
    # transformers trains on $seq tokens: $seq - 1 inputs with a label each, as --seq-len $((seq - 1)).
    # The first step warms up; cpl reports the best of the others.
    c=$(./target/release/cpl bench train --model target/bench/llama-4l-512 --seq-len $((seq - 1)) \
        --steps $((${REPEATS:-3} + 1)) --dtype "$dt" --json)
    [ "$rounds" = 1 ] || echo "round $r of $rounds: transformers $t; cpl $c"
    torch_all+=("$t")
    cpl_all+=("$c")
done
# The best run of each side (by tokens/s).
best() {
    python3 -c 'import json, sys; k = sys.argv[1]; print(max(sys.argv[2:], key=lambda s: json.loads(s)[k]))' "$@"
}
torch_json=$(best tokens_per_sec "${torch_all[@]}")
cpl_json=$(best tokens_per_sec_best "${cpl_all[@]}")
echo "transformers: $torch_json"
echo "cpl bench train: $cpl_json"
python3 - "$torch_json" "$cpl_json" <<'PY'
import json, sys
t = json.loads(sys.argv[1]); c = json.loads(sys.argv[2])
best = c["tokens_per_sec_best"]
print(f"dtype {t['dtype']} seq {t['seq_len']}: cpl train {best:.0f} tok/s (peak RSS {c['peak_rss_mib']:.0f} MiB), "
      f"transformers {t['tokens_per_sec']:.0f} tok/s (peak RSS {t['peak_rss_mib']:.0f} MiB), ratio {best / t['tokens_per_sec']:.2f}x")
PY
