#!/usr/bin/env bash
# `cpl train` on a small LLaVA vs transformers + PyTorch (issue 15): the 4-layer hidden-512
# LLaMA with a small CLIP tower (scripts/bench_llava.py builds it), one sequence of $SEQ tokens
# with one 224x224 image per step, AdamW, same machine, same run.
# Usage: PY=path/to/python scripts/bench_llava.sh   (SEQ=4096 and REPEATS=3 are the defaults;
# SKIP_BUILD=1 uses target/release/cpl as built)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
seq=${SEQ:-4096}
reps=${REPEATS:-3}
mkdir -p target/bench
[ -n "${SKIP_BUILD:-}" ] || cargo build --release -p cpl
torch_json=$("$PY" scripts/bench_llava.py --seq-len "$seq" --repeats "$reps")
echo "transformers: $torch_json"
# One conversation whose text fills the window after the image (cut by the tokenizer's
# length: the data file is made long enough, then --seq-len truncates nothing: it must fit).
python3 - target/bench/llava-chat.jsonl "$seq" <<'PY'
import json, sys
img = "tests/fixtures/llava/images/a.png"
words = "the miller grinds the corn and the baker bakes the bread " * 2000
msgs = [{"role": "user", "content": "<image>describe"}, {"role": "assistant", "content": words}]
open(sys.argv[1], "w").write(json.dumps({"messages": msgs, "images": ["../../" + img]}) + "\n")
PY
out=target/bench/llava-run
rm -rf "$out"
/usr/bin/time -f "%M" -o target/bench/cpl_llava_rss ./target/release/cpl train --model target/bench/llava-bench \
    --data target/bench/llava-chat.jsonl --template plain --seq-len "$seq" --steps $((reps + 1)) --batch 1 \
    --grad-accum 1 --warmup 0 --lr 1e-4 --min-lr 1e-4 --no-shuffle --out "$out" 2>&1 | tail -2
python3 - "$torch_json" "$out/metrics.jsonl" target/bench/cpl_llava_rss "$seq" <<'PY'
import json, sys
t = json.loads(sys.argv[1])
lines = [json.loads(l) for l in open(sys.argv[2])][1:]
best = int(sys.argv[4]) / min(l["seconds"] for l in lines)
rss = int(open(sys.argv[3]).read().split()[-1]) / 1024
print(f"LLaVA seq {t['seq_len']}: cpl train {best:.0f} tok/s (peak RSS {rss:.0f} MiB), "
      f"transformers {t['tokens_per_sec']:.0f} tok/s (peak RSS {t['peak_rss_mib']:.0f} MiB), ratio {best / t['tokens_per_sec']:.2f}x")
PY
