#!/usr/bin/env python3
"""What transformers saves when a config's RoPE is changed: the expected results of
`models::rope_override` (`cpl train --rope-theta / --rope-scaling ...`), for its tests.

For each input config (v5 flat, v4, v5 per layer type) and each case, the case's settings are
set on transformers' config object the way its documentation says (`config.rope_parameters = {...}`,
`config.max_position_embeddings = N`), the config is saved with `save_pretrained` and reloaded,
and the saved `rope_parameters` and `max_position_embeddings` are recorded, with the reloaded
object's `rope_parameters` (what transformers computes RoPE from).

The settings spell out models::rope_override's stated defaults: `original_max_position_embeddings`
is the config's `max_position_embeddings` when not given (yarn, longrope, llama3), and the new
`max_position_embeddings` is original x factor when not given (not for dynamic).

Run from the repository root (pinned stack: scripts/requirements-fixtures.txt):
    .venv/bin/python scripts/make_rope_override_fixtures.py
Writes tests/fixtures/rope_override/cases.json.
"""
import copy
import json
import os
import tempfile

from transformers import AutoConfig

INPUTS = {
    "v5": "assets/default/model",
    "v4": "tests/fixtures/zoo/qwen2_v4",
    "v5_layer_types": "tests/fixtures/zoo/gemma3",
}

# name: (override as cpl's flags set it, scaling params (None: keep the checkpoint's))
CASES = {
    "theta": ({"theta": 500000.0}, None),
    "yarn": ({"scaling": {"rope_type": "yarn", "factor": 16.0}}, {"rope_type": "yarn", "factor": 16.0}),
    "yarn_full": (
        {"theta": 20000.0, "max_position_embeddings": 512,
         "scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                     "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.2}},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
         "beta_slow": 2.0, "attention_factor": 1.2},
    ),
    "linear": ({"scaling": {"rope_type": "linear", "factor": 4.0}}, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": ({"scaling": {"rope_type": "dynamic", "factor": 2.0}}, {"rope_type": "dynamic", "factor": 2.0}),
    "llama3": (
        {"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    ),
    "default": ({"scaling": {"rope_type": "default"}}, {"rope_type": "default"}),
}


def main():
    out = {"transformers": __import__("transformers").__version__, "inputs": INPUTS, "cases": []}
    for form, path in INPUTS.items():
        for name, (override, scaling) in CASES.items():
            cfg = AutoConfig.from_pretrained(path)
            trained = cfg.max_position_embeddings
            nested = isinstance(cfg.rope_parameters, dict) and "full_attention" in cfg.rope_parameters
            old = copy.deepcopy(cfg.rope_parameters["full_attention"] if nested else cfg.rope_parameters)
            theta = override.get("theta", old["rope_theta"])
            if scaling is None:
                new = dict(old)
            else:
                new = dict(scaling)
                if new["rope_type"] in ("yarn", "longrope", "llama3"):
                    new.setdefault("original_max_position_embeddings", trained)
            new["rope_theta"] = theta
            if nested:
                rp = copy.deepcopy(cfg.rope_parameters)
                rp["full_attention"] = new
            else:
                rp = new
            cfg.rope_parameters = rp
            max_pos = override.get("max_position_embeddings")
            # dynamic NTK reads max_position_embeddings as the original context: kept.
            if max_pos is None and scaling is not None and "factor" in scaling \
                    and scaling["rope_type"] != "dynamic":
                max_pos = round(new.get("original_max_position_embeddings", trained) * scaling["factor"])
            if max_pos is not None:
                cfg.max_position_embeddings = max_pos
            with tempfile.TemporaryDirectory() as d:
                cfg.save_pretrained(d)
                saved = json.load(open(os.path.join(d, "config.json")))
                reloaded = AutoConfig.from_pretrained(d)
            out["cases"].append({
                "input": form,
                "name": name,
                "override": override,
                "saved": {"rope_parameters": saved["rope_parameters"],
                          "max_position_embeddings": saved["max_position_embeddings"]},
                "reloaded_rope_parameters": reloaded.rope_parameters,
            })
    os.makedirs("tests/fixtures/rope_override", exist_ok=True)
    with open("tests/fixtures/rope_override/cases.json", "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{len(out['cases'])} cases")


if __name__ == "__main__":
    main()
