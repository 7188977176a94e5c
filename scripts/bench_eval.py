#!/usr/bin/env python3
"""`cpl eval` throughput next to transformers' forward on the same checkpoint and tokens (issue 5).

Builds (once) a random 4-layer, hidden-512 LLaMA (8 heads, intermediate 1536, vocab 32000) in
target/bench/llama-4l-512/, writes one sequence of --seq-len random token ids to
target/bench/eval_tokens.json, times transformers' forward (eval mode, no grad, sdpa attention,
loss computed from the labels as `cpl eval` does) and prints JSON with tokens/s.
Run through scripts/bench_eval.sh, which then runs `cpl bench eval` on the same checkpoint and prints the ratio.
Setup: python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt
"""
import argparse
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def bench_args():
    """The flags both PyTorch benchmarks take; returns (args, model dir, torch dtype). Seeds torch."""
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--dir", default="target/bench")
    a = p.parse_args()
    torch.manual_seed(0)
    return a, os.path.join(a.dir, "llama-4l-512"), getattr(torch, a.dtype)


def bench_tokens(seq_len):
    """The benchmark's one sequence of `seq_len` random token ids (seeded: the same ids every run)."""
    return torch.randint(0, 32000, (1, seq_len), generator=torch.Generator().manual_seed(1))


def main():
    a, model_dir, dtype = bench_args()
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                          max_position_embeddings=max(a.seq_len, 4096), tie_word_embeddings=False)
        LlamaForCausalLM(cfg).save_pretrained(model_dir)
    ids = bench_tokens(a.seq_len)
    with open(os.path.join(a.dir, "eval_tokens.json"), "w") as f:
        json.dump(ids.tolist(), f)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=dtype, attn_implementation="sdpa")
    best, loss = time_eval(model, ids, a.repeats)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": a.dtype,
                      "seq_len": a.seq_len, "seconds": best, "tokens_per_sec": (a.seq_len - 1) / best,
                      "loss": loss, "model": model_dir}))


def time_eval(model, ids, repeats):
    """Best seconds of `repeats` forwards of `ids` (eval mode, no grad, loss from the labels) after a
    warm-up, and the loss."""
    model.eval()
    best = float("inf")
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
        for _ in range(repeats):
            t = time.perf_counter()
            out = model(input_ids=ids, labels=ids)
            best = min(best, time.perf_counter() - t)
    return best, out.loss.item()


if __name__ == "__main__":
    main()
