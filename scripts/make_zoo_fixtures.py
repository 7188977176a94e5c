#!/usr/bin/env python3
"""Build the tiny model-zoo fixtures under tests/fixtures/zoo/ (offline, deterministic).

Run from the repository root:

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt && .venv/bin/python scripts/make_zoo_fixtures.py

One random checkpoint per family variant (Qwen2 with and without its sliding window, Qwen3, Mistral,
Gemma 2, Gemma 3 text, Phi-3 plain and with LongRoPE, partial rotation and a window), saved with ``save_pretrained`` in f32, plus ``reference.safetensors`` in the format of
``scripts/make_llama_fixtures.py``: ``input_ids`` (2, 32) int64, ``labels`` (2, 32) int64 (a few -100),
``logits`` (2, 32, 256) f32, ``loss`` (scalar) f32 and ``grad.<name>`` f32 for every stored tensor.

The reference is transformers' own model loaded from the files on disk in float64
(``attn_implementation="eager"``), run in eval mode without cache; the loss is HF's causal-LM loss
(shift left, mean over labels that are not -100). transformers keeps a few steps in float32 even in a
float64 model (RMSNorm's ``.to(float32)``, the eager softmax, the RoPE tables): those bound the
reference's own error near 1e-7 relative, which the README records as the gap to an unmodified float32
run. Weights are sharper than the default init (``initializer_range`` 0.2, norm weights random) so that
errors cannot hide near a uniform softmax, and the sequence (32) is longer than every sliding window (8),
so a window that is dropped or off by one changes the logits.

Configs whose Hub spelling differs from what ``save_pretrained`` writes get a hand-written config.json in
the Hub spelling (``qwen2_v4``: Qwen2.5's ``rope_theta``, ``use_sliding_window: false`` with a
``sliding_window`` value and no ``layer_types``); the script asserts that transformers reads it as the
settings it replaces.
"""
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "zoo"
COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt"
    " && .venv/bin/python scripts/make_zoo_fixtures.py"
)

VOCAB = 256
BATCH, SEQ = 2, 32
INPUT_SEED = 4321
IGNORED_LABELS = [(0, 5), (0, 6), (1, 11), (1, 31)]
WINDOW = 8
# Phi-3's pre-scaling context of the longrope fixture: shorter than SEQ.
PHI3_ORIGINAL = 16

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)

