#!/usr/bin/env python3
"""Reference fixtures for the DiT port: a tiny random diffusers `DiTTransformer2DModel` and what
diffusers + PyTorch compute with it.

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-dit.txt
    .venv/bin/python scripts/make_dit_fixtures.py [OUT_DIR]      # default tests/fixtures/dit/tiny

Writes OUT_DIR/config.json + diffusion_pytorch_model.safetensors (`save_pretrained`, f32, every
parameter re-initialised non-zero so adaLN-Zero is not zero and every gradient is non-trivial)
and OUT_DIR/reference.safetensors:

  fwd.*          forward outputs for integer and float timesteps (and in float64), patch
                 tokens, block 0's conditioning
  *.grad64.*     the same gradients computed in float64 (stored as f32), so a test can hold
                 our f32 error to PyTorch's own f32 error instead of to their difference
  ddpm.*         DiT's DDPM training loss (facebookresearch/DiT `create_diffusion("")`: linear
                 betas 1e-4..0.02 over 1000 steps, MSE on eps, learned-range variance trained by
                 the variational bound in bits, eps detached there): inputs, x_t, per-sample
                 mse and vb, the mean loss and the gradient of every parameter
  flow.*         rectified flow: x_s = (1 - s) x0 + s noise at timestep 1000 s, target
                 noise - x0, mean-squared error; loss and every gradient
  respace{50,5}.*  DiT's respaced schedules (betas float64, timestep_map)
  ddim.*         DDIM (eta 0) in 5 respaced steps with classifier-free guidance 4 from fixed noise
  ddpm_sample.*  ancestral DDPM in 5 respaced steps from fixed per-step noise

Timestep features. diffusers computes the sinusoidal timestep features in float32 (argument error
~1e-4 rad at t = 1000). `fwd.output*`, `fwd.cond` and `ddpm.*` (f32) are diffusers as it is. The
float64 runs (`*64`) and, deliberately, the f32 `flow.loss`, `flow.grad.*`, `ddim.out` and
`ddpm_sample.out` use the features computed in float64 (cast to the model dtype by diffusers), as
the Rust port computes them; `flow.loss_diffusers`, `ddim.out_diffusers` and
`ddpm_sample.out_diffusers` are the same three with diffusers' own f32 features.

Every model call is in eval mode: diffusers' `LabelEmbedding` (class_dropout_prob 0.1) replaces
labels by the null class at random in train mode; there is no other dropout in this config.

The diffusion formulas are written here from DiT's `gaussian_diffusion.py`, `diffusion_utils.py`
and `respace.py` (float64 numpy tables, per-sample values cast to float32 as its
`_extract_into_tensor` does). Guidance is applied to all `in_channels` noise channels (DiT's
`forward_with_cfg` hard-codes 3 of 4 latent channels; we guide every noise channel).
"""
import contextlib
import copy
import math
import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import DiTTransformer2DModel
from diffusers.models import embeddings
from safetensors.torch import load_file, save_file

torch.manual_seed(0)
np.random.seed(0)

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/dit/tiny")
CONFIG = dict(
    num_attention_heads=4,
    attention_head_dim=8,
    in_channels=4,
    out_channels=8,
    num_layers=2,
    sample_size=8,
    patch_size=2,
    num_embeds_ada_norm=10,
    norm_type="ada_norm_zero",
    activation_fn="gelu-approximate",
    attention_bias=True,
    norm_elementwise_affine=False,
    norm_eps=1e-5,
)
NULL = CONFIG["num_embeds_ada_norm"]


# --------------------------------------------------------------------------------------------
# DiT's Gaussian diffusion (float64 tables)
# --------------------------------------------------------------------------------------------
class Diffusion:
    def __init__(self, betas, timestep_map=None):
        self.betas = betas = np.asarray(betas, dtype=np.float64)
        self.num_timesteps = len(betas)
        self.timestep_map = list(range(len(betas))) if timestep_map is None else timestep_map
        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas, axis=0)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_log_variance_clipped = np.log(
            np.append(self.posterior_variance[1], self.posterior_variance[1:])
        )
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)

    @staticmethod
    def linear(n=1000):
        scale = 1000 / n
        return Diffusion(np.linspace(scale * 0.0001, scale * 0.02, n, dtype=np.float64))

    def respaced(self, steps):
        size = self.num_timesteps
        stride = 1 if steps <= 1 else (size - 1) / (steps - 1)
        cur, keep = 0.0, set()
        for _ in range(steps):
            keep.add(round(cur))
            cur += stride
        last, betas, tmap = 1.0, [], []
        for i, ac in enumerate(self.alphas_cumprod):
            if i in keep:
                betas.append(1 - ac / last)
                last = ac
                tmap.append(i)
        return Diffusion(np.array(betas), tmap)


