#!/usr/bin/env python3
"""Build the LoRA-on-experts fixtures under tests/fixtures/moe_lora/ (offline, deterministic).

Run from the repository root (after scripts/make_moe_fixtures.py, whose checkpoints are the bases):

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-finetune.txt \\
        && .venv/bin/python scripts/make_moe_lora_fixtures.py

For the tiny Qwen3-MoE, Mixtral and Qwen2-MoE of tests/fixtures/moe/ (8 experts, top-2), what PEFT 0.21.2 does under
transformers 5.23, where the experts are two 3-D parameters per block (`mlp.experts.gate_up_proj` (E, 2I, H),
`mlp.experts.down_proj` (E, H, I)) and the router `mlp.gate` is no `nn.Linear`:

* ``<family>/adapter/``: ``get_peft_model(base, LoraConfig(r=2, lora_alpha=3, target_modules="all-linear"))``
  saved with ``save_pretrained``. PEFT converts the config (``convert_peft_config_for_transformers``):
  ``target_modules`` becomes the attention's q/k/v/o, ``target_parameters`` ``gate.weight`` (the router),
  ``gate_up_proj`` and ``down_proj``, and ``rank_pattern`` / ``alpha_pattern`` give ``.*\\.gate_up_proj``
  twice the rank and alpha (gate and up fused); for Qwen2-MoE, which PEFT does not convert, ``all-linear``
  plus ``target_parameters=["gate_up_proj", "down_proj"]`` (rank r each). Every lora_A / lora_B is redrawn from normal(0, 0.1) (PEFT
  starts B at zero). The script asserts the saved key names and shapes and the delta rule
  ``W_e + s B_e A_e`` with ``A_e = A[e R:(e+1) R]`` and ``B_e = B.reshape(out, R, E)[:, :, e]``.
* ``<family>/reference.safetensors``: with the adapter, in float64 (eager attention and experts): the
  fixture inputs of tests/fixtures/moe (``input_ids``, ``labels``), ``logits``, ``loss`` (transformers'
  training loss: LM loss + 0.3 x the balancing loss) and ``grad.<adapter key without base_model.model.>``
  for every LoRA tensor; and for a short input of 1 x 4 tokens (most experts of a layer get no token):
  ``short.input_ids``, ``short.labels``, ``short.loss``, ``short.grad.<key>`` and
  ``short.tokens_per_expert`` (layers, E): the routed slots of each expert, and
  ``short.scored_tokens_per_expert`` the same over the positions the loss scores (all but the last).
* ``README.md`` (generated).
"""
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_zoo_fixtures import log, make_inputs, rel_err, setup_determinism  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASES = ROOT / "tests" / "fixtures" / "moe"
OUT = ROOT / "tests" / "fixtures" / "moe_lora"
PREFIX = "base_model.model."
R, ALPHA, STD, SEED = 2, 3, 0.1, 777
EXPERTS, TOP_K = 8, 2
SHORT = [[17, 201, 5, 99]]
FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]
# PEFT 0.21 converts the `all-linear` of Qwen3-MoE and Mixtral to the experts' parameters and the
# router; Qwen2-MoE it leaves as it is (`all-linear`: the attention, the shared expert, its gate and
# the dense layers' MLPs), so its experts are named directly (what `cpl finetune
# --lora-target-parameters gate_up_proj,down_proj` writes).
TARGET_PARAMETERS = {"qwen2_moe": ["gate_up_proj", "down_proj"]}


def load_base(name, dtype):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(BASES / name), attn_implementation="eager", experts_implementation="eager", dtype=dtype,
        output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def lora_params(model):
    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert n.startswith(PREFIX) and ".default." in n, n
            out[n[len(PREFIX):].replace(".default.", ".")] = p
    return dict(sorted(out.items()))


