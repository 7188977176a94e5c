#!/usr/bin/env python3
"""f32 accuracy of `cpl eval` against a float64 forward of the same checkpoint (issue 21, `docs/accuracy.md`).

Needs the venv of `scripts/requirements-fixtures.txt`. From the repository root:

    # inputs: the issue's sequence (ids 1..199), an ensemble of ill-conditioned variants, natural text
    .venv/bin/python scripts/accuracy_report.py inputs --model DIR --out-dir OUT [--text FILE.jsonl]
    # logits of cpl (any number of builds or layouts), then the table
    cpl eval --model DIR --tokens OUT/ill.json --dtype f32 --logits-out OUT/cpl_ill.safetensors
    .venv/bin/python scripts/accuracy_report.py compare --model DIR --tokens OUT/ill.json OUT/cpl_ill.safetensors ...
    # per-layer and per-op errors of the first sequence (needs the `llama_trace` example built)
    cargo build --release -p cpl-models --example llama_trace
    .venv/bin/python scripts/accuracy_report.py trace --model DIR --tokens OUT/ill.json --out-dir OUT

Error metric everywhere: max |logits - reference| / max |reference| per sequence. The reference is transformers'
LlamaForCausalLM in float64 with the steps transformers itself runs in float32 inside a float64 model (RMSNorm,
eager softmax, RoPE cos/sin) run in float64 (`make_llama_fixtures.pure_f64`). `compare` also reports
transformers in float32 (eager and sdpa attention) and the geometric mean over the sequences: on ill-conditioned
inputs a single sequence's error depends on how a few roundings happen to align with the directions the model
amplifies (transformers eager and sdpa differ by up to 6x there), so a build is judged on the whole ensemble.

`trace` runs the model op by op in float64, in torch float32 and in cpl (`models/examples/llama_trace.rs`), each
op fed the float64 reference's input rounded to f32, and prints every op's error against the float64 op on that
same input (its own rounding only), then the free-running error of every layer's output.
"""
import argparse
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_llama_fixtures as base  # noqa: E402  (pure_f64, inv_freq_f64)

ROOT = Path(__file__).resolve().parent.parent


def rel(a, ref) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max()).item()


def load(model, dtype, attn="eager"):
    return LlamaForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=attn).eval()


@torch.no_grad()
def references(model, seqs):
    """{f64, eager, sdpa}: one (len, vocab) logits tensor per sequence."""
    m64, m32, m32s = load(model, torch.float64), load(model, torch.float32), load(model, torch.float32, "sdpa")
    out = {"f64": [], "eager": [], "sdpa": []}
    for s in seqs:
        ids = torch.tensor([s])
        with base.pure_f64(m64):
            out["f64"].append(m64(input_ids=ids, use_cache=False).logits[0])
        out["eager"].append(m32(input_ids=ids, use_cache=False).logits[0])
        out["sdpa"].append(m32s(input_ids=ids, use_cache=False).logits[0])
    return out


def cmd_inputs(args):
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    # The input, then the same tokens with the 16 special tokens in shuffled order (the
    # large activations come from the special-token run at the start).
    ill = [list(range(1, 200))]
    for _ in range(args.ensemble - 1):
        head = list(range(1, 17))
        rng.shuffle(head)
        ill.append(head + list(range(17, 200)))
    (out / "ill.json").write_text(json.dumps(ill))
    print(f"wrote {out / 'ill.json'} ({len(ill)} sequences of {len(ill[0])})")
    if args.text:
        tok = AutoTokenizer.from_pretrained(args.model)
        docs = [json.loads(line)["text"] for line in Path(args.text).read_text().splitlines() if line.strip()]
        ids = tok("\n\n".join(docs))["input_ids"]
        text = [ids[i * args.text_len:(i + 1) * args.text_len] for i in range(args.text_windows)]
        assert all(len(t) == args.text_len for t in text), "text too short"
        (out / "text.json").write_text(json.dumps(text))
        print(f"wrote {out / 'text.json'} ({len(text)} windows of {args.text_len})")


