#!/usr/bin/env bash
# Pipeline bubble, throughput and memory (issue 13): `cpl train --pp 2` as 2 MPI processes
# with one core each (RAYON_NUM_THREADS=1, so that an idle stage cannot lend its core to the
# other) for GPipe, 1F1B and interleaved 1F1B (2 chunks per rank) at 4, 8 and 16 micro-batches,
# next to the formula (p-1)/(v*m+p-1); and the same model without a pipeline on one process
# with 2 threads. Model: a random LLaMA of 8 layers, hidden 512, vocab 4096 (made with the venv
# of scripts/requirements-fixtures.txt), sequences of 512 tokens. Usage: scripts/bench_pipeline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/bench/pipeline
mkdir -p "$dir"
[ -f "$dir/model/model.safetensors" ] || "${PYTHON:-.venv/bin/python}" - "$dir" <<'PY'
import json, random, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
d = sys.argv[1]
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32")
LlamaForCausalLM(cfg).save_pretrained(f"{d}/model", safe_serialization=True)
random.seed(0)
json.dump([[random.randrange(4096) for _ in range(600)] for _ in range(200)], open(f"{d}/tokens.json", "w"))
PY
cargo build --release -p cpl --features cpl/mpi,candle-parallel/mpi
cpl=target/release/cpl
common=(train --model "$dir/model" --tokens "$dir/tokens.json" --seq-len 512 --steps 3 --no-shuffle)
for m in 4 8 16; do
    for s in "gpipe 1" "1f1b 1" "interleaved 2"; do
        set -- $s
        RAYON_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -np 2 -x RAYON_NUM_THREADS \
            "$cpl" "${common[@]}" --ranks 2 --pp 2 --backend mpi --micro-batches "$m" \
            --pp-schedule "$1" --virtual-stages "$2" --out "$dir/$1-v$2-m$m" > /dev/null 2>&1
    done
    RAYON_NUM_THREADS=2 "$cpl" "${common[@]}" --grad-accum "$m" --out "$dir/none-m$m" > /dev/null 2>&1
done
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
print("| schedule | m | measured bubble | formula | after / formula | tok/s | vs no pipeline | peak RSS per process |")
print("|---|---|---|---|---|---|---|---|")
for m in (4, 8, 16):
    base = [json.loads(l) for l in open(f"{d}/none-m{m}/metrics.jsonl")][1:]
    base_tps = max(x["tokens_per_sec"] for x in base)
    for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        lines = [json.loads(l) for l in open(f"{d}/{s}-v{v}-m{m}/metrics.jsonl")][1:]
        bubble = sum(x["pp_bubble"] for x in lines) / len(lines)
        formula = 1 / (v * m + 1)
        tps = max(x["tokens_per_sec"] for x in lines)
        rss = max(x["peak_rss_mib"] for x in lines)
        print(f"| {s} v={v} | {m} | {bubble:.3f} | {formula:.3f} | {bubble / formula:.2f} | {tps:.0f} | {tps / base_tps:.2f}x | {rss:.0f} MiB |")
    rss = max(x["peak_rss_mib"] for x in base)
    print(f"| no pipeline (1 process, 2 threads) | {m} | | | | {base_tps:.0f} | 1.00x | {rss:.0f} MiB |")
PY
