#!/usr/bin/env python3
"""Build tests/fixtures/moe/topk.json: what PyTorch's CPU `torch.topk` returns on rows full of ties
(offline, deterministic; the reference of `candle_parallel::nn::topk`, which a mixture of experts'
router uses so that it routes every token as transformers does).

Run from the repository root (the venv of scripts/requirements-fixtures.txt):

    .venv/bin/python scripts/make_topk_fixture.py

`torch.topk` breaks ties by no rule of its own: ATen's CPU kernel (`topk_impl_loop`) runs libstdc++'s
`std::nth_element` (then `std::sort` of the first k - 1) or, when 64 k <= n, `std::partial_sort`, with a
comparator that looks at the values alone (NaN largest), so the order of equal values is what those
algorithms leave. Router probabilities tie whenever router logits do, which is common in bf16.

Rows: for every n in N and every k <= n in K, ROWS rows of n values drawn from 2, 3, 5 or 50 levels
(multiples of 0.25), some with a NaN; and organ-pipe rows (ORGAN), on which introselect exhausts its
depth limit and falls back to heap select. Stored as {"n", "k", "codes", "indices"}: the values are
0.25 * code (code null: NaN) and `indices` is torch.topk(row, k).indices (largest, sorted).
"""
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "moe" / "topk.json"
N = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 60, 64, 100, 128, 129, 256]
K = [1, 2, 3, 4, 6, 8, 16, 20]
ROWS = 8
ORGAN = [(31, 8), (90, 8), (91, 8), (126, 8), (168, 84), (174, 87), (178, 8), (180, 4), (180, 90),
         (183, 4), (183, 91)]


def main():
    torch.set_num_threads(1)
    rng = random.Random(20261129)
    cases = []
    for n in N:
        for k in sorted({*K, n}):
            if k > n:
                continue
            for t in range(ROWS):
                levels = rng.choice([2, 3, 5, 50])
                codes = [rng.randrange(levels) for _ in range(n)]
                if t % 5 == 4:
                    codes[rng.randrange(n)] = None
                row = torch.tensor([float("nan") if c is None else 0.25 * c for c in codes], dtype=torch.float32)
                cases.append({"n": n, "k": k, "codes": codes, "indices": torch.topk(row, k).indices.tolist()})
    # Organ-pipe rows (rising then falling): introselect's median-of-three pivots go wrong on them
    # until its depth limit (2 floor(log2 n)) sends it to heap select, the path random rows never
    # take; (n, k) pairs where that happens.
    for n, k in ORGAN:
        codes = list(range(n // 2)) + list(range(n - n // 2, 0, -1))
        row = torch.tensor([0.25 * c for c in codes], dtype=torch.float32)
        cases.append({"n": n, "k": k, "codes": codes, "indices": torch.topk(row, k).indices.tolist(),
                      "organ": True})
    doc = {"generator": "scripts/make_topk_fixture.py", "torch": torch.__version__, "cases": cases}
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}: {len(cases)} rows, {OUT.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
