#!/usr/bin/env python3
"""Build the tiny LLaVA (vision-language) fixtures under tests/fixtures/llava/ (offline, deterministic).

Run from the repository root:

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-llava.txt && .venv/bin/python scripts/make_llava_fixtures.py

What it writes (everything is rebuilt from fixed seeds; rerunning gives byte-identical files):

* ``images/``: ``a.png`` (32x32), ``b.png`` (48 wide x 40 high), ``c.jpg`` (40x40, JPEG 4:4:4), drawn with numpy.
* ``clip/`` and ``siglip/``: random ``LlavaForConditionalGeneration`` checkpoints (CLIP resp. SigLIP vision tower,
  2-layer GELU projector, LLaMA text model) saved with ``save_pretrained`` in f32, with the tokenizer (the
  ``tests/fixtures/llama/tokenizer`` BPE plus an ``<image>`` special token, id 256), ``processor_config.json``
  (LlavaProcessor) and ``preprocessor_config.json`` (the image processor alone), and ``reference.safetensors``.
* ``clip_v4_keys/`` and ``clip_v5_keys/``: the ``clip`` weights rewritten with other key layouts (same config).
* ``README.md`` (generated: versions, files, tensors, conventions, measured cross-checks).

References are computed with unmodified transformers in float32 (CPU, eager attention, eval mode, one thread) and
cross-checked against a float64 run (where transformers' own float32 steps are also run in float64), against
``attn_implementation="sdpa"``, against transformers' own loss, and against a run with the vision tower frozen.
"""
import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import PIL  # noqa: E402
import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoProcessor,
    AutoTokenizer,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    SiglipImageProcessorPil,
    SiglipVisionConfig,
)
from transformers.activations import ACT2FN  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_llama_fixtures as mlf  # noqa: E402  (pure_f64: float64 RMSNorm / RoPE / softmax)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "llava"
TOKENIZER_SRC = ROOT / "tests" / "fixtures" / "llama" / "tokenizer"
COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-llava.txt"
    " && .venv/bin/python scripts/make_llava_fixtures.py"
)

TEXT_VOCAB = 260  # tokenizer has 257 entries (256 BPE + <image>); 260 leaves 3 unused rows
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 256
SEQ = 64
IMAGE_NAMES = ["a", "b", "c"]
KEPT_LAYOUTS = ("clip_v4_keys",)
IMAGE_FILES = {"a": "a.png", "b": "b.png", "c": "c.jpg"}
# Sample 0 has image a, sample 1 has images b then c (the order of pixel_values).
PROMPTS = [
    "the miller: <image>\nwhat is in the picture? answer:",
    "the keeper: <image> and <image>\nwhich one is the mill? answer:",
]
ANSWERS = [
    " the river that runs past the old mill is slow in summer and loud in spring. every evening the miller "
    "counts the sacks of grain.",
    " the lighthouse on the northern point, with the light turning once every ten seconds.",
]

TEXT = dict(
    vocab_size=TEXT_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
    eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.2,
)

MODELS = {
    "clip": dict(
        seed=201,
        vision=lambda: CLIPVisionConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=32),
        llava=dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
        image_processor=lambda: CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, resample=3, do_resize=True,
            do_center_crop=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True),
        num_additional_image_tokens=1,
    ),
    "siglip": dict(
        seed=202,
        vision=lambda: SiglipVisionConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False),
        llava=dict(vision_feature_layer=-1, vision_feature_select_strategy="full"),
        image_processor=lambda: SiglipImageProcessorPil(
            size={"height": 32, "width": 32}, resample=2, do_resize=True, do_rescale=True, rescale_factor=1 / 255,
            do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_convert_rgb=True),
        num_additional_image_tokens=0,
    ),
}


def log(*args):
    print(*args, flush=True)


def setup_determinism():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def rel_err(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------

def draw(width, height, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 255 * x / (width - 1)
    g = 255 * y / (height - 1)
    b = 127.5 + 127.5 * np.sin(2 * np.pi * (x + 2 * y) / 11.0)
    img = np.stack([r, g, b], axis=-1)
    # A checkerboard of 4-pixel cells darkening one channel, a bright diagonal line and a little noise.
    checker = ((x // 4 + y // 4) % 2 == 0)
    img[..., 0] = np.where(checker, img[..., 0] * 0.6, img[..., 0])
    img[np.abs(x - y * width / height) < 1.0] = [250, 250, 30]
    img += rng.normal(0, 6, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def make_images(d: Path):
    d.mkdir(parents=True)
    Image.fromarray(draw(32, 32, 11), "RGB").save(d / "a.png", optimize=False)
    Image.fromarray(draw(48, 40, 12), "RGB").save(d / "b.png", optimize=False)
    Image.fromarray(draw(40, 40, 13), "RGB").save(d / "c.jpg", quality=90, subsampling=0, optimize=False)
    images = {n: Image.open(d / IMAGE_FILES[n]) for n in IMAGE_NAMES}
    for im in images.values():
        im.load()
    return images


# ----------------------------------------------------------------------------------------------
# Tokenizer / processor
# ----------------------------------------------------------------------------------------------

def make_tokenizer():
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_SRC))
    assert len(tok) == 256
    added = tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    assert added == 1 and len(tok) == 257
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    return tok


def fix_tokenizer_config(d: Path):
    p = d / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # same convention as tests/fixtures/llama/tokenizer
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

def is_norm_weight(name):
    return name.endswith(("norm.weight", "layrnorm.weight", "layer_norm1.weight", "layer_norm2.weight"))


def make_model(name):
    spec = MODELS[name]
    config = LlavaConfig(vision_config=spec["vision"](), text_config=LlamaConfig(**TEXT),
                         image_token_index=IMAGE_TOKEN_ID, projector_hidden_act="gelu", image_seq_length=16,
                         multimodal_projector_bias=True, tie_word_embeddings=False, **spec["llava"])
    torch.manual_seed(spec["seed"])
    model = LlavaForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(spec["seed"] + 1000)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if is_norm_weight(n):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif n.endswith("bias"):
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.1, generator=gen))
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.2, generator=gen))
    return model.float().eval()


