#!/usr/bin/env bash
# Builds tests/fixtures/passkey/copy: the bundled model fine-tuned to retrieve passkeys, so that
# tests can show passkey accuracy 1.0 (`bin/tests/long_context_cli.rs`). About 4 minutes on 2
# cores. From the repository root:
#
#     bash scripts/make_passkey_fixture.sh
#
# 1. `cpl data passkey`: 10,920 prompts of `cpl eval --passkey`'s template (64 and 128 tokens,
#    21 depths, 260 keys per cell, seed 11: other keys than the evaluations', which use seed 0);
# 2. `cpl train` of the bundled model on them: 1000 AdamW steps of 8 windows of 128 tokens with
#    document masks, lr 4e-3 (warmup 50, cosine to 4e-4), seed 5, f32, one rank;
# 3. the last checkpoint, with its tokenizer, copied to the fixture with the run's final passkey
#    grid (64,128 x 0,0.5,1 x 4 keys) in README.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=tests/fixtures/passkey/copy
cargo build --quiet -p cpl
CPL=${CARGO_TARGET_DIR:-target}/debug/cpl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
DEPTHS=0,0.05,0.1,0.15,0.2,0.25,0.3,0.35,0.4,0.45,0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95,1
"$CPL" data passkey --model assets/default/model --passkey-lengths 64,128 \
    --passkey-depths "$DEPTHS" --passkey-trials 260 --passkey-seed 11 --out "$tmp/train.json"
"$CPL" train --model assets/default/model --tokens "$tmp/train.json" --seq-len 128 --batch 8 \
    --grad-accum 1 --doc-mask --lr 4e-3 --min-lr 4e-4 --warmup 50 --steps 1000 --seed 5 \
    --out "$tmp/run" --eval-passkey --passkey-lengths 64,128 --passkey-depths 0,0.5,1 \
    --passkey-trials 4 --eval-every 250 2>&1 | grep -v '^step ' || true
[ -f "$tmp/run/step-1000/model.safetensors" ] || { echo "training did not finish" >&2; exit 1; }
rm -rf "$OUT"
mkdir -p "$OUT"
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json; do
    if [ -f "$tmp/run/step-1000/$f" ]; then
        cp "$tmp/run/step-1000/$f" "$OUT/"
    elif [ -f "assets/default/model/$f" ]; then
        cp "assets/default/model/$f" "$OUT/"
    fi
done
accuracy=$(python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(" ".join("step %d: %.2f" % (x["step"], x["passkey"]["accuracy"]) for x in r if "passkey" in x))' "$tmp/run/eval.jsonl")
cat >"$OUT/README.md" <<EOF
# A model that retrieves passkeys (generated)

The bundled model (\`assets/default/model\`) fine-tuned to retrieve passkeys, by
\`scripts/make_passkey_fixture.sh\` (do not edit by hand; rerun it): 1000 steps on 10,920 prompts of
\`cpl eval --passkey\`'s template (64 and 128 tokens, 21 depths, keys of seed 11; the evaluations use
seed 0). Passkey accuracy during the run (64,128 x 0,0.5,1 x 4 keys): $accuracy.

Used by \`bin/tests/long_context_cli.rs\` to show accuracy 1.0 within the trained length, on one rank
and under sequence parallelism.
EOF
echo "wrote $OUT ($(du -sh "$OUT" | cut -f1)); passkey accuracy $accuracy"
