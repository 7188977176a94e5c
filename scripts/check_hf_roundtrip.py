#!/usr/bin/env python3
"""Check that a LLaMA model directory (e.g. one written by our Rust code) loads in transformers and
reproduces the reference logits of a fixture.

    .venv/bin/python scripts/check_hf_roundtrip.py DIR REFERENCE_DIR [--rtol 1e-4] [--dtype float32]

DIR: a Hugging Face model directory (config.json + model.safetensors or shards with their index).
REFERENCE_DIR: a fixture directory such as tests/fixtures/llama/mha (its reference.safetensors is used;
a path to a reference.safetensors file also works). Setup: see scripts/requirements-fixtures.txt.

Loads DIR with `LlamaForCausalLM.from_pretrained(DIR, attn_implementation="eager")`, runs the reference
`input_ids` in eval mode with use_cache=False, and requires
    max |logits - ref_logits| / max |ref_logits| <= rtol   (default 1e-4).
Missing or unexpected checkpoint tensors, shape mismatches and non-finite logits are failures too.
Prints "OK <max rel err>" and exits 0 on success; otherwise prints "FAIL: ..." to stderr and exits 1
(2 for usage errors).
"""
import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def fail(msg: str, code: int = 1):
    print(f"FAIL: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="model directory to check (written by the Rust code)")
    ap.add_argument("reference_dir", help="fixture directory holding reference.safetensors (or the file)")
    ap.add_argument("--rtol", type=float, default=1e-4, help="max-abs / max|ref| tolerance (default 1e-4)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="dtype transformers computes in (default float32)")
    args = ap.parse_args()

    model_dir = Path(args.dir)
    ref_path = Path(args.reference_dir)
    if ref_path.is_dir():
        ref_path = ref_path / "reference.safetensors"
    if not (model_dir / "config.json").is_file():
        fail(f"{model_dir}/config.json not found", 2)
    if not ref_path.is_file():
        fail(f"{ref_path} not found", 2)

    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)

    ref = load_file(str(ref_path))
    for key in ("input_ids", "logits"):
        if key not in ref:
            fail(f"{ref_path} has no `{key}` tensor")
    input_ids, ref_logits = ref["input_ids"].long(), ref["logits"].double()

    dtype = getattr(torch, args.dtype)
    try:
        model, info = LlamaForCausalLM.from_pretrained(
            str(model_dir), attn_implementation="eager", dtype=dtype, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - report any loading error clearly
        fail(f"transformers could not load {model_dir}: {type(e).__name__}: {e}")
    problems = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if problems:
        fail(f"loading {model_dir} reported {problems}")
    model.eval()
    cfg = model.config
    if cfg.vocab_size != ref_logits.shape[-1]:
        fail(f"vocab_size {cfg.vocab_size} != reference vocab {ref_logits.shape[-1]}")

    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits.double()
    if logits.shape != ref_logits.shape:
        fail(f"logits shape {tuple(logits.shape)} != reference {tuple(ref_logits.shape)}")
    if not torch.isfinite(logits).all():
        fail("non-finite logits")
    diff = (logits - ref_logits).abs()
    err = (diff.max() / ref_logits.abs().max().clamp_min(1e-30)).item()
    if not err <= args.rtol:
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        fail(f"logits differ from {ref_path}: max rel err {err:.3e} > {args.rtol:g} "
             f"(max abs diff {diff.max().item():.3e} at {idx}: got {logits[idx].item():.6f}, "
             f"ref {ref_logits[idx].item():.6f}; config: heads {cfg.num_attention_heads}, "
             f"kv heads {cfg.num_key_value_heads}, head_dim {cfg.head_dim}, "
             f"rope {dict(cfg.rope_parameters)}, tied {cfg.tie_word_embeddings})")
    print(f"OK {err:.3e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
