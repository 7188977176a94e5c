"""By hand: TensorBoard's own reader loads a `cpl train --tensorboard` directory.

    .venv/bin/pip install tensorboard   # not pinned in the fixture requirements: a check only
    cpl train --steps 4 --eval-every 2 --tensorboard --out /tmp/tbrun
    .venv/bin/python scripts/check_tensorboard.py /tmp/tbrun

Asserts that every scalar of metrics.jsonl (train/<key>) and eval.jsonl (eval/<key>) is in the
event files at its step with its value (as float32), and that the command line is a text summary.
"""
import json
import sys
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

out = Path(sys.argv[1])
acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
checked = 0
for name, prefix in [("metrics.jsonl", "train"), ("eval.jsonl", "eval")]:
    for line in (out / name).read_text().splitlines():
        rec = json.loads(line)
        for key, value in rec.items():
            if key == "step" or not isinstance(value, (int, float)):
                continue
            events = {e.step: e.value for e in acc.Scalars(f"{prefix}/{key}")}
            got = events[rec["step"]]
            assert got == np.float32(value), (prefix, key, rec["step"], got, value)
            checked += 1
texts = tags.get("tensors", [])
assert "run/command" in texts, tags
command = acc.Tensors("run/command")[0].tensor_proto.string_val[0].decode()
assert "--tensorboard" in command, command
print(f"ok: {checked} scalars equal metrics.jsonl/eval.jsonl; text tags {texts}")
