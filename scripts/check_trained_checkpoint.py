#!/usr/bin/env python3
"""Check that a checkpoint written by `cpl train` loads in transformers and computes what cpl computes.

    .venv/bin/python scripts/check_trained_checkpoint.py DIR TOKENS LOGITS [--rtol 1e-4]

DIR: a `step-N` directory written by `cpl train` (a Hugging Face model directory plus training
state). TOKENS: the `--tokens` JSON file (an array of token-id arrays) given to
`cpl eval --model DIR --tokens TOKENS --logits-out LOGITS`, whose safetensors output (tensors
`logits.0`, `logits.1`, ... one per sequence, shape (len, vocab)) is LOGITS.

Loads DIR with `LlamaForCausalLM.from_pretrained` (eager attention, float32), runs every sequence,
and requires max |logits - cpl| / max |cpl| <= rtol for each. Missing or unexpected tensors in the
checkpoint are failures. Prints "OK <max rel err>" and exits 0, or "FAIL: ..." and exits 1.
Setup: see scripts/requirements-fixtures.txt.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("tokens")
    ap.add_argument("logits")
    ap.add_argument("--rtol", type=float, default=1e-4)
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(
        a.dir, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(k):
            fail(f"{k}: {info[k]}")
    model.eval()
    seqs = json.load(open(a.tokens))
    ours = load_file(a.logits)
    worst = 0.0
    with torch.no_grad():
        for i, ids in enumerate(seqs):
            want = ours.get(f"logits.{i}")
            if want is None:
                fail(f"{a.logits} has no logits.{i}")
            got = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            if got.shape != want.shape:
                fail(f"sequence {i}: transformers logits {tuple(got.shape)}, cpl {tuple(want.shape)}")
            if not torch.isfinite(got).all():
                fail(f"sequence {i}: non-finite logits")
            err = ((got - want).abs().max() / want.abs().max()).item()
            worst = max(worst, err)
    if worst > a.rtol:
        fail(f"max rel err {worst:.3e} > {a.rtol:.1e}")
    print(f"OK {worst:.3e}")


if __name__ == "__main__":
    main()
