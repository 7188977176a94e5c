#!/usr/bin/env python3
"""Check that a PEFT LoRA adapter directory (e.g. one written by our Rust code) loads in PEFT on top of its
base model and reproduces reference logits; optionally check a merged model directory too.

    python scripts/check_peft_adapter.py BASE_DIR ADAPTER_DIR REFERENCE.safetensors [--merged MERGED_DIR]
                                         [--rtol 1e-4]

BASE_DIR: the base model directory of any causal-LM family (e.g. tests/fixtures/llama/gqa, tests/fixtures/zoo/qwen3).
ADAPTER_DIR: adapter_config.json + adapter_model.safetensors (PEFT layout).
REFERENCE.safetensors: a file with `input_ids` (B, T) and `logits` (B, T, V), e.g.
tests/fixtures/finetune/lora/reference.safetensors.
MERGED_DIR: a plain model directory (config.json + model.safetensors) with the adapter merged in.
Setup: scripts/requirements-finetune.txt.

Loads BASE_DIR with `AutoModelForCausalLM.from_pretrained(attn_implementation="eager")` (float32, eval,
use_cache=False), applies ADAPTER_DIR with `PeftModel.from_pretrained`, and requires that every tensor of
adapter_model.safetensors was loaded into a LoRA parameter of the same shape (no unknown or missing keys; a
fused module such as Phi-3's `qkv_proj` or `gate_up_proj` has one LoRA, `lora_B` with the rows of all its
parts) and that
    max |logits - ref_logits| / max |ref_logits| <= rtol   (default 1e-4).
With --merged, MERGED_DIR is loaded as a plain AutoModelForCausalLM (no missing / unexpected tensors, no
leftover lora keys) and its logits must match the PEFT model's within the same tolerance.
Prints the max diffs and "OK" and exits 0; otherwise prints "FAIL: ..." to stderr and exits 1 (2 for
usage errors).
"""
import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PREFIX = "base_model.model."


def fail(msg: str, code: int = 1):
    print(f"FAIL: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base_dir", help="base model directory")
    ap.add_argument("adapter_dir", help="PEFT adapter directory to check")
    ap.add_argument("reference", help="safetensors file with input_ids and logits")
    ap.add_argument("--merged", help="merged model directory to check as well")
    ap.add_argument("--rtol", type=float, default=1e-4, help="max-abs / max|ref| tolerance (default 1e-4)")
    args = ap.parse_args()

    base_dir, adapter_dir, ref_path = Path(args.base_dir), Path(args.adapter_dir), Path(args.reference)
    if not (base_dir / "config.json").is_file():
        fail(f"{base_dir}/config.json not found", 2)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        if not (adapter_dir / f).is_file():
            fail(f"{adapter_dir}/{f} not found", 2)
    if not ref_path.is_file():
        fail(f"{ref_path} not found", 2)
    merged_dir = Path(args.merged) if args.merged else None
    if merged_dir is not None and not (merged_dir / "config.json").is_file():
        fail(f"{merged_dir}/config.json not found", 2)

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)

    ref = load_file(str(ref_path))
    for key in ("input_ids", "logits"):
        if key not in ref:
            fail(f"{ref_path} has no `{key}` tensor")
    input_ids, ref_logits = ref["input_ids"].long(), ref["logits"].double()

    def load_plain(d: Path):
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                str(d), attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - report any loading error clearly
            fail(f"transformers could not load {d}: {type(e).__name__}: {e}")
        problems = {k: sorted(map(str, v)) for k, v in info.items() if v}
        if problems:
            fail(f"loading {d} reported {problems}")
        return model.eval()

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

    def abs_diff(a, b):
        return (a.double() - b.double()).abs().max().item()

    try:
        adapter_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    except Exception as e:  # noqa: BLE001
        fail(f"{adapter_dir}/adapter_config.json is not valid JSON: {e}")
    if adapter_cfg.get("peft_type") != "LORA":
        fail(f"adapter_config.json peft_type is {adapter_cfg.get('peft_type')!r}, expected 'LORA'")

    base = load_plain(base_dir)
    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    except Exception as e:  # noqa: BLE001
        fail(f"PEFT could not load {adapter_dir}: {type(e).__name__}: {e}")
    model.eval()

    # Every stored tensor must land in a LoRA parameter, and every LoRA parameter must come from the file
    # (PEFT itself only warns about unexpected / missing adapter keys).
    stored = load_file(str(adapter_dir / "adapter_model.safetensors"))
    params = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            params[n.replace(".default.", ".")] = p
    unknown = sorted(set(stored) - set(params))
    missing = sorted(set(params) - set(stored))
    if unknown or missing:
        fail(f"adapter keys do not match the LoRA modules PEFT created from adapter_config.json: "
             f"unknown (in file, not in model) {unknown[:8]}{' ...' if len(unknown) > 8 else ''}; "
             f"missing (in model, not in file) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for k, t in stored.items():
        if tuple(t.shape) != tuple(params[k].shape):
            fail(f"{k}: shape {tuple(t.shape)} in file, {tuple(params[k].shape)} in the model")
        if not torch.equal(params[k].detach().float(), t.float()):
            fail(f"{k}: the loaded parameter differs from the file")
    n_modules = len(stored) // 2
    print(f"adapter: {len(stored)} tensors ({n_modules} modules), r={adapter_cfg.get('r')}, "
          f"lora_alpha={adapter_cfg.get('lora_alpha')}, use_rslora={adapter_cfg.get('use_rslora')}", flush=True)

    if model.config.vocab_size != ref_logits.shape[-1]:
        fail(f"vocab_size {model.config.vocab_size} != reference vocab {ref_logits.shape[-1]}")
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits.double()
        with model.disable_adapter():
            base_logits = model(input_ids=input_ids, use_cache=False).logits.double()
    if logits.shape != ref_logits.shape:
        fail(f"logits shape {tuple(logits.shape)} != reference {tuple(ref_logits.shape)}")
    if not torch.isfinite(logits).all():
        fail("non-finite logits")
    err = rel(logits, ref_logits)
    print(f"peft vs reference: max abs diff {abs_diff(logits, ref_logits):.3e}, max rel diff {err:.3e} "
          f"(max |ref logit| {ref_logits.abs().max().item():.3f}; base-only model would be at "
          f"{rel(base_logits, ref_logits):.3e})", flush=True)
    failures = []
    if err > args.rtol:
        failures.append(f"PEFT logits differ from the reference: max rel diff {err:.3e} > {args.rtol:g}")

    if merged_dir is not None:
        merged = load_plain(merged_dir)
        with torch.no_grad():
            mlogits = merged(input_ids=input_ids, use_cache=False).logits.double()
        if mlogits.shape != logits.shape:
            failures.append(f"merged logits shape {tuple(mlogits.shape)} != {tuple(logits.shape)}")
        else:
            merr = rel(mlogits, logits)
            print(f"merged vs peft: max abs diff {abs_diff(mlogits, logits):.3e}, max rel diff {merr:.3e}; "
                  f"merged vs reference: max rel diff {rel(mlogits, ref_logits):.3e}", flush=True)
            if not torch.isfinite(mlogits).all():
                failures.append("non-finite merged logits")
            elif merr > args.rtol:
                failures.append(f"merged model logits differ from the PEFT model's: max rel diff {merr:.3e} "
                                f"> {args.rtol:g}")

    if failures:
        fail("; ".join(failures))
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
