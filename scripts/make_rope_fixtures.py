#!/usr/bin/env python3
"""Build the RoPE fixtures under tests/fixtures/rope/ from transformers' own rotary embeddings.

Run from the repository root (pinned stack: scripts/requirements-fixtures.txt):

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt && .venv/bin/python scripts/make_rope_fixtures.py

Every fixture is one ``<name>.json``: a ``config`` dict exactly as a ``config.json`` would hold it (v4 keys
``rope_theta`` + ``rope_scaling`` with ``type`` or ``rope_type``, v5 ``rope_parameters``, Gemma 3's
per-layer-type forms, Phi-3's ``partial_rotary_factor`` and top-level ``original_max_position_embeddings``),
the ``family`` whose config class and rotary-embedding module read it (``llama``: ``LlamaConfig`` /
``LlamaRotaryEmbedding``, ``phi3``, ``gemma3``: ``Gemma3TextConfig`` / ``Gemma3RotaryEmbedding`` with a
``layer_type``), and what transformers computes from it:

* ``cases``: for several sequence lengths (below, at and above ``original_max_position_embeddings`` /
  ``max_position_embeddings``), a fresh module run on ``position_ids = arange(seq_len)`` (what a forward
  without cache does): the ``inv_freq`` buffer it used (float32, as transformers computes it), the
  ``attention_scaling`` it multiplied cos and sin by, and the ``cos`` / ``sin`` rows at a few positions;
* ``generation``: one module called as ``generate`` calls it with a KV cache: the prompt's positions
  ``0..prompt``, then one new position per step; the cos/sin rows of the last position of each call (the
  dynamic-NTK module keeps state across calls, ``dynamic_rope_update``; cached keys keep the rotation
  they were given when they were new);
* ``q`` / ``rotated`` (the last case of each fixture): ``apply_rotary_pos_emb`` of the family (Phi-3's
  rotates only the first ``rotary_dim`` dims) on fixed random rows of q (float32 values), one per sampled
  position.

Precision: transformers computes ``inv_freq`` and cos/sin in float32 whatever the model's dtype (explicit
``dtype=torch.float``); the modules are called with a float64 ``x`` so that their float32 results reach the
fixture unrounded (``.to(x.dtype)`` is exact), and ``rotated`` is computed in float64 from them. The torch
default dtype stays float32, as in real use: the dynamic-NTK update computes its base from a float32 tensor.
Numbers are written with Python's shortest round-trip repr. Rerunning gives byte-identical files.
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply  # noqa: E402
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding  # noqa: E402
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "rope"
PINNED = {"torch": "2.15.0", "transformers": "5.23.0"}

HEAD_DIM = 16
HEADS = 2
# LLaMA: the pre-scaling context is 32 tokens, the model's 64 (or 32 for dynamic NTK, which scales
# relative to max_position_embeddings).
BASE = dict(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, head_dim=HEAD_DIM, num_hidden_layers=1,
            intermediate_size=8, vocab_size=16)

# Per-frequency LongRoPE factors (8 = HEAD_DIM / 2 frequencies; 6 for Phi-3's 0.75 partial rotation).
SHORT8 = [1.0, 1.0, 1.05, 1.1, 1.3, 1.7, 2.2, 2.9]
LONG8 = [1.0, 1.2, 1.9, 3.5, 6.0, 11.5, 17.25, 24.0]
SHORT6 = [1.0, 1.02, 1.1, 1.25, 1.5, 2.0]
LONG6 = [1.0, 1.5, 3.0, 7.0, 12.0, 20.0]


def llama(**kw):
    return dict(BASE, **kw)


# name -> (family, config, layer types or [None], sequence lengths, generation (prompt, steps) or None)
FIXTURES = {
    # default and linear, v4 and v5
    "default_v4": ("llama", llama(max_position_embeddings=64, rope_theta=10000.0), [None], [8], None),
    "default_v5": ("llama", llama(max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), [None], [8], None),
    "default_implicit_theta": ("llama", llama(max_position_embeddings=64), [None], [8], None),
    "linear_v4_type": ("llama", llama(max_position_embeddings=64, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0}), [None], [40], None),
    "linear_v5": ("llama", llama(max_position_embeddings=64, rope_parameters={"rope_type": "linear", "factor": 4, "rope_theta": 10000.0}), [None], [40], None),
    # llama3 (original_max_position_embeddings given, and defaulted to max_position_embeddings)
    "llama3_v4": ("llama", llama(max_position_embeddings=128, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), [None], [16, 100], None),
    "llama3_v5_default_original": ("llama", llama(max_position_embeddings=32, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}), [None], [16, 50], None),
    # dynamic NTK: scaled by the sequence length beyond max_position_embeddings (32)
    "dynamic_v4": ("llama", llama(max_position_embeddings=32, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0}), [None], [20, 32, 33, 50, 77], (20, 24)),
    "dynamic_v5": ("llama", llama(max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0}), [None], [20, 32, 33, 50, 77], (40, 6)),
    # YaRN: default attention factor, mscale/mscale_all_dim, explicit attention factor, betas, truncate
    "yarn_v4": ("llama", llama(max_position_embeddings=128, rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}), [None], [16, 100], None),
    "yarn_v5_mscale": ("llama", llama(max_position_embeddings=128, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}), [None], [16, 100], None),
    "yarn_v5_attention_factor_no_truncate": ("llama", llama(max_position_embeddings=128, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 3.0, "original_max_position_embeddings": 32, "attention_factor": 1.25, "truncate": False}), [None], [16, 100], None),
    "yarn_v5_default_original": ("llama", llama(max_position_embeddings=32, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}), [None], [16, 50], None),
    # LongRoPE: short factors up to original_max_position_embeddings, long beyond
    "longrope_v4": ("llama", llama(max_position_embeddings=128, rope_theta=10000.0, rope_scaling={"type": "longrope", "short_factor": SHORT8, "long_factor": LONG8, "original_max_position_embeddings": 32}), [None], [16, 32, 33, 100], (30, 6)),
    "longrope_v5_factor": ("llama", llama(max_position_embeddings=128, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT8, "long_factor": LONG8, "original_max_position_embeddings": 32, "factor": 2.0}), [None], [16, 100], None),
    "longrope_v5_attention_factor": ("llama", llama(max_position_embeddings=128, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT8, "long_factor": LONG8, "original_max_position_embeddings": 32, "attention_factor": 1.5}), [None], [16, 100], None),
    # Phi-3 / Phi-4-mini: partial rotation, LongRoPE with the original length outside rope_scaling
    "phi3_partial_default": ("phi3", dict(BASE, max_position_embeddings=64, rope_theta=10000.0, partial_rotary_factor=0.5, pad_token_id=0), [None], [20], None),
    "phi3_partial_longrope": ("phi3", dict(BASE, max_position_embeddings=128, original_max_position_embeddings=32, rope_theta=10000.0, partial_rotary_factor=0.75, pad_token_id=0, rope_scaling={"type": "longrope", "short_factor": SHORT6, "long_factor": LONG6}), [None], [16, 100], (30, 4)),
    # Gemma 3: per-layer-type parameters, v5 nested and v4 (rope_local_base_freq; rope_scaling on global layers)
    "gemma3_v5": ("gemma3", dict(BASE, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}), ["sliding_attention", "full_attention"], [40], None),
    "gemma3_v4": ("gemma3", dict(BASE, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}), ["sliding_attention", "full_attention"], [40], None),
    "gemma3_v4_default_thetas": ("gemma3", dict(BASE, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128), ["sliding_attention", "full_attention"], [40], None),
    "gemma3_v5_yarn_dynamic": ("gemma3", dict(BASE, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=32, rope_parameters={"sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0, "original_max_position_embeddings": 16, "truncate": False}}), ["sliding_attention", "full_attention"], [20, 50], None),
}

CONFIGS = {"llama": LlamaConfig, "phi3": Phi3Config, "gemma3": Gemma3TextConfig}
MODULES = {"llama": LlamaRotaryEmbedding, "phi3": Phi3RotaryEmbedding, "gemma3": Gemma3RotaryEmbedding}
APPLY = {"llama": llama_apply, "phi3": phi3_apply, "gemma3": llama_apply}


def floats(t):
    return [float(v) for v in t.reshape(-1).tolist()]


def call(module, family, layer_type, positions):
    """cos, sin (float64 views of transformers' float32 results), (len, rotary width)."""
    x = torch.zeros(1, dtype=torch.float64)
    pos = torch.tensor([positions], dtype=torch.int64)
    if family == "gemma3":
        cos, sin = module(x, pos, layer_type)
    else:
        cos, sin = module(x, pos)
    assert cos.dtype == torch.float64
    return cos[0], sin[0]


def module_state(module, family, layer_type):
    prefix = f"{layer_type}_" if family == "gemma3" else ""
    inv = getattr(module, f"{prefix}inv_freq")
    assert inv.dtype == torch.float32
    if family == "gemma3":
        scaling = getattr(module, f"{layer_type}_attention_scaling")
    else:
        scaling = module.attention_scaling
    return floats(inv), float(scaling)


def sample_positions(seq_len):
    return sorted({0, 1, 7, seq_len // 2, seq_len - 2, seq_len - 1} & set(range(seq_len)))


def build(name, family, raw, layer_types, seq_lens, generation):
    config = CONFIGS[family](**json.loads(json.dumps(raw)))
    out = {"family": family, "config": raw, "layers": []}
    for layer_type in layer_types:
        layer = {"layer_type": layer_type, "cases": []}
        for seq_len in seq_lens:
            module = MODULES[family](config)
            cos, sin = call(module, family, layer_type, list(range(seq_len)))
            inv, scaling = module_state(module, family, layer_type)
            pos = sample_positions(seq_len)
            case = {
                "seq_len": seq_len,
                "inv_freq": inv,
                "attention_scaling": scaling,
                "positions": pos,
                "cos": [floats(cos[p]) for p in pos],
                "sin": [floats(sin[p]) for p in pos],
            }
            if layer_type == layer_types[-1] and seq_len == seq_lens[-1]:
                g = torch.Generator().manual_seed(7)
                q = torch.randn(1, 1, len(pos), HEAD_DIM, generator=g, dtype=torch.float64)
                q32 = q.float().double()  # what the f32 Rust side sees
                rot, _ = APPLY[family](q32, q32, cos[pos][None], sin[pos][None])
                case["q"] = [floats(r) for r in q32[0, 0]]
                case["rotated"] = [floats(r) for r in rot[0, 0]]
            layer["cases"].append(case)
        if generation is not None:
            prompt, steps = generation
            module = MODULES[family](config)
            calls = [list(range(prompt))] + [[prompt + i] for i in range(steps)]
            gen = []
            for positions in calls:
                cos, sin = call(module, family, layer_type, positions)
                gen.append({"positions": positions, "cos": floats(cos[-1]), "sin": floats(sin[-1])})
            layer["generation"] = gen
        out["layers"].append(layer)
    return out


def main():
    for pkg, want in PINNED.items():
        have = getattr(sys.modules[pkg], "__version__").split("+")[0]
        if have != want:
            sys.exit(f"{pkg} {have} installed, the fixtures are pinned to {want} (scripts/requirements-fixtures.txt)")
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.json"):
        old.unlink()
    for name, (family, raw, layer_types, seq_lens, generation) in FIXTURES.items():
        data = build(name, family, raw, layer_types, seq_lens, generation)
        text = json.dumps(data, sort_keys=True) + "\n"
        (OUT / f"{name}.json").write_text(text)
        print(f"{name}: {len(text)} bytes")


if __name__ == "__main__":
    main()
