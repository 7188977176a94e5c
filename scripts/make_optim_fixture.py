#!/usr/bin/env python3
"""Build the AdamW + grad clipping + LR schedule fixture under tests/fixtures/optim/ (offline, deterministic).

Run from the repository root:

    .venv/bin/python scripts/make_optim_fixture.py

(The venv is the one of `scripts/requirements-fixtures.txt`: torch 2.15.0, transformers 5.23.0, safetensors 0.8.0.)

Three parameters (fixed seed, values drawn in float32 then widened, so the Rust side starts from the exact
same numbers): ``proj.weight`` (8, 6), ``norm.weight`` (6,), ``head.weight`` (5, 6). Three steps of fixed
float32 gradients; step 0 and 2 have a global norm well above 1 (clipping active), step 1 below 1 (not
clipped). Each step, in float64:

    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    lr   = optimizer.param_groups[0]["lr"]          # the lr this optimizer step uses
    optimizer.step(); scheduler.step()

with ``torch.optim.AdamW([{2-D params, weight_decay 0.1}, {1-D params, weight_decay 0.0}], lr=1e-2,
betas=(0.9, 0.95), eps=1e-8, foreach=False)`` and
``transformers.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=10)``
(so step 0 runs with lr 0: transformers' warmup starts at 0).

Writes ``tests/fixtures/optim/adamw.safetensors``:

* ``init.<name>``      float32, the initial parameters;
* ``grad.<s>.<name>``  float32, the raw (unclipped) gradient of step s = 0, 1, 2;
* ``param.<s>.<name>`` float64, the parameters after step s;
* ``lr``               float64 (3,), the lr of each step;
* ``grad_norm``        float64 (3,), the global gradient norm of each step before clipping.
"""
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import get_cosine_schedule_with_warmup

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "optim" / "adamw.safetensors"

SHAPES = {"proj.weight": (8, 6), "norm.weight": (6,), "head.weight": (5, 6)}
GRAD_SCALES = [1.0, 0.05, 0.5]  # global norms about 9, 0.45, 4.5
STEPS = len(GRAD_SCALES)


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(1234)

    init = {}
    for name, shape in SHAPES.items():
        if len(shape) == 1:
            init[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
        else:
            init[name] = 0.5 * torch.randn(shape, generator=gen, dtype=torch.float32)
    grads = [
        {name: scale * torch.randn(shape, generator=gen, dtype=torch.float32) for name, shape in SHAPES.items()}
        for scale in GRAD_SCALES
    ]

    params = {name: torch.nn.Parameter(t.to(torch.float64).clone()) for name, t in init.items()}
    decay = [p for n, p in params.items() if p.dim() >= 2]
    no_decay = [p for n, p in params.items() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=10)

    out = {f"init.{n}": t.contiguous() for n, t in init.items()}
    lrs, norms = [], []
    for s in range(STEPS):
        for n, p in params.items():
            p.grad = grads[s][n].to(torch.float64).clone()
            out[f"grad.{s}.{n}"] = grads[s][n].contiguous()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=1.0)
        norms.append(float(norm))
        lrs.append(opt.param_groups[0]["lr"])
        assert all(g["lr"] == lrs[-1] for g in opt.param_groups)
        opt.step()
        sched.step()
        for n, p in params.items():
            out[f"param.{s}.{n}"] = p.detach().clone().contiguous()
    assert any(n > 1.0 for n in norms) and any(n < 1.0 for n in norms), norms
    out["lr"] = torch.tensor(lrs, dtype=torch.float64)
    out["grad_norm"] = torch.tensor(norms, dtype=torch.float64)

    OUT.parent.mkdir(parents=True, exist_ok=True)
    # One metadata key only: safetensors writes a multi-key map in hash order (not reproducible).
    meta = {
        "source": f"scripts/make_optim_fixture.py, torch {torch.__version__}: AdamW(lr=1e-2, betas=(0.9, 0.95), "
        "eps=1e-8, weight_decay 0.1 for 2-D / 0.0 for 1-D), clip_grad_norm_(1.0), "
        "get_cosine_schedule_with_warmup(1, 10), float64"
    }
    save_file(out, str(OUT), metadata=meta)
    os.chmod(OUT, 0o644)
    print(f"wrote {OUT.relative_to(ROOT)}: lr={lrs} grad_norm={norms}")


if __name__ == "__main__":
    main()
