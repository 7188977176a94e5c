#!/usr/bin/env python3
"""Build the tiny LLaMA fixtures under tests/fixtures/llama/ (offline, deterministic).

Run from the repository root:

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt && .venv/bin/python scripts/make_llama_fixtures.py

What it writes (everything is rebuilt from fixed seeds; rerunning gives byte-identical files):

* ``tests/fixtures/llama/tokenizer/``: a byte-level BPE with exactly 256 entries (``<unk>`` 0, ``<s>`` 1,
  ``</s>`` 2, ``<pad>`` 3), trained with the ``tokenizers`` library on the original prose in ``CORPUS``
  below, plus ``sample.json`` (ids of ``SAMPLE_TEXT`` without and with special tokens).
* ``tests/fixtures/llama/<name>/``: a random ``LlamaForCausalLM`` saved with ``save_pretrained`` in f32
  (``config.json``, ``generation_config.json``, ``model.safetensors`` or shards + index), and
  ``reference.safetensors`` with ``input_ids`` (2, 32) int64, ``labels`` (2, 32) int64 (= input_ids with a
  few positions set to -100), ``logits`` (2, 32, 256) f32, ``loss`` (scalar, shape []) f32 and
  ``grad.<checkpoint tensor name>`` f32 for every tensor stored in the checkpoint.
* ``tests/fixtures/llama/mha/bf16_error.json``: PyTorch's own bf16 error against f32 on mha's reference
  input (``write_bf16_error``; ``--bf16-error`` rewrites only this file).
* ``tests/fixtures/llama/README.md`` (generated: configs, sizes, measured tolerances, tokenizer sample).

References are computed in float64 and stored as float32. The checkpoint is loaded back from disk with
``LlamaForCausalLM.from_pretrained(dir, attn_implementation="eager", dtype=torch.float64)`` (so the
config is read exactly as transformers reads it), run in eval mode with ``use_cache=False``, and the steps
where transformers' own code drops to float32 even in a float64 model (RMSNorm's ``.to(float32)``, the
eager softmax's ``dtype=float32``, the RoPE cos/sin computed from float32 ``inv_freq``/positions, and the
loss' ``logits.float()``) are run in float64 instead (see ``pure_f64``). The loss is HF's causal-LM loss:
labels shifted left by one, mean cross-entropy over the positions whose shifted label is not -100.
Each reference is cross-checked against unmodified transformers in float32 and float64 (with
``labels=`` passed to the model, so HF computes the loss itself); the measured differences are asserted
and written to the README.
"""
import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
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
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "llama"
COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-fixtures.txt"
    " && .venv/bin/python scripts/make_llama_fixtures.py"
)

VOCAB = 256
BATCH, SEQ = 2, 32
INPUT_SEED = 1234
# (row, position) of labels set to -100. Position 0 is never a target after the shift, so it is not used.
IGNORED_LABELS = [(0, 3), (0, 4), (0, 17), (1, 9), (1, 30), (1, 31)]
SAMPLE_TEXT = "Hello world! The miller counts the sacks of grain."

# Shared by every model; per-fixture entries below override / extend it.
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    # No pad_token_id: it would set nn.Embedding(padding_idx=...) and zero that row's gradient.
)

