#!/usr/bin/env python3
"""Build the LoRA and DPO reference fixtures under tests/fixtures/finetune/ (offline, deterministic).

Run from the repository root (after `scripts/make_llama_fixtures.py`, whose `gqa` model is the base):

    /work/venv21/bin/python scripts/make_finetune_fixtures.py

(or any venv with `pip install -r scripts/requirements-finetune.txt`).

What it writes (everything is rebuilt from fixed seeds; rerunning gives byte-identical files):

* ``lora/adapter/``: a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) for
  ``tests/fixtures/llama/gqa``: ``LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
  target_modules="all-linear", bias="none", task_type="CAUSAL_LM")``, with every lora_A and lora_B redrawn
  from normal(0, 0.1) (PEFT starts B at zero, which would make the adapter a no-op).
* ``lora/reference.safetensors``: inputs, shifted labels, logits with / without the adapter, the masked
  mean cross-entropy, its gradients w.r.t. every LoRA parameter, and the merged weight W + (alpha/r) B A of
  every targeted module.
* ``dpo/reference.safetensors``: 3 chosen / rejected pairs sharing their prompts, per-sequence log-probs
  of the policy (base + the same adapter) and of the reference (adapters disabled), TRL's sigmoid DPO loss
  (beta 0.1), rewards, reward accuracy and the gradients of the loss w.r.t. every LoRA parameter.
* ``README.md`` (generated).

The references are what stock transformers + PEFT compute in float32 on CPU (eager attention, eval mode,
use_cache=False); the DPO log-prob sums and losses are then evaluated in float64 from those float32
logits. Every value is also recomputed with the whole model in float64 (without transformers' internal
float32 steps, see `make_llama_fixtures.pure_f64`) and the measured differences are asserted and written
to the README. The DPO loss is cross-checked against TRL's own `DPOTrainer._compute_loss`.
"""
import copy
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import peft  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_llama_fixtures import pure_f64  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "finetune"
BASE_REL = "tests/fixtures/llama/gqa"
BASE_DIR = ROOT / BASE_REL
COMMAND = "/work/venv21/bin/python scripts/make_finetune_fixtures.py"

VOCAB = 256
R, ALPHA = 4, 8
SCALING = ALPHA / R
LORA_STD = 0.1
LORA_SEED = 4242
PREFIX = "base_model.model."  # PEFT's prefix in adapter_model.safetensors and parameter names
LAYERS = 2
TARGETS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
EXPECTED_MODULES = sorted(f"model.layers.{i}.{t}" for i in range(LAYERS) for t in TARGETS)

# lora/: inputs
LM_BATCH, LM_SEQ = 2, 16
LM_SEED = 5151
LM_MASKED_PROMPT = (0, 4)  # labels[0, 0:4] = -100

# dpo/: 3 pairs of length 12, prompts of 3, 5 and 7 tokens
DPO_SEQ = 12
PROMPT_LENS = [3, 5, 7]
DPO_SEED = 6262
BETA = 0.1
MIN_ID = 3  # ids drawn from [3, 256): no <unk>/<s>/</s>

LOGIT_TOL = 1e-5   # asserted max |a - b| / max |b| between independent computations
GRAD_TOL = 1e-4


def log(*args):
    print(*args, flush=True)