def cmd_compare(args):
    seqs = json.loads(Path(args.tokens).read_text())
    refs = references(args.model, seqs)
    cols = ["transformers eager", "transformers sdpa"] + [Path(f).name for f in args.cpl]
    cpl = [load_file(f) for f in args.cpl]
    logs = [[] for _ in cols]
    print("| seq | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for i in range(len(seqs)):
        ref = refs["f64"][i]
        errs = [rel(refs["eager"][i], ref), rel(refs["sdpa"][i], ref)] + [rel(c[f"logits.{i}"], ref) for c in cpl]
        for lg, e in zip(logs, errs):
            lg.append(math.log(e))
        print(f"| {i} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
    print("| geometric mean | " + " | ".join(f"{math.exp(sum(v) / len(v)):.2e}" for v in logs) + " |")
    print("| max | " + " | ".join(f"{math.exp(max(v)):.2e}" for v in logs) + " |")


class Ops:
    """The LLaMA ops in `dtype`, as transformers computes them (float64: without its float32 steps)."""

    def __init__(self, cfg, dtype):
        self.dt, self.cfg = dtype, cfg
        self.hd, self.hq, self.hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.eps = cfg.rms_norm_eps
        if dtype == torch.float64:
            self.inv = base.inv_freq_f64(cfg)
        else:
            theta = cfg.rope_parameters["rope_theta"]
            self.inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.int64).float() / self.hd))

    def norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x):
        fr = torch.arange(x.shape[1], dtype=self.inv.dtype)[:, None] * self.inv[None]
        emb = torch.cat([fr, fr], -1)
        cos, sin = emb.cos().to(x.dtype)[None, :, None], emb.sin().to(x.dtype)[None, :, None]
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def attention(self, q, k, v):
        g = self.hq // self.hkv
        q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
        n = q.shape[2]
        s = q @ k.transpose(2, 3) / math.sqrt(self.hd) + torch.full((n, n), float("-inf"), dtype=q.dtype).triu(1)
        return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(1, n, -1), torch.logsumexp(s, -1)