def check_format(name, model, cfg):
    """The facts docs/moe.md states, asserted."""
    base = model.base_model.model
    h = base.config.hidden_size
    i = base.config.moe_intermediate_size if hasattr(base.config, "moe_intermediate_size") else base.config.intermediate_size
    params = lora_params(model)
    # The experts' gate_up_proj rank and alpha: doubled by PEFT's conversion, as given when named.
    gu = 1 if name in TARGET_PARAMETERS else 2
    want = {"mlp.experts.base_layer.lora_A.weight": (gu * R * EXPERTS, h),
            "mlp.experts.base_layer.lora_B.weight": (2 * i, gu * R * EXPERTS),
            "mlp.experts.lora_A.weight": (R * EXPERTS, i), "mlp.experts.lora_B.weight": (h, R * EXPERTS)}
    if name in TARGET_PARAMETERS:
        assert sorted(cfg["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                 "shared_expert_gate", "up_proj", "v_proj"], cfg["target_modules"]
        assert cfg["target_parameters"] == sorted(TARGET_PARAMETERS[name]), cfg
        assert not cfg["rank_pattern"] and not cfg["alpha_pattern"], cfg
        assert not any(".mlp.gate." in k for k in params), "the router is adapted"
    else:
        assert sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"], cfg["target_modules"]
        assert sorted(cfg["target_parameters"]) == ["down_proj", "gate.weight", "gate_up_proj"], cfg
        assert cfg["rank_pattern"] == {".*\\.gate_up_proj": 2 * R} and cfg["alpha_pattern"] == {
            ".*\\.gate_up_proj": 2 * ALPHA}, cfg
        want |= {"mlp.gate.lora_A.weight": (R, h), "mlp.gate.lora_B.weight": (EXPERTS, R)}
    for k, shape in want.items():
        got = tuple(params[f"model.layers.0.{k}"].shape)
        assert got == shape, (name, k, got, shape)
    # The delta rule, on layer 0's experts (float64 model).
    ex = base.model.layers[0].mlp.experts
    assert ex.parameter_name == "down_proj" and ex.base_layer.parameter_name == "gate_up_proj"
    for wrapper, rank, alpha in [(ex.base_layer, gu * R, gu * ALPHA), (ex, R, ALPHA)]:
        a = wrapper.lora_A["default"].weight
        b = wrapper.lora_B["default"].weight
        assert wrapper.scaling["default"] == alpha / rank
        w0 = wrapper.get_param().detach().clone()
        with wrapper._activate_lora(["default"]):
            w1 = wrapper.get_param().detach().clone()
        for e in range(EXPERTS):
            a_e = a[e * rank:(e + 1) * rank]
            b_e = b.reshape(b.shape[0], rank, EXPERTS)[:, :, e]
            want = w0[e] + alpha / rank * (b_e @ a_e)
            assert rel_err(w1[e], want) < 1e-12, (name, e)


def build_adapter(name, adapter_dir):
    model = get_peft_model(load_base(name, torch.float32),
                           LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear",
                                      target_parameters=TARGET_PARAMETERS.get(name),
                                      bias="none", task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, p in lora_params(model).items():
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, STD, generator=gen))
    model.save_pretrained(str(adapter_dir))
    (adapter_dir / "README.md").unlink()
    cfg_path = adapter_dir / "adapter_config.json"
    raw = json.loads(cfg_path.read_text())
    # Sets saved in hash order: sort them so reruns are byte-identical; the base as a path relative to
    # the repository (PeftModel.from_pretrained(base, dir) does not read it).
    for k in ("target_modules", "target_parameters"):
        raw[k] = sorted(raw[k])
    raw["base_model_name_or_path"] = f"tests/fixtures/moe/{name}"
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True))
    return raw


def routed(model, input_ids, scored):
    """(layers, E) routed slots per expert of the adapted model on input_ids (one sequence): over every
    position, or (scored) over the positions the loss scores (all but the last)."""
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=False, output_router_logits=True)
    counts = []
    for logits in out.router_logits:
        logits = logits[:-1] if scored else logits
        _, chosen = torch.topk(torch.softmax(logits.double(), dim=-1), TOP_K, dim=-1)
        counts.append(torch.bincount(chosen.flatten(), minlength=EXPERTS))
    return torch.stack(counts)


def run(model, input_ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels, use_cache=False)
    out.loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in lora_params(model).items()}
    return out.logits.detach(), out.loss.detach(), grads


