#!/usr/bin/env python3
"""The diffusers + PyTorch side of the DiT training benchmark (`scripts/bench_dit.sh`).

    .venv/bin/python scripts/bench_dit.py --tokens 256 --batch 8 --steps 4 --out target/bench/dit-256

Builds a DiT-S/2 (hidden 384, 12 blocks, 6 heads, patch 2, 4 latent channels, learned sigma, 1000
classes) at `sqrt(tokens) * 2` latent pixels, writes its config.json (so `cpl train --model OUT
--from-scratch` builds the same model) and a latents file of `batch * steps` random latents, then
times DiT's DDPM training step (the loss of scripts/make_dit_fixtures.py: MSE + variational bound,
AdamW) on them in f32. Prints one JSON line with images/s (best step after a warm-up) and the peak
RSS. Setup: scripts/requirements-dit.txt.
"""
import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
from diffusers import DiTTransformer2DModel
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import make_dit_fixtures as ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    side = int(math.isqrt(a.tokens)) * 2
    cfg = dict(num_attention_heads=6, attention_head_dim=64, in_channels=4, out_channels=8, num_layers=12,
               sample_size=side, patch_size=2, num_embeds_ada_norm=1000)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = DiTTransformer2DModel(**cfg)
    model.save_config(out)
    n = a.batch * (a.steps + 1)
    x = torch.randn(n, 4, side, side).clamp(-1, 1)
    y = torch.randint(0, 1000, (n,))
    save_file({"latents": x.contiguous(), "labels": y}, str(out / "latents.safetensors"))
    d = ref.Diffusion.linear(1000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    best = 0.0
    for s in range(a.steps + 1):
        xb, yb = x[s * a.batch:(s + 1) * a.batch], y[s * a.batch:(s + 1) * a.batch]
        t = torch.randint(0, 1000, (a.batch,))
        t0 = time.perf_counter()
        _, mse, vb = ref.ddpm_losses(d, model, xb, t, yb, torch.randn_like(xb))
        loss = (mse + vb).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if s > 0:
            best = max(best, a.batch / dt)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "tokens": a.tokens,
                      "batch": a.batch, "images_per_sec": best,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
