#!/usr/bin/env bash
# Every side-by-side benchmark of docs/benchmarks.md, one after another on this machine in one
# session (issue 39), then their one table (scripts/bench_table.py): training and evaluation in
# f32 and bf16, attention at 2K and 8K, DiT at 256 and 1024 tokens/image, LLaVA, LoRA and full
# fine-tuning, and the local collectives (`cpl bench comm`).
# Usage: scripts/bench_all.sh [--out DIR] [--quick] [--no-build]
#   --out DIR    where each benchmark's NAME.log (stdout and stderr), NAME.json (where it writes
#                JSON) and NAME.status (exit code, UTC times, load average, command) go, with
#                session (commit, versions), cpuinfo and table.md (default target/bench/all)
#   --quick      tiny sizes and one timed step each: checks the plumbing end to end, its figures
#                mean nothing
#   --no-build   use target/release/cpl as built (default: build it once here)
# TRAIN_ROUNDS (default 3) is how many times the two training rows run transformers and cpl in
# turn (the best of each counts: this VM's speed drifts over minutes, docs/benchmarks.md).
# BF16_SEQ and BF16_REPEATS (default 4096 and 3) size the bf16 training and evaluation rows alone:
# on a CPU without AVX512-BF16 PyTorch's bf16 products run at about a tenth of its f32 rate, and
# its 4096-token bf16 training step takes minutes.
# PY (or PYTHON) picks the one interpreter of every script (default .venv/bin/python, with
# scripts/requirements-{bench,fixtures,dit,llava,finetune}.txt). A failing benchmark is recorded
# and the next one runs; the exit code is that of the table.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/bench/all quick='' build=1
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --quick) quick=1; shift ;;
        --no-build) build=''; shift ;;
        *) echo "bench_all.sh: unknown flag $1" >&2; exit 2 ;;
    esac
done
export PY=${PY:-${PYTHON:-.venv/bin/python}}
export PYTHON=$PY SKIP_BUILD=1
if [ -n "$build" ]; then cargo build --release -p cpl; fi
cpl=./target/release/cpl
mkdir -p "$out"
# The real run: each script's documented sizes (docs/benchmarks.md); --quick: tiny ones.
# shellcheck disable=SC2054  # the commas are inside flag values
if [ -n "$quick" ]; then
    lm=(SEQ=256 REPEATS=1) lm_bf16=("${lm[@]}") rounds=(ROUNDS=2) att=(--seqs 256 --dtypes f32,bf16) att_env=(REPEATS=1 TORCH_REPEATS=1)
    dit=(16) dit_env=(STEPS=1) llava=(SEQ=512 REPEATS=1) comm=(--mib 4 --iters 2)
else
    lm=(REPEATS=3) lm_bf16=(SEQ="${BF16_SEQ:-4096}" REPEATS="${BF16_REPEATS:-3}") rounds=(ROUNDS="${TRAIN_ROUNDS:-3}") att=(--seqs 2048,8192 --dtypes f32,bf16) att_env=(REPEATS=3 TORCH_REPEATS=3)
    dit=(256 1024) dit_env=(STEPS=3) llava=(REPEATS=3) comm=()
fi
{
    echo "quick=${quick:-0}"
    echo "start=$(date -u +%FT%TZ)"
    echo "commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "cpus=$(nproc)"
    echo "python=$PY"
    "$PY" -c 'import importlib.metadata as m
print("versions=" + ", ".join(f"{p} {m.version(p)}" for p in ("torch", "transformers", "diffusers", "peft")))' \
        2>/dev/null || echo "versions=unknown"
} > "$out/session"
sed '/^$/q' /proc/cpuinfo > "$out/cpuinfo"

run() { # NAME COMMAND...: its output in $out/NAME.log; exit code, times, load before it in NAME.status
    local name=$1 start load rc=0 cmd
    shift
    cmd="$*" && cmd=${cmd#env }
    rm -f "$out/$name".*
    start=$(date -u +%FT%TZ) load=$(cut -d' ' -f1-3 /proc/loadavg)
    echo "== $name: $cmd" >&2
    "$@" > "$out/$name.log" 2>&1 || rc=$?
    [ "$rc" = 0 ] || echo "== $name failed (exit $rc), see $out/$name.log" >&2
    printf 'rc=%s\nstart=%s\nend=%s\nload=%s\ncmd=%s\n' "$rc" "$start" "$(date -u +%FT%TZ)" \
        "$load" "$cmd" > "$out/$name.status"
    return 0
}
# Training: transformers and cpl in turn, the best of each (scripts/bench_train.sh ROUNDS).
run train-f32 env "${lm[@]}" "${rounds[@]}" scripts/bench_train.sh f32
run train-bf16 env "${lm_bf16[@]}" "${rounds[@]}" scripts/bench_train.sh bf16
run eval-f32 env "${lm[@]}" scripts/bench_eval.sh f32
run eval-bf16 env "${lm_bf16[@]}" scripts/bench_eval.sh bf16
run attention env "${att_env[@]}" scripts/bench_attention.sh "${att[@]}"
# bench_attention.sh writes its JSON to target/bench; keep this run's (not an older one's).
if grep -qx rc=0 "$out/attention.status"; then cp target/bench/attention.json "$out/attention.json"; fi
for t in "${dit[@]}"; do run "dit-$t" env "${dit_env[@]}" TOKENS="$t" CPL=$cpl scripts/bench_dit.sh; done
run llava env "${llava[@]}" scripts/bench_llava.sh
run finetune-f32 env "${lm[@]}" scripts/bench_finetune.sh f32
run comm "$cpl" bench comm "${comm[@]}" --json
grep -m1 '^{' "$out/comm.log" > "$out/comm.json" || rm -f "$out/comm.json"
echo "end=$(date -u +%FT%TZ)" >> "$out/session"
python3 scripts/bench_table.py "$out" | tee "$out/table.md"