def file_keys(d: Path):
    with safetensors.safe_open(str(d / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def load(d: Path, dtype=torch.float32, attn="eager"):
    model, info = LlavaForConditionalGeneration.from_pretrained(
        str(d), attn_implementation=attn, dtype=dtype, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{d}: loading problems {bad}"
    return model.eval()


def inmemory_to_saved(name):
    """transformers 5.23 save_pretrained's key for an in-memory parameter name (reverse of the llava mapping)."""
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model."):]
    assert name.startswith(("model.vision_tower.", "model.multi_modal_projector.")), name
    return name[len("model."):]


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

def make_inputs(processor, images):
    texts = [PROMPTS[i] + ANSWERS[i] for i in range(2)]
    imgs = [images["a"], images["b"], images["c"]]
    enc = processor(text=texts, images=imgs, padding=False, return_tensors=None)
    ids = [list(x) for x in enc["input_ids"]]
    prompt_enc = processor(text=PROMPTS, images=imgs, padding=False, return_tensors=None)
    prompt_lens = [len(x) for x in prompt_enc["input_ids"]]
    for i in range(2):
        assert ids[i][:prompt_lens[i]] == list(prompt_enc["input_ids"][i]), "prompt is not a prefix"
        assert len(ids[i]) >= SEQ, (i, len(ids[i]))
    input_ids = torch.tensor([x[:SEQ] for x in ids], dtype=torch.int64)
    n_img = (input_ids == IMAGE_TOKEN_ID).sum(1).tolist()
    assert n_img == [16, 32], n_img
    pixel_values = torch.as_tensor(np.asarray(enc["pixel_values"]))
    assert pixel_values.shape == (3, 3, 32, 32) and pixel_values.dtype == torch.float32
    # Shifted labels: target of position i is input_ids[i+1]; -100 for the last position, for targets inside
    # the prompt (which contains every image token) and for image-token targets.
    labels = torch.full_like(input_ids, -100)
    for b in range(2):
        for i in range(SEQ - 1):
            t = input_ids[b, i + 1].item()
            if i + 1 >= prompt_lens[b] and t != IMAGE_TOKEN_ID:
                labels[b, i] = t
    assert ((labels == IMAGE_TOKEN_ID).sum() == 0)
    return input_ids, pixel_values, labels, prompt_lens, [list(x) for x in prompt_enc["input_ids"]]


def image_debug(processor, images):
    """Per image: decoded uint8 (H, W, 3), resized(+cropped) uint8 (3, 32, 32), pixel_values (3, 32, 32)."""
    ip = processor.image_processor
    out = {}
    for n in IMAGE_NAMES:
        im = images[n]
        decoded = np.asarray(im.convert("RGB"))
        chw = np.moveaxis(decoded, -1, 0)
        size = ip.size
        resized = ip.resize(chw, size=size, resample=ip.resample)
        if getattr(ip, "do_center_crop", False):
            resized = ip.center_crop(resized, ip.crop_size)
        assert resized.dtype == np.uint8 and resized.shape == (3, 32, 32), (resized.dtype, resized.shape)
        x = resized.astype(np.float64) * ip.rescale_factor
        x = x.astype(np.float32)
        mean = np.array(ip.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(ip.image_std, dtype=np.float32)[:, None, None]
        manual = (x - mean) / std
        pv = ip(images=im, return_tensors="pt")["pixel_values"][0]
        assert np.array_equal(manual, pv.numpy()), n
        out[n] = (decoded.copy(), np.ascontiguousarray(resized), pv.contiguous())
    return out


# ----------------------------------------------------------------------------------------------
# Forward / backward
# ----------------------------------------------------------------------------------------------

def loss_from_logits(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def forward(model, input_ids, pixel_values, labels, keymap, backward=True):
    """Returns dict of tensors (detached) and grads keyed by saved-file key."""
    model.zero_grad(set_to_none=True)
    cfg = model.config
    captured = {}

    def pre_hook(module, args, kwargs):
        captured["inputs_embeds"] = kwargs["inputs_embeds"].detach().clone()

    h = model.model.language_model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        out = model(input_ids=input_ids, pixel_values=pixel_values, use_cache=False)
    finally:
        h.remove()
    logits = out.logits
    loss = loss_from_logits(logits, labels)
    res = {"logits": logits.detach().clone(), "loss": loss.detach().reshape(1).clone(),
           "inputs_embeds": captured["inputs_embeds"]}
    with torch.no_grad():
        vt = model.model.vision_tower(pixel_values.to(model.dtype), output_hidden_states=True)
        hs = vt.hidden_states
        raw = hs[cfg.vision_feature_layer]
        sel = raw[:, 1:] if cfg.vision_feature_select_strategy == "default" else raw
        proj = model.model.multi_modal_projector(sel)
        feats = model.model.get_image_features(pixel_values=pixel_values.to(model.dtype)).pooler_output
        assert torch.equal(torch.stack(feats), proj), "get_image_features != manual selection + projector"
        assert torch.equal(out.image_hidden_states, proj.reshape(-1, proj.shape[-1]))
        emb = model.model.language_model.embed_tokens(input_ids)
        mask = (input_ids == cfg.image_token_id).unsqueeze(-1)
        merged = emb.masked_scatter(mask, proj.reshape(-1, proj.shape[-1]))
        assert torch.equal(merged, res["inputs_embeds"]), "manual merge != transformers' inputs_embeds"
    res.update(image_features_raw=raw.clone(), image_features=sel.clone(), projected=proj.clone(),
               hidden_states=[x.clone() for x in hs])
    if backward:
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            if p.requires_grad:
                grads[keymap[n]] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        res["grads"] = grads
    return res


@contextlib.contextmanager
def pure_f64_llava(model):
    shim = types.SimpleNamespace(model=types.SimpleNamespace(rotary_emb=model.model.language_model.rotary_emb),
                                 config=model.config.text_config)
    with mlf.pure_f64(shim) as hits:
        yield hits


# ----------------------------------------------------------------------------------------------
# Key layouts
# ----------------------------------------------------------------------------------------------

def v4_key(saved_key, vision_prefix):
    if saved_key.startswith("vision_tower."):
        return "vision_tower." + vision_prefix + saved_key[len("vision_tower."):]
    return saved_key


def v5_key(saved_key):
    if saved_key == "language_model.lm_head.weight":
        return "lm_head.weight"
    if saved_key.startswith("language_model.model."):
        return "model.language_model." + saved_key[len("language_model.model."):]
    return "model." + saved_key


def write_layout(src: Path, dst: Path, rename):
    dst.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {rename(k): v.contiguous() for k, v in tensors.items()}
    assert len(renamed) == len(tensors)
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)
    return sorted(renamed)


# ----------------------------------------------------------------------------------------------
# Build
# ----------------------------------------------------------------------------------------------

def build(name, images, tok):
    spec = MODELS[name]
    d = OUT / name
    model = make_model(name)
    mem_names = [n for n, _ in model.named_parameters()]
    model.save_pretrained(str(d))
    keys = file_keys(d)
    keymap = {n: inmemory_to_saved(n) for n in mem_names}
    assert sorted(keymap.values()) == keys, (sorted(set(keymap.values()) ^ set(keys)))

    ip = spec["image_processor"]()
    processor = LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=8,
                               vision_feature_select_strategy=spec["llava"]["vision_feature_select_strategy"],
                               num_additional_image_tokens=spec["num_additional_image_tokens"])
    processor.save_pretrained(str(d))
    ip.save_pretrained(str(d))  # preprocessor_config.json (the processor itself writes processor_config.json)
    fix_tokenizer_config(d)
    processor = AutoProcessor.from_pretrained(str(d))
    assert type(processor).__name__ == "LlavaProcessor"
    assert type(processor.image_processor).__name__.endswith("Pil"), type(processor.image_processor)

    dbg = image_debug(processor, images)
    input_ids, pixel_values, labels, prompt_lens, prompt_ids = make_inputs(processor, images)
    for i, n in enumerate(IMAGE_NAMES):
        assert torch.equal(pixel_values[i], dbg[n][2])

    model = load(d)
    assert model.config._attn_implementation == "eager"
    ref = forward(model, input_ids, pixel_values, labels, keymap)
    info = {"name": name, "keys": keys, "mem_names": mem_names, "keymap": keymap, "prompt_lens": prompt_lens,
            "prompt_ids": prompt_ids, "config": model.config, "input_ids": input_ids, "labels": labels,
            "n_hidden_states": len(ref["hidden_states"])}

    # hidden_states semantics: index 0 = embeddings (+ pre_layrnorm for CLIP), i = output of encoder layer i-1,
    # without post_layernorm.
    vt = model.model.vision_tower
    with torch.no_grad():
        x = vt.embeddings(pixel_values)
        if name == "clip":
            x = vt.pre_layrnorm(x)
        manual = [x]
        for layer in vt.encoder.layers:
            x = layer(x, None)
            manual.append(x)
        assert all(torch.equal(a, b) for a, b in zip(manual, ref["hidden_states"]))
        last = vt(pixel_values).last_hidden_state
        info["last_is_postln"] = torch.equal(last, vt.post_layernorm(manual[-1]))
        info["last_eq_hs_last"] = torch.equal(last, ref["hidden_states"][-1])
        info["raw_is_index"] = cfg_index = model.config.vision_feature_layer % len(manual)
        assert torch.equal(ref["image_features_raw"], manual[cfg_index])

    # Loss as transformers computes it (unshifted labels, HF shifts them).
    with torch.no_grad():
        hf_labels = torch.cat([torch.full((2, 1), -100), labels[:, :-1]], dim=1)
        hf_loss = model(input_ids=input_ids, pixel_values=pixel_values, labels=hf_labels, use_cache=False).loss
    info["hf_loss_diff"] = (hf_loss.reshape(1) - ref["loss"]).abs().item()

    # Vision tower frozen: every remaining gradient must be unchanged.
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(False)
    frozen = forward(model, input_ids, pixel_values, labels, keymap)
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(True)
    assert not any(k.startswith("vision_tower.") for k in frozen["grads"])
    info["frozen_max_diff"] = max((frozen["grads"][k] - ref["grads"][k]).abs().max().item() for k in frozen["grads"])
    info["frozen_equal"] = all(torch.equal(frozen["grads"][k], ref["grads"][k]) for k in frozen["grads"])

    # SDPA.
    sd = load(d, attn="sdpa")
    assert sd.config._attn_implementation == "sdpa"
    s = forward(sd, input_ids, pixel_values, labels, keymap)
    info["sdpa"] = {"logits_abs": (s["logits"] - ref["logits"]).abs().max().item(),
                    "logits_rel": rel_err(s["logits"], ref["logits"]),
                    "grad_rel": max(rel_err(s["grads"][k], ref["grads"][k]) for k in keys
                                    if not k.endswith("k_proj.bias") and ref["grads"][k].abs().max() > 0)}
    assert info["sdpa"]["logits_abs"] < 1e-5, info["sdpa"]

    # float64.
    m64 = load(d, dtype=torch.float64)
    with pure_f64_llava(m64) as hits:
        r64 = forward(m64, input_ids, pixel_values.double(), labels, keymap)
    assert all(v > 0 for v in hits.values()), hits
    stock64 = forward(m64, input_ids, pixel_values.double(), labels, keymap, backward=False)
    # Gradients that are zero in exact arithmetic but not in floating point: the attention key bias (softmax is
    # invariant to adding q.b_k to every score of a row). Compared separately (absolute size).
    info["analytic_zero"] = {k: (ref["grads"][k].abs().max().item(), r64["grads"][k].abs().max().item())
                             for k in keys if 0 < r64["grads"][k].abs().max() < 1e-12}
    assert all(k.endswith("self_attn.k_proj.bias") for k in info["analytic_zero"]), info["analytic_zero"]
    assert all(a < 1e-6 for a, _ in info["analytic_zero"].values()), info["analytic_zero"]
    worst = max((k for k in keys if r64["grads"][k].abs().max() >= 1e-12),
                key=lambda k: rel_err(ref["grads"][k], r64["grads"][k]))
    info["f64"] = {
        "logits": rel_err(ref["logits"], r64["logits"]),
        "loss": rel_err(ref["loss"], r64["loss"]),
        "image_features": rel_err(ref["image_features"], r64["image_features"]),
        "projected": rel_err(ref["projected"], r64["projected"]),
        "grad": rel_err(ref["grads"][worst], r64["grads"][worst]), "grad_worst": worst,
        "stock64_logits": rel_err(stock64["logits"], r64["logits"]),
    }
    assert info["f64"]["logits"] < 1e-5 and info["f64"]["grad"] < 1e-4, info["f64"]
    info["zero_grads"] = sorted(k for k in keys if ref["grads"][k].abs().max() == 0)
    assert all(r64["grads"][k].abs().max() == 0 for k in info["zero_grads"])
    info["max_abs_logit"] = ref["logits"].abs().max().item()
    info["loss"] = ref["loss"].item()
    info["n_targets"] = int((labels != -100).sum())

    # reference.safetensors
    tensors = {"input_ids": input_ids, "pixel_values": pixel_values.contiguous(), "labels": labels,
               "image_features_raw": ref["image_features_raw"], "image_features": ref["image_features"],
               "projected": ref["projected"], "inputs_embeds": ref["inputs_embeds"], "logits": ref["logits"],
               "loss": ref["loss"]}
    for n in IMAGE_NAMES:
        decoded, resized, pv = dbg[n]
        tensors[f"pixel_values.{n}"] = pv
        tensors[f"decoded_u8.{n}"] = torch.from_numpy(decoded)
        tensors[f"resized_u8.{n}"] = torch.from_numpy(resized)
    for k in keys:
        tensors[f"grad.{k}"] = ref["grads"][k]
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(d / "reference.safetensors"), metadata={"format": "pt"})
    info["tensors"] = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in tensors.items()}
    info["files"] = sorted(p.name for p in d.iterdir())
    info["dbg_shapes"] = {n: dbg[n][0].shape for n in IMAGE_NAMES}
    info["ref"] = ref
    return info


def check_layouts(clip_info):
    src = OUT / "clip"
    ref_logits = clip_info["ref"]["logits"]
    ids = clip_info["input_ids"]
    pv = load_file(str(src / "reference.safetensors"))["pixel_values"]
    results = {}
    layouts = {
        "clip_v4_keys": lambda k: v4_key(k, "vision_model."),
        "clip_v5_keys": v5_key,
    }
    tmp = Path(tempfile.mkdtemp(prefix="llava_layouts_"))
    for name, fn in layouts.items():
        # clip_v5_keys is only checked (in a temporary directory), not kept: it is a plain prefix change and the
        # fixture size budget is tight.
        dst = OUT / name if name in KEPT_LAYOUTS else tmp / name
        keys = write_layout(src, dst, fn)
        m = load(dst)
        with torch.no_grad():
            lg = m(input_ids=ids, pixel_values=pv, use_cache=False).logits
        results[name] = {"keys": keys, "equal": torch.equal(lg, ref_logits), "rel": rel_err(lg, ref_logits)}
        assert results[name]["equal"], (name, results[name]["rel"])
        results[name]["kept"] = name in KEPT_LAYOUTS
    shutil.rmtree(tmp)
    return results


# ----------------------------------------------------------------------------------------------
# README
# ----------------------------------------------------------------------------------------------

def fmt(x):
    return f"{x:.1e}"


def write_readme(infos, layouts, images):
    L = []
    w = L.append
    clip, sig = infos["clip"], infos["siglip"]
    w("# Tiny LLaVA fixtures (generated)")
    w("")
    w("Generated by `scripts/make_llava_fixtures.py` (do not edit by hand; rerun the script). From the")
    w("repository root:")
    w("")
    w("```sh")
    w(COMMAND)
    w("```")
    w("")
    w(f"Versions: torch {torch.__version__}, transformers {transformers.__version__}, safetensors "
      f"{safetensors.__version__}, tokenizers {tokenizers.__version__}, numpy {np.__version__}, Pillow "
      f"{PIL.__version__}; no torchvision (pinned in `scripts/requirements-llava.txt`). Offline, CPU, fixed seeds, "
      "one thread, `torch.use_deterministic_algorithms(True)`: rerunning reproduces every file byte for byte.")
    w("")
    w("## Files")
    w("")
    for sub in sorted(p for p in OUT.iterdir() if p.is_dir()):
        for p in sorted(sub.iterdir()):
            w(f"- `{sub.name}/{p.name}` ({p.stat().st_size} bytes)")
    w("")
    w("- `clip/`, `siglip/`: complete model directories (`AutoProcessor.from_pretrained` and "
      "`LlavaForConditionalGeneration.from_pretrained` both work): `config.json`, `generation_config.json`, "
      "`model.safetensors` (exactly as `save_pretrained` writes it), tokenizer (`tokenizer.json`, "
      "`tokenizer_config.json`), `processor_config.json` (LlavaProcessor: nested `image_processor` dict plus "
      "`patch_size`, `num_additional_image_tokens`, `vision_feature_select_strategy`, `image_token`), "
      "`preprocessor_config.json` (the image processor alone, `image_processor.save_pretrained`; transformers 5 "
      "`LlavaProcessor.save_pretrained` does NOT write this file, it nests the same dict in processor_config.json), "
      "`reference.safetensors`.")
    w("- `clip_v4_keys/`: `config.json`, `generation_config.json` (copies of clip's) and `model.safetensors` with the "
      "`clip` weights under the transformers 4 key names (see Key layouts); no tokenizer / processor files, no "
      "reference (its logits equal `clip/reference.safetensors` bit for bit). The `clip_v5_keys` layout "
      "(in-memory names) is written to a temporary directory and checked the same way, but not kept (size).")
    w("")
    w("## Models")
    w("")
    w("`LlavaForConditionalGeneration` built from `LlavaConfig` (no hub access), saved in float32. Text model "
      "(both): LLaMA like `tests/fixtures/llama/gqa`: vocab_size 260, hidden 32, intermediate 64, 2 layers, 8 heads "
      "/ 2 kv heads, head_dim 8, rms_norm_eps 1e-5, RoPE default theta 10000, silu, untied lm_head, bos 1, eos 2, "
      "no pad_token_id. `image_token_index` 256 (`config.image_token_id` is an alias), `image_seq_length` 16, "
      "`projector_hidden_act` \"gelu\", `multimodal_projector_bias` true, `tie_word_embeddings` false.")
    w("")
    w("| model | vision tower | vision_feature_layer | select strategy | image tokens / image | params | loss | max abs logit |")
    w("|---|---|---|---|---|---|---|---|")
    for n, inf in infos.items():
        vc = inf["config"].vision_config
        params = sum(v.numel() for k, v in load_file(str(OUT / n / "model.safetensors")).items())
        w(f"| `{n}` | {type(vc).__name__}: image 32, patch 8, hidden {vc.hidden_size}, {vc.num_hidden_layers} layers, "
          f"{vc.num_attention_heads} heads, intermediate {vc.intermediate_size}, `{vc.hidden_act}`, layer_norm_eps "
          f"{vc.layer_norm_eps}{', vision_use_head false' if n == 'siglip' else ''} | {inf['config'].vision_feature_layer} | "
          f"{inf['config'].vision_feature_select_strategy} | 16 | {params} | {inf['loss']:.6f} | {inf['max_abs_logit']:.3f} |")
    w("")
    w("Weights (drawn after construction, `torch.Generator` seeded 1201 (clip) / 1202 (siglip), parameters in sorted "
      "in-memory name order): every LayerNorm / RMSNorm weight (`*norm.weight`, `pre_layrnorm.weight`, "
      "`layer_norm1/2.weight`, `post_layernorm.weight`) uniform(0.5, 1.5); every bias (LayerNorm, linear, conv) "
      "normal(0, 0.1); everything else (linear / conv weights, embeddings, CLIP `class_embedding`, position "
      "embeddings) normal(0, 0.2). No tensor is zero or one.")
    w("")
    w("Activations (transformers `ACT2FN`): CLIP MLP `quick_gelu` = `x * sigmoid(1.702 x)` "
      f"(`{type(ACT2FN['quick_gelu']).__name__}`); SigLIP MLP `gelu_pytorch_tanh` = `F.gelu(x, approximate=\"tanh\")` "
      f"(`{type(ACT2FN['gelu_pytorch_tanh']).__name__}`); projector `gelu` = exact erf GELU `F.gelu(x)` "
      f"(`{type(ACT2FN['gelu']).__name__}`); LLaMA `silu`.")
    w("")
    w("## Vision towers in transformers 5.23 (verified by the script)")
    w("")
    w("- CLIP (`CLIPVisionModel`, no `vision_model` submodule any more in 5.x): patch conv 3->32, kernel = stride "
      "= 8, NO bias; `class_embedding` (32,) prepended (CLS first) -> 17 tokens; `position_embedding` (17, 32) added "
      "(position ids 0..16, CLS is position 0); then `pre_layrnorm` (spelled so) BEFORE the encoder; encoder layers "
      "are pre-LN: `x + out_proj(attn(layer_norm1(x)))`, then `x + fc2(act(fc1(layer_norm2(x))))`; attention has "
      "biases on q/k/v/out_proj, head_dim = 32/4 = 8, scale head_dim^-0.5, no mask (bidirectional), eager softmax "
      "in float32. `post_layernorm` is applied ONLY to the pooled CLS (`pooler_output`), never to "
      "`last_hidden_state` or `hidden_states`: LLaVA does not use it (its gradient is zero).")
    w("- SigLIP (`SiglipVisionModel`): patch conv 3->32, kernel = stride = 8, WITH bias; no CLS -> 16 tokens; "
      "`position_embedding` (16, 32); no pre-layernorm; same pre-LN encoder layer (layer_norm1, self_attn, "
      "layer_norm2, mlp fc1/fc2, biases everywhere); then `post_layernorm` on `last_hidden_state` and (when "
      "`vision_use_head`, default true, false here) the attention-pooling `head` (`head.probe`, "
      "`head.attention.in_proj_weight/bias` (96, 32)/(96,), `head.attention.out_proj`, `head.layernorm`, "
      "`head.mlp.fc1/fc2`). LLaVA with vision_feature_layer -1 takes `hidden_states[-1]`, which is the output of "
      f"the last encoder layer BEFORE post_layernorm (checked: `last_hidden_state == post_layernorm(hidden_states[-1])` "
      f"is {sig['last_is_postln']}, `last_hidden_state == hidden_states[-1]` is {sig['last_eq_hs_last']}): "
      "post_layernorm (and the head) are unused, their gradients are zero. This is because CLIP/SigLIP use "
      "`capture_outputs(tie_last_hidden_states=False)`.")
    w(f"- `hidden_states` has num_hidden_layers + 1 = {clip['n_hidden_states']} entries: index 0 = the "
      "embeddings (CLIP: after pre_layrnorm; SigLIP: patch + position embeddings), index i = output of encoder "
      "layer i-1. `vision_feature_layer` indexes this tuple Python-style: CLIP -2 -> index "
      f"{clip['raw_is_index']} (output of encoder layer 0; encoder layer 1 is computed but unused, so all of its "
      f"gradients are zero), SigLIP -1 -> index {sig['raw_is_index']} (output of the last layer, no post_layernorm). "
      "In 5.23 `get_image_features` is decorated with `select_hidden_states(\"vision_feature_layer\")`, which "
      "passes `output_hidden_states=<the index>` to the tower so only that entry is recorded, but the selected "
      "tensor is the same as with `output_hidden_states=True` (checked).")
    w("- Select strategy: \"default\" drops token 0 (`[:, 1:]`, the CLS for CLIP) -> 16 features; \"full\" keeps "
      "all (SigLIP has no CLS) -> 16. A list-valued vision_feature_layer would concatenate the selected layers "
      "along the feature dim (projector input = hidden * len(list)); not used here.")
    w("- Projector `multi_modal_projector`: `linear_2(gelu(linear_1(x)))`, linear_1 (32 <- vision hidden 32), "
      "linear_2 (32 <- 32), both with bias.")
    w("- Merge: `inputs_embeds = embed_tokens(input_ids)`, then `masked_scatter` of the projected features "
      "(all images concatenated in order, (3*16, 32)) into the positions where `input_ids == image_token_id`, in "
      "row-major order over (batch, position). transformers raises if the number of image tokens != number of "
      "features. The `<image>` row of `embed_tokens` is never used (its gradient row is zero). Then the LLaMA "
      "decoder runs on inputs_embeds with positions 0..T-1 and causal attention (image tokens are causal too).")
    w("")
    w("## Key layouts")
    w("")
    w("SURPRISE: transformers 5.23 keeps the parameters in memory as `model.language_model.*`, "
      "`model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.weight`, but `save_pretrained` REVERSES "
      "its checkpoint conversion mapping and writes `language_model.model.*`, `language_model.lm_head.weight`, "
      "`vision_tower.*`, `multi_modal_projector.*` (and, for CLIP, WITHOUT the `vision_model.` level that "
      "transformers 4 checkpoints have). So `clip/model.safetensors` and `siglip/model.safetensors` are in this "
      "saved layout, and the `grad.*` names in reference.safetensors are these saved-file keys.")
    w("")
    w("| directory | text | lm_head | vision | projector | loads in 5.23 with identical logits |")
    w("|---|---|---|---|---|---|")
    w("| `clip/`, `siglip/` (what 5.23 save_pretrained writes) | `language_model.model.*` | "
      "`language_model.lm_head.weight` | `vision_tower.*` | `multi_modal_projector.*` | yes (reference) |")
    for n, r in layouts.items():
        if n == "clip_v4_keys":
            w("| `clip_v4_keys/` (transformers 4.x llava-hf layout) | `language_model.model.*` | "
              "`language_model.lm_head.weight` | `vision_tower.vision_model.*` | `multi_modal_projector.*` | "
              f"{'yes, bit for bit' if r['equal'] else 'NO'} |")
        else:
            w("| `clip_v5_keys` (in-memory names = `state_dict()` keys; checked, not kept) | `model.language_model.*` | "
              "`lm_head.weight` | `model.vision_tower.*` | `model.multi_modal_projector.*` | "
              f"{'yes, bit for bit' if r['equal'] else 'NO'} |")
    w("")
    w("Loading goes through `conversion_mapping.py` (\"llava\": `^language_model.lm_head` -> `lm_head`, "
      "`^language_model` -> `model.language_model`, `^vision_tower` -> `model.vision_tower`, "
      "`^multi_modal_projector` -> `model.multi_modal_projector`; \"LlavaModel\": `^language_model.model` -> "
      "`language_model`; \"CLIPVisionModel\" (also used for SiglipVisionModel): drop a `vision_model.` prefix). A "
      "Rust loader should accept all three: strip an optional leading `model.`; `language_model.model.X` and "
      "`language_model.X` (X not lm_head) are text `X`; `language_model.lm_head.weight` and `lm_head.weight` are the "
      "lm_head; `vision_tower.vision_model.X` and `vision_tower.X` are vision `X`.")
    w("")
    for n in ("clip", "siglip"):
        w(f"Exact keys of `{n}/model.safetensors` ({len(infos[n]['keys'])}) -> in-memory parameter name:")
        w("")
        inv = {v: k for k, v in infos[n]["keymap"].items()}
        for k in infos[n]["keys"]:
            w(f"- `{k}` -> `{inv[k]}`")
        w("")
    for n, r in layouts.items():
        w(f"Exact keys of `{n}` ({len(r['keys'])}):")
        w("")
        w(", ".join(f"`{k}`" for k in r["keys"]))
        w("")
    w("## Tokenizer and image tokens")
    w("")
    w("The tokenizer is `tests/fixtures/llama/tokenizer` (byte-level BPE, 256 entries, `<unk>` 0, `<s>` 1, `</s>` 2, "
      f"`<pad>` 3) plus the special token `{IMAGE_TOKEN}` = id {IMAGE_TOKEN_ID} "
      "(`add_special_tokens({\"additional_special_tokens\": [\"<image>\"]})`; stored as an added token in "
      "tokenizer.json and in `extra_special_tokens` of tokenizer_config.json). 257 tokens, text vocab_size 260 "
      "(ids 257..259 unused). `tokenizer_class` is rewritten to `PreTrainedTokenizerFast` as in the llama fixtures.")
    w("")
    w("`LlavaProcessor` expands each `<image>` in the text into `num_image_tokens` copies BEFORE tokenizing: "
      "`num_image_tokens = (H // patch_size) * (W // patch_size) + num_additional_image_tokens`, minus 1 if "
      "vision_feature_select_strategy == \"default\"; H, W = the processed pixel_values size (32x32). clip: "
      "patch_size 8, num_additional_image_tokens 1 (the CLS), \"default\" -> 16 + 1 - 1 = 16. siglip: "
      "num_additional_image_tokens 0, \"full\" -> 16. (`patch_size`, `num_additional_image_tokens` and "
      "`vision_feature_select_strategy` live in processor_config.json, not in config.json.)")
    w("")
    w("## Images and preprocessing")
    w("")
    w("`images/a.png` 32x32, `images/b.png` 48 wide x 40 high, `images/c.jpg` 40x40 (Pillow JPEG quality 90, 4:4:4 "
      "chroma, no subsampling): RGB gradient + sine stripe in blue, 4-pixel checkerboard in red, a yellow "
      "diagonal and gaussian noise (numpy seeds 11/12/13).")
    w("")
    w("transformers 5.23's default image processors (`CLIPImageProcessor`, `SiglipImageProcessor`) are torchvision "
      "backends; without torchvision installed (as here) `AutoProcessor` falls back to the PIL backends "
      "`CLIPImageProcessorPil` / `SiglipImageProcessorPil` (config.json still says `CLIPImageProcessor` / "
      "`SiglipImageProcessor`). The pixel values here are the PIL backend's. With torchvision installed the same "
      "config would resize with torchvision (antialiased tensor resize, different rounding): values may differ by "
      "a few 1/255 steps. The PIL pipeline, reproduced exactly by the script (checked bit for bit):")
    w("")
    w("1. decode, `convert(\"RGB\")` (do_convert_rgb), uint8 HWC -> CHW.")
    w("2. resize with Pillow `Image.resize((w, h), resample)` on the uint8 image (result rounded to uint8 by Pillow). "
      "clip: `resample` 3 = BICUBIC, `size {\"shortest_edge\": 32}`: short side -> 32, long side -> "
      "`int(32 * long / short)` (truncation, not rounding); b.png 48x40 -> 38 wide x 32 high; 32x32 input "
      "-> unchanged (Pillow returns a copy when the size is equal); c.jpg 40x40 -> 32x32. siglip: `resample` 2 "
      "= BILINEAR (set explicitly; the 5.23 class default is BICUBIC), `size {\"height\": 32, \"width\": 32}`: "
      "every image straight to 32x32, aspect ratio NOT kept, no crop.")
    w("3. clip only: center crop 32x32 on the resized uint8 image: `top = (H - 32) // 2`, `left = (W - 32) // 2` "
      "(b.png: top 0, left 3, i.e. columns 3..34 of 38).")
    w("4. rescale: `(u8.astype(float64) * rescale_factor).astype(float32)`, rescale_factor = 1/255 = "
      "0.00392156862745098.")
    w("5. normalize in float32: `(x - mean) / std` per channel, mean/std cast to float32. clip: OPENAI_CLIP_MEAN "
      "[0.48145466, 0.4578275, 0.40821073], OPENAI_CLIP_STD [0.26862954, 0.26130258, 0.27577711]; siglip: 0.5 / 0.5.")
    w("")
    w("A Rust implementation must match Pillow's resampling (separable, fixed-point coefficients with "
      "support scaled by the downscale factor, i.e. antialiased, clamped edges, uint8 rounding); "
      "`resized_u8.<name>` lets it test that step alone, and `decoded_u8.<name>` separates JPEG decoder differences "
      "(libjpeg-turbo vs a Rust decoder can differ by 1 in some pixels) from the resize.")
    w("")
    w("## reference.safetensors (clip/ and siglip/)")
    w("")
    w("| tensor | shape | dtype | meaning |")
    w("|---|---|---|---|")
    desc = {
        "input_ids": "2 samples, no padding. Produced by the saved LlavaProcessor from text (see below) and cut to "
                     f"{SEQ} tokens; sample 0 has 16 `<image>` (256) tokens (image a), sample 1 has 2 x 16 (b then c)",
        "pixel_values": "processor output for [a, b, c] (the order the image tokens appear, batch-major)",
        "labels": "SHIFTED targets: labels[b, i] = input_ids[b, i+1], -100 at i = T-1, -100 where the target lies "
                  "in the prompt (prompt = everything up to and including `answer:`, which holds all image tokens), "
                  "-100 where the target is an image token. Use directly: CE(logits[b, i], labels[b, i])",
        "image_features_raw": "vision tower `hidden_states[vision_feature_layer]` before the select strategy",
        "image_features": "after the select strategy (clip: [:, 1:] drops CLS)",
        "projected": "multi_modal_projector(image_features)",
        "inputs_embeds": "merged embeddings fed to the LLaMA decoder (captured with a forward pre-hook)",
        "logits": "model(input_ids, pixel_values).logits (eager, eval, use_cache=False, no attention mask)",
        "loss": "mean cross-entropy of logits vs labels over the non -100 labels (computed from logits, labels not passed to the model)",
        "pixel_values.a": "image processor output for one image (same as pixel_values[i])",
        "decoded_u8.a": "decoded RGB uint8, HWC, before any processing",
        "resized_u8.a": "uint8 CHW after resize (+ center crop for clip), before rescale/normalize",
    }
    for k, (shape, dt) in clip["tensors"].items():
        if k.startswith("grad."):
            continue
        base = k if k in desc else k.split(".")[0] + ".a"
        sshape = str(shape)
        if k.startswith(("image_features_raw",)):
            sshape = f"clip {shape}, siglip {sig['tensors'][k][0]}"
        if k.startswith("decoded_u8"):
            sshape = str(shape)
        w(f"| `{k}` | {sshape} | {dt} | {desc[base] if k == base or k.endswith('.a') else '(as above)'} |")
    nclip = sum(k.startswith("grad.") for k in clip["tensors"])
    nsig = sum(k.startswith("grad.") for k in sig["tensors"])
    w(f"| `grad.<key>` | as the tensor | float32 | d loss / d parameter for EVERY key of model.safetensors (saved "
      f"layout, e.g. `grad.language_model.model.layers.0.self_attn.q_proj.weight`, "
      f"`grad.vision_tower.encoder.layers.0.mlp.fc1.weight`, `grad.multi_modal_projector.linear_1.weight`, "
      f"`grad.language_model.lm_head.weight`); clip {nclip}, siglip {nsig} |")
    w("")
    for n, inf in infos.items():
        w(f"`{n}`: prompt lengths (tokens, with `<s>` and the expanded image tokens) {inf['prompt_lens']}, "
          f"{inf['n_targets']} loss targets of {2 * SEQ}. Gradients that are exactly zero (parameters LLaVA "
          f"never uses): {', '.join('`' + k + '`' for k in inf['zero_grads'])}.")
        w("")
    w("Texts (processor input; each `<image>` becomes 16 image tokens; the answer is cut where the sequence reaches "
      f"{SEQ} tokens):")
    w("")
    for i in range(2):
        w(f"- sample {i}: prompt {json.dumps(PROMPTS[i])}, answer {json.dumps(ANSWERS[i])}")
    w("")
    w(f"clip `input_ids[0]`: `{clip['input_ids'][0].tolist()}`")
    w("")
    w(f"clip `input_ids[1]`: `{clip['input_ids'][1].tolist()}`")
    w("")
    w(f"(siglip's input_ids are identical.) Characters absent from the BPE's training text would encode as "
      f"`<unk>` 0; these texts contain none ({int((clip['input_ids'] == 0).sum())} zeros).")
    w("")
    w("## Cross-checks (measured; max relative error = max |x - ref| / max |ref|)")
    w("")
    w("| model | f32 ref vs float64: logits | loss | image_features | projected | worst grad | stock-HF f64 vs pure f64 logits | sdpa vs eager: logits (abs) | sdpa worst grad (rel) | HF loss(labels=) vs ref (abs) | frozen vision: other grads |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, inf in infos.items():
        f = inf["f64"]
        w(f"| `{n}` | {fmt(f['logits'])} | {fmt(f['loss'])} | {fmt(f['image_features'])} | {fmt(f['projected'])} | "
          f"{fmt(f['grad'])} (`{f['grad_worst']}`) | {fmt(f['stock64_logits'])} | {fmt(inf['sdpa']['logits_abs'])} | "
          f"{fmt(inf['sdpa']['grad_rel'])} | {fmt(inf['hf_loss_diff'])} | "
          f"{'bit-identical' if inf['frozen_equal'] else 'max diff ' + fmt(inf['frozen_max_diff'])} |")
    w("")
    w("- float64: the checkpoint loaded with `dtype=torch.float64` and transformers' own float32 steps (RMSNorm, "
      "eager softmax, RoPE cos/sin) run in float64 (`pure_f64` from make_llama_fixtures.py); pixel_values cast to "
      "float64. \"stock-HF f64\" is the same without that patch.")
    w("- HF loss: `model(..., labels=L)` with UNshifted labels `L = [-100, labels[:, :-1]]` (transformers shifts).")
    w("- frozen vision: `requires_grad_(False)` on every vision_tower parameter; the projector and text gradients "
      "are unchanged (so no separate `frozen_vision.grad.*` tensors are stored); vision_tower parameters then get "
      "no gradient.")
    w("- An f32 Rust implementation should reach about the f32-vs-f64 column: tolerances ~1e-5 for logits and "
      "~1e-4 for gradients leave margin.")
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
    (OUT / "README.md").write_text("\n".join(L))


def main():
    setup_determinism()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    images = make_images(OUT / "images")
    tok = make_tokenizer()
    infos = {}
    for name in MODELS:
        infos[name] = build(name, images, tok)
        inf = infos[name]
        log(f"{name}: loss={inf['loss']:.6f} f64={inf['f64']} sdpa={inf['sdpa']} hf_loss_diff={inf['hf_loss_diff']} "
            f"frozen_equal={inf['frozen_equal']} zero_grads={inf['zero_grads']}")
    assert torch.equal(infos["clip"]["input_ids"], infos["siglip"]["input_ids"])
    layouts = check_layouts(infos["clip"])
    log("layouts:", {k: (v["equal"], v["rel"]) for k, v in layouts.items()})
    write_readme(infos, layouts, images)
    digest = hashlib.sha256()
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            digest.update(str(p.relative_to(OUT)).encode() + b"\0" + p.read_bytes())
    log(f"wrote {OUT} ({dir_bytes(OUT)} bytes), sha256 of all files {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
