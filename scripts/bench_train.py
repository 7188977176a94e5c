#!/usr/bin/env python3
"""transformers + PyTorch training throughput, next to `cpl bench train` (issue 6; run scripts/bench_train.sh).

Uses the checkpoint and tokens of scripts/bench_eval.py (4-layer, hidden-512 LLaMA, vocab 32000)
and times AdamW training steps (forward, backward, clip 1.0, step) on one sequence of --seq-len
tokens, best of --repeats steps after one warm-up, f32 or bf16 parameters, sdpa attention.
Prints JSON with tokens/s and the peak resident memory (ru_maxrss) of the process.
"""
import json
import resource
import time

import torch
from transformers import LlamaForCausalLM

from bench_eval import bench_args, bench_tokens  # same flags, model and tokens


def main():
    a, model_dir, dtype = bench_args()
    # The tokens of scripts/bench_eval.py at this length (its eval_tokens.json holds the length
    # of its last run, which may be shorter).
    ids = bench_tokens(a.seq_len)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=dtype, attn_implementation="sdpa")
    best = time_train(model, ids, a.repeats)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": a.dtype,
                      "seq_len": ids.shape[1], "seconds": best, "tokens_per_sec": (ids.shape[1] - 1) / best,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def time_train(model, ids, repeats):
    """Best seconds of `repeats` training steps on `ids` (forward, backward, clip 1.0, AdamW at lr 1e-4)
    after a warm-up step."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.item()

    step()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


if __name__ == "__main__":
    main()
