#!/usr/bin/env python3
"""The bundled image set of the DiT job: scikit-learn's 8x8 handwritten digits as a latents file,
and the config of the small pixel-space DiT for it.

    .venv/bin/python scripts/make_digits.py [OUT] [CONFIG_DIR]
    # defaults: assets/digits/digits.safetensors, tests/fixtures/dit/digits-config

Writes OUT with `latents` (1797, 1, 8, 8) float32, the 0..16 pixel counts mapped to [-1, 1]
(x / 8 - 1, exact), and `labels` (1797) int64, the digit (deterministic: no randomness).
Source: `sklearn.datasets.load_digits()` (scikit-learn ships the data as
sklearn/datasets/data/digits.csv.gz); see assets/digits/README.md for the attribution.

Writes CONFIG_DIR/config.json (`save_config` of a diffusers `DiTTransformer2DModel`, no weights):
1 channel in, 2 out (noise + learned sigma), 8x8 samples in 2x2 patches (16 tokens), 4 blocks of
4 heads x 16, 10 classes (+ the null class), adaLN-Zero, tanh GELU, LayerNorms without affine
parameters, eps 1e-5. assets/digits/dit/config.json is the same config (checked here).
Setup: scripts/requirements-dit.txt.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import DiTTransformer2DModel
from safetensors.torch import load_file, save_file
from sklearn.datasets import load_digits

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "assets/digits/digits.safetensors")
CONFIG_DIR = Path(sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/dit/digits-config")
CONFIG = dict(
    in_channels=1,
    out_channels=2,
    sample_size=8,
    patch_size=2,
    num_layers=4,
    num_attention_heads=4,
    attention_head_dim=16,
    num_embeds_ada_norm=10,
    norm_type="ada_norm_zero",
    activation_fn="gelu-approximate",
    attention_bias=True,
    norm_elementwise_affine=False,
    norm_eps=1e-5,
)

d = load_digits()
assert d.images.shape == (1797, 8, 8) and d.images.min() == 0 and d.images.max() == 16
images = torch.from_numpy(d.images.astype(np.float32) / 8.0 - 1.0).reshape(-1, 1, 8, 8)
labels = torch.from_numpy(d.target.astype(np.int64))
OUT.parent.mkdir(parents=True, exist_ok=True)
save_file({"latents": images.contiguous(), "labels": labels}, str(OUT))
back = load_file(str(OUT))
assert back["latents"].dtype == torch.float32 and torch.equal(back["latents"], images)
assert back["labels"].dtype == torch.int64 and torch.equal(back["labels"], labels)
assert torch.equal((back["latents"].reshape(-1, 8, 8) + 1) * 8, torch.from_numpy(d.images).float())
print(f"wrote {OUT}: {tuple(images.shape)} images, {int(labels.max()) + 1} classes")

model = DiTTransformer2DModel(**CONFIG)
model.save_config(CONFIG_DIR)
written = json.loads((CONFIG_DIR / "config.json").read_text())
assets = Path("assets/digits/dit/config.json")
if assets.is_file():
    strip = lambda c: {k: v for k, v in c.items() if k != "_diffusers_version"}  # noqa: E731
    assert strip(json.loads(assets.read_text())) == strip(written), f"{assets} differs from {CONFIG_DIR}"
n = sum(p.numel() for p in model.parameters())
print(f"wrote {CONFIG_DIR / 'config.json'}: {n} parameters")
