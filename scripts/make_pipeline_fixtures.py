#!/usr/bin/env python3
"""Write PyTorch's interleaved 1F1B orders to tests/fixtures/pipeline/torch_interleaved.json.

Run from the repository root (offline, deterministic, no process group needed):

    .venv/bin/python scripts/make_pipeline_fixtures.py

(The venv is the one of `scripts/requirements-fixtures.txt`: torch 2.15.0.)

`torch.distributed.pipelining.ScheduleInterleaved1F1B` (the schedule torchtitan runs) accepts
micro-batch counts that are not a multiple of the stages ("flexible PP"): it splits the step into
`rounds = max(1, m // p)` rounds of `m // rounds` micro-batches and needs `m % rounds == 0`.
For every (p, m, v) with 2 <= p <= 6, 1 <= m <= 13, v in (2, 3) that it accepts, this script
calls the same functions its constructor calls (`_get_warmup_ops` with `multiply_factor=2` and
`_get_1f1b_rank_ops` with its forward and backward stage indices) and stores each rank's
compute order in torch's notation: `F3` / `B3` for micro-batch 3 on the rank's chunk 0,
`F3.c1` on chunk 1 (chunk = stage index // p), the idle slots (`None`) left out.

candle-parallel/tests/pipeline_schedule.rs runs these orders through our validator with the
same unit costs as our own interleaved schedule and compares bubbles and activation peaks.
"""
import json
from pathlib import Path

import torch
from torch.distributed.pipelining import schedules as S

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "pipeline" / "torch_interleaved.json"


def rank_orders(p, m, v):
    """Each rank's compute order as ScheduleInterleaved1F1B.__init__ builds it, or None where
    the constructor raises (m not a multiple of its rounds)."""
    rounds = max(1, m // p)
    per_round = m // rounds
    if m % rounds:
        return None
    orders = []
    for rank in range(p):
        warmup = S._get_warmup_ops(rank, v, per_round, p, m, multiply_factor=2)
        total = v * m
        fwd_bwd = total - warmup
        cooldown = total - fwd_bwd

        def forward_stage(step, rank=rank):
            return ((step // per_round) % v) * p + rank

        def backward_stage(step, rank=rank, warmup=warmup):
            return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

        ops = S._get_1f1b_rank_ops(
            v, p, warmup, fwd_bwd, cooldown, rank, forward_stage, backward_stage
        )
        names = []
        for op in ops:
            if op is None:
                continue
            if op.computation_type == S._ComputationType.FORWARD:
                kind = "F"
            elif op.computation_type == S._ComputationType.FULL_BACKWARD:
                kind = "B"
            else:
                raise SystemExit(f"unexpected action {op} for p={p} m={m} v={v}")
            chunk = op.stage_index // p
            names.append(f"{kind}{op.microbatch_index}" + (f".c{chunk}" if chunk else ""))
        orders.append(names)
    return orders


def main():
    cases = []
    for p in range(2, 7):
        for m in range(1, 14):
            for v in (2, 3):
                orders = rank_orders(p, m, v)
                if orders is not None:
                    cases.append({"p": p, "m": m, "v": v, "orders": orders})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps({"torch": torch.__version__, "cases": cases}, separators=(",", ":")) + "\n"
    )
    print(f"wrote {len(cases)} cases to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