def cmd_trace(args):
    cfg = load(args.model, torch.float32).config
    w = {}
    for f in sorted(Path(args.model).glob("*.safetensors")):
        w.update(load_file(str(f)))
    ids = torch.tensor(json.loads(Path(args.tokens).read_text())[0])
    ref, f32 = {}, {}
    for dt, rec in [(torch.float64, ref), (torch.float32, f32)]:
        ops = Ops(cfg, dt)
        x = w["model.embed_tokens.weight"].to(dt)[ids][None]
        for i in range(cfg.num_hidden_layers):
            W = lambda k: w[f"model.layers.{i}.{k}"].to(dt)  # noqa: E731
            rec[f"{i}.x"] = x
            n1 = rec[f"{i}.n1"] = ops.norm(x, W("input_layernorm.weight"))
            ql = rec[f"{i}.ql"] = F.linear(n1, W("self_attn.q_proj.weight"))
            kl = rec[f"{i}.kl"] = F.linear(n1, W("self_attn.k_proj.weight"))
            v = rec[f"{i}.v"] = F.linear(n1, W("self_attn.v_proj.weight")).reshape(1, -1, ops.hkv, ops.hd)
            q = rec[f"{i}.q"] = ops.rope(ql.reshape(1, -1, ops.hq, ops.hd))
            k = rec[f"{i}.k"] = ops.rope(kl.reshape(1, -1, ops.hkv, ops.hd))
            o, rec[f"{i}.lse"] = ops.attention(q, k, v)
            rec[f"{i}.o"] = o
            h = rec[f"{i}.h"] = x + F.linear(o, W("self_attn.o_proj.weight"))
            n2 = rec[f"{i}.n2"] = ops.norm(h, W("post_attention_layernorm.weight"))
            g = rec[f"{i}.g"] = F.linear(n2, W("mlp.gate_proj.weight"))
            u = rec[f"{i}.u"] = F.linear(n2, W("mlp.up_proj.weight"))
            s = rec[f"{i}.s"] = F.silu(g) * u
            x = rec[f"{i}.y"] = h + F.linear(s, W("mlp.down_proj.weight"))
        rec["final.x"] = x
        rec["final.n"] = ops.norm(x, w["model.norm.weight"].to(dt))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = ["x", "n1", "ql", "kl", "q", "k", "v", "o", "h", "n2", "g", "u", "s"]
    inputs = {"input_ids": ids[None].to(torch.int64)}
    for i in range(cfg.num_hidden_layers):
        inputs.update({f"{i}.{n}": ref[f"{i}.{n}"].float().contiguous() for n in names})
    inputs["final.x"], inputs["final.n"] = ref["final.x"].float().contiguous(), ref["final.n"].float().contiguous()
    save_file(inputs, str(out / "trace_inputs.safetensors"))
    exe = Path(args.trace_bin)
    subprocess.run([str(exe), args.model, str(out / "trace_inputs.safetensors"), str(out / "trace_out.safetensors")],
                   check=True)
    cpl = load_file(str(out / "trace_out.safetensors"))
    # Each op on the reference's input, rounded to f32: float64 op vs torch f32 vs cpl.
    op_inputs = {
        "n1 (RMSNorm)": ("x", lambda o, X, W: o.norm(X, W("input_layernorm.weight"))),
        "ql (q_proj)": ("n1", lambda o, X, W: F.linear(X, W("self_attn.q_proj.weight"))),
        "o (attention)": (None, lambda o, R, W: o.attention(R("q"), R("k"), R("v"))[0]),
        "lse (attention)": (None, lambda o, R, W: o.attention(R("q"), R("k"), R("v"))[1]),
        "n2 (RMSNorm)": ("h", lambda o, X, W: o.norm(X, W("post_attention_layernorm.weight"))),
        "g (gate_proj)": ("n2", lambda o, X, W: F.linear(X, W("mlp.gate_proj.weight"))),
        "s (SwiGLU)": (None, lambda o, R, W: F.silu(R("g")) * R("u")),
        "d (down_proj)": ("s", lambda o, X, W: F.linear(X, W("mlp.down_proj.weight"))),
    }
    cpl_names = {"n1 (RMSNorm)": "n1", "ql (q_proj)": "ql", "o (attention)": "o", "lse (attention)": "lse",
                 "n2 (RMSNorm)": "n2", "g (gate_proj)": "g", "s (SwiGLU)": "s", "d (down_proj)": "d"}
    errs = {k: ([], []) for k in op_inputs}
    o64, o32 = Ops(cfg, torch.float64), Ops(cfg, torch.float32)
    for i in range(cfg.num_hidden_layers):
        for label, (src, fn) in op_inputs.items():
            res = []
            for o, dt in [(o64, torch.float64), (o32, torch.float32)]:
                W = lambda k, dt=dt: w[f"model.layers.{i}.{k}"].to(dt)  # noqa: E731
                R = lambda n, dt=dt: inputs[f"{i}.{n}"].to(dt)  # noqa: E731
                res.append(fn(o, R(src), W) if src else fn(o, R, W))
            exact, torch32 = res
            errs[label][0].append(rel(cpl[f"op.{i}.{cpl_names[label]}"], exact))
            errs[label][1].append(rel(torch32, exact))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    print("| op | cpl median over layers | torch f32 median | cpl worst layer | torch f32 worst |")
    print("|---|---|---|---|---|")
    for label, (c, t) in errs.items():
        print(f"| {label} | {med(c):.1e} | {med(t):.1e} | {max(c):.1e} | {max(t):.1e} |")
    print("\n| layer | cpl | torch f32 |  (free-running output vs float64)\n|---|---|---|")
    for i in range(cfg.num_hidden_layers):
        print(f"| {i} | {rel(cpl[f'run.{i}.y'], ref[f'{i}.y']):.2e} | {rel(f32[f'{i}.y'], ref[f'{i}.y']):.2e} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("inputs")
    a.add_argument("--model", required=True)
    a.add_argument("--out-dir", required=True)
    a.add_argument("--ensemble", type=int, default=16)
    a.add_argument("--text")
    a.add_argument("--text-windows", type=int, default=4)
    a.add_argument("--text-len", type=int, default=256)
    c = sub.add_parser("compare")
    c.add_argument("--model", required=True)
    c.add_argument("--tokens", required=True)
    c.add_argument("cpl", nargs="*")
    t = sub.add_parser("trace")
    t.add_argument("--model", required=True)
    t.add_argument("--tokens", required=True)
    t.add_argument("--out-dir", required=True)
    t.add_argument("--trace-bin", default=str(ROOT / "target" / "release" / "examples" / "llama_trace"))
    args = p.parse_args()
    torch.set_num_threads(2)
    base.hf_logging.set_verbosity_error()
    base.hf_logging.disable_progress_bar()
    {"inputs": cmd_inputs, "compare": cmd_compare, "trace": cmd_trace}[args.cmd](args)


if __name__ == "__main__":
    main()
