#!/usr/bin/env python3
"""Build the large-activation LLaMA fixture under tests/fixtures/llama/massive/ (offline, deterministic).

Run from the repository root (the venv of `scripts/requirements-fixtures.txt`):

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt && .venv/bin/python scripts/make_precision_fixture.py

The model reproduces, in a tiny checkpoint, what made `cpl eval` lose precision on a trained SmolLM2
(issue 21, `docs/accuracy.md`): outputs of a linear layer that are long sums of large products of one
sign which cancel to a small result. A product with one running sum per output over 512 or more terms
(what `Tensor::matmul` does through the `gemm` crate) rounds every partial sum at the size of the large
terms; PyTorch's CPU matmul (MKL) and `flash_ring::matmul` sum short chains and lose several times less.

The model: one decoder layer, hidden 32, intermediate 1024, 4 heads / 2 kv heads of dim 8, vocab 256,
untied head, RMSNorm eps 1e-5, RoPE theta 10000.

* Embeddings N(0, 1) with channel 0 set to 4.0 for every token: a "bias" channel, so every token's
  normalised input has the same large component.
* gate_proj and up_proj: N(0, 0.01), column 0 uniform(0.8, 1.2): every intermediate unit fires on the
  bias channel, so the intermediate activations silu(g) * u are large (about 6) and positive for every
  token, with a small token-dependent part.
* down_proj: each row N(0, 0.1) made zero-mean (the common part of the intermediate activations
  cancels, as the removal of a large activation does) and ordered from its largest to its smallest
  weight, so the positive products come first: a running sum over the row climbs to about half of the
  row's absolute sum (about 150) before falling back to the small result (about 0.3).
* Attention projections N(0, 0.1), RMSNorm weights uniform(0.9, 1.1), head N(0, 1/sqrt(32)).

Writes ``tests/fixtures/llama/massive/``: ``config.json``, ``generation_config.json``,
``model.safetensors`` (f32, `save_pretrained`), ``reference.safetensors`` and ``README.md`` (generated,
with the measured errors). ``reference.safetensors`` holds

* ``input_ids`` (1, 64) int64: token 1 then 63 ids drawn uniformly from 3..256 (seed 5);
* ``logits`` (1, 64, 256) **float64**: the reference, transformers in float64 with the steps transformers
  itself runs in float32 inside a float64 model (RMSNorm, eager softmax, RoPE cos/sin) run in float64
  (`make_llama_fixtures.pure_f64`);
* ``hf_f32_eager_rel_err``, ``hf_f32_sdpa_rel_err`` (float64 scalars): max |logits - reference| / max
  |reference| of unmodified transformers in float32 (eager and sdpa attention), one thread, on the machine
  that ran the script;
* ``long_chain_rel_err`` (float64 scalar): the same error with every linear layer summed in one running
  sum per block of up to 512 products (the `gemm` crate's order, emulated with exact FMAs) — the error
  `cpl` had before issue 21.
"""
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_llama_fixtures as base  # noqa: E402  (pure_f64, load, setup_determinism)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "llama" / "massive"
COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt"
    " && .venv/bin/python scripts/make_precision_fixture.py"
)

SEED = 0
INPUT_SEED = 5
SEQ = 64
CONFIG = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=1024,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
BIAS = 4.0
# The old accumulation order: one running sum per block of max(512, k / ceil(k / 512)) products.
OLD_BLOCK = 512


def make_model() -> LlamaForCausalLM:
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(SEED)
    normal = lambda *shape, std: torch.randn(*shape, generator=g) * std  # noqa: E731
    uniform = lambda n, lo, hi: lo + (hi - lo) * torch.rand(n, generator=g)  # noqa: E731
    h, i = config.hidden_size, config.intermediate_size
    with torch.no_grad():
        emb = normal(config.vocab_size, h, std=1.0)
        emb[:, 0] = BIAS
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(normal(config.vocab_size, h, std=1.0 / math.sqrt(h)))
        model.model.norm.weight.copy_(uniform(h, 0.9, 1.1))
        for layer in model.model.layers:
            a = layer.self_attn
            for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                p.weight.copy_(normal(*p.weight.shape, std=0.1))
            layer.input_layernorm.weight.copy_(uniform(h, 0.9, 1.1))
            layer.post_attention_layernorm.weight.copy_(uniform(h, 0.9, 1.1))
            for p in (layer.mlp.gate_proj, layer.mlp.up_proj):
                w = normal(i, h, std=0.01)
                w[:, 0] = uniform(i, 0.8, 1.2)
                p.weight.copy_(w)
            z = normal(h, i, std=0.1)
            z = z - z.mean(dim=1, keepdim=True)
            layer.mlp.down_proj.weight.copy_(torch.sort(z, dim=1, descending=True).values)
    return model


def rel_err(a, ref) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max()).item()