def build(name):
    d = OUT / name
    adapter_dir = d / "adapter"
    cfg = build_adapter(name, adapter_dir)
    m64 = PeftModel.from_pretrained(load_base(name, torch.float64), str(adapter_dir), is_trainable=True).eval()
    stored = load_file(str(adapter_dir / "adapter_model.safetensors"))
    params = lora_params(m64)
    assert sorted(stored) == sorted(PREFIX + k for k in params), sorted(stored)
    for k, p in params.items():
        assert torch.equal(p.detach().float(), stored[PREFIX + k]), k
    check_format(name, m64, cfg)
    input_ids, labels = make_inputs()
    logits, loss, grads = run(m64, input_ids, labels)
    with torch.no_grad(), m64.disable_adapter():
        base_logits = m64(input_ids=input_ids, use_cache=False).logits
    effect = rel_err(logits, base_logits)
    assert effect > 1e-2, effect
    for k, g in grads.items():
        assert g.abs().max() > 0, k
    # float32 PEFT against the float64 reference.
    m32 = PeftModel.from_pretrained(load_base(name, torch.float32), str(adapter_dir), is_trainable=True).eval()
    l32, s32, g32 = run(m32, input_ids, labels)
    f32 = {"logits": rel_err(l32, logits), "loss": rel_err(s32, loss),
           "grad": max(rel_err(g32[k], grads[k]) for k in grads)}
    assert f32["logits"] < 1e-5 and f32["loss"] < 1e-5 and f32["grad"] < 1e-4, f32
    short_ids = torch.tensor(SHORT, dtype=torch.int64)
    short_labels = short_ids.clone()
    counts = routed(m64, short_ids, False)
    scored = routed(m64, short_ids, True)
    assert (counts == 0).any(), counts
    _, short_loss, short_grads = run(m64, short_ids, short_labels)
    tensors = {"input_ids": input_ids, "labels": labels, "logits": logits.float().contiguous(),
               "loss": loss.float().reshape(()), "short.input_ids": short_ids, "short.labels": short_labels,
               "short.loss": short_loss.float().reshape(()),
               "short.tokens_per_expert": counts.to(torch.int64).contiguous(),
               "short.scored_tokens_per_expert": scored.to(torch.int64).contiguous()}
    for k, g in grads.items():
        tensors[f"grad.{k}"] = g.float().contiguous()
    for k, g in short_grads.items():
        tensors[f"short.grad.{k}"] = g.float().contiguous()
    save_file(tensors, str(d / "reference.safetensors"), metadata={"format": "pt"})
    return {"name": name, "loss": loss.item(), "adapter_effect": effect, "f32": f32,
            "short_tokens_per_expert": counts.tolist(), "keys": len(stored)}


def main():
    setup_determinism()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    results = [build(name) for name in FAMILIES]
    lines = [
        "# LoRA on the experts of tiny MoE models (generated)",
        "",
        "Generated by `scripts/make_moe_lora_fixtures.py` (do not edit by hand; rerun the script) with torch",
        f"{torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__} (CPU, offline,",
        "fixed seeds). Bases: `tests/fixtures/moe/<family>`. Adapters: PEFT's `all-linear` under transformers 5",
        f"(r {R}, lora_alpha {ALPHA}; Qwen3-MoE and Mixtral as PEFT converts it: the router and the experts'",
        f"`gate_up_proj` r {2 * R}, alpha {2 * ALPHA}, and `down_proj`; Qwen2-MoE's experts named in",
        f"`target_parameters` {TARGET_PARAMETERS['qwen2_moe']}, r {R} each), every factor",
        f"redrawn from normal(0, {STD}). References in float64; `f32`: PEFT in float32 against them.",
        "",
        "| fixture | adapter tensors | loss | adapter effect on logits | f32 logits / loss / worst grad |"
        " short input: tokens per expert (layer x expert) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        f = r["f32"]
        lines.append(f"| `{r['name']}` | {r['keys']} | {r['loss']:.6f} | {r['adapter_effect']:.3f} | "
                     f"{f['logits']:.1e} / {f['loss']:.1e} / {f['grad']:.1e} | {r['short_tokens_per_expert']} |")
    (OUT / "README.md").write_text("\n".join(lines) + "\n")
    digest = hashlib.sha256()
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            digest.update(str(p.relative_to(OUT)).encode() + b"\0" + p.read_bytes())
    log(f"wrote {OUT}: {results}; sha256 {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