# name -> (model_type, weight seed, config overrides, description)
FIXTURES = {
    "qwen2": (
        "qwen2", 201,
        dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "Qwen2ForCausalLM: biases on q/k/v only, GQA 4/2, use_sliding_window with max_window_layers 1 "
        f"(layer 0 global, layers 1 and 2 windowed to {WINDOW} tokens), untied",
    ),
    "qwen2_v4": (
        "qwen2", 202,
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             use_sliding_window=False, sliding_window=4, max_window_layers=1, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "Qwen2.5-style config.json as on the Hub (v4 keys: rope_theta, no layer_types): "
        "use_sliding_window false with sliding_window 4, so no layer is windowed; tied embeddings",
    ),
    "qwen3": (
        "qwen3", 203,
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "Qwen3ForCausalLM: per-head q_norm/k_norm before RoPE, explicit head_dim 16 (hidden/heads "
        "would be 8), GQA 4/2, untied",
    ),
    "mistral": (
        "mistral", 204,
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        f"MistralForCausalLM: every layer windowed to {WINDOW} tokens, GQA 4/2, untied",
    ),
    "gemma2": (
        "gemma2", 205,
        dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=2.0,
             final_logit_softcapping=3.0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "Gemma2ForCausalLM: (1 + w) RMSNorms, four norms per layer, GeGLU, embeddings times "
        "sqrt(32), softmax scale 24^-0.5 (head_dim 16), layers 0 and 2 windowed to "
        f"{WINDOW} tokens, attention logits capped at 2 and final logits at 3 (both saturate), "
        "tied embeddings (Gemma's default)",
    ),
    "gemma3": (
        "gemma3_text", 206,
        dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=False,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        "Gemma3ForCausalLM (text): Gemma 2's layout with per-head (1 + w) q/k norms, no soft-caps, "
        f"layers 0 and 1 windowed to {WINDOW} tokens with RoPE base 10000, layer 2 global with base "
        "1e6 and linear scaling 2 (per-layer-type rope_parameters, as transformers 5 writes them), untied",
    ),
    "gemma3_v4": (
        "gemma3_text", 206,
        dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=False,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        "the `gemma3` weights with the Hub's spelling of the same settings (as gemma-3 configs "
        "ship): sliding_window_pattern 3, rope_theta 1e6 with rope_scaling linear 2 for global "
        "layers, rope_local_base_freq 10000, no layer_types or rope_parameters",
    ),
    "phi3": (
        "phi3", 207,
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
             tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "Phi3ForCausalLM: q/k/v fused in `qkv_proj` and gate/up in `gate_up_proj`, GQA 4/2, "
        "no window (`sliding_window: null`), untied",
    ),
    "phi3_longrope": (
        "phi3", 208,
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
             tie_word_embeddings=True, original_max_position_embeddings=PHI3_ORIGINAL,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "short_factor": [1.0, 1.25], "long_factor": [3.0, 7.5]}),
        "Phi-3-128k / Phi-4-mini-style config.json as on the Hub (v4 keys): `rope_scaling` "
        "`{type: longrope, short_factor, long_factor}`, top-level `rope_theta`, `partial_rotary_factor` 0.5 "
        f"(4 of 8 dims rotate) and `original_max_position_embeddings` {PHI3_ORIGINAL}, so the 32 tokens "
        f"take the long factors (attention factor sqrt(1 + ln 16 / ln 16)); every layer windowed to {WINDOW} "
        "tokens; tied embeddings",
    ),
}


def log(*args):
    print(*args, flush=True)


def setup_determinism():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def make_config(model_type, overrides):
    return AutoConfig.for_model(model_type, **BASE, **overrides)