def long_chain_linear(x, weight):
    """`x @ weight.T` summed like the `gemm` crate: one running f32 sum (exact FMAs) per block."""
    k = x.shape[-1]
    blocks = -(-k // OLD_BLOCK)
    kc = -(-k // blocks)
    x2 = x.reshape(-1, k).double()
    w = weight.double()
    out = torch.zeros(x2.shape[0], w.shape[0], dtype=torch.float32)
    for k0 in range(0, k, kc):
        acc = torch.zeros_like(out)
        for t in range(k0, min(k, k0 + kc)):
            acc = (acc.double() + x2[:, t, None] * w[None, :, t]).float()
        out = out + acc
    return out.reshape(*x.shape[:-1], w.shape[0])


@torch.no_grad()
def logits(model, input_ids):
    return model(input_ids=input_ids, use_cache=False).logits


def main():
    base.setup_determinism()
    OUT.mkdir(parents=True, exist_ok=True)
    for p in OUT.iterdir():
        p.unlink()
    make_model().save_pretrained(str(OUT))

    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.tensor([[1] + torch.randint(3, CONFIG["vocab_size"], (SEQ - 1,), generator=gen).tolist()])

    m64 = base.load(OUT, torch.float64)
    down = m64.model.layers[0].mlp.down_proj
    seen = {}
    hook = down.register_forward_hook(lambda mod, args, out: seen.update(act=args[0].detach()))
    with base.pure_f64(m64) as hits:
        ref = logits(m64, input_ids)
    hook.remove()
    assert hits == {"norm": 3, "softmax": 1, "rope": 1}, hits
    m32 = base.load(OUT, torch.float32)
    eager = rel_err(logits(m32, input_ids), ref)
    sdpa_model = LlamaForCausalLM.from_pretrained(str(OUT), attn_implementation="sdpa", dtype=torch.float32).eval()
    sdpa = rel_err(logits(sdpa_model, input_ids), ref)
    orig = nn.Linear.forward
    nn.Linear.forward = lambda self, x: long_chain_linear(x, self.weight)
    try:
        long_chain = rel_err(logits(m32, input_ids), ref)
    finally:
        nn.Linear.forward = orig

    # The large sums the fixture is about: down_proj's running sums vs its results.
    act = seen["act"]
    terms = act[0, :, None, :] * down.weight[None]  # (seq, hidden, intermediate)
    peak = terms.cumsum(-1).abs().amax(-1)
    result = terms.sum(-1).abs()
    stats = dict(
        act_mean=act.mean().item(),
        act_min=act.min().item(),
        peak_running_sum=peak.median().item(),
        down_result=result.median().item(),
    )
    assert stats["act_min"] > 0 and stats["peak_running_sum"] > 30 * stats["down_result"], stats
    # The fixture must separate the two accumulation orders (the Rust test relies on it).
    assert long_chain > 2.0 * eager, (long_chain, eager)

    save_file(
        {
            "input_ids": input_ids.to(torch.int64).contiguous(),
            "logits": ref.contiguous(),
            "hf_f32_eager_rel_err": torch.tensor(eager, dtype=torch.float64),
            "hf_f32_sdpa_rel_err": torch.tensor(sdpa, dtype=torch.float64),
            "long_chain_rel_err": torch.tensor(long_chain, dtype=torch.float64),
        },
        str(OUT / "reference.safetensors"),
    )
    back = load_file(str(OUT / "reference.safetensors"))
    assert back["logits"].dtype == torch.float64 and torch.equal(back["logits"], ref)
    write_readme(eager, sdpa, long_chain, ref, stats)
    print(json.dumps(dict(hf_f32_eager=eager, hf_f32_sdpa=sdpa, long_chain=long_chain, **stats)), flush=True)
    return 0


def write_readme(eager, sdpa, long_chain, ref, stats):
    size = sum(p.stat().st_size for p in OUT.iterdir() if p.name != "README.md")
    text = f"""# Large-activation LLaMA fixture (generated)

Generated by `scripts/make_precision_fixture.py` (do not edit by hand; rerun the script). From the
repository root:

```sh
{COMMAND}
```

Versions: torch {torch.__version__}, transformers {__import__("transformers").__version__} (pinned in
`scripts/requirements-fixtures.txt`). Offline, CPU, fixed seeds, one thread.

A one-layer LLaMA (hidden 32, intermediate 1024, 4 heads / 2 kv heads of dim 8, vocab 256, untied)
whose MLP output is made of long sums of large same-sign products that cancel: every token's
intermediate activations are large and positive (mean {stats['act_mean']:.2f}, min
{stats['act_min']:.2f}: embedding channel 0 is {BIAS} for every token and every unit's gate and up
weights read it), and every row of down_proj is zero-mean and ordered from its largest to its smallest
weight, so that a running sum over a row climbs to about {stats['peak_running_sum']:.0f} (median over
outputs) before cancelling down to about {stats['down_result']:.2f}. See the script's docstring for
every weight.

`reference.safetensors`: `input_ids` (1, 64) int64, `logits` (1, 64, 256) **float64** (transformers in
float64 with its internal float32 steps in float64; max |logit| {ref.abs().max().item():.3f}), and the
measured max |logits - reference| / max |reference| of

| implementation (f32) | error |
|---|---|
| transformers eager (`hf_f32_eager_rel_err`) | {eager:.2e} |
| transformers sdpa (`hf_f32_sdpa_rel_err`) | {sdpa:.2e} |
| every linear layer with one running sum per block of 512 products, the `gemm` crate's order (`long_chain_rel_err`, emulated) | {long_chain:.2e} |

`tests/llama_precision.rs` requires `cpl`'s logits (single rank and parallel layouts) to be within
the transformers eager error of this reference: PyTorch-level accuracy, while the old accumulation
order is {long_chain / eager:.1f}x worse.

Size: {size} bytes.
"""
    (OUT / "README.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
