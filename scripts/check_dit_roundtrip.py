#!/usr/bin/env python3
"""Check that a DiT directory (e.g. one our Rust code saved) loads in diffusers and reproduces the
reference output of a fixture.

    .venv/bin/python scripts/check_dit_roundtrip.py DIR REFERENCE_DIR [--rtol 1e-5]

Loads DIR with `DiTTransformer2DModel.from_pretrained(DIR)` (one file or shards with an index),
requires no missing or unexpected keys, runs REFERENCE_DIR/reference.safetensors' `fwd.sample`,
`fwd.timestep`, `fwd.class_labels` and requires max |out - fwd.output| / max |fwd.output| <= rtol.
Prints "OK <err>" and exits 0, else "FAIL: ..." and exits 1. Setup: scripts/requirements-dit.txt.
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
    with torch.no_grad():
        out = model.eval()(r["fwd.sample"], timestep=r["fwd.timestep"], class_labels=r["fwd.class_labels"]).sample
    err = ((out - r["fwd.output"]).abs().max() / r["fwd.output"].abs().max()).item()
    if not err <= a.rtol:
        print(f"FAIL: relative error {err:.3e} > {a.rtol:g}", file=sys.stderr)
        sys.exit(1)
    print(f"OK {err:.3e}")


if __name__ == "__main__":
    main()