# name -> (weight seed, config overrides, save kwargs, description)
FIXTURES = {
    "mha": (
        101,
        dict(num_attention_heads=4, num_key_value_heads=4,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {},
        "multi-head attention (4 heads, 4 kv heads, head_dim 8 = hidden/heads), untied, default RoPE "
        "theta 10000; also carries the tokenizer (complete HF model directory)",
    ),
    "gqa": (
        102,
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {},
        "grouped-query attention 8 heads / 2 kv heads (4:1), explicit head_dim 8 (hidden/heads would be 4: "
        "q_proj is 64x32, k/v_proj 16x32, o_proj 32x64), untied, default RoPE theta 10000",
    ),
    "tied": (
        103,
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {},
        "tie_word_embeddings=true: model.safetensors has NO lm_head.weight; the output projection is "
        "model.embed_tokens.weight and grad.model.embed_tokens.weight is the sum of both uses",
    ),
    "llama3_rope": (
        104,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}),
        {},
        "Llama 3.1 RoPE scaling (factor 8, low_freq_factor 1, high_freq_factor 4, "
        "original_max_position_embeddings 64), rope_theta 500000, GQA 4 heads / 2 kv heads, explicit "
        "head_dim 16 (hidden/heads would be 8); wavelengths 6.3 / 32.4 / 167 / 863 ... hit all three "
        "branches (kept, smoothed, divided by 8)",
    ),
    "v4_keys": (
        105,
        dict(num_attention_heads=4, num_key_value_heads=4,
             rope_parameters={"rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0}),
        {},
        "config.json rewritten by hand with the pre-v5 keys: top-level rope_theta 20000, "
        "rope_scaling {\"type\": \"linear\", \"factor\": 2.0}, torch_dtype, no dtype, no head_dim "
        "(derived: 32/4 = 8), no rope_parameters",
    ),
    "v5_keys": (
        106,
        dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
             rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
        {},
        "config.json exactly as transformers 5 writes it (rope_parameters {rope_theta 50000, rope_type "
        "default}, dtype, head_dim) with head_dim 16 != hidden/heads (8): q/k/v_proj are 64x32, o_proj 32x64",
    ),
    "yarn_rope": (
        108,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 16}),
        {},
        "YaRN (factor 4, original_max_position_embeddings 16: the 32-token inputs run past the original "
        "context; default beta_fast 32 / beta_slow 1, truncated ramp; attention factor 0.1 ln 4 + 1 "
        "multiplying cos and sin), GQA 4 / 2, head_dim 16",
    ),
    "longrope_rope": (
        109,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                              "original_max_position_embeddings": 16,
                              "short_factor": [1.0, 1.0, 1.05, 1.1, 1.3, 1.7, 2.2, 2.9],
                              "long_factor": [1.0, 1.2, 1.9, 3.5, 6.0, 11.5, 17.25, 24.0]}),
        {},
        "LongRoPE (original_max_position_embeddings 16: the 32-token inputs use the long factors; "
        "attention factor sqrt(1 + ln(256/16) / ln 16) from max_position_embeddings / original), GQA 4 / 2, "
        "head_dim 16",
    ),
    "dynamic_rope": (
        110,
        dict(num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
             rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        {},
        "dynamic NTK RoPE (factor 2) with max_position_embeddings 16: the 32-token inputs scale the base "
        "by (2 * 32 / 16 - 1) ** (8 / 6); MHA 4 heads, head_dim 8",
    ),
    "sharded": (
        101,  # same weights as `mha`
        dict(num_attention_heads=4, num_key_value_heads=4,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {"max_shard_size": "64KB"},
        "same weights and config as `mha`, saved with max_shard_size=\"64KB\": 3 safetensors shards + "
        "model.safetensors.index.json (reference identical to mha's)",
    ),
}

V4_TRANSFORMERS_VERSION = "4.44.2"  # written into v4_keys/config.json to mark it as an old-style file

# Original prose written for this repository (no third-party text); the tokenizer is trained on it.
CORPUS = """\
Hello world! This small book of notes was written for a tokenizer that only needs to learn a few
hundred pieces of text, so it talks about ordinary things in plain words.

The river that runs past the old mill is slow in summer and loud in spring. Every evening the miller
counts the sacks of grain that were brought in during the day. He writes the number on a slate by the
door, wipes his hands on his apron, and listens to the wheel turning in the dark water. When the count
is good he sings; when it is poor he is quiet, and his daughter knows to leave the lamp burning a little
longer while he checks the figures again.

On market days the road to town fills with carts. A baker carries warm loaves wrapped in cloth, a
potter balances blue bowls on a board, and two children lead a goat that refuses to walk in a straight
line. The goat stops to eat every flower it can reach. The children laugh, pull on the rope, and
promise the goat a carrot if it will only keep moving. By noon the square is full of voices: people
trade eggs for thread, apples for nails, and stories for more stories.

The lighthouse keeper on the northern point has a different rhythm. She climbs one hundred and twelve
steps at dusk, trims the wick, polishes the great lens, and writes the weather into a thick logbook:
wind from the west, light rain, three ships seen, all well. In winter the storms come quickly. Waves
break over the rocks and throw white spray against the glass, but the light keeps turning, once every
ten seconds, the same as it has done for longer than anyone in the village can remember.

A teacher in the village school asks her pupils to describe the sky. One writes that it is grey like
a pigeon. Another says it is the colour of milk that has been left out too long. A third draws a
picture instead of writing anything, a round sun with long yellow arms, and the teacher decides that
this also counts as an answer. Later they practise numbers: 1, 2, 3, 10, 42, 100, 2048. They add,
subtract, and then try to divide seven apples between three friends without cutting any of them.

In the workshop behind the school, an old clockmaker repairs watches with tools no larger than a
needle. He says that patience is the most important part of the job. "A clock does not hurry," he
tells the apprentice, "so neither should you." The apprentice nods, drops a tiny screw, and spends the
next twenty minutes searching the floor with a magnet. When the watch finally ticks again, both of them
smile as if they had just heard a piece of music.

Farmers read the clouds the way sailors read the stars. A red sky in the evening promises a fair
morning; a ring around the moon warns of rain. Some of these sayings are true and some are only
hopeful, but they are repeated every season, passed from parents to children along with seeds, fences,
and the names of the fields: the long meadow, the stony acre, the field by the well.

Numbers, names and small habits hold a place together. The baker always opens at six. The bell
rings twice on Sundays. The bridge was mended after the flood of the wet year, and the new stones are
still a lighter colour than the old ones. Visitors ask why (is it the stone, or the weather?), and the answer is always the same: give it
time, and the river will paint them all alike.

At night the village is quiet. A dog barks once, a window closes, and the only sound left is the mill
wheel turning and turning, counting water the way the miller counts grain. Tomorrow the carts will come
again, the lamp will be lit, the children will learn another page, and the light on the point will
keep sweeping the sea, patient as a clock. That's all - for now.
"""


def log(*args):
    print(*args, flush=True)


def setup_determinism():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tokenizer(out_dir: Path) -> dict:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # No initial_alphabet: the 256-byte alphabet alone would overflow a 256-entry vocabulary. Bytes that
    # never occur in CORPUS therefore map to <unk>.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator([CORPUS], trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]),
    ])

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>", pad_token="<pad>", model_max_length=256)
    out_dir.mkdir(parents=True)
    hf_tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers 5 writes "TokenizersBackend", which transformers 4 does not know; PreTrainedTokenizerFast
    # is an alias of it in v5 and the generic tokenizer.json class in v4.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    written = sorted(p.name for p in out_dir.iterdir())
    assert written == ["tokenizer.json", "tokenizer_config.json"], written

    # The ids a Rust test compares with: transformers' tokenizer(text), checked against the raw library.
    loaded = AutoTokenizer.from_pretrained(str(out_dir))
    ids = loaded(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
    ids_special = loaded(SAMPLE_TEXT)["input_ids"]
    raw = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    assert raw.encode(SAMPLE_TEXT, add_special_tokens=False).ids == ids
    assert raw.encode(SAMPLE_TEXT).ids == ids_special
    assert ids_special == [1] + ids, (ids, ids_special)
    assert loaded.decode(ids) == SAMPLE_TEXT, loaded.decode(ids)
    assert len(loaded) == VOCAB
    sample = {
        "text": SAMPLE_TEXT,
        "ids": ids,
        "ids_with_special": ids_special,
        "tokens": raw.encode(SAMPLE_TEXT, add_special_tokens=False).tokens,
    }
    (out_dir / "sample.json").write_text(json.dumps(sample, indent=2, ensure_ascii=False) + "\n")
    # A character never seen in the corpus becomes <unk> (byte-level alphabet is not complete).
    unk_ids = raw.encode("\u00e9", add_special_tokens=False).ids
    return {"sample": sample, "unk_example": unk_ids, "num_merges": len(json.loads(
        (out_dir / "tokenizer.json").read_text())["model"]["merges"])}


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

def make_model(seed: int, overrides: dict) -> LlamaForCausalLM:
    config = LlamaConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # RMSNorm weights start at 1.0; randomise them so a loader that ignores them is caught.
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
    return model.float().eval()


def write_v4_config(fixture_dir: Path):
    """Replace the v5 config.json with the pre-v5 spelling of the same settings."""
    path = fixture_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    assert rope["rope_type"] == "linear"
    cfg.pop("head_dim")
    cfg.pop("dtype")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {"factor": rope["factor"], "type": "linear"}
    cfg["torch_dtype"] = "float32"
    cfg["transformers_version"] = V4_TRANSFORMERS_VERSION
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def checkpoint_keys(fixture_dir: Path) -> list:
    index = fixture_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    with safetensors.safe_open(str(fixture_dir / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def load(fixture_dir: Path, dtype, config=None) -> LlamaForCausalLM:
    kwargs = {"config": config} if config is not None else {}
    model, info = LlamaForCausalLM.from_pretrained(
        str(fixture_dir), attn_implementation="eager", dtype=dtype, output_loading_info=True, **kwargs)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{fixture_dir}: loading problems {bad}"
    assert model.config._attn_implementation == "eager"
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Float64 forward/backward
# ----------------------------------------------------------------------------------------------

def inv_freq_f64(config, seq_len=None) -> torch.Tensor:
    """RoPE inverse frequencies in float64 (same formulas as transformers.modeling_rope_utils) for a
    forward over ``seq_len`` tokens (``max(position_ids) + 1``; None: at initialisation)."""
    rp = config.rope_parameters
    dim = config.head_dim
    arange = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv = 1.0 / (rp["rope_theta"] ** arange)
    kind = rp["rope_type"]
    if kind == "default":
        return inv
    if kind == "dynamic":
        mpe, factor = config.max_position_embeddings, rp["factor"]
        s = max(seq_len or mpe, mpe)
        base = rp["rope_theta"] * ((factor * s / mpe) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** arange)
    if kind == "yarn":
        base, factor, omp = rp["rope_theta"], rp["factor"], rp["original_max_position_embeddings"]
        beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

        def correction_dim(rotations):
            return (dim * math.log(omp / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if rp.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (inv / factor) * (1 - extrapolation) + inv * extrapolation
    if kind == "longrope":
        long = seq_len is not None and seq_len > rp["original_max_position_embeddings"]
        ext = torch.tensor(rp["long_factor" if long else "short_factor"], dtype=torch.float64)
        return inv / ext
    if kind == "linear":
        return inv / rp["factor"]
    if kind == "llama3":
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
        return torch.where(medium, smoothed, out)
    raise ValueError(f"unsupported rope_type {kind}")


@contextlib.contextmanager
def pure_f64(model):
    """Run the float64 model without transformers' internal float32 steps."""
    hits = {"norm": 0, "softmax": 0, "rope": 0}
    rms_cls, rot_cls = modeling_llama.LlamaRMSNorm, modeling_llama.LlamaRotaryEmbedding
    orig_rms, orig_rot, orig_softmax = rms_cls.forward, rot_cls.forward, torch.nn.functional.softmax

    def rms_forward(self, x):
        assert x.dtype == torch.float64
        hits["norm"] += 1
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    def rot_forward(self, x, position_ids):
        hits["rope"] += 1
        # transformers' `dynamic_rope_update`: the length of this forward, `max(position_ids) + 1`.
        inv_freq = inv_freq_f64(self.config, int(position_ids.max()) + 1)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if input.dtype == torch.float64 and dtype == torch.float32:
            hits["softmax"] += 1
            dtype = torch.float64
        return orig_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    rms_cls.forward, rot_cls.forward, torch.nn.functional.softmax = rms_forward, rot_forward, softmax
    try:
        yield hits
    finally:
        rms_cls.forward, rot_cls.forward, torch.nn.functional.softmax = orig_rms, orig_rot, orig_softmax


def causal_lm_loss(logits, labels):
    """transformers' ForCausalLMLoss without the float32 upcast: shift, then mean CE ignoring -100."""
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100)


def run(model, input_ids, labels, keys, hf_loss: bool):
    model.zero_grad(set_to_none=True)
    if hf_loss:
        out = model(input_ids=input_ids, labels=labels, use_cache=False)
        logits, loss = out.logits, out.loss
    else:
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss = causal_lm_loss(logits, labels)
    loss.backward()
    params = dict(model.named_parameters())
    assert sorted(params) == keys, (sorted(params), keys)
    grads = {k: params[k].grad.detach().clone() for k in keys}
    return logits.detach(), loss.detach(), grads


def rel_err(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def compare(name, got, ref):
    """Max relative errors (max-abs / max|ref|) of logits, loss and the worst gradient."""
    lg, ls, gr = got
    rl, rs, rg = ref
    worst = max(gr, key=lambda k: rel_err(gr[k], rg[k]))
    return {"logits": rel_err(lg, rl), "loss": rel_err(ls, rs), "grad": rel_err(gr[worst], rg[worst]),
            "grad_worst": worst}


def make_inputs():
    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    labels = input_ids.clone()
    for r, c in IGNORED_LABELS:
        labels[r, c] = -100
    return input_ids, labels


def check_config(name, config, overrides):
    rp = config.rope_parameters
    want = overrides["rope_parameters"]
    for k, v in want.items():
        assert rp[k] == v, (name, k, rp[k], v)
    hd = overrides.get("head_dim", BASE["hidden_size"] // overrides["num_attention_heads"])
    assert config.head_dim == hd, (name, config.head_dim, hd)
    assert config.num_key_value_heads == overrides["num_key_value_heads"]
    assert config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)


def build_fixture(name, input_ids, labels):
    seed, overrides, save_kwargs, _ = FIXTURES[name]
    d = OUT / name
    model = make_model(seed, overrides)
    model.save_pretrained(str(d), **save_kwargs)
    if name == "v4_keys":
        write_v4_config(d)
    keys = checkpoint_keys(d)
    has_lm_head = "lm_head.weight" in keys
    assert has_lm_head == (not overrides.get("tie_word_embeddings", False)), (name, keys)

    # Reference: float64 from the files on disk.
    m64 = load(d, torch.float64)
    check_config(name, m64.config, overrides)
    with pure_f64(m64) as hits:
        ref = run(m64, input_ids, labels, keys, hf_loss=False)
    layers = BASE["num_hidden_layers"]
    assert hits == {"norm": 2 * layers + 1, "softmax": layers, "rope": 1}, hits
    logits, loss, grads = ref
    assert torch.isfinite(logits).all() and torch.isfinite(loss)

    # The f64 inverse frequencies agree with transformers' own (float32) ones.
    m32 = load(d, torch.float32)
    hf_inv = m32.model.rotary_emb.inv_freq.double()
    assert ((hf_inv - inv_freq_f64(m64.config)).abs() / inv_freq_f64(m64.config)).max() < 1e-6

    # Cross-checks against unmodified transformers (HF computes the loss itself from labels=).
    stock32 = compare(name, run(m32, input_ids, labels, keys, hf_loss=True), ref)
    stock64 = compare(name, run(load(d, torch.float64), input_ids, labels, keys, hf_loss=True), ref)
    assert stock64["logits"] < 1e-6 and stock64["loss"] < 1e-6 and stock64["grad"] < 1e-5, stock64
    assert stock32["logits"] < 1e-5 and stock32["loss"] < 1e-5 and stock32["grad"] < 1e-4, stock32

    extra = {}
    if name == "v4_keys":
        # The hand-written old-style config must mean exactly the v5 settings it replaces ...
        v5_equiv = LlamaConfig(**BASE, **overrides)
        v5_equiv._attn_implementation = "eager"
        same = load(d, torch.float32, config=v5_equiv)
        same_logits = same(input_ids=input_ids, use_cache=False).logits.detach()
        assert torch.equal(same_logits, m32(input_ids=input_ids, use_cache=False).logits.detach())
        # ... and the linear scaling must matter.
        plain = dict(overrides, rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
        unscaled_cfg = LlamaConfig(**BASE, **plain)
        unscaled = load(d, torch.float32, config=unscaled_cfg)
        unscaled_logits = unscaled(input_ids=input_ids, use_cache=False).logits.detach().double()
        extra["unscaled_rel_diff"] = rel_err(unscaled_logits, logits)
        assert extra["unscaled_rel_diff"] > 1e-3, extra
        raw = json.loads((d / "config.json").read_text())
        assert "head_dim" not in raw and "rope_parameters" not in raw and "dtype" not in raw
        extra["loaded_rope_parameters"] = dict(m64.config.rope_parameters)
    if name == "llama3_rope":
        inv = inv_freq_f64(m64.config)
        base_inv = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
        ratio = (base_inv / inv).tolist()
        assert ratio[0] == 1.0 and 1.0 < ratio[1] < 8.0 and all(abs(r - 8.0) < 1e-12 for r in ratio[2:]), ratio
        extra["inv_freq_ratio"] = ratio

    tensors = {"input_ids": input_ids, "labels": labels,
               "logits": logits.float().contiguous(), "loss": loss.float().reshape(())}
    for k in keys:
        tensors[f"grad.{k}"] = grads[k].float().contiguous()
    # A single metadata key: safetensors writes the metadata map in hash order, so more keys would make
    # the file bytes differ from run to run.
    save_file(tensors, str(d / "reference.safetensors"), metadata={"format": "pt"})
    files = sorted(p.name for p in d.iterdir())
    return {
        "name": name, "keys": keys, "has_lm_head": has_lm_head, "files": files,
        "max_abs_logit": logits.abs().max().item(), "logit_std": logits.std().item(),
        "loss": loss.item(), "stock32": stock32, "stock64": stock64, "extra": extra,
        "config": json.loads((d / "config.json").read_text()),
        "num_params": sum(p.numel() for p in m64.parameters()),
        "num_targets": int((F.pad(labels, (0, 1), value=-100)[..., 1:] != -100).sum()),
    }


# ----------------------------------------------------------------------------------------------
# README
# ----------------------------------------------------------------------------------------------

def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# Checks of checkpoints written by `cpl` (run by hand; results recorded here, not recomputed).
TRAINED_CHECKPOINT_CHECKS = "A checkpoint that `cpl train` wrote after training is checked against cpl's own logits:\n\n```sh\ncpl train --model tests/fixtures/llama/mha --tokens tests/fixtures/llama/tokens.json --seq-len 8 \\\n    --steps 5 --warmup 1 --lr 1e-2 --min-lr 1e-3 --grad-accum 1 --ranks 4 --tp 2 --ring 2 \\\n    --zero 3 --checkpointing selective --out /tmp/tck\ncpl eval --model /tmp/tck/step-5 --tokens tests/fixtures/llama/tokens.json --logits-out /tmp/tck/logits.safetensors\n.venv/bin/python scripts/check_trained_checkpoint.py /tmp/tck/step-5 tests/fixtures/llama/tokens.json /tmp/tck/logits.safetensors\n```\n\nResults (2026-11-23, transformers 5.23.0, torch 2.15.0, CPU):\n\n| checkpoint | written by | check | result |\n|---|---|---|---|\n| `mha` saved under tp2 as 4 sharded files + index, f32 | `tests/llama_reference.rs` (`target/tmp/saved-mha-tp2`) | `check_hf_roundtrip.py`, rtol 1e-4 | OK 9.8e-7 |\n| the same saved in bf16 | `target/tmp/saved-mha-tp2-bf16` | `check_hf_roundtrip.py`, rtol 2e-2 (bf16 weights) | OK 1.8e-2 |\n| `mha` after 5 steps of `cpl train` at tp2 x ring2, ZeRO-3, selective checkpointing | the commands above | `check_trained_checkpoint.py`, rtol 1e-4 | OK 8.2e-7 |\n\nThese need the 5.6 GB PyTorch stack, so CI does not run them; the Rust tests check the same\ndirectories reload in `cpl` with the same logits (`tests/llama_reference.rs`)."


def write_readme(results, tok_info):
    lines = []
    w = lines.append
    w("# Tiny LLaMA fixtures (generated)")
    w("")
    w("Generated by `scripts/make_llama_fixtures.py` (do not edit by hand; rerun the script). From the")
    w("repository root:")
    w("")
    w("```sh")
    w(COMMAND)
    w("```")
    w("")
    w(f"Versions: torch {torch.__version__}, transformers {transformers.__version__}, safetensors "
      f"{safetensors.__version__}, tokenizers {tokenizers.__version__}, numpy {np.__version__} "
      "(pinned in `scripts/requirements-fixtures.txt`). Offline, CPU, fixed seeds, one thread, "
      "`torch.use_deterministic_algorithms(True)`: rerunning reproduces every file byte for byte.")
    w("")
    w("## Models")
    w("")
    w("Random `LlamaForCausalLM` checkpoints saved with `save_pretrained` in float32 (`config.json`,")
    w("`generation_config.json`, `model.safetensors` or shards + `model.safetensors.index.json`). Common")
    w(f"settings: vocab_size {BASE['vocab_size']}, hidden_size {BASE['hidden_size']}, intermediate_size "
      f"{BASE['intermediate_size']}, {BASE['num_hidden_layers']} layers, max_position_embeddings "
      f"{BASE['max_position_embeddings']}, rms_norm_eps {BASE['rms_norm_eps']}, silu, no biases, "
      f"bos 1, eos 2, no pad_token_id. Weights: normal(0, {BASE['initializer_range']}) "
      "(initializer_range), RMSNorm weights uniform(0.5, 1.5) (not 1.0, so ignoring them is caught).")
    w("")
    w("| fixture | heads / kv heads / head_dim | rope | tied | params | files | max abs logit | loss |")
    w("|---|---|---|---|---|---|---|---|")
    for r in results:
        c = r["config"]
        rope = c.get("rope_parameters") or dict(c.get("rope_scaling") or {}, rope_theta=c.get("rope_theta"))
        rope_s = ", ".join(f"{k}={v}" for k, v in sorted(rope.items()))
        hd = c.get("head_dim", "(absent: 8)")
        w(f"| `{r['name']}` | {c['num_attention_heads']} / {c['num_key_value_heads']} / {hd} | {rope_s} | "
          f"{c['tie_word_embeddings']} | {r['num_params']} | {', '.join(r['files'])} | "
          f"{r['max_abs_logit']:.3f} | {r['loss']:.5f} |")
    w("")
    for r in results:
        w(f"- `{r['name']}`: {FIXTURES[r['name']][3]}.")
    w("")
    w("Config notes (transformers 5.23):")
    w("")
    w("- transformers 5 writes `rope_parameters` (always with `rope_theta` and `rope_type`, plus the scaling")
    w("  keys: linear `factor`; llama3 `factor`, `low_freq_factor`, `high_freq_factor`,")
    w("  `original_max_position_embeddings`), `dtype` (not `torch_dtype`) and an explicit `head_dim`, and")
    w("  never top-level `rope_theta` / `rope_scaling`.")
    r4 = next(r for r in results if r["name"] == "v4_keys")
    w("- It still reads the old keys: `v4_keys` loads with `rope_parameters` = "
      f"`{json.dumps(r4['extra']['loaded_rope_parameters'], sort_keys=True)}` (the old `type` key is kept "
      "next to the new `rope_type`, and is written back if the config is saved again), `torch_dtype` is "
      "accepted as `dtype`, and the missing `head_dim` becomes hidden/heads. The script checks that these "
      "logits equal (bit for bit) those of the same weights with the equivalent v5 config, and that without "
      f"the linear scaling they differ (max rel diff {r4['extra']['unscaled_rel_diff']:.3g}).")
    w("- Tied checkpoints contain no `lm_head.weight`; `tie_word_embeddings: true` is in config.json.")
    w("- A loader should accept both spellings, `rope_scaling.type` as well as `rope_type`, and derive")
    w("  head_dim = hidden_size / num_attention_heads only when `head_dim` is absent.")
    w("")
    w("## reference.safetensors")
    w("")
    w(f"Per fixture: `input_ids` ({BATCH}, {SEQ}) int64 (uniform over 0..{VOCAB}, seed {INPUT_SEED}, the same "
      f"for every fixture), `labels` ({BATCH}, {SEQ}) int64 = input_ids with (row, position) "
      f"{IGNORED_LABELS} set to -100, `logits` ({BATCH}, {SEQ}, {VOCAB}) float32, `loss` float32 of shape [] "
      "(scalar), and `grad.<name>` float32 for every tensor name in the checkpoint (e.g. "
      "`grad.model.embed_tokens.weight`, `grad.model.layers.0.self_attn.q_proj.weight`, "
      "`grad.model.layers.1.mlp.down_proj.weight`, `grad.model.norm.weight`, `grad.lm_head.weight`; "
      "tied: no `grad.lm_head.weight`, the embedding gradient includes the output projection's part).")
    w("")
    w("`loss` is transformers' causal-LM loss for `labels`: targets are labels shifted left by one (the last "
      f"position has none), mean cross-entropy over the non-ignored targets ({results[0]['num_targets']} of "
      f"{BATCH * SEQ}). Gradients are of that loss. Eval mode, `attn_implementation=\"eager\"`, "
      "`use_cache=False`, no attention mask (all ones), positions 0..31.")
    w("")
    w("Computed in float64 and stored as float32: the checkpoint is loaded with `dtype=torch.float64`, and")
    w("the steps where transformers itself computes in float32 inside a float64 model (RMSNorm, eager")
    w("softmax, RoPE cos/sin, the loss' `logits.float()`) run in float64. Measured max relative error")
    w("(max |x - ref| / max |ref|, worst gradient tensor) of unmodified transformers against the reference:")
    w("")
    w("| fixture | HF f32 logits | HF f32 loss | HF f32 grad (worst) | HF f64 logits | HF f64 grad |")
    w("|---|---|---|---|---|---|")
    for r in results:
        s, t = r["stock32"], r["stock64"]
        w(f"| `{r['name']}` | {s['logits']:.1e} | {s['loss']:.1e} | {s['grad']:.1e} (`{s['grad_worst']}`) | "
          f"{t['logits']:.1e} | {t['grad']:.1e} |")
    w("")
    w("An f32 implementation that matches transformers should reach errors of the same order as the f32 "
      "column (tolerances around 1e-5 for logits and 1e-4 for gradients leave margin).")
    w("")
    w("## Tokenizer")
    w("")
    w(f"`tokenizer/` (also copied into `mha/`): byte-level BPE, exactly {VOCAB} entries: `<unk>` 0, `<s>` 1 "
      f"(bos), `</s>` 2 (eos), `<pad>` 3, the bytes seen in the training text, and {tok_info['num_merges']} "
      "merges. Trained offline with the `tokenizers` library on original prose embedded in the script "
      "(CORPUS). ByteLevel pre-tokenizer (GPT-2 regex, no prefix space) and decoder; the post-processor adds "
      "`<s>` in front (no `</s>`). Because the 256-entry vocabulary cannot hold the full 256-byte alphabet "
      "plus merges, bytes absent from the corpus encode as `<unk>` (e.g. \"\u00e9\" -> "
      f"{tok_info['unk_example']}). `tokenizer_config.json` names `PreTrainedTokenizerFast` (an alias of "
      "transformers 5's `TokenizersBackend`, and understood by transformers 4).")
    w("")
    s = tok_info["sample"]
    w(f"`tokenizer/sample.json`: `tokenizer({json.dumps(s['text'])})` in transformers gives")
    w("")
    w(f"- ids without special tokens: `{s['ids']}`")
    w(f"- ids with special tokens: `{s['ids_with_special']}`")
    w(f"- tokens: `{s['tokens']}`")
    w("")
    w("## Checking a checkpoint written by Rust")
    w("")
    w("```sh")
    w(".venv/bin/python scripts/check_hf_roundtrip.py OUT_DIR tests/fixtures/llama/mha")
    w("```")
    w("")
    w("loads OUT_DIR with `LlamaForCausalLM.from_pretrained`, runs the reference `input_ids`, and requires "
      "max |logits - ref| / max |ref| <= 1e-4; it prints `OK <err>` or exits non-zero.")
    w("")
    w(TRAINED_CHECKPOINT_CHECKS)
    w("")
    w("## Sizes (bytes)")
    w("")
    total = 0
    for sub in sorted(p for p in OUT.iterdir() if p.is_dir()):
        b = dir_bytes(sub)
        total += b
        w(f"- `{sub.name}/`: {b}")
    w(f"- total without this README: {total}")
    w("")
    (OUT / "README.md").write_text("\n".join(lines))


def write_bf16_error(fixture_dir: Path) -> dict:
    """PyTorch's own bf16 error against f32 on a fixture's reference input, written to
    ``bf16_error.json``: the model in float32 and cast to bfloat16 (parameters, activations and
    gradients in bf16, the loss as transformers computes it); the max-norm relative error of the
    loss, the logits, every parameter's gradient and the worst gradient. The yardstick of cpl's
    bf16 test (tests/llama_layouts.rs, bf16_matches_f32_under_every_layout)."""
    ref = load_file(str(fixture_dir / "reference.safetensors"))
    input_ids, labels = ref["input_ids"], ref["labels"]
    keys = checkpoint_keys(fixture_dir)
    f32 = run(load(fixture_dir, torch.float32), input_ids, labels, keys, hf_loss=True)
    bf16 = run(load(fixture_dir, torch.float32).to(torch.bfloat16), input_ids, labels, keys,
               hf_loss=True)
    grads = {k: rel_err(bf16[2][k].float(), f32[2][k]) for k in keys}
    out = {
        "what": f"PyTorch bf16 vs f32 on {fixture_dir.name} (scripts/make_llama_fixtures.py), "
                f"torch {torch.__version__}",
        "loss": rel_err(bf16[1].float(), f32[1]),
        "logits": rel_err(bf16[0].float(), f32[0]),
        "worst_grad": max(grads.values()),
        "grads": grads,
    }
    (fixture_dir / "bf16_error.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return out


def main():
    if sys.argv[1:] == ["--bf16-error"]:
        setup_determinism()
        out = write_bf16_error(OUT / "mha")
        log({k: v for k, v in out.items() if k != "grads"})
        return 0
    setup_determinism()
    names = list(FIXTURES) + ["tokenizer"]
    OUT.mkdir(parents=True, exist_ok=True)
    for n in names:
        if (OUT / n).exists():
            shutil.rmtree(OUT / n)
    tok_info = build_tokenizer(OUT / "tokenizer")
    log("tokenizer:", tok_info["sample"])

    input_ids, labels = make_inputs()
    results = []
    for name in FIXTURES:
        r = build_fixture(name, input_ids, labels)
        results.append(r)
        log(f"{name}: files={r['files']} max|logit|={r['max_abs_logit']:.4f} loss={r['loss']:.6f} "
            f"hf32={r['stock32']} hf64={r['stock64']} {r['extra']}")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(OUT / "tokenizer" / f, OUT / "mha" / f)
    # mha (with tokenizer) loads as a complete model directory.
    assert AutoTokenizer.from_pretrained(str(OUT / "mha"))(SAMPLE_TEXT)["input_ids"] == \
        tok_info["sample"]["ids_with_special"]

    ref_mha = load_file(str(OUT / "mha" / "reference.safetensors"))
    ref_sh = load_file(str(OUT / "sharded" / "reference.safetensors"))
    assert ref_mha.keys() == ref_sh.keys() and all(torch.equal(ref_mha[k], ref_sh[k]) for k in ref_mha)

    write_bf16_error(OUT / "mha")
    write_readme(results, tok_info)
    digest = hashlib.sha256()
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            digest.update(str(p.relative_to(OUT)).encode() + b"\0" + p.read_bytes())
    log(f"wrote {OUT} ({dir_bytes(OUT)} bytes), sha256 of all files {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
