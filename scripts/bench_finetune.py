#!/usr/bin/env python3
"""transformers + PEFT LoRA (or full) fine-tuning throughput, next to `cpl finetune` (issue 16;
run scripts/bench_finetune.sh).

Uses the checkpoint of scripts/bench_eval.py (4-layer, hidden-512 LLaMA, vocab 32000) and times
AdamW steps (forward, backward, clip 1.0, step) on one sequence of --seq-len tokens with the
first quarter of the labels masked (a prompt), LoRA r 16, alpha 32 on every linear layer (PEFT's
"all-linear"), or every weight with --full; best of --repeats steps after one warm-up, sdpa
attention. Prints JSON with tokens/s and the peak resident memory (ru_maxrss) of the process.
"""
import argparse
import json
import os
import resource
import time

import torch
from transformers import LlamaForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--dir", default="target/bench")
    p.add_argument("--full", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(os.path.join(a.dir, "llama-4l-512"), dtype=getattr(torch, a.dtype),
                                             attn_implementation="sdpa").train()
    if not a.full:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    ids = torch.randint(3, 2048, (1, a.seq_len), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, : a.seq_len // 4] = -100
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.item()

    step()
    best = float("inf")
    for _ in range(a.repeats):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": a.dtype,
                      "mode": "full" if a.full else "lora", "seq_len": a.seq_len, "seconds": best,
                      "tokens_per_sec": a.seq_len / best,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
