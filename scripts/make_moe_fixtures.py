#!/usr/bin/env python3
"""Build the tiny mixture-of-experts fixtures under tests/fixtures/moe/ (offline, deterministic).

Run from the repository root:

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt && .venv/bin/python scripts/make_moe_fixtures.py

One random checkpoint per family (Mixtral, Qwen2-MoE, Qwen3-MoE): 8 experts, top-2, saved with
``save_pretrained`` in f32 in the Hub's per-expert layout (transformers 5 fuses the experts in memory and
splits them again on save), plus ``reference.safetensors`` as in ``scripts/make_zoo_fixtures.py``:
``input_ids`` (2, 32), ``labels`` (2, 32) (a few -100), ``logits`` (2, 32, 256), ``loss`` and
``grad.<name>`` for every stored tensor. ``output_router_logits`` is true with ``router_aux_loss_coef``
0.3, so ``loss`` is transformers' training loss: the causal-LM loss plus 0.3 times the load-balancing loss
(also stored alone as ``aux_loss``), and the routers' gradients include the balancing loss's (the README
records by how much they change without it).

The reference is transformers in float64 (eager attention). The per-expert gradients are cut from the
fused parameters' gradients at the places the stored tensors come from (found by their values). The
script checks the balancing loss against its own formula (transformers' ``load_balancing_loss_func`` over
the router logits of every sparse layer) and that every expert receives tokens in the batch.

A padded run is stored beside it (``padded.*``): row 1's last ``PADDED`` tokens are right padding
(``padded.attention_mask`` 0 there, their labels -100), as TRL pads fine-tuning batches. transformers then
leaves the padding out of the balancing loss (``load_balancing_loss_func`` with the attention mask):
``padded.loss``, ``padded.aux_loss`` and ``padded.grad.<name>`` for every stored tensor. The script checks
that this balancing loss differs from the unmasked one over the same router logits.
"""
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_zoo_fixtures  # noqa: E402
from make_zoo_fixtures import (  # noqa: E402
    BASE, IGNORED_LABELS, BATCH, SEQ, VOCAB, causal_lm_loss, log, make_inputs, make_model, rel_err,
    results_table, setup_determinism,
)

# Mixtral's experts are `intermediate_size` wide: a family's settings replace the common ones.
make_zoo_fixtures.make_config = lambda model_type, overrides: transformers.AutoConfig.for_model(
    model_type, **{**BASE, **overrides})

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "moe"
COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt"
    " && .venv/bin/python scripts/make_moe_fixtures.py"
)
EXPERTS, TOP_K, COEF = 8, 2, 0.3
# Right padding of row 1 in the padded run: 15 of 32, so that each padded query still sees a real
# token within Mixtral's window of 16 (transformers gives NaN for a row whose window holds padding alone).
PADDED = 15
COMMON = dict(output_router_logits=True, router_aux_loss_coef=COEF, num_experts_per_tok=TOP_K)