def setup_determinism():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def rel_err(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

def load_base(dtype=torch.float32) -> LlamaForCausalLM:
    model, info = LlamaForCausalLM.from_pretrained(
        str(BASE_DIR), attn_implementation="eager", dtype=dtype, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"loading problems {bad}"
    return model.eval()


def lora_config() -> LoraConfig:
    return LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear", bias="none",
                      task_type="CAUSAL_LM")


def lora_params(model) -> dict:
    """{fixture name: parameter} for every LoRA parameter, fixture name = PEFT name without the
    `base_model.model.` prefix and the `.default` adapter name (= adapter file key without the prefix)."""
    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert n.startswith(PREFIX) and ".default." in n, n
            out[n[len(PREFIX):].replace(".default.", ".")] = p
    return dict(sorted(out.items()))


def targeted_modules(model) -> list:
    from peft.tuners.lora import LoraLayer
    inner = model.base_model.model
    return sorted(n for n, m in inner.named_modules() if isinstance(m, LoraLayer))


def build_adapter(adapter_dir: Path) -> dict:
    """get_peft_model with all-linear, redraw A and B, save; returns facts for the README."""
    model = get_peft_model(load_base(), lora_config())
    cfg = model.peft_config["default"]
    facts = {"target_modules_type": type(cfg.target_modules).__name__}
    mods = targeted_modules(model)
    assert mods == EXPECTED_MODULES, mods
    assert sorted(cfg.target_modules) == EXPECTED_MODULES, cfg.target_modules
    assert not isinstance(model.base_model.model.lm_head, peft.tuners.lora.LoraLayer)
    assert type(model.base_model.model.lm_head) is torch.nn.Linear
    params = lora_params(model)
    assert len(params) == 2 * len(EXPECTED_MODULES)
    # PEFT's own init: kaiming-uniform A, zero B.
    assert all(p.abs().max() == 0 for n, p in params.items() if ".lora_B." in n)
    assert all(p.abs().max() > 0 for n, p in params.items() if ".lora_A." in n)
    gen = torch.Generator().manual_seed(LORA_SEED)
    with torch.no_grad():
        for n, p in params.items():  # sorted names: the draw order is fixed
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, LORA_STD, generator=gen))
    # Only LoRA parameters are trainable.
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(PREFIX + k.replace(".lora_A.", ".lora_A.default.").replace(
        ".lora_B.", ".lora_B.default.") for k in params), trainable

    model.save_pretrained(str(adapter_dir))
    # PEFT also writes a model-card README.md; not needed to load the adapter.
    (adapter_dir / "README.md").unlink()
    # all-linear is expanded to a Python *set* of module names, saved as a JSON list in set order, which
    # depends on the string hash seed: sort it so reruns are byte-identical. Same format as PEFT's
    # (json.dumps(indent=2, sort_keys=True), no trailing newline).
    cfg_path = adapter_dir / "adapter_config.json"
    raw = json.loads(cfg_path.read_text())
    facts["raw_target_modules_is_list"] = isinstance(raw["target_modules"], list)
    assert sorted(raw["target_modules"]) == EXPECTED_MODULES
    raw["target_modules"] = sorted(raw["target_modules"])
    # PEFT records the base as the absolute path it was loaded from (differs per checkout): store the path
    # relative to the repository root instead (PeftModel.from_pretrained(base, dir) does not read it).
    assert Path(raw["base_model_name_or_path"]).resolve() == BASE_DIR.resolve(), raw["base_model_name_or_path"]
    raw["base_model_name_or_path"] = BASE_REL
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True))
    files = sorted(p.name for p in adapter_dir.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"], files
    facts["config"] = raw
    return facts


def load_policy(adapter_dir: Path, dtype=torch.float32):
    """Base from disk + adapter from disk (what a user of the files gets)."""
    base = load_base(torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    if dtype != torch.float32:
        model = model.to(dtype)
    model.eval()
    # The adapter file round-trips exactly into the model.
    stored = load_file(str(adapter_dir / "adapter_model.safetensors"))
    params = lora_params(model)
    assert sorted(stored) == sorted(PREFIX + k for k in params), (sorted(stored), list(params))
    for k, p in params.items():
        assert torch.equal(p.detach().to(torch.float32), stored[PREFIX + k]), k
        assert p.requires_grad
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    return model


# ----------------------------------------------------------------------------------------------
# lora/
# ----------------------------------------------------------------------------------------------

def lm_inputs():
    gen = torch.Generator().manual_seed(LM_SEED)
    input_ids = torch.randint(MIN_ID, VOCAB, (LM_BATCH, LM_SEQ), generator=gen, dtype=torch.int64)
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:]
    r, n = LM_MASKED_PROMPT
    labels[r, :n] = -100
    return input_ids, labels


def lm_run(model, input_ids, labels):
    """Forward + masked mean CE (labels already shifted) + backward; adapter logits, base logits, loss, grads."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids, use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in lora_params(model).items()}
    with torch.no_grad(), model.disable_adapter():
        base_logits = model(input_ids=input_ids, use_cache=False).logits
    return logits.detach(), base_logits.detach(), loss.detach(), grads


def merged_weights(model) -> dict:
    """merge_and_unload on a copy: {module name: merged weight}, checked against W + (alpha/r) B A in f64."""
    m = copy.deepcopy(model)
    params = lora_params(m)
    base_w = {mod: m.base_model.model.get_submodule(mod).base_layer.weight.detach().clone()
              for mod in EXPECTED_MODULES}
    merged = m.merge_and_unload()
    out = {}
    for mod in EXPECTED_MODULES:
        w = merged.get_submodule(mod).weight.detach().clone()
        a = params[f"{mod}.lora_A.weight"].detach().double()
        b = params[f"{mod}.lora_B.weight"].detach().double()
        want = base_w[mod].double() + SCALING * (b @ a)
        assert rel_err(w, want) < 1e-6, (mod, rel_err(w, want))
        assert w.shape == base_w[mod].shape
        out[mod] = w
    return out, merged


def build_lora(adapter_dir: Path, facts: dict) -> dict:
    input_ids, labels = lm_inputs()
    model = load_policy(adapter_dir)
    logits, base_logits, loss, grads = lm_run(model, input_ids, labels)
    assert torch.isfinite(logits).all() and torch.isfinite(loss)

    # Base logits equal the plain base model's (adapters really disabled) ...
    with torch.no_grad():
        plain = load_base()(input_ids=input_ids, use_cache=False).logits
    assert torch.equal(plain, base_logits)
    # ... and the adapter matters.
    adapter_effect = rel_err(logits, base_logits)
    assert adapter_effect > 1e-2, adapter_effect
    for k, g in grads.items():
        assert g.abs().max() > 0, k

    # Loss by hand: mean over the non-masked labels of -log_softmax(logits)[label].
    mask = labels != -100
    lp = logits.double().log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    manual = -(lp * mask).sum() / mask.sum()
    assert abs(manual.item() - loss.item()) < 1e-5, (manual.item(), loss.item())

    merged, merged_model = merged_weights(model)
    with torch.no_grad():
        merged_logits = merged_model(input_ids=input_ids, use_cache=False).logits
    merged_err = rel_err(merged_logits, logits)
    assert merged_err < LOGIT_TOL, merged_err

    # Float64 recomputation (whole model in f64, no internal f32 steps).
    m64 = load_policy(adapter_dir, torch.float64)
    with pure_f64(m64.base_model.model) as hits:
        l64, b64, s64, g64 = lm_run(m64, input_ids, labels)
    assert hits["norm"] > 0 and hits["softmax"] > 0 and hits["rope"] > 0, hits
    worst = max(g64, key=lambda k: rel_err(grads[k], g64[k]))
    f64_errs = {"logits": rel_err(logits, l64), "base_logits": rel_err(base_logits, b64),
                "loss": rel_err(loss, s64), "grad": rel_err(grads[worst], g64[worst]), "grad_worst": worst}
    assert f64_errs["logits"] < LOGIT_TOL and f64_errs["base_logits"] < LOGIT_TOL, f64_errs
    assert f64_errs["loss"] < LOGIT_TOL and f64_errs["grad"] < GRAD_TOL, f64_errs

    tensors = {"input_ids": input_ids, "labels": labels,
               "logits": logits.float().contiguous(), "base_logits": base_logits.float().contiguous(),
               "loss": loss.float().reshape(1)}
    for k, g in grads.items():
        tensors[f"grad.{k}"] = g.float().contiguous()
    for mod, w in merged.items():
        tensors[f"merged.{mod}.weight"] = w.float().contiguous()
    save_file(tensors, str(OUT / "lora" / "reference.safetensors"), metadata={"format": "pt"})
    return {"tensors": {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in tensors.items()},
            "loss": loss.item(), "num_targets": int(mask.sum()), "adapter_effect": adapter_effect,
            "max_abs_logit": logits.abs().max().item(), "merged_logits_err": merged_err, "f64": f64_errs,
            "lora_shapes": {k: tuple(p.shape) for k, p in lora_params(model).items()}}


# ----------------------------------------------------------------------------------------------
# dpo/
# ----------------------------------------------------------------------------------------------

def shifted_labels(ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """labels[i] = ids[i + 1], -100 at the last position and wherever ids[i + 1] is a prompt token."""
    labels = torch.full_like(ids, -100)
    labels[:-1] = ids[1:]
    labels[:prompt_len - 1] = -100
    return labels


def dpo_inputs():
    gen = torch.Generator().manual_seed(DPO_SEED)
    chosen, rejected, cl, rl = [], [], [], []
    for p in PROMPT_LENS:
        prompt = torch.randint(MIN_ID, VOCAB, (p,), generator=gen, dtype=torch.int64)
        reply_c = torch.randint(MIN_ID, VOCAB, (DPO_SEQ - p,), generator=gen, dtype=torch.int64)
        reply_r = torch.randint(MIN_ID, VOCAB, (DPO_SEQ - p,), generator=gen, dtype=torch.int64)
        assert reply_c[0] != reply_r[0]
        c, r = torch.cat([prompt, reply_c]), torch.cat([prompt, reply_r])
        chosen.append(c)
        rejected.append(r)
        cl.append(shifted_labels(c, p))
        rl.append(shifted_labels(r, p))
    return (torch.stack(chosen), torch.stack(cl), torch.stack(rejected), torch.stack(rl),
            torch.tensor(PROMPT_LENS, dtype=torch.int64))


def seq_logps(logits, labels):
    """SUM over non-masked label positions of log_softmax(logits)[label], in float64."""
    lp = logits.double().log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return (lp * (labels != -100)).sum(-1)


def dpo_run(model, chosen_ids, chosen_labels, rejected_ids, rejected_labels):
    """One batched forward [chosen; rejected] for the policy (with grad) and the reference (no grad)."""
    n = chosen_ids.shape[0]
    ids = torch.cat([chosen_ids, rejected_ids])
    labels = torch.cat([chosen_labels, rejected_labels])
    model.zero_grad(set_to_none=True)
    pol = seq_logps(model(input_ids=ids, use_cache=False).logits, labels)
    with torch.no_grad(), model.disable_adapter():
        ref = seq_logps(model(input_ids=ids, use_cache=False).logits, labels)
    pc, pr, rc, rr = pol[:n], pol[n:], ref[:n], ref[n:]
    losses = -F.logsigmoid(BETA * ((pc - pr) - (rc - rr)))
    loss = losses.mean()
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in lora_params(model).items()}
    chosen_rewards = BETA * (pc - rc).detach()
    rejected_rewards = BETA * (pr - rr).detach()
    out = {"policy_chosen_logps": pc.detach(), "policy_rejected_logps": pr.detach(),
           "reference_chosen_logps": rc, "reference_rejected_logps": rr,
           "losses": losses.detach(), "loss": loss.detach().reshape(1),
           "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
           "reward_accuracy": (chosen_rewards > rejected_rewards).double().mean().reshape(1)}
    return out, grads


def trl_check(model, chosen_ids, chosen_labels, rejected_ids, rejected_labels, want, want_grads):
    """TRL's DPOTrainer._compute_loss (loss_type sigmoid, beta 0.1) on a copy of the policy."""
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    m = copy.deepcopy(model)
    tok = AutoTokenizer.from_pretrained(str(ROOT / "tests" / "fixtures" / "llama" / "tokenizer"))
    # The trainer only needs a (text) dataset to construct; the batch below is built by hand.
    ds = Dataset.from_dict({"prompt": ["Hello"], "chosen": [" world"], "rejected": [" there"]})
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, beta=BETA, loss_type=["sigmoid"], report_to=[], use_cpu=True,
                         save_strategy="no", logging_strategy="no", bf16=False, fp16=False, seed=0)
        trainer = DPOTrainer(model=m, args=args, train_dataset=ds, processing_class=tok)
        # Handed a PeftModel that already has an adapter, TRL adds a frozen copy of it named "ref" and uses
        # that as the reference. Our reference is the base (adapters disabled), which is what TRL does for
        # a fresh adapter (peft_config=...): drop the copy so TRL falls back to `disable_adapter()`.
        assert "ref" in trainer.model.peft_config
        trainer.model.delete_adapter("ref")
        assert list(trainer.model.peft_config) == ["default"]
        assert trainer.beta == BETA and trainer.loss_types == ["sigmoid"]
        assert trainer.f_divergence_type == "reverse_kl" and trainer.ld_alpha is None
        assert not trainer.use_weighting and not trainer.precompute_ref_logps
        ids = torch.cat([chosen_ids, rejected_ids])
        labels = torch.cat([chosen_labels, rejected_labels])
        # TRL's completion_mask marks completion *tokens*: token j+1 is scored iff our labels[j] != -100.
        completion_mask = torch.zeros_like(ids)
        completion_mask[:, 1:] = (labels[:, :-1] != -100).long()
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion_mask}
        trainer.model.eval()
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(trainer.model, inputs, False)
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in lora_params(trainer.model).items()}
        metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    errs = {"loss": rel_err(loss.detach().reshape(1), want["loss"])}
    worst = max(grads, key=lambda k: rel_err(grads[k], want_grads[k]))
    errs["grad"], errs["grad_worst"] = rel_err(grads[worst], want_grads[worst]), worst
    checks = {"rewards/chosen": want["chosen_rewards"].mean().item(),
              "rewards/rejected": want["rejected_rewards"].mean().item(),
              "rewards/accuracies": want["reward_accuracy"].item(),
              "logps/chosen": want["policy_chosen_logps"].mean().item(),
              "logps/rejected": want["policy_rejected_logps"].mean().item()}
    errs["metrics"] = max(abs(metrics[k] - v) / max(abs(v), 1e-3) for k, v in checks.items())
    assert errs["loss"] < LOGIT_TOL and errs["grad"] < GRAD_TOL and errs["metrics"] < 1e-4, (errs, metrics, checks)
    return {"version": trl.__version__, "errs": errs}