DTYPE = [torch.float32]  # the dtype of the tables' per-sample values (float64 for the f64 run)


def ex(arr, t, ndim=4):
    res = torch.from_numpy(arr)[t].to(DTYPE[0])
    return res.view(-1, *([1] * (ndim - 1)))


def q_sample(d, x0, t, noise):
    return ex(d.sqrt_alphas_cumprod, t) * x0 + ex(d.sqrt_one_minus_alphas_cumprod, t) * noise


def q_posterior(d, x0, x_t, t):
    mean = ex(d.posterior_mean_coef1, t) * x0 + ex(d.posterior_mean_coef2, t) * x_t
    return mean, ex(d.posterior_log_variance_clipped, t)


def p_mean_variance(d, out, x, t):
    C = x.shape[1]
    eps, var = out[:, :C], out[:, C:]
    min_log = ex(d.posterior_log_variance_clipped, t)
    max_log = ex(np.log(d.betas), t)
    frac = (var + 1) / 2
    log_var = frac * max_log + (1 - frac) * min_log
    x0 = ex(d.sqrt_recip_alphas_cumprod, t) * x - ex(d.sqrt_recipm1_alphas_cumprod, t) * eps
    mean, _ = q_posterior(d, x0, x, t)
    return mean, log_var, x0


def normal_kl(m1, lv1, m2, lv2):
    return 0.5 * (-1.0 + lv2 - lv1 + torch.exp(lv1 - lv2) + ((m1 - m2) ** 2) * torch.exp(-lv2))


def approx_cdf(x):
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def discretized_ll(x, means, log_scales):
    centered = x - means
    inv = torch.exp(-log_scales)
    cdf_plus = approx_cdf(inv * (centered + 1.0 / 255.0))
    cdf_min = approx_cdf(inv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    delta = cdf_plus - cdf_min
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus, torch.log(delta.clamp(min=1e-12))))


def timestep_embedding64(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1, scale=1, max_period=10000):
    """diffusers' get_timestep_embedding computed in float64 (for the float64 reference)."""
    half = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float64) / (half - downscale_freq_shift)
    emb = scale * timesteps[:, None].double() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    return emb


@contextlib.contextmanager
def f64_timestep_features():
    """diffusers' timestep features computed in float64 while inside (see the docstring)."""
    orig = embeddings.get_timestep_embedding
    embeddings.get_timestep_embedding = timestep_embedding64
    try:
        yield
    finally:
        embeddings.get_timestep_embedding = orig


def mean_flat(x):
    return x.mean(dim=list(range(1, x.ndim)))


def ddpm_losses(d, model, x0, t, labels, noise):
    x_t = q_sample(d, x0, t, noise)
    out = model(x_t, timestep=t, class_labels=labels).sample
    C = x0.shape[1]
    eps = out[:, :C]
    frozen = torch.cat([eps.detach(), out[:, C:]], dim=1)
    true_mean, true_lv = q_posterior(d, x0, x_t, t)
    mean, lv, _ = p_mean_variance(d, frozen, x_t, t)
    kl = mean_flat(normal_kl(true_mean, true_lv, mean, lv)) / math.log(2.0)
    nll = mean_flat(-discretized_ll(x0, mean, 0.5 * lv)) / math.log(2.0)
    vb = torch.where(t == 0, nll, kl)
    mse = mean_flat((noise - eps) ** 2)
    return x_t, mse, vb


