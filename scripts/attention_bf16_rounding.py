#!/usr/bin/env python3
"""PyTorch's bf16 SDPA against float64 on the ill-conditioned inputs of flash-ring's
`tests/rounded_p.rs` (docs/accuracy.md, "P and dS rounded to bf16").

Needs the venv of `scripts/requirements-bench.txt` (torch). From the repository root:

    .venv/bin/python scripts/attention_bf16_rounding.py

Inputs are built as the Rust test builds them (not the same random numbers): q, k, v, dO of
shape (1, heads, S, 64), rounded to bf16, then attention forward and backward in bf16 (PyTorch's
CPU kernel) and in float64 on the same bf16 values. Prints the max-norm relative error
`max |x - ref| / max |ref|` of out, dq, dk and dv for each case.
"""
import torch


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def bf(x):
    return x.to(torch.bfloat16).to(torch.float64)


def grads(q, k, v, do, dtype, causal):
    qs, ks, vs = [x.to(dtype).detach().requires_grad_() for x in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    o.backward(do.to(dtype))
    return [t.detach().double() for t in (o, qs.grad, ks.grad, vs.grad)]


def normalish(shape, mean, spread, gen):
    u = torch.rand(shape, dtype=torch.float64, generator=gen) * 2 - 1
    w = torch.rand(shape, dtype=torch.float64, generator=gen) * 2 - 1
    return mean + spread * (u + w)


def report(name, q, k, v, do, causal):
    q, k, v, do = map(bf, (q, k, v, do))
    exact = grads(q, k, v, do, torch.float64, causal)
    got = grads(q, k, v, do, torch.bfloat16, causal)
    errs = " ".join(f"{n} {rel(a, b):.2e}" for n, a, b in zip(["out", "dq", "dk", "dv"], got, exact))
    print(f"{name:<40} {'causal' if causal else 'full':<6} {errs}")


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(11)
    s, h, d = 301, 4, 64
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for qm, km, vm, ks in [(0, 0, 0, 0.6), (0, 20, 0, 0.6), (20, 0, 0, 0.6), (64, 0, 0, 0.05),
                           (20, 20, 0, 0.6), (0, 4, 20, 0.6)]:
        for causal in (True, False):
            q = normalish((1, h, s, d), qm, 0.6, gen)
            k = normalish((1, h, s, d), km, ks, gen)
            v = normalish((1, h, s, d), vm, 1.0, gen)
            do = normalish((1, h, s, d), 0, 1.0, gen)
            report(f"means q {qm} k {km} v {vm}", q, k, v, do, causal)
    # Paired queries: row 2i+1 is row 2i plus a few ulps (mean 4), with the opposite dO.
    s = 256
    u = 4 + torch.rand(1, 2, s // 2, d, dtype=torch.float64, generator=gen) - 0.5
    w = (torch.rand(u.shape, dtype=torch.float64, generator=gen) - 0.5) * 0.2
    g = torch.rand(u.shape, dtype=torch.float64, generator=gen) * 2 - 1
    q = torch.empty(1, 2, s, d, dtype=torch.float64)
    do = torch.empty_like(q)
    q[:, :, 0::2], q[:, :, 1::2] = u, u + w
    do[:, :, 0::2], do[:, :, 1::2] = g, -g
    k = (torch.rand(1, 2, s, d, dtype=torch.float64, generator=gen) * 2 - 1) * 0.3
    v = torch.rand(1, 2, s, d, dtype=torch.float64, generator=gen) * 2 - 1
    report("paired queries, opposite dO", q, k, v, do, False)


if __name__ == "__main__":
    main()
