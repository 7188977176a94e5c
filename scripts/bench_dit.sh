#!/usr/bin/env bash
# DiT training throughput, cpl vs diffusers + PyTorch (issue 14): DiT-S/2 (hidden 384, 12 blocks,
# 6 heads) at 256 and 1024 patch tokens per image, f32, DDPM loss with the learned-sigma bound,
# AdamW, same machine, same run. Usage: scripts/bench_dit.sh (needs .venv with
# scripts/requirements-dit.txt; PY=... picks another interpreter; CPL="a/cpl b/cpl" times those
# binaries instead of building this checkout's, each against the same PyTorch run, to compare
# builds). Prints one line per size and binary.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
steps=${STEPS:-4}
cpl=${CPL:-}
if [ -z "$cpl" ]; then
    cargo build --release -p cpl
    cpl=./target/release/cpl
fi
for tokens in ${TOKENS:-256 1024}; do
    batch=$(( tokens == 256 ? 8 : 2 ))
    dir=target/bench/dit-$tokens
    torch_json=$("$py" scripts/bench_dit.py --tokens "$tokens" --batch "$batch" --steps "$steps" --out "$dir")
    for bin in $cpl; do
        out=$dir/run
        rm -rf "$out"
        /usr/bin/time -f "%M" -o "$dir/cpl_rss" "$bin" train --model "$dir" --from-scratch \
            --data "$dir/latents.safetensors" --steps $((steps + 1)) --batch "$batch" --grad-accum 1 \
            --warmup 0 --lr 1e-4 --min-lr 1e-4 --no-shuffle --out "$out" 2>/dev/null
        python3 - "$torch_json" "$out/metrics.jsonl" "$dir/cpl_rss" "$bin" <<'PY'
import json, sys
t = json.loads(sys.argv[1])
lines = [json.loads(l) for l in open(sys.argv[2])][1:]  # the first step warms up
best = max(l["images_per_sec"] for l in lines)
rss = int(open(sys.argv[3]).read().split()[-1]) / 1024
print(f"DiT-S/2 {t['tokens']} tokens/image, batch {t['batch']}: cpl {best:.2f} images/s (peak RSS {rss:.0f} MiB), "
      f"diffusers {t['images_per_sec']:.2f} images/s (peak RSS {t['peak_rss_mib']:.0f} MiB), ratio {best / t['images_per_sec']:.2f}x"
      + (f" [{sys.argv[4]}]" if sys.argv[4] != "./target/release/cpl" else ""))
PY
    done
done