# name -> (model_type, weight seed, config overrides, description)
FIXTURES = {
    "mixtral": (
        "mixtral", 301,
        dict(COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=16, num_local_experts=EXPERTS, sliding_window=16,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "MixtralForCausalLM: `block_sparse_moe` with 8 experts (w1/w3/w2) of 16 units, top-2 renormalised, "
        "every layer windowed to 16 tokens, GQA 4/2, untied",
    ),
    "qwen2_moe": (
        "qwen2_moe", 302,
        dict(COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             num_experts=EXPERTS, moe_intermediate_size=16, shared_expert_intermediate_size=24,
             decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "Qwen2MoeForCausalLM: q/k/v biases, 8 experts of 16 units, top-2 not renormalised, a shared "
        "expert of 24 units behind a sigmoid gate, layer 1 dense (`mlp_only_layers` [1], intermediate 64), "
        "GQA 4/2, untied",
    ),
    "qwen3_moe": (
        "qwen3_moe", 303,
        dict(COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=EXPERTS, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[],
             norm_topk_prob=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "Qwen3MoeForCausalLM: q/k norms, head_dim 16, 8 experts of 16 units, top-2 renormalised, "
        "GQA 4/2, untied",
    ),
}


def load(fixture_dir: Path, dtype):
    """transformers' model from the fixture's files, with the experts' eager (per-expert loop)
    implementation: its grouped-matmul one has no float64."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(fixture_dir), attn_implementation="eager", experts_implementation="eager", dtype=dtype,
        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{fixture_dir}: loading problems {bad}"
    return model.eval()


def balancing_loss(router_logits, experts, top_k):
    """transformers' load_balancing_loss_func without an attention mask."""
    logits = torch.cat([r for r in router_logits], dim=0)
    probs = torch.softmax(logits.double(), dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    mask = torch.nn.functional.one_hot(chosen, experts).double()
    tokens_per_expert = mask.mean(dim=0)
    prob_per_expert = probs.mean(dim=0)
    return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * experts, chosen


def masked_balancing_loss(router_logits, experts, top_k, attention_mask):
    """transformers' load_balancing_loss_func with an attention mask, written out."""
    logits = torch.cat([r for r in router_logits], dim=0)
    probs = torch.softmax(logits.double(), dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    mask = torch.nn.functional.one_hot(chosen, experts).double()
    layers = logits.shape[0] // attention_mask.numel()
    keep = attention_mask.reshape(-1).double().repeat(layers)
    tokens_per_expert = (mask * keep[:, None, None]).sum(0) / keep.sum()
    prob_per_expert = (probs * keep[:, None]).sum(0) / keep.sum()
    return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * experts


def run_padded(model, input_ids, labels, sources):
    """The training loss and gradients with row 1 right-padded by PADDED tokens."""
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -PADDED:] = 0
    labels = labels.clone()
    labels[1, -PADDED:] = -100
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False,
                output_router_logits=True)
    aux = masked_balancing_loss(out.router_logits, EXPERTS, TOP_K, attention_mask)
    assert abs(out.aux_loss.item() - aux.item()) <= 1e-6 * abs(aux.item()), (out.aux_loss.item(), aux.item())
    unmasked, _ = balancing_loss(out.router_logits, EXPERTS, TOP_K)
    assert abs(unmasked.item() - aux.item()) > 2e-3 * abs(aux.item()), (unmasked.item(), aux.item())
    out.loss.backward()
    params = dict(model.named_parameters())
    grads = {k: params[p].grad[idx].detach().clone() for k, (p, idx) in sources.items()}
    return attention_mask, labels, out.loss.detach(), aux.detach(), grads


def stored_sources(model, stored):
    """For each stored tensor, where its values are in the model's parameters:
    name -> (parameter, index tuple)."""
    params = dict(model.named_parameters())
    out = {}
    for key, t in stored.items():
        if key in params:
            assert torch.equal(params[key].detach().to(t.dtype), t), key
            out[key] = (key, ())
            continue
        # Renamed (Mixtral's `block_sparse_moe` is `mlp` in memory): the same values.
        found = next(((n, ()) for n, p in params.items()
                      if p.shape == t.shape and torch.equal(p.detach().to(t.dtype), t)), None)
        for pname, p in params.items():
            if found:
                break
            if p.dim() != 3 or p.shape[0] != EXPERTS:
                continue
            v = p.detach().to(t.dtype)
            for e in range(EXPERTS):
                rows = v[e].shape[0]
                if v[e].shape == t.shape and torch.equal(v[e], t):
                    found = (pname, (e,))
                elif v[e].shape[1:] == t.shape[1:] and rows % t.shape[0] == 0:
                    for start in range(0, rows, t.shape[0]):
                        if torch.equal(v[e, start:start + t.shape[0]], t):
                            found = (pname, (e, slice(start, start + t.shape[0])))
                if found:
                    break
        assert found, f"stored tensor {key} not found in the model's parameters"
        out[key] = found
    return out


def run(model, input_ids, labels, sources, spec):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels, use_cache=False, output_router_logits=True)
    lm = causal_lm_loss(out.logits, labels)
    aux, chosen = balancing_loss(out.router_logits, EXPERTS, TOP_K)
    assert abs(out.aux_loss.item() - aux.item()) <= 1e-6 * abs(aux.item()), (out.aux_loss.item(), aux.item())
    assert abs(out.loss.item() - (lm + COEF * aux).item()) <= 1e-6, (out.loss, lm, aux)
    out.loss.backward()
    params = dict(model.named_parameters())
    grads = {k: params[p].grad[idx].detach().clone() for k, (p, idx) in sources.items()}
    return out.logits.detach(), out.loss.detach(), aux.detach(), grads, chosen


def build_fixture(name, input_ids, labels):
    model_type, seed, overrides, _ = FIXTURES[name]
    d = OUT / name
    model = make_model(model_type, seed, overrides)
    model.save_pretrained(str(d))
    stored = load_file(str(d / "model.safetensors"))
    assert any(".experts.0." in k for k in stored), sorted(stored)
    m64 = load(d, torch.float64)
    sources = stored_sources(m64, stored)
    logits, loss, aux, grads, chosen = run(m64, input_ids, labels, sources, overrides)
    used = torch.bincount(chosen.flatten(), minlength=EXPERTS)
    assert (used > 0).all(), f"{name}: experts without tokens over the batch: {used.tolist()}"
    m32 = load(d, torch.float32)
    got32 = run(m32, input_ids, labels, stored_sources(m32, stored), overrides)
    keys = sorted(stored)
    stock32 = {"logits": rel_err(got32[0], logits), "loss": rel_err(got32[1], loss),
               "grad": max(rel_err(got32[3][k], grads[k]) for k in keys)}
    assert stock32["logits"] < 1e-5 and stock32["loss"] < 1e-5 and stock32["grad"] < 1e-4, stock32
    # Without the balancing loss the routers' gradients change: the test sees the aux gradient.
    plain = load(d, torch.float64)
    plain.config.output_router_logits = False
    plain.zero_grad(set_to_none=True)
    plain(input_ids=input_ids, labels=labels, use_cache=False).loss.backward()
    pp = dict(plain.named_parameters())
    router_keys = [k for k in keys if k.endswith(".gate.weight")]
    aux_share = max(rel_err(pp[sources[k][0]].grad[sources[k][1]], grads[k]) for k in router_keys)
    assert aux_share > 1e-2, aux_share
    extra = {"aux_loss": round(aux.item(), 6), "tokens_per_expert": used.tolist(),
             "router_grad_change_without_aux": round(aux_share, 3)}
    tensors = {"input_ids": input_ids, "labels": labels, "logits": logits.float().contiguous(),
               "loss": loss.float().reshape(()), "aux_loss": aux.float().reshape(())}
    for k in keys:
        tensors[f"grad.{k}"] = grads[k].float().contiguous()
    mask, padded_labels, padded_loss, padded_aux, padded_grads = run_padded(m64, input_ids, labels, sources)
    extra["padded_aux_loss"] = round(padded_aux.item(), 6)
    tensors.update({"padded.attention_mask": mask, "padded.labels": padded_labels,
                    "padded.loss": padded_loss.float().reshape(()),
                    "padded.aux_loss": padded_aux.float().reshape(())})
    for k in keys:
        tensors[f"padded.grad.{k}"] = padded_grads[k].float().contiguous()
    save_file(tensors, str(d / "reference.safetensors"), metadata={"format": "pt"})
    return {"name": name, "loss": loss.item(), "max_abs_logit": logits.abs().max().item(),
            "stock32": stock32, "extra": extra, "num_params": sum(v.numel() for v in stored.values()),
            "architecture": m64.config.architectures[0]}


def write_readme(results):
    lines = [
        "# Tiny mixture-of-experts fixtures (generated)",
        "",
        "Generated by `scripts/make_moe_fixtures.py` (do not edit by hand; rerun the script). From the",
        "repository root:",
        "",
        "```sh",
        COMMAND,
        "```",
        "",
        f"Versions: torch {torch.__version__}, transformers {transformers.__version__}. Offline, CPU, fixed",
        "seeds, one thread.",
        "",
        f"Common settings: vocab {VOCAB}, hidden {BASE['hidden_size']}, {EXPERTS} experts, top-{TOP_K},",
        f"`output_router_logits` true with `router_aux_loss_coef` {COEF} (the loss includes the balancing loss),",
        "weights normal(0, 0.2), norm weights uniform(0.5, 1.5), biases normal(0, 0.2); inputs",
        f"({BATCH}, {SEQ}) with labels {IGNORED_LABELS} set to -100. References: transformers in float64 (eager",
        "attention); `hf f32` is unmodified transformers in float32 against it (max-abs / max|ref|).",
        "`tokens_per_expert`: routed slots per expert over the batch and all sparse layers.",
        f"`padded_aux_loss`: the balancing loss with row 1's last {PADDED} tokens right padding (attention",
        "mask 0, labels -100), left out by transformers (`padded.*` in `reference.safetensors`).",
        "",
    ]
    lines += results_table(results, FIXTURES, loss="loss (with aux)")
    (OUT / "README.md").write_text("\n".join(lines))


def main():
    setup_determinism()
    OUT.mkdir(parents=True, exist_ok=True)
    input_ids, labels = make_inputs()
    results = []
    for name in FIXTURES:
        if (OUT / name).exists():
            shutil.rmtree(OUT / name)
        r = build_fixture(name, input_ids, labels)
        results.append(r)
        log(f"{name}: loss={r['loss']:.6f} max|logit|={r['max_abs_logit']:.3f} hf32={r['stock32']} {r['extra']}")
    write_readme(results)
    digest = hashlib.sha256()
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            digest.update(str(p.relative_to(OUT)).encode() + b"\0" + p.read_bytes())
    log(f"wrote {OUT}, sha256 of all files {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
