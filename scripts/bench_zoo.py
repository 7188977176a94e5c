#!/usr/bin/env python3
"""`cpl bench eval|train` next to transformers + PyTorch for every causal-LM family (issue 33).

Run through scripts/bench_zoo.sh (which builds cpl first), from the repository root:

    scripts/bench_zoo.sh [--families llama,qwen2,qwen3,mistral,gemma2,gemma3,phi3,mixtral,qwen3_moe]
                         [--dtypes f32,bf16]
                         [--seq-len 4096] [--repeats 3] [--rounds 1] [--json FILE]

For each family it builds once, with transformers (``AutoConfig.for_model`` + ``save_pretrained``, random
weights, f32), a bench-sized checkpoint in target/bench/zoo/<family>-4l-512/: 4 layers, hidden 512, 8 heads /
4 kv heads of dim 64, intermediate 1536, vocab 32000, every other setting the family's default (Gemma 2: tied
embeddings, GeGLU, sandwich norms, soft-caps 50 and 30, ``query_pre_attn_scalar`` scaled down to the head dim
64). Sliding windows stay where the family has them (Mistral on every layer, Gemma 2 on every other layer;
Qwen2 and Qwen3 have theirs off by default) but are ``max(4096, seq_len)`` tokens long, so they never cut
the sequence: the timings are of the same computation as full causal attention, not of the window's savings.
(target/bench/llama-4l-512 is the 8/8-head checkpoint of scripts/bench_eval.py; the zoo's LLaMA is 8/4 like
the others.)

Then for each dtype, in this process and one after the other on the same checkpoint:
- transformers' forward (scripts/bench_eval.py's ``time_eval``: eval mode, no grad, loss from the labels) on
  one sequence of --seq-len random tokens, best of --repeats after a warm-up; next to ``cpl bench eval
  --seq-len S --repeats R`` (best pass after a warm-up). Tokens/s count the S - 1 scored tokens in both.
- transformers' training step (scripts/bench_train.py's ``time_train``: forward, backward, clip 1.0, AdamW at
  lr 1e-4) on the same S tokens (S - 1 labelled), best of --repeats after a warm-up; next to ``cpl bench train
  --seq-len S-1 --steps R+1`` (S - 1 inputs with a label each; best step after the first).
With ``--rounds N`` the pair (transformers, then cpl) runs N times in turn and the best of each counts,
with every round's rates in the JSON and on the progress line: on a VM whose speed drifts over minutes
(transformers' bf16 step moved 25% between two runs three minutes apart, docs/benchmarks.md) one block of
each side is not a fair comparison.
transformers runs ``sdpa`` attention where the family supports it, else its default (Gemma 2: ``eager``,
as sdpa has no soft-cap), and for the mixtures of experts (Mixtral, Qwen3-MoE: 8 experts of 1536 units,
top-2) its default experts implementation; the table says which. It prints the CPU (lscpu: vendor, model name, the flags
avx2, avx512f, avx512_bf16, amx), the load average before and after, and a table per family and dtype.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_eval import time_eval  # noqa: E402
from bench_train import time_train  # noqa: E402

VOCAB = 32000
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=8192)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def family_overrides(family, window):
    """The config fields of `family` besides SHAPE (its windows `window` tokens long)."""
    return {
        "llama": dict(tie_word_embeddings=False),
        "qwen2": dict(),  # use_sliding_window is off by default
        "qwen3": dict(head_dim=64),  # Qwen3's default head_dim (128) is not hidden / heads
        "mistral": dict(sliding_window=window),
        # Gemma 2's defaults are head_dim 256 and query_pre_attn_scalar 256: scaled to the head dim.
        "gemma2": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=window),
        # Gemma 3 (text): the same scaling; q/k norms, per-layer-type RoPE, no soft-caps.
        "gemma3": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=window,
                       tie_word_embeddings=True),
        # Phi-3: fused qkv_proj and gate_up_proj, untied; its default pad (32000) and eos
        # (32000) ids lie outside a 32000-token vocabulary, so they are moved inside it.
        "phi3": dict(tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, sliding_window=None),
        # Mixtral-shaped (issue 34): 8 experts of 1536 units, top-2, no window.
        "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                        tie_word_embeddings=False),
        # Qwen3-MoE: 8 experts of 1536 units (moe_intermediate_size), top-2 renormalised.
        "qwen3_moe": dict(head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1536,
                          norm_topk_prob=True, tie_word_embeddings=False),
    }[family]


# transformers' model_type of a family whose name differs from it.
MODEL_TYPES = {"gemma3": "gemma3_text"}


def checkpoint(family, root, seq_len):
    """The directory of `family`'s bench checkpoint, built when missing."""
    d = os.path.join(root, "zoo", f"{family}-4l-512")
    window = max(4096, seq_len)
    if os.path.exists(os.path.join(d, "model.safetensors")):
        with open(os.path.join(d, "config.json")) as f:
            w = json.load(f).get("sliding_window")
        if seq_len <= 4096 or w is None or w >= seq_len:
            return d
    cfg = AutoConfig.for_model(MODEL_TYPES.get(family, family), **SHAPE, **family_overrides(family, window))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def load(model_dir, dtype):
    """transformers' model of `model_dir` in `dtype`, with sdpa attention where the family has it."""
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    except ValueError:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def cpl(binary, args):
    """The JSON object `cpl bench ... --json` prints."""
    out = subprocess.run([binary, "bench", *args, "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def lscpu():
    """Vendor, model name and the flags that decide the kernels, from lscpu."""
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    flags = set(fields.get("Flags", "").split())
    return {
        "vendor": fields.get("Vendor ID", "?"),
        "model_name": fields.get("Model name", "?"),
        "cpus": fields.get("CPU(s)", "?"),
        "flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16")} | {"amx": "amx_tile" in flags},
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--families", default="llama,qwen2,qwen3,mistral,gemma2,gemma3,phi3")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--works", default="eval,train")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="transformers then cpl, this many times in turn; the best of each counts")
    p.add_argument("--dir", default="target/bench")
    p.add_argument("--cpl", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "release", "cpl"))
    p.add_argument("--json", help="also write every measurement to this file")
    a = p.parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cpu = lscpu()
    on = [f for f, v in cpu["flags"].items() if v]
    off = [f for f, v in cpu["flags"].items() if not v]
    print(f"CPU: {cpu['vendor']} {cpu['model_name']}, {cpu['cpus']} CPUs; flags: {' '.join(on) or '-'}"
          f" (not: {' '.join(off) or '-'}); torch {torch.__version__} with {torch.get_num_threads()} threads;"
          f" load average {os.getloadavg()[0]:.2f}", flush=True)
    S, R = a.seq_len, a.repeats
    rows = []
    for family in a.families.split(","):
        model_dir = checkpoint(family, a.dir, S)
        ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))
        for dt in a.dtypes.split(","):
            for work in a.works.split(","):
                t0 = time.time()
                # --rounds N: the peer and cpl alternately, N times; the best of each counts.
                rounds = []
                for _ in range(a.rounds):
                    model = load(model_dir, DTYPES[dt])
                    attn = model.config._attn_implementation
                    experts = getattr(model.config, "_experts_implementation", None)
                    if experts:
                        attn = f"{attn}, experts {experts}"
                    if work == "eval":
                        seconds, _ = time_eval(model, ids, R)
                    else:
                        seconds = time_train(model, ids, R)
                    del model
                    gc.collect()
                    if work == "eval":
                        c = cpl(a.cpl, ["eval", "--model", model_dir, "--seq-len", str(S), "--repeats", str(R),
                                        "--dtype", dt])
                    else:
                        c = cpl(a.cpl, ["train", "--model", model_dir, "--seq-len", str(S - 1), "--steps",
                                        str(R + 1), "--dtype", dt])
                    rounds.append(((S - 1) / seconds, c))
                peer = max(r[0] for r in rounds)
                c = max((r[1] for r in rounds), key=lambda x: x["tokens_per_sec_best"])
                row = {"family": family, "cpl_family": c["family"], "dtype": dt, "work": work, "seq_len": S,
                       "cpl_tokens_per_sec": c["tokens_per_sec_best"],
                       "cpl_tokens_per_sec_median": c["tokens_per_sec_median"],
                       "transformers_tokens_per_sec": peer, "transformers_attention": attn,
                       "load_average": os.getloadavg()[0], "wall_seconds": time.time() - t0, "cpl": c,
                       "rounds": [{"transformers_tokens_per_sec": t, "cpl_tokens_per_sec": x["tokens_per_sec_best"]}
                                  for t, x in rounds]}
                row["ratio"] = row["cpl_tokens_per_sec"] / row["transformers_tokens_per_sec"]
                rows.append(row)
                each = ", ".join(f"{x['cpl_tokens_per_sec']:.0f}/{x['transformers_tokens_per_sec']:.0f}"
                                 for x in row["rounds"])
                print(f"{family} {dt} {work}: cpl {row['cpl_tokens_per_sec']:.0f} tok/s, transformers "
                      f"{row['transformers_tokens_per_sec']:.0f} tok/s ({attn}), ratio {row['ratio']:.2f}x, "
                      f"load {row['load_average']:.2f}, {row['wall_seconds']:.0f} s"
                      + (f" (rounds cpl/peer: {each})" if len(row["rounds"]) > 1 else ""), flush=True)
    print()
    print("| family | dtype | work | cpl tok/s best (median) | transformers tok/s | ratio | transformers attention |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['dtype']} | {r['work']} | {r['cpl_tokens_per_sec']:.0f} "
              f"({r['cpl_tokens_per_sec_median']:.0f}) | {r['transformers_tokens_per_sec']:.0f} | "
              f"**{r['ratio']:.2f}x** | {r['transformers_attention']} |")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu, "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
