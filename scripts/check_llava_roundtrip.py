#!/usr/bin/env python3
"""transformers reloads a LLaVA checkpoint written by `cpl train` and gives cpl's logits.

Usage: python scripts/check_llava_roundtrip.py CHECKPOINT_DIR TOKENS.json PIXELS.safetensors LOGITS.safetensors
where LOGITS.safetensors is `cpl eval --model CHECKPOINT_DIR --tokens TOKENS.json
--pixel-values PIXELS.safetensors --logits-out LOGITS.safetensors` (the sequences must have the
same length). Exits 1 when the largest difference exceeds 1e-4 of the largest logit.
"""
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import LlavaForConditionalGeneration


def main():
    if len(sys.argv) != 5:
        print(__doc__)
        sys.exit(2)
    ckpt, tokens, pixels, logits = sys.argv[1:]
    model = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    ids = torch.tensor(json.load(open(tokens)))
    pv = load_file(pixels)["pixel_values"]
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=pv).logits
    ours = load_file(logits)
    got = torch.stack([ours[f"logits.{i}"] for i in range(ids.shape[0])])
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"max |cpl - transformers| / max |logit| = {err:.3e}")
    sys.exit(0 if err <= 1e-4 else 1)


if __name__ == "__main__":
    main()
