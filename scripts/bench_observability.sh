#!/usr/bin/env bash
# Overheads of the observability flags (issue 36): `cpl train` step time with nothing, with
# --trace, with --detect-anomaly and with --tensorboard, and of a build with every tracing span
# compiled out (`--features spans-off`: what the spans cost while no trace records), on the bench LLaMA (4 layers, hidden
# 512, vocab 32000; made by scripts/bench_zoo.py when missing) at 4096 tokens on 4 local ranks
# (ring 4). Prints the median step time of steps 1..STEPS-1 of each mode and its ratio to the
# plain run; the modes alternate REPEATS times so drift hits them alike.
# Usage: scripts/bench_observability.sh   (STEPS=5 REPEATS=2 SEQ=4096 RANKS=4 override; MODES
# picks some of: plain spans-off trace anomaly tensorboard)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-5}
REPEATS=${REPEATS:-2}
SEQ=${SEQ:-4096}
RANKS=${RANKS:-4}
MODES=${MODES:-plain spans-off trace anomaly tensorboard}
PY=${PYTHON:-.venv/bin/python}
cargo build --release -p cpl
CPL=${CARGO_TARGET_DIR:-target}/release/cpl
# The spans-off build in its own target folder (seeded from the release one when new: only
# tracing and its dependents rebuild).
OFF_TARGET=target/bench/spans-off
if [ ! -d "$OFF_TARGET/release" ] && [ -d "${CARGO_TARGET_DIR:-target}/release" ]; then
    mkdir -p "$OFF_TARGET"
    cp -a "${CARGO_TARGET_DIR:-target}/release" "$OFF_TARGET/"
fi
CARGO_TARGET_DIR=$OFF_TARGET cargo build --release -p cpl --features spans-off
CPL_OFF=$OFF_TARGET/release/cpl
W=target/bench/observability
mkdir -p "$W"
MODEL=target/bench/zoo/llama-4l-512
if [ ! -f "$MODEL/model.safetensors" ]; then
    "$PY" -c "import sys; sys.path.insert(0, 'scripts'); import bench_zoo; bench_zoo.checkpoint('llama', 'target/bench', $SEQ)"
fi
python3 -c "
import json, random
random.seed(0)
json.dump([[random.randrange(32000) for _ in range($SEQ)] for _ in range($STEPS + 1)], open('$W/ids.json', 'w'))"
run() { # name, extra flags... (CPL_BIN overrides the binary)
    local name=$1
    shift
    rm -rf "${W:?}/${name:?}"
    "${CPL_BIN:-$CPL}" train --model "$MODEL" --tokens "$W/ids.json" --seq-len "$SEQ" --steps "$STEPS" \
        --ranks "$RANKS" --ring "$RANKS" --out "$W/$name" "$@" > "$W/$name.log" 2>&1
    python3 -c "
import json, statistics, sys
s = [json.loads(l)['seconds'] for l in open('$W/$name/metrics.jsonl')][1:]
print(statistics.median(s))" >> "$W/$name.times"
}
rm -f "$W"/*.times
for _ in $(seq "$REPEATS"); do
    for m in $MODES; do
        case $m in
        plain) run plain ;;
        spans-off) CPL_BIN=$CPL_OFF run spans-off ;;
        trace) run trace --trace "$W/trace.json" ;;
        anomaly) run anomaly --detect-anomaly ;;
        tensorboard) run tensorboard --tensorboard ;;
        *) echo "unknown mode $m" >&2; exit 2 ;;
        esac
    done
done
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| mode | median step s | vs plain |"
echo "|---|---|---|"
for m in $MODES; do
    python3 -c "
import statistics
plain = statistics.median(float(x) for x in open('$W/plain.times'))
t = statistics.median(float(x) for x in open('$W/$m.times'))
print(f'| $m | {t:.3f} | {t / plain:.3f}x |')"
done
