#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention timings on the shapes of `cpl bench attention`.

Shape (batch 1, --heads 8, S, --head-dim 64), S in {2048, 8192}, causal and full, f32 and bf16,
on --device cpu (default) or cuda (every timing ends with torch.cuda.synchronize(); PyTorch picks
its fastest SDPA backend, FlashAttention-2 or cuDNN for bf16).
Prints JSON: {"torch": version, "threads": n, "matmul_f32_gflops": x, "results": {
"<dtype>_<S>_<mask>": {"fwd_s": best forward seconds, "fwd_bwd_s": best forward+backward}}}.
Timings are the best of --repeats runs after one warm-up. Setup:
    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-bench.txt
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


SYNC = [lambda: None]


def best_of(repeats, fn):
    fn()
    SYNC[0]()
    best = float("inf")
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        fn()
        SYNC[0]()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="2048,8192")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--masks", default="causal,full")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--out", default="", help="also write the JSON to this file")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda":
        SYNC[0] = torch.cuda.synchronize
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

    n = 2048
    x, y = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    mm = 2 * n**3 / best_of(10, lambda: x @ y) / 1e9

    results = {}
    for dts in a.dtypes.split(","):
        dt = dtypes[dts]
        for s in [int(v) for v in a.seqs.split(",")]:
            for mask in a.masks.split(","):
                causal = mask == "causal"
                shape = (1, a.heads, s, a.head_dim)
                q, k, v = (torch.randn(*shape, dtype=dt, device=dev) for _ in range(3))
                dout = torch.randn(*shape, dtype=dt, device=dev)

                def fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

                def fwd_bwd():
                    for t in (qg, kg, vg):
                        t.grad = None
                    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    o.backward(dout)

                results[f"{dts}_{s}_{mask}"] = {
                    "fwd_s": best_of(a.repeats, fwd),
                    "fwd_bwd_s": best_of(a.repeats, fwd_bwd),
                }
    doc = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul_f32_gflops": mm,
        "device": str(dev),
        "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
        "shape": f"(batch 1, heads {a.heads}, S, head_dim {a.head_dim})",
        "results": results,
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
