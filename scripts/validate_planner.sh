#!/usr/bin/env bash
# The planner's measured validation (docs/planner.md): calibrates this machine, then for three
# model shapes and sequence lengths ranks every layout of 4 local ranks with `cpl plan --auto`
# and runs 10 of them, spread over the ranking, with `cpl bench train` (`--measure 10`).
# Prints Kendall's tau of predicted and measured tokens/s for each, and writes the JSON
# reports to $OUT (default target/planner-validation).
#
#   scripts/validate_planner.sh            # about 20 minutes on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/planner-validation}
mkdir -p "$OUT"
cargo build --release --bin cpl
CPL=target/release/cpl
$CPL bench calibrate --out "$OUT/hardware.toml" --ranks 4
config() { # name layers hidden heads kv_heads intermediate vocab
  printf '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": %s, "hidden_size": %s, "num_attention_heads": %s, "num_key_value_heads": %s, "intermediate_size": %s, "vocab_size": %s, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false}\n' \
    "$2" "$3" "$4" "$5" "$6" "$7" > "$OUT/$1.json"
}
config small 2 256 8 4 768 8000
config deep 4 128 8 2 384 4000
config wide 2 512 8 8 1536 16000
for spec in "small 2048" "deep 4096" "wide 1024"; do
  set -- $spec
  $CPL plan --auto --model "$OUT/$1.json" --seq-len "$2" --world 4 \
    --hardware "$OUT/hardware.toml" --measure 10 --json > "$OUT/$1-$2.json"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'tau', d['measured']['kendall_tau'])" \
    "$OUT/$1-$2.json" "$1 S=$2"
done
