#!/usr/bin/env python3
"""The bundled image set of the DiT job: scikit-learn's 8x8 handwritten digits as a latents file.

    .venv/bin/python scripts/make_digits.py [OUT]     # default assets/digits/digits.safetensors

Writes `latents` (1797, 1, 8, 8) float16, the 0..16 pixel counts mapped to [-1, 1] (x / 8 - 1,
exact in float16), and `labels` (1797) int64, the digit. Source: `sklearn.datasets.load_digits()`
(scikit-learn ships the data as sklearn/datasets/data/digits.csv.gz); see assets/digits/README.md
for the attribution. Setup: scripts/requirements-dit.txt.
"""
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from sklearn.datasets import load_digits

out = Path(sys.argv[1] if len(sys.argv) > 1 else "assets/digits/digits.safetensors")
d = load_digits()
images = torch.from_numpy(d.images.astype(np.float32) / 8.0 - 1.0).reshape(-1, 1, 8, 8)
labels = torch.from_numpy(d.target.astype(np.int64))
out.parent.mkdir(parents=True, exist_ok=True)
save_file({"latents": images.to(torch.float16).contiguous(), "labels": labels}, str(out))
print(f"wrote {out}: {tuple(images.shape)} images, {int(labels.max()) + 1} classes")