def make_model(model_type, seed, overrides):
    config = make_config(model_type, overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms scale by (1 + w): random offsets; the others: random around 1.
                lo, hi = (-0.5, 0.5) if model_type.startswith("gemma") else (0.5, 1.5)
                p.copy_(torch.empty(p.shape).uniform_(lo, hi, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.2, generator=gen))
    return model.float().eval()


def write_v4_config(fixture_dir: Path, overrides: dict):
    """The Hub spelling of a Qwen2.5 config: rope_theta at the top, no layer_types / rope_parameters, and
    the `sliding_window` value kept although `use_sliding_window` is false (transformers nulls it when
    saving)."""
    cfg = json.loads((fixture_dir / "config.json").read_text())
    cfg["sliding_window"] = overrides["sliding_window"]
    rp = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg.pop("dtype", None)
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["torch_dtype"] = "float32"
    (fixture_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_gemma3_v4_config(fixture_dir: Path):
    """The Hub spelling of a Gemma 3 text config (before transformers 5)."""
    cfg = json.loads((fixture_dir / "config.json").read_text())
    cfg.pop("layer_types")
    rp = cfg.pop("rope_parameters")
    cfg.pop("dtype", None)
    full = dict(rp["full_attention"])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = full
    cfg["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
    cfg.pop("_sliding_window_pattern", None)
    cfg["sliding_window_pattern"] = 3
    cfg["torch_dtype"] = "float32"
    (fixture_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_phi3_hub_config(fixture_dir: Path):
    """The Hub spelling of a Phi-3 longrope config (Phi-3-mini-128k, Phi-4-mini): `rope_scaling` with `type`,
    `rope_theta`, `partial_rotary_factor` and `original_max_position_embeddings` at the top level. (The
    legacy type name `su` is not used: transformers 5.23 then does not copy the top-level
    `original_max_position_embeddings` into the parameters and refuses the config.)"""
    cfg = json.loads((fixture_dir / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    cfg.pop("dtype", None)
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["partial_rotary_factor"] = rp["partial_rotary_factor"]
    cfg["rope_scaling"] = {"type": "longrope", "short_factor": rp["short_factor"], "long_factor": rp["long_factor"]}
    cfg["original_max_position_embeddings"] = PHI3_ORIGINAL
    cfg["torch_dtype"] = "float32"
    (fixture_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def logits_with(d: Path, config, input_ids):
    config._attn_implementation = "eager"
    m = AutoModelForCausalLM.from_pretrained(str(d), config=config, dtype=torch.float64).eval()
    return m(input_ids=input_ids, use_cache=False).logits.detach()


def checkpoint_keys(fixture_dir: Path) -> list:
    with safetensors.safe_open(str(fixture_dir / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def load(fixture_dir: Path, dtype):
    model, info = AutoModelForCausalLM.from_pretrained(
        str(fixture_dir), attn_implementation="eager", dtype=dtype, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{fixture_dir}: loading problems {bad}"
    return model.eval()


def causal_lm_loss(logits, labels):
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100)


def run(model, input_ids, labels, keys):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids, use_cache=False).logits
    loss = causal_lm_loss(logits, labels)
    loss.backward()
    params = dict(model.named_parameters())
    # A tied head is one parameter, stored once.
    assert sorted(params) == keys, (sorted(params), keys)
    grads = {k: params[k].grad.detach().clone() for k in keys}
    return logits.detach(), loss.detach(), grads


def rel_err(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def make_inputs():
    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    labels = input_ids.clone()
    for r, c in IGNORED_LABELS:
        labels[r, c] = -100
    return input_ids, labels


def window_matters(model_type, overrides, d, input_ids, ref_logits):
    """The same weights without any window give other logits (the window is exercised)."""
    plain = dict(overrides)
    plain.pop("sliding_window", None)
    plain.pop("use_sliding_window", None)
    # Gemma needs a window value for its sliding layers: one longer than the sequence.
    no_window = 4 * SEQ if model_type.startswith("gemma") else None
    cfg = make_config(model_type, dict(plain, sliding_window=no_window))
    return rel_err(logits_with(d, cfg, input_ids), ref_logits)


def build_fixture(name, input_ids, labels):
    model_type, seed, overrides, _ = FIXTURES[name]
    d = OUT / name
    model = make_model(model_type, seed, overrides)
    model.save_pretrained(str(d))
    if name == "qwen2_v4":
        write_v4_config(d, overrides)
    if name == "gemma3_v4":
        write_gemma3_v4_config(d)
    if name == "phi3_longrope":
        write_phi3_hub_config(d)
    keys = checkpoint_keys(d)
    m64 = load(d, torch.float64)
    ref = run(m64, input_ids, labels, keys)
    logits, loss, grads = ref
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    m32 = load(d, torch.float32)
    got32 = run(m32, input_ids, labels, keys)
    stock32 = {"logits": rel_err(got32[0], logits), "loss": rel_err(got32[1], loss),
               "grad": max(rel_err(got32[2][k], grads[k]) for k in keys)}
    assert stock32["logits"] < 1e-5 and stock32["loss"] < 1e-5 and stock32["grad"] < 1e-4, stock32
    extra = {"layer_types": list(getattr(m64.config, "layer_types", None) or [])}
    if name == "qwen2":
        assert extra["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
        extra["no_window_rel_diff"] = window_matters(model_type, overrides, d, input_ids, logits)
        assert extra["no_window_rel_diff"] > 1e-3, extra
    if name == "mistral":
        extra["no_window_rel_diff"] = window_matters(model_type, overrides, d, input_ids, logits)
        assert extra["no_window_rel_diff"] > 1e-3, extra
    if name == "gemma2":
        assert extra["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
        extra["no_window_rel_diff"] = window_matters(model_type, overrides, d, input_ids, logits)
        assert extra["no_window_rel_diff"] > 1e-3, extra
        uncapped = make_config(model_type, dict(overrides, attn_logit_softcapping=None,
                                                 final_logit_softcapping=None))
        uncapped._attn_implementation = "eager"
        m = AutoModelForCausalLM.from_pretrained(str(d), config=uncapped, dtype=torch.float64).eval()
        extra["no_caps_rel_diff"] = rel_err(m(input_ids=input_ids, use_cache=False).logits.detach(), logits)
        assert extra["no_caps_rel_diff"] > 1e-2, extra
    if name in ("gemma3", "gemma3_v4"):
        assert extra["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"], extra
        extra["no_window_rel_diff"] = window_matters(model_type, overrides, d, input_ids, logits)
        assert extra["no_window_rel_diff"] > 1e-3, extra
    if name == "gemma3_v4":
        # The Hub spelling means exactly the v5 settings of `gemma3` (same weights).
        v5 = load_file(str(OUT / "gemma3" / "reference.safetensors"))
        assert torch.equal(v5["logits"], logits.float()), rel_err(logits, v5["logits"])
    if model_type == "phi3":
        # The checkpoint keeps Phi-3's fused projections.
        assert any(k.endswith("self_attn.qkv_proj.weight") for k in keys), keys
        assert any(k.endswith("mlp.gate_up_proj.weight") for k in keys), keys
    if name == "phi3":
        assert m64.config.sliding_window is None, m64.config.sliding_window
    if name == "phi3_longrope":
        rp = m64.config.rope_parameters
        assert rp["rope_type"] == "longrope" and rp["partial_rotary_factor"] == 0.5, rp
        assert rp["original_max_position_embeddings"] == PHI3_ORIGINAL, rp
        extra["no_window_rel_diff"] = window_matters(model_type, overrides, d, input_ids, logits)
        assert extra["no_window_rel_diff"] > 1e-3, extra
        # The long factors apply: the short ones in their place give other logits.
        short = AutoConfig.from_pretrained(str(d))
        short.rope_parameters = dict(short.rope_parameters, long_factor=list(rp["short_factor"]))
        extra["short_factors_rel_diff"] = rel_err(logits_with(d, short, input_ids), logits)
        assert extra["short_factors_rel_diff"] > 1e-3, extra
    if name == "qwen2_v4":
        assert m64.config.sliding_window is None, m64.config.sliding_window
        assert set(extra["layer_types"]) == {"full_attention"}, extra
    tensors = {"input_ids": input_ids, "labels": labels,
               "logits": logits.float().contiguous(), "loss": loss.float().reshape(())}
    for k in keys:
        tensors[f"grad.{k}"] = grads[k].float().contiguous()
    save_file(tensors, str(d / "reference.safetensors"), metadata={"format": "pt"})
    return {"name": name, "files": sorted(p.name for p in d.iterdir()), "loss": loss.item(),
            "max_abs_logit": logits.abs().max().item(), "stock32": stock32, "extra": extra,
            "num_params": sum(p.numel() for p in m64.parameters()),
            "architecture": m64.config.architectures[0]}


# Checked by hand with scripts/check_zoo_roundtrip.sh (kept here so that regenerating the README keeps it).
HAND_CHECKS = """## Checked by hand: checkpoints and adapters reload in transformers and PEFT

`scripts/check_zoo_roundtrip.sh` (needs `.venv` with `scripts/requirements-finetune.txt`, or `PY=`; run on
2026-11-26 with torch 2.15.0, transformers 5.23.0, peft 0.21.2): for each family, `cpl train` 3 steps
under `--tp 2` saves a checkpoint that `AutoModelForCausalLM.from_pretrained` loads with no missing or
unexpected tensor and whose logits equal `cpl eval`'s on it; a LoRA adapter of `cpl finetune` (all linear
layers, `--tp 2`) loads with `PeftModel.from_pretrained`, every stored tensor landing in one of PEFT's
LoRA parameters with its shape, and gives our logits; and `cpl finetune merge` folds it into a model
transformers loads with the PEFT model's logits (`check_peft_adapter.py --merged`). Phi-3's checkpoints
and adapters are in its fused layout: `qkv_proj.lora_A` (8, 32) and `qkv_proj.lora_B` (64, 8),
`gate_up_proj.lora_B` (128, 8), as PEFT creates them on `Phi3ForCausalLM`. All rel = max-abs / max|ref|:

| family | trained checkpoint in transformers | LoRA adapter in PEFT vs ours | merged vs PEFT |
|---|---|---|---|
| qwen2 | 1.61e-06 | 1.03e-06 | 1.21e-06 |
| qwen3 | 7.09e-07 | 1.11e-06 | 1.62e-06 |
| mistral | 1.02e-06 | 1.02e-06 | 8.72e-07 |
| gemma2 | 8.94e-07 | 8.28e-07 | 1.13e-06 |
| gemma3 | 5.32e-07 | 8.15e-07 | 5.79e-07 |
| phi3 | 8.80e-07 | 1.70e-06 | 1.20e-06 |
| phi3_longrope | 1.04e-06 | 1.39e-06 | 1.57e-06 |

(The untrained model is 70-120% away from the trained logits, and the base model 100-130% from the
adapted one, so the comparisons see the training.)
"""


def results_table(results, fixtures, loss="loss"):
    """The README's table of `results` (one row per fixture: size, logits, loss, transformers' own
    float32 error) and the list of the `fixtures`' descriptions, as lines."""
    lines = [
        f"| fixture | architecture | params | max abs logit | {loss} | hf f32 logits / loss / worst grad | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["stock32"]
        lines.append(
            f"| `{r['name']}` | {r['architecture']} | {r['num_params']} | {r['max_abs_logit']:.3f} | "
            f"{r['loss']:.5f} | {s['logits']:.1e} / {s['loss']:.1e} / {s['grad']:.1e} | {r['extra']} |")
    lines.append("")
    for name, (_, _, _, desc) in fixtures.items():
        lines.append(f"- `{name}`: {desc}.")
    lines.append("")
    return lines


def write_readme(results):
    lines = [
        "# Tiny model-zoo fixtures (generated)",
        "",
        "Generated by `scripts/make_zoo_fixtures.py` (do not edit by hand; rerun the script). From the",
        "repository root:",
        "",
        "```sh",
        COMMAND,
        "```",
        "",
        f"Versions: torch {torch.__version__}, transformers {transformers.__version__}, safetensors "
        f"{safetensors.__version__}, numpy {np.__version__}. Offline, CPU, fixed seeds, one thread.",
        "",
        f"Common settings: vocab {VOCAB}, hidden 32, intermediate 64, rms_norm_eps 1e-5, weights normal(0, 0.2),",
        "norm weights uniform(0.5, 1.5) (Gemma: offsets uniform(-0.5, 0.5)), biases normal(0, 0.2); inputs",
        f"({BATCH}, {SEQ}) with labels {IGNORED_LABELS} set to -100. References: transformers in float64",
        "(eager attention); `hf f32` is unmodified transformers in float32 against it (max-abs / max|ref|).",
        "",
    ]
    lines += results_table(results, FIXTURES)
    lines.append(HAND_CHECKS)
    (OUT / "README.md").write_text("\n".join(lines))


def main():
    setup_determinism()
    only = sys.argv[1:]
    OUT.mkdir(parents=True, exist_ok=True)
    input_ids, labels = make_inputs()
    results = []
    for name in FIXTURES:
        if only and name not in only:
            continue
        if (OUT / name).exists():
            shutil.rmtree(OUT / name)
        r = build_fixture(name, input_ids, labels)
        results.append(r)
        log(f"{name}: loss={r['loss']:.6f} max|logit|={r['max_abs_logit']:.3f} hf32={r['stock32']} {r['extra']}")
    if not only:
        write_readme(results)
    digest = hashlib.sha256()
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            digest.update(str(p.relative_to(OUT)).encode() + b"\0" + p.read_bytes())
    log(f"wrote {OUT}, sha256 of all files {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
