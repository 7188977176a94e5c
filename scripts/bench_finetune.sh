#!/usr/bin/env bash
# `cpl finetune` (LoRA SFT and full SFT) vs transformers + PEFT throughput and peak memory
# (issue 16): same checkpoint (scripts/bench_eval.py's 4-layer hidden-512 LLaMA), one sequence
# of $SEQ tokens per step, LoRA r 16 alpha 32 on every linear layer, AdamW, same machine, same
# run. Usage: PY=path/to/python scripts/bench_finetune.sh [f32|bf16] (PY needs torch,
# transformers and peft: scripts/requirements-finetune.txt; SEQ=4096 and REPEATS=3 are the defaults;
# SKIP_BUILD=1 uses target/release/cpl as built).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
dt=${1:-f32}
pyd=float32; [ "$dt" = bf16 ] && pyd=bfloat16
seq=${SEQ:-4096}
reps=${REPEATS:-3}
mkdir -p target/bench
[ -n "${SKIP_BUILD:-}" ] || cargo build --release -p cpl
[ -f target/bench/llama-4l-512/model.safetensors ] || "$PY" scripts/bench_eval.py --seq-len "$seq" --repeats 1 > /dev/null
# cpl finetune reads chat data: the bundled model's tokenizer (ids below the bench model's
# vocabulary) and one long conversation of bundled dialogue turns, cut to $seq tokens.
cp assets/default/model/tokenizer.json assets/default/model/tokenizer_config.json target/bench/llama-4l-512/
python3 - target/bench/long-chat.jsonl <<'PY'
import json, sys
rows = [json.loads(l) for l in open("assets/chat/dialogue.jsonl")]
msgs = [{"role": "system", "content": "A long scene."}]
for r in rows[:200]:
    msgs += [m for m in r["messages"] if m["role"] != "system"]
open(sys.argv[1], "w").write(json.dumps({"messages": msgs}) + "\n")
PY
run_cpl() { # tag, extra flags
    local out=target/bench/finetune-$1; rm -rf "$out"
    /usr/bin/time -f "%M" -o "target/bench/cpl_ft_rss_$1" ./target/release/cpl finetune --model target/bench/llama-4l-512 \
        --data target/bench/long-chat.jsonl --template plain --seq-len "$seq" --steps $((reps + 1)) --batch 1 \
        --grad-accum 1 --warmup 0 --lr 1e-4 --min-lr 1e-4 --dtype "$dt" --no-shuffle --lora-rank 16 \
        --lora-alpha 32 --out "$out" "${@:2}" 2>/dev/null
}
run_cpl lora
run_cpl full --finetuning-type full
peft_json=$("$PY" scripts/bench_finetune.py --dtype "$pyd" --seq-len "$seq" --repeats "$reps")
full_json=$("$PY" scripts/bench_finetune.py --dtype "$pyd" --seq-len "$seq" --repeats "$reps" --full)
echo "transformers + PEFT: $peft_json"
echo "transformers (full): $full_json"
python3 - "$peft_json" "$full_json" <<'PY'
import json, sys
for arg, tag in ((sys.argv[1], "lora"), (sys.argv[2], "full")):
    t = json.loads(arg)
    lines = [json.loads(l) for l in open(f"target/bench/finetune-{tag}/metrics.jsonl")][1:]  # first step warms up
    best = max(l["tokens_per_sec"] for l in lines)
    rss = int(open(f"target/bench/cpl_ft_rss_{tag}").read().split()[-1]) / 1024
    print(f"{tag} dtype {t['dtype']} seq {t['seq_len']}: cpl finetune {best:.0f} tok/s (peak RSS {rss:.0f} MiB), "
          f"transformers {t['tokens_per_sec']:.0f} tok/s (peak RSS {t['peak_rss_mib']:.0f} MiB), ratio {best / t['tokens_per_sec']:.2f}x")
PY
