#!/usr/bin/env bash
# The commands besides `cpl train` on a GPU: `cpl eval` (one rank and a zigzag ring of 2 local
# ranks sharing the GPU; f32 and bf16), `cpl generate` (greedy, f32) and `cpl finetune` (LoRA SFT,
# packed; LoRA DPO) of the bundled model, each on --device cuda and on --device cpu with the same
# flags, the results compared. Run after scripts/gpu_check.sh (its env.txt gives the CUDA
# libraries' path), in the same device call:
#
#   bash scripts/gpu_commands.sh --out $OUT
#
# Writes $OUT/commands.txt, one line per comparison. Tolerances (relative): eval f32 1e-5,
# bf16 2e-2; finetune losses 1e-3 (as gpu_check.sh's train stage); generate: the same text
# (greedy decoding of a model whose top two logits are far apart at every step; a flip is
# reported with the first differing character).
# Options: --cpl PATH (a cpl binary instead of the bundle's), --device DEV (default cuda),
# --limit S (seconds per run, default 120). Exit status: the number of failed comparisons.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

OUT=
CPL=
DEVICE=cuda
LIMIT=120
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
# shellcheck source=scripts/gpu_common.sh disable=SC1091
. scripts/gpu_common.sh
gpu_compare_setup "$@"
MODEL=assets/default/model
# About 24K tokens of the corpus: its first 100,000 characters, as 10 documents.
python3 - "$W/small.jsonl" <<'PY'
import json, sys
text = "".join(json.loads(l)["text"] for l in open("assets/default/corpus/shakespeare.jsonl"))[:100000]
with open(sys.argv[1], "w") as f:
    for i in range(0, len(text), 10000):
        f.write(json.dumps({"text": text[i:i + 10000]}) + "\n")
PY
REPORT=$OUT/commands.txt
: >"$REPORT"
FAILS=0
report() {
    echo "$1" | tee -a "$REPORT"
    [[ $1 == ok* ]] || FAILS=$((FAILS + 1))
}

# run NAME DEV ARGS...: cpl ARGS --device DEV, stdout to $W/NAME-DEV.out; the exit status.
run() {
    local name=$1 dev=$2
    shift 2
    timeout "$LIMIT" "$CPL" "$@" --device "$dev" >"$W/$name-$dev.out" 2>"$W/$name-$dev.err"
}

# compare NAME TOL A B: two files of numbers (one JSON object a line; every numeric field
# named in KEYS) within TOL relative.
compare() {
    python3 - "$@" <<'PY'
import json, math, sys
name, tol, a, b, keys = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5].split(",")
def rows(p):
    out = []
    for l in open(p):
        l = l.strip()
        if l.startswith("{"):
            r = json.loads(l)
            out.append([r[k] for k in keys if k in r])
    return out
ra, rb = rows(a), rows(b)
va = [x for r in ra for x in r]
vb = [x for r in rb for x in r]
ok = len(va) == len(vb) > 0 and all(isinstance(x, (int, float)) and math.isfinite(x) for x in va + vb)
rel = max((abs(x - y) / max(abs(x), 1e-30) for x, y in zip(va, vb)), default=float("nan")) if ok else float("nan")
ok = ok and rel <= tol
print(f"{'ok  ' if ok else 'FAIL'} {name}: {len(va)} values ({','.join(keys)}), max relative difference "
      f"{rel:.2e} (tolerance {tol:g}); cpu {va[:6]} vs {vb[:6]}")
PY
}

pair() { # pair NAME TOL KEYS FILE ARGS...: run on cpu and DEVICE, compare FILE (out = stdout).
    local name=$1 tol=$2 keys=$3 file=$4 rc=0
    shift 4
    local args=("$@")
    for dev in cpu "$DEVICE"; do
        local a=("${args[@]}")
        if [ "$file" != out ]; then a+=(--out "$W/$name-$dev-dir"); fi
        run "$name" "$dev" "${a[@]}" || rc=$?
    done
    if [ "$rc" -ne 0 ]; then
        report "FAIL $name: exit $rc: $(tail -n 2 "$W/$name-"*.err | tr '\n' ' ')"
        return
    fi
    local fa=$W/$name-cpu.out fb=$W/$name-$DEVICE.out
    if [ "$file" != out ]; then fa=$W/$name-cpu-dir/$file; fb=$W/$name-$DEVICE-dir/$file; fi
    report "$(compare "$name" "$tol" "$fa" "$fb" "$keys")"
}

EVAL=(eval --model "$MODEL" --data "$W/small.jsonl" --seq-len 256 --json)
pair eval-f32 1e-5 loss,perplexity out "${EVAL[@]}" --dtype f32
pair eval-bf16 2e-2 loss,perplexity out "${EVAL[@]}" --dtype bf16
pair eval-zigzag2-f32 1e-5 loss,perplexity out "${EVAL[@]}" --dtype f32 --ranks 2 --ring 2

# generate: the same text.
rc=0
for dev in cpu "$DEVICE"; do
    run generate "$dev" generate --model "$MODEL" --prompt "To be, or not to be" \
        --max-new-tokens 48 --dtype f32 || rc=$?
done
if [ "$rc" -ne 0 ]; then
    report "FAIL generate: exit $rc: $(tail -n 2 "$W"/generate-*.err | tr '\n' ' ')"
elif cmp -s "$W/generate-cpu.out" "$W/generate-$DEVICE.out"; then
    report "ok   generate: greedy f32, 48 tokens: the same text ($(wc -c <"$W/generate-cpu.out") bytes)"
else
    report "FAIL generate: greedy f32 differs: $(cmp "$W/generate-cpu.out" "$W/generate-$DEVICE.out")"
fi

FT=(finetune --steps 4 --warmup 1 --lr 1e-2 --min-lr 1e-3 --grad-accum 1 --log-every 1 --dtype f32)
pair finetune-lora-sft 1e-3 loss,grad_norm metrics.jsonl "${FT[@]}" --seq-len 128 --max-examples 32 --packing
pair finetune-lora-sft-zigzag2 1e-3 loss,grad_norm metrics.jsonl "${FT[@]}" --seq-len 128 --max-examples 32 \
    --packing --ranks 2 --ring 2
pair finetune-lora-dpo 1e-3 loss,grad_norm metrics.jsonl "${FT[@]}" --stage dpo --seq-len 128 --max-examples 16
echo "commands: $FAILS failed" | tee -a "$REPORT"
exit $((FAILS > 100 ? 100 : FAILS))
