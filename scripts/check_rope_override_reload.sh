#!/usr/bin/env bash
# By hand (needs .venv with scripts/requirements-finetune.txt): `cpl train --rope-*` saves a
# checkpoint whose config.json transformers reloads with `cpl eval`'s logits, on sequences longer
# than the trained context, for each RoPE type and both config forms (v5: the bundled model; v4:
# the qwen2_v4 fixture). Prints the max |logit difference| per case; results in docs/context.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p cpl
cpl=$PWD/target/release/cpl
py=$PWD/.venv/bin/python
work=target/rope-reload
rm -rf "$work" && mkdir -p "$work" && cd "$work"
python3 -c "
import json, random
random.seed(1)
json.dump([[random.randrange(256) for _ in range(300)] for _ in range(8)], open('docs.json', 'w'))
json.dump([[(i * 37 + b * 11) % 256 for i in range(300)] for b in range(2)], open('ids.json', 'w'))"
mkdir -p v4
cp ../../tests/fixtures/zoo/qwen2_v4/{config.json,model.safetensors} v4/
cp ../../tests/fixtures/llama/tokenizer/tokenizer{,_config}.json v4/
for model in ../../assets/default/model v4; do
  for rope in "--rope-theta 50000" "--rope-scaling yarn --rope-factor 4" \
      "--rope-scaling linear --rope-factor 2" "--rope-scaling dynamic --rope-factor 2" \
      "--rope-scaling llama3 --rope-factor 8 --rope-low-freq-factor 1 --rope-high-freq-factor 4"; do
    name=$(basename "$model")-$(echo "$rope" | tr -c 'a-z0-9' '_')
    # shellcheck disable=SC2086
    "$cpl" train --model "$model" --tokens docs.json --seq-len 256 --steps 1 --warmup 0 \
      --ranks 1 --out "tr-$name" $rope > /dev/null
    "$cpl" eval --model "tr-$name/step-1" --tokens ids.json --logits-out "$name.safetensors" --dtype f32 \
      --json > /dev/null
    "$py" - "tr-$name/step-1" "$name.safetensors" "$name" <<'PY'
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
import json
ckpt, ours, name = sys.argv[1:]
m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
ids = torch.tensor(json.load(open("ids.json")))
with torch.no_grad():
    ref = m(ids).logits
d = load_file(ours)
got = torch.stack([d[f"logits.{i}"] for i in range(len(d))]).to(torch.float32)
print(f"{name}: rope {m.config.rope_parameters} max_position {m.config.max_position_embeddings}: max |diff| {(ref - got).abs().max().item():.2e} (logits up to {ref.abs().max().item():.1f})")
PY
  done
done
