#!/usr/bin/env python3
"""Check that a DiT directory (e.g. one our Rust code saved) loads in diffusers and reproduces the
reference output of a fixture.

    .venv/bin/python scripts/check_dit_roundtrip.py DIR REFERENCE_DIR [--rtol 1e-5]

Loads DIR with `DiTTransformer2DModel.from_pretrained(DIR)` (one file or shards with an index),
requires no missing, unexpected or mismatched keys, runs REFERENCE_DIR/reference.safetensors'
`fwd.sample` and `fwd.class_labels` at `fwd.timestep` (integer) and at `fwd.timestep_float` (eval
mode) and requires max |out - ref| / max |ref| <= rtol against `fwd.output` and `fwd.output_float`.
Prints "OK <worst err>" and exits 0, else "FAIL: ..." (stderr) and exits 1.
Setup: scripts/requirements-dit.txt.
"""
import argparse
import sys
from pathlib import Path

import torch
from diffusers import DiTTransformer2DModel
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("reference_dir")
    ap.add_argument("--rtol", type=float, default=1e-5)
    a = ap.parse_args()
    try:
        model, info = DiTTransformer2DModel.from_pretrained(a.dir, output_loading_info=True)
    except Exception as e:  # noqa: BLE001
        print(f"FAIL: {a.dir} does not load: {e}", file=sys.stderr)
        sys.exit(1)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        print(f"FAIL: loading info {bad}", file=sys.stderr)
        sys.exit(1)
    r = load_file(str(Path(a.reference_dir) / "reference.safetensors"))
    model.eval()  # train mode would drop class labels at random (class_dropout_prob 0.1)
    worst = 0.0
    for ts, want in (("fwd.timestep", "fwd.output"), ("fwd.timestep_float", "fwd.output_float")):
        with torch.no_grad():
            out = model(r["fwd.sample"], timestep=r[ts], class_labels=r["fwd.class_labels"]).sample
        if out.shape != r[want].shape:
            print(f"FAIL: output shape {tuple(out.shape)} != {want} {tuple(r[want].shape)}", file=sys.stderr)
            sys.exit(1)
        err = ((out - r[want]).abs().max() / r[want].abs().max()).item()
        if not err <= a.rtol:
            print(f"FAIL: {want}: relative error {err:.3e} > {a.rtol:g}", file=sys.stderr)
            sys.exit(1)
        worst = max(worst, err)
    print(f"OK {worst:.3e}")


if __name__ == "__main__":
    main()
