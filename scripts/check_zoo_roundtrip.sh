#!/usr/bin/env bash
# By hand (needs .venv with scripts/requirements-finetune.txt): for each zoo family, `cpl train`
# under tp2 saves a checkpoint that transformers' AutoModelForCausalLM loads with no missing or
# unexpected tensor and whose logits equal `cpl eval`'s; and `cpl finetune` (LoRA, tp2) writes an
# adapter that PEFT's PeftModel.from_pretrained loads with our logits, and that `cpl finetune
# merge` folds into a model transformers loads with the same logits
# (scripts/check_peft_adapter.py). Phi-3's checkpoints and adapters are in its fused layout
# (qkv_proj, gate_up_proj). PY overrides the Python (default .venv/bin/python). Results are
# recorded in tests/fixtures/zoo/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -p cpl
cpl=$PWD/target/debug/cpl
py=${PY:-$PWD/.venv/bin/python}
work=target/zoo-roundtrip
rm -rf "$work" && mkdir -p "$work" && cd "$work"
python3 -c "
import json, random
random.seed(1)
json.dump([[random.randrange(256) for _ in range(40)] for _ in range(20)], open('docs.json', 'w'))
json.dump([[(i * 37 + b * 11) % 256 for i in range(32)] for b in range(2)], open('ids.json', 'w'))"
for f in qwen2 qwen3 mistral gemma2 gemma3 phi3 phi3_longrope; do
  mkdir -p "$f"
  cp ../../tests/fixtures/zoo/$f/{config.json,generation_config.json,model.safetensors} "$f/"
  cp ../../tests/fixtures/llama/tokenizer/tokenizer{,_config}.json "$f/"
  "$cpl" train --model "$f" --tokens docs.json --seq-len 32 --steps 3 --warmup 0 --lr 1e-2 \
    --ranks 2 --tp 2 --out "tr-$f" > /dev/null
  "$cpl" eval --model "tr-$f/step-3" --tokens ids.json --logits-out "tr-$f.safetensors" --json > /dev/null
  "$cpl" finetune --model "$f" --template plain --seq-len 64 --steps 3 --max-examples 8 \
    --warmup 0 --lr 5e-2 --ranks 2 --tp 2 --out "ft-$f" > /dev/null
  "$cpl" eval --model "$f" --adapter "ft-$f/step-3" --tokens ids.json \
    --logits-out "ft-$f.safetensors" --json > /dev/null
  "$cpl" finetune merge --model "$f" --adapter "ft-$f/step-3" --out "mg-$f" > /dev/null
  "$py" - "$f" <<'PY'
import json, sys, torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
f = sys.argv[1]
ids = torch.tensor(json.load(open("ids.json")))
def ours(path):
    t = load_file(path)
    return torch.stack([t[f"logits.{i}"] for i in range(len(t))], 0)
m, info = AutoModelForCausalLM.from_pretrained(f"tr-{f}/step-3", attn_implementation="eager",
                                               dtype=torch.float32, output_loading_info=True)
bad = {k: v for k, v in info.items() if v}
assert not bad, bad
hf = m.eval()(input_ids=ids, use_cache=False).logits.detach()
o = ours(f"tr-{f}.safetensors")
rel = ((hf - o).abs().max() / o.abs().max()).item()
print(f"{f}: {type(m).__name__} reloads our trained checkpoint, logits rel {rel:.2e}")
assert rel < 1e-5, rel
save_file({"input_ids": ids, "logits": ours(f"ft-{f}.safetensors").contiguous()}, f"ft-{f}-ref.safetensors")
PY
  "$py" ../../scripts/check_peft_adapter.py "$f" "ft-$f/step-3" "ft-$f-ref.safetensors" --rtol 1e-5 \
    --merged "mg-$f" | tail -3
done