def build_dpo(adapter_dir: Path) -> dict:
    chosen_ids, chosen_labels, rejected_ids, rejected_labels, prompt_len = dpo_inputs()
    model = load_policy(adapter_dir)
    vals, grads = dpo_run(model, chosen_ids, chosen_labels, rejected_ids, rejected_labels)
    acc = vals["reward_accuracy"].item()
    assert 0.0 < acc < 1.0, acc  # a mixed batch: some pairs right, some wrong
    for k, g in grads.items():
        assert g.abs().max() > 0, k

    # Per-sequence log-probs from one sequence at a time agree with the batched ones.
    with torch.no_grad():
        for i in range(chosen_ids.shape[0]):
            for ids, lab, key in ((chosen_ids, chosen_labels, "chosen"), (rejected_ids, rejected_labels, "rejected")):
                one = seq_logps(model(input_ids=ids[i:i + 1], use_cache=False).logits, lab[i:i + 1])[0]
                assert abs(one - vals[f"policy_{key}_logps"][i]) < 1e-4
                with model.disable_adapter():
                    one = seq_logps(model(input_ids=ids[i:i + 1], use_cache=False).logits, lab[i:i + 1])[0]
                assert abs(one - vals[f"reference_{key}_logps"][i]) < 1e-4

    trl_info = trl_check(model, chosen_ids, chosen_labels, rejected_ids, rejected_labels, vals, grads)

    m64 = load_policy(adapter_dir, torch.float64)
    with pure_f64(m64.base_model.model):
        v64, g64 = dpo_run(m64, chosen_ids, chosen_labels, rejected_ids, rejected_labels)
    worst = max(g64, key=lambda k: rel_err(grads[k], g64[k]))
    f64_errs = {k: rel_err(vals[k], v64[k]) for k in ("policy_chosen_logps", "policy_rejected_logps",
                                                        "reference_chosen_logps", "reference_rejected_logps",
                                                        "losses", "loss")}
    f64_errs["grad"], f64_errs["grad_worst"] = rel_err(grads[worst], g64[worst]), worst
    assert max(v for k, v in f64_errs.items() if k not in ("grad", "grad_worst")) < LOGIT_TOL, f64_errs
    assert f64_errs["grad"] < GRAD_TOL, f64_errs
    assert v64["reward_accuracy"].item() == acc

    tensors = {"chosen_ids": chosen_ids, "chosen_labels": chosen_labels, "rejected_ids": rejected_ids,
               "rejected_labels": rejected_labels, "prompt_len": prompt_len,
               "beta": torch.tensor([BETA], dtype=torch.float32)}
    for k, v in vals.items():
        tensors[k] = v.float().contiguous()
    for k, g in grads.items():
        tensors[f"grad.{k}"] = g.float().contiguous()
    save_file(tensors, str(OUT / "dpo" / "reference.safetensors"), metadata={"format": "pt"})
    return {"tensors": {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in tensors.items()},
            "values": {k: v.tolist() for k, v in vals.items()}, "trl": trl_info, "f64": f64_errs,
            "num_scored": [int((chosen_labels[i] != -100).sum()) for i in range(len(PROMPT_LENS))],
            "chosen_ids": chosen_ids.tolist(), "chosen_labels": chosen_labels.tolist(),
            "rejected_ids": rejected_ids.tolist()}


