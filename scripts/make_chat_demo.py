#!/usr/bin/env python3
"""Builds the bundled fine-tuning demo data (`assets/chat/`) from the bundled Shakespeare corpus.

Only the standard library; deterministic (rerunning reproduces the files byte for byte). From the
repository root: `python3 scripts/make_chat_demo.py`.

- `dialogue.jsonl`: chat examples in OpenAI `messages` form. Each takes two consecutive speeches
  of a play: the first, with its speaker, is the user turn; the reply of the next speaker is the
  assistant turn; a system prompt names the play and the replying character.
- `dialogue-dpo.jsonl`: preference pairs (`prompt`, `chosen`, `rejected`): the chosen reply is
  the next speech, the rejected one a speech of the same length class drawn from another play.
"""
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "assets/default/corpus/shakespeare.jsonl"
OUT = ROOT / "assets/chat"
SPEAKER = re.compile(r"^([A-Z][A-Za-z]{1,12}(?: [A-Z][A-Za-z]{1,12})?)\.$")
SFT_PER_PLAY = 24
DPO_PER_PLAY = 12


def speeches(text):
    """(speaker, speech) pairs: a line `Ham.` followed by the lines up to the next blank line."""
    out = []
    blocks = text.split("\n\n")
    for b in blocks:
        lines = b.strip().split("\n")
        if len(lines) < 2:
            continue
        m = SPEAKER.match(lines[0].strip())
        if not m:
            continue
        speech = " ".join(l.strip() for l in lines[1:] if not l.strip().startswith("["))
        if 3 <= len(speech.split()) <= 40:
            out.append((m.group(1), speech))
    return out


def main():
    rng = random.Random(20261124)
    plays = [json.loads(l) for l in CORPUS.read_text().splitlines() if l.strip()]
    sft, dpo, by_play = [], [], []
    for play in plays:
        sp = speeches(play["text"])
        pairs = [(a, b) for a, b in zip(sp, sp[1:]) if a[0] != b[0]]
        by_play.append((play["title"], pairs))
    for i, (title, pairs) in enumerate(by_play):
        if len(pairs) < SFT_PER_PLAY + DPO_PER_PLAY:
            continue
        chosen = rng.sample(pairs, SFT_PER_PLAY + DPO_PER_PLAY)
        for (who, said), (replier, reply) in chosen[:SFT_PER_PLAY]:
            sft.append({"messages": [
                {"role": "system", "content": f"You are {replier} in {title}."},
                {"role": "user", "content": f"{who}: {said}"},
                {"role": "assistant", "content": reply},
            ]})
        others = [p for j, (_, ps) in enumerate(by_play) if j != i for p in ps]
        for (who, said), (replier, reply) in chosen[SFT_PER_PLAY:]:
            _, (_, wrong) = rng.choice(others)
            dpo.append({
                "prompt": [
                    {"role": "system", "content": f"You are {replier} in {title}."},
                    {"role": "user", "content": f"{who}: {said}"},
                ],
                "chosen": reply,
                "rejected": wrong,
            })
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "dialogue.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in sft))
    (OUT / "dialogue-dpo.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in dpo))
    print(f"{len(sft)} chat examples, {len(dpo)} preference pairs -> {OUT}")


if __name__ == "__main__":
    main()