# --------------------------------------------------------------------------------------------
# The model and the references
# --------------------------------------------------------------------------------------------
def main():
    OUT.mkdir(parents=True, exist_ok=True)
    model = DiTTransformer2DModel(**CONFIG)
    # The null (guidance) class: a table of num_classes + 1 rows when class_dropout_prob > 0.
    table = model.transformer_blocks[0].norm1.emb.class_embedder.embedding_table
    assert table.weight.shape == (NULL + 1, CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.5 if "embedding_table" in name else (0.1 if name.endswith("bias") else 0.2)
            p.copy_(torch.randn(p.shape, generator=g) * std)
    model.eval()  # for every call below: train mode would drop class labels at random
    model.save_pretrained(OUT, safe_serialization=True)
    ref = {}
    C, S = CONFIG["in_channels"], CONFIG["sample_size"]

    # Forward.
    sample = torch.randn(3, C, S, S, generator=g)
    ts = torch.tensor([0, 421, 999])
    labels = torch.tensor([3, NULL, 7])
    tf = torch.tensor([0.5, 250.25, 999.0])
    with torch.no_grad():
        ref["fwd.sample"] = sample
        ref["fwd.timestep"] = ts
        ref["fwd.class_labels"] = labels
        ref["fwd.output"] = model(sample, timestep=ts, class_labels=labels).sample
        ref["fwd.timestep_float"] = tf
        ref["fwd.output_float"] = model(sample, timestep=tf, class_labels=labels).sample
        ref["fwd.patch_tokens"] = model.pos_embed(sample)
        ref["fwd.cond"] = model.transformer_blocks[0].norm1.emb(ts, labels, hidden_dtype=torch.float32)

    # DDPM training loss and gradients.
    d = Diffusion.linear(1000)
    x0 = torch.rand(4, C, S, S, generator=g) * 2 - 1
    x0[0, 0, 0, :3] = torch.tensor([-1.0, 1.0, 0.9995])
    x0[3, 1, 2, :2] = torch.tensor([1.0, -1.0])
    t = torch.tensor([0, 1, 500, 999])
    yl = torch.tensor([1, 4, NULL, 9])
    noise = torch.randn(4, C, S, S, generator=g)
    model.zero_grad()
    x_t, mse, vb = ddpm_losses(d, model, x0, t, yl, noise)
    loss = (mse + vb).mean()
    loss.backward()
    ref.update({"ddpm.x0": x0, "ddpm.t": t, "ddpm.labels": yl, "ddpm.noise": noise,
                "ddpm.x_t": x_t.detach(), "ddpm.mse": mse.detach(), "ddpm.vb": vb.detach(),
                "ddpm.loss": loss.detach()})
    for name, p in model.named_parameters():
        ref[f"ddpm.grad.{name}"] = p.grad.detach().clone()

    # The same in float64 (the timestep features too: diffusers computes them in float32).
    m64 = copy.deepcopy(model).double()
    DTYPE[0] = torch.float64
    with f64_timestep_features():
        m64.zero_grad()
        _, mse64, vb64 = ddpm_losses(d, m64, x0.double(), t, yl, noise.double())
        loss64 = (mse64 + vb64).mean()
        loss64.backward()
        ref["ddpm.loss64"] = loss64.detach().float()
        with torch.no_grad():
            for key, ts_ in (("fwd.output64", ts), ("fwd.output_float64", tf)):
                ref[key] = m64(sample.double(), timestep=ts_.double(), class_labels=labels).sample.float()
    ref["ddpm.mse64"] = mse64.detach().float()
    ref["ddpm.vb64"] = vb64.detach().float()
    for name, p in m64.named_parameters():
        ref[f"ddpm.grad64.{name}"] = p.grad.detach().float()
    DTYPE[0] = torch.float32

    # Rectified flow.
    x0 = torch.rand(4, C, S, S, generator=g) * 2 - 1
    noise = torch.randn(4, C, S, S, generator=g)
    s = torch.sigmoid(torch.randn(4, generator=g))
    yl = torch.tensor([0, 2, 5, NULL])

    def flow_loss(m, x0, noise, s):
        m.zero_grad()
        sv = s.view(-1, 1, 1, 1)
        xs = (1 - sv) * x0 + sv * noise
        out = m(xs, timestep=s * 1000, class_labels=yl).sample[:, :C]
        loss = mean_flat((out - (noise - x0)) ** 2).mean()
        loss.backward()
        return loss

    with f64_timestep_features():
        floss = flow_loss(model, x0, noise, s)
    ref.update({"flow.x0": x0, "flow.noise": noise, "flow.labels": yl, "flow.s": s, "flow.loss": floss.detach()})
    for name, p in model.named_parameters():
        ref[f"flow.grad.{name}"] = p.grad.detach().clone()
    ref["flow.loss_diffusers"] = flow_loss(model, x0, noise, s).detach()
    with f64_timestep_features():
        floss64 = flow_loss(m64, x0.double(), noise.double(), s.double())
    ref["flow.loss64"] = floss64.detach().float()
    for name, p in m64.named_parameters():
        ref[f"flow.grad64.{name}"] = p.grad.detach().float()

    # Respacing.
    for n in (50, 5):
        r = d.respaced(n)
        ref[f"respace{n}.betas"] = torch.from_numpy(r.betas.copy())
        ref[f"respace{n}.timestep_map"] = torch.tensor(r.timestep_map)

    def guided(r, x, i, y, scale):
        b = x.shape[0]
        tm = torch.tensor([r.timestep_map[i]] * (2 * b if scale is not None else b))
        if scale is None:
            return model(x, timestep=tm, class_labels=y).sample
        both = torch.cat([x, x])
        out = model(both, timestep=tm, class_labels=torch.cat([y, torch.full_like(y, NULL)])).sample
        cond, unc = out[:b], out[b:]
        eps = unc[:, :C] + scale * (cond[:, :C] - unc[:, :C])
        return torch.cat([eps, cond[:, C:]], dim=1)

    r = d.respaced(5)

    def ddim(z, y, scale):
        x = z
        for i in reversed(range(r.num_timesteps)):
            t = torch.tensor([i] * 2)
            out = guided(r, x, i, y, scale)
            _, _, px0 = p_mean_variance(r, out, x, t)
            eps = (ex(r.sqrt_recip_alphas_cumprod, t) * x - px0) / ex(r.sqrt_recipm1_alphas_cumprod, t)
            ab_prev = ex(r.alphas_cumprod_prev, t)
            x = px0 * torch.sqrt(ab_prev) + torch.sqrt(1 - ab_prev) * eps
        return x

    def ddpm_sample(z, y, steps):
        x = z
        for k, i in enumerate(reversed(range(r.num_timesteps))):
            t = torch.tensor([i] * 2)
            out = guided(r, x, i, y, None)
            mean, lv, _ = p_mean_variance(r, out, x, t)
            x = mean + (0.0 if i == 0 else 1.0) * torch.exp(0.5 * lv) * steps[k]
        return x

    with torch.no_grad():
        z = torch.randn(2, C, S, S, generator=g)
        y = torch.tensor([2, 6])
        with f64_timestep_features():
            x = ddim(z, y, 4.0)
        ref.update({"ddim.noise": z, "ddim.labels": y, "ddim.guidance": torch.tensor(4.0), "ddim.out": x})
        ref["ddim.out_diffusers"] = ddim(z, y, 4.0)

        z = torch.randn(2, C, S, S, generator=g)
        steps = torch.randn(r.num_timesteps, 2, C, S, S, generator=g)
        y = torch.tensor([1, 8])
        with f64_timestep_features():
            x = ddpm_sample(z, y, steps)
        ref.update({"ddpm_sample.noise": z, "ddpm_sample.step_noise": steps, "ddpm_sample.labels": y, "ddpm_sample.out": x})
        ref["ddpm_sample.out_diffusers"] = ddpm_sample(z, y, steps)

    save_file({k: v.contiguous() for k, v in ref.items()}, OUT / "reference.safetensors")

    # Reload both files: the checkpoint loads with no missing or unexpected keys and reproduces
    # the forward output exactly; every parameter has a gradient for both objectives.
    back = load_file(str(OUT / "reference.safetensors"))
    assert back.keys() == ref.keys() and all(torch.equal(back[k], ref[k].contiguous()) for k in ref)
    again, info = DiTTransformer2DModel.from_pretrained(OUT, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        out = again.eval()(sample, timestep=ts, class_labels=labels).sample
    assert torch.equal(out, back["fwd.output"])
    names = [n for n, _ in again.named_parameters()]
    assert sorted(names) == sorted(load_file(str(OUT / "diffusion_pytorch_model.safetensors")).keys())
    for pre in ("ddpm.grad.", "flow.grad.", "ddpm.grad64.", "flow.grad64."):
        assert all(pre + n in back for n in names), pre
    print(f"wrote {OUT}: {len(ref)} reference tensors")


if __name__ == "__main__":
    main()