# ----------------------------------------------------------------------------------------------
# README
# ----------------------------------------------------------------------------------------------

def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def fmt_shape(s):
    return "(" + ", ".join(map(str, s)) + (",)" if len(s) == 1 else ")")


def write_readme(facts, lora, dpo):
    import trl
    lines = []
    w = lines.append
    w("# LoRA / DPO reference fixtures (generated)")
    w("")
    w("Generated by `scripts/make_finetune_fixtures.py` (do not edit by hand; rerun the script). From the")
    w("repository root:")
    w("")
    w("```sh")
    w(COMMAND)
    w("```")
    w("")
    w("(any venv with `pip install -r scripts/requirements-finetune.txt` works the same way).")
    w("")
    w(f"Versions: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
      f"trl {trl.__version__} (DPO cross-check only), safetensors {safetensors.__version__}, numpy "
      f"{np.__version__} (pinned in `scripts/requirements-finetune.txt`). Offline, CPU, fixed seeds, one "
      "thread, `torch.use_deterministic_algorithms(True)`: rerunning reproduces every file byte for byte.")
    w("")
    w(f"Base model: `{BASE_REL}` (from `scripts/make_llama_fixtures.py`: LlamaForCausalLM, vocab 256, hidden "
      "32, 8 heads / 2 kv heads, head_dim 8, intermediate 64, 2 layers, untied lm_head). Loaded with "
      "`attn_implementation=\"eager\"`, float32, eval mode, `use_cache=False`, no attention mask, "
      "positions 0..T-1.")
    w("")
    w("## Files")
    w("")
    for sub in ("lora/adapter", "lora", "dpo"):
        d = OUT / sub
        for f in sorted(p for p in d.iterdir() if p.is_file()):
            w(f"- `{sub}/{f.name}` ({f.stat().st_size} bytes)")
    w("")
    w("## lora/adapter (PEFT LoRA adapter)")
    w("")
    w(f"Written by PEFT {peft.__version__} `PeftModel.save_pretrained` for `LoraConfig(r={R}, lora_alpha={ALPHA}, "
      "lora_dropout=0.0, target_modules=\"all-linear\", bias=\"none\", task_type=\"CAUSAL_LM\")`. PEFT's "
      "model-card `README.md` is deleted (not needed to load).")
    w("")
    w("- `all-linear` expands to every `nn.Linear` of the model EXCEPT the output layer "
      "(`model.get_output_embeddings()`, excluded by PEFT's `_maybe_include_all_linear_layers`): `lm_head` "
      f"is not adapted (checked). Targeted modules ({len(EXPECTED_MODULES)}): "
      + ", ".join(f"`{m}`" for m in EXPECTED_MODULES) + ".")
    c = facts["config"]
    w(f"- In memory `target_modules` becomes a Python `{facts['target_modules_type']}` of these full module "
      "names; `adapter_config.json` stores it as a JSON list of full names (not the string \"all-linear\"). "
      "PEFT writes the list in set-iteration order, which depends on Python's string hash seed, so the "
      "script sorts it (otherwise reruns differ; the order varies with PYTHONHASHSEED). A loader should treat "
      "it as a set. PEFT's matching (`check_target_module_exists`): a JSON string is a regex that must "
      "`re.fullmatch` the module name; a list matches a module if it contains the full name or a suffix "
      "after a dot (`name == key or name.endswith('.' + key)`, e.g. `[\"q_proj\", \"v_proj\"]`).")
    keys = ["r", "lora_alpha", "lora_dropout", "bias", "fan_in_fan_out", "use_rslora", "use_dora",
            "init_lora_weights", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform",
            "exclude_modules", "task_type", "peft_type", "inference_mode", "base_model_name_or_path",
            "peft_version", "lora_bias", "target_parameters"]
    w("- Other `adapter_config.json` fields that matter: " + ", ".join(
        f"`{k}`: `{json.dumps(c[k])}`" for k in keys if k in c) + f" ({len(c)} keys in all; the rest configure other PEFT "
      "variants, all unused here). `use_rslora` false means scaling = lora_alpha / r = "
      f"{SCALING:g} (with rsLoRA it would be lora_alpha / sqrt(r)). `inference_mode: true` is what "
      "save_pretrained always writes (it sets it while saving).")
    w("- `adapter_model.safetensors` (metadata `{\"format\": \"pt\"}`), float32, "
      f"{len(lora['lora_shapes'])} tensors, keys `base_model.model.<module>.lora_A.weight` (r x in) and "
      "`base_model.model.<module>.lora_B.weight` (out x r); NO adapter name (`.default.`) in the keys "
      "(the in-memory parameter names have it: `...q_proj.lora_A.default.weight`). No biases, no "
      "embedding / lm_head tensors. Shapes:")
    w("")
    for k, s in lora["lora_shapes"].items():
        if k.startswith("model.layers.0."):
            w(f"  - `base_model.model.{k}`: {fmt_shape(s)}")
    w("  - (layer 1 identical)")
    w("")
    w(f"- Weights: PEFT initialises A kaiming-uniform and B to zero (the adapter would be a no-op). Here "
      f"every A and B is redrawn from normal(0, {LORA_STD}) (torch.Generator seed {LORA_SEED}, in sorted "
      "name order), so logits differ from the base and both A and B get gradients.")
    w(f"- Forward (PEFT): `y = x W^T + (x A^T B^T) * scaling`, scaling = alpha / r = {SCALING:g}; "
      "lora_dropout 0. Merged weight `W' = W + scaling * B @ A` (fan_in_fan_out false: no transpose).")
    w("")
    w("## lora/reference.safetensors")
    w("")
    w("| tensor | shape | dtype | meaning |")
    w("|---|---|---|---|")
    t = lora["tensors"]
    desc = {
        "input_ids": f"uniform ids in [{MIN_ID}, {VOCAB}) (seed {LM_SEED})",
        "labels": "SHIFTED targets: labels[b, i] = input_ids[b, i+1] for i < 15, -100 at i = 15; also "
                  f"labels[0, 0:{LM_MASKED_PROMPT[1]}] = -100 (masked prompt)",
        "logits": "policy logits (base + adapter)",
        "base_logits": "logits with adapters disabled (`with model.disable_adapter():`), equal to the plain "
                       "base model's",
        "loss": "mean over the non -100 labels of cross_entropy(logits[b, i], labels[b, i]) "
                f"({lora['num_targets']} of {LM_BATCH * LM_SEQ} positions); no further shift",
    }
    for k in ("input_ids", "labels", "logits", "base_logits", "loss"):
        w(f"| `{k}` | {fmt_shape(t[k][0])} | {t[k][1]} | {desc[k]} |")
    w(f"| `grad.<name>` x{sum(1 for k in t if k.startswith('grad.'))} | as the parameter | float32 | d loss / "
      "d parameter for every LoRA parameter; `<name>` = adapter file key without `base_model.model.`, e.g. "
      "`grad.model.layers.0.self_attn.q_proj.lora_A.weight` (4, 32), `grad.model.layers.0.self_attn."
      "q_proj.lora_B.weight` (64, 4) |")
    w(f"| `merged.<module>.weight` x{sum(1 for k in t if k.startswith('merged.'))} | (out, in) | float32 | "
      "PEFT `merge_and_unload()` weight W + (alpha/r) B @ A of every targeted module, e.g. "
      "`merged.model.layers.0.self_attn.q_proj.weight` (64, 32), `merged.model.layers.0.mlp.down_proj.weight` "
      "(32, 64) |")
    w("")
    w(f"loss = {lora['loss']:.6f}; max |logit| = {lora['max_abs_logit']:.3f}; adapter effect max|logits - "
      f"base_logits| / max|base_logits| = {lora['adapter_effect']:.3f}. The merged model's logits equal the "
      f"adapter logits to {lora['merged_logits_err']:.1e} (relative).")
    w("")
    w("## dpo/reference.safetensors")
    w("")
    w(f"Policy = base + the adapter above (the same lora/adapter files); reference = the same model with "
      f"adapters disabled (= the base). beta = {BETA}. {len(PROMPT_LENS)} pairs of length {DPO_SEQ}; "
      f"pair b has a prompt of `prompt_len[b]` = {PROMPT_LENS} tokens shared by chosen and rejected, then "
      "different reply tokens (uniform ids in [3, 256), seed "
      f"{DPO_SEED}; the first reply tokens differ). No padding.")
    w("")
    w("Labels are shifted like lora/ (labels[b, i] = ids[b, i+1], -100 at the last position) and -100 where "
      "the TARGET ids[b, i+1] is a prompt token, i.e. at label positions 0 .. prompt_len[b]-2 (the first "
      "prompt_len[b]-1 positions): label position prompt_len[b]-1 predicts the first reply token and is "
      f"scored. Scored positions per pair: {dpo['num_scored']} (= {DPO_SEQ} - prompt_len). This is TRL's "
      "convention (`completion_mask` over the reply tokens, log-prob of every completion token).")
    w("")
    w("| tensor | shape | dtype | meaning |")
    w("|---|---|---|---|")
    t = dpo["tensors"]
    desc = {
        "chosen_ids": "prompt + chosen reply",
        "chosen_labels": "shifted, prompt targets and last position -100",
        "rejected_ids": "same prompt + rejected reply",
        "rejected_labels": "as chosen_labels",
        "prompt_len": "prompt tokens per pair",
        "beta": "DPO beta",
        "policy_chosen_logps": "SUM over non -100 positions of log_softmax(policy logits)[label]",
        "policy_rejected_logps": "same, rejected",
        "reference_chosen_logps": "same with adapters disabled",
        "reference_rejected_logps": "same with adapters disabled, rejected",
        "losses": "-logsigmoid(beta * ((pc - pr) - (rc - rr)))",
        "loss": "mean of losses",
        "chosen_rewards": "beta * (pc - rc)",
        "rejected_rewards": "beta * (pr - rr)",
        "reward_accuracy": "mean of (chosen_rewards > rejected_rewards)",
    }
    for k in desc:
        w(f"| `{k}` | {fmt_shape(t[k][0])} | {t[k][1]} | {desc[k]} |")
    w(f"| `grad.<name>` x{sum(1 for k in t if k.startswith('grad.'))} | as the parameter | float32 | d loss / "
      "d parameter, names as in lora/ (reference forward under no_grad) |")
    w("")
    v = dpo["values"]
    for k in ("policy_chosen_logps", "policy_rejected_logps", "reference_chosen_logps",
              "reference_rejected_logps", "losses", "loss", "chosen_rewards", "rejected_rewards",
              "reward_accuracy"):
        w(f"- `{k}` = {[round(x, 6) for x in v[k]]}")
    w("")
    w("Precision: the policy / reference forwards are stock float32 (transformers + PEFT); the logits are "
      "cast to float64 before log_softmax, so the log-prob sums, losses, rewards and the backward pass down "
      "to the logits are float64; everything is stored as float32. Chosen and rejected go through one "
      "batched forward ([chosen; rejected], 6 x 12); the script checks that one-sequence-at-a-time forwards "
      "give the same log-probs.")
    w("")
    tr = dpo["trl"]
    w(f"TRL cross-check (trl {tr['version']}): this TRL has no standalone `dpo_loss` function; the loss is "
      "inline in `DPOTrainer._compute_loss` (trl/trainer/dpo_trainer.py: per-token log-probs from the model's "
      "fused LM head, summed over the completion; `chosen_logratios = chosen_logps - ref_chosen_logps`; "
      "`loss_type=\"sigmoid\"`: `-F.logsigmoid(beta * (chosen_logratios - rejected_logratios))`, "
      "`.mean()`; rewards `beta * logratios`, accuracy `(chosen_rewards > rejected_rewards).float()`). The "
      "script builds a real `DPOTrainer(model=<copy of the policy>, args=DPOConfig(beta=0.1, "
      "loss_type=[\"sigmoid\"]))`, deletes the frozen \"ref\" adapter copy TRL adds when handed a PeftModel "
      "that already has an adapter (so the reference is the base via `disable_adapter()`, as TRL does for a "
      "fresh adapter), calls `_compute_loss` on the same batch (TRL's `completion_mask` = 1 on reply tokens) "
      "and backpropagates. Max relative difference to this fixture: loss "
      f"{tr['errs']['loss']:.1e}, worst gradient {tr['errs']['grad']:.1e} (`{tr['errs']['grad_worst']}`), "
      f"logged rewards / accuracy / logps {tr['errs']['metrics']:.1e}.")
    w("")
    w("Note: with a PeftModel that already carries a trained adapter, TRL's default reference is a frozen "
      "copy of that adapter (not the base); this fixture's reference is the base.")
    w("")
    w("## Conventions")
    w("")
    w("- Labels are stored ALREADY SHIFTED: logits[b, i] is scored against labels[b, i] (no further shift; "
      "do not feed them to HF's `labels=`, which shifts again).")
    w("- Gradient names drop PEFT's `base_model.model.` prefix and the `.default` adapter name: "
      "`grad.model.layers.<L>.<self_attn|mlp>.<proj>.lora_<A|B>.weight`.")
    w(f"- LoRA scaling alpha / r = {ALPHA} / {R} = {SCALING:g}; A is (r, in), B is (out, r).")
    w("- No gradients for base weights (frozen; PEFT sets requires_grad False on everything but LoRA).")
    w("- Scalars are stored with shape (1,) (`loss`, `reward_accuracy`, `beta`) in these files (the llama "
      "fixtures use shape ()).")
    w("")
    w("## Precision (measured)")
    w("")
    w("Max relative error (max |x - ref| / max |ref|) of these float32 references against the same "
      "computation with the whole model in float64 (no internal float32 steps):")
    w("")
    f = lora["f64"]
    w(f"- lora: logits {f['logits']:.1e}, base_logits {f['base_logits']:.1e}, loss {f['loss']:.1e}, worst "
      f"grad {f['grad']:.1e} (`{f['grad_worst']}`)")
    f = dpo["f64"]
    w("- dpo: " + ", ".join(f"{k} {f[k]:.1e}" for k in ("policy_chosen_logps", "policy_rejected_logps",
                                                         "reference_chosen_logps", "reference_rejected_logps",
                                                         "losses", "loss"))
      + f", worst grad {f['grad']:.1e} (`{f['grad_worst']}`)")
    w("")
    w("An f32 implementation should match to about 1e-5 (logits, log-probs, losses) and 1e-4 (gradients) "
      "relative.")
    w("")
    w("## Checking an adapter written by Rust")
    w("")
    w("```sh")
    w("/work/venv21/bin/python scripts/check_peft_adapter.py tests/fixtures/llama/gqa ADAPTER_DIR "
      "tests/fixtures/finetune/lora/reference.safetensors [--merged MERGED_DIR]")
    w("```")
    w("")
    w("loads the base with transformers, applies ADAPTER_DIR with `PeftModel.from_pretrained`, runs the "
      "reference `input_ids` and requires max |logits - ref| / max |ref| <= 1e-4; with `--merged`, also "
      "loads MERGED_DIR as a plain LlamaForCausalLM and requires its logits to match the PEFT model's "
      "within 1e-4. Prints the max diffs; exits non-zero on a mismatch.")
    w("")
    w("## Sizes (bytes)")
    w("")
    w(f"- `lora/`: {dir_bytes(OUT / 'lora')}")
    w(f"- `dpo/`: {dir_bytes(OUT / 'dpo')}")
    w("")
    (OUT / "README.md").write_text("\n".join(lines))


def main():
    setup_determinism()
    if OUT.exists():
        shutil.rmtree(OUT)
    (OUT / "lora").mkdir(parents=True)
    (OUT / "dpo").mkdir(parents=True)
    adapter_dir = OUT / "lora" / "adapter"
    facts = build_adapter(adapter_dir)
    lora = build_lora(adapter_dir, facts)
    log(f"lora: loss={lora['loss']:.6f} effect={lora['adapter_effect']:.3f} f64={lora['f64']} "
        f"merged={lora['merged_logits_err']:.2e}")
    dpo = build_dpo(adapter_dir)
    log(f"dpo: {dpo['values']['losses']} acc={dpo['values']['reward_accuracy']} trl={dpo['trl']} f64={dpo['f64']}")
    write_readme(facts, lora, dpo)
    digest = hashlib.sha256()
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            digest.update(str(p.relative_to(OUT)).encode() + b"\0" + p.read_bytes())
    log(f"wrote {OUT} ({dir_bytes(OUT)} bytes), sha256 of all files {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
