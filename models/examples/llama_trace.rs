//! Numerics trace of a single-rank LLaMA forward, op by op, for accuracy investigations
//! (`docs/accuracy.md`).
//!
//!     cargo run --release -p cpl-models --example llama_trace -- MODEL_DIR INPUTS OUT
//!
//! `MODEL_DIR` is a Hugging Face LLaMA directory (`model*.safetensors`, computed in f32).
//! `INPUTS` is a safetensors file with `input_ids` (1, n) and, for every layer `L`, the inputs of
//! each op as a reference computed them (f32): `L.x` (layer input), `L.n1` (input norm output),
//! `L.ql`, `L.kl` (q/k projections before RoPE), `L.q`, `L.k`, `L.v` (attention inputs,
//! `(1, n, heads, head_dim)`), `L.o` (attention output `(1, n, hidden)`), `L.h` (after the
//! attention residual), `L.n2`, `L.g`, `L.u`, `L.s` (SwiGLU output); and `final.x` (input of the
//! final norm), `final.n` (its output). `OUT` receives, under the same names prefixed by `op.`,
//! what this crate's ops compute from those inputs (each op fed the reference's input: local
//! errors), and under `run.` the free-running forward (each op fed this crate's own previous
//! output), including `run.logits`, which must equal `cpl eval --logits-out`.
//!
//! The ops are the ones `models::llama` calls (`rms_norm`, `linear`, `RotaryEmbedding`,
//! `flash_ring::flash_fwd`, `swiglu`), composed in the same order.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::nn::linear;
use candle_parallel::ops::{rms_norm, swiglu, RotaryEmbedding};
use flash_ring::{AttnSpec, MaskKind, Positions};
use models::llama::LlamaConfig;

/// The shapes the trace needs, from the checkpoint's config.json (as `cpl` reads it).
struct Cfg {
    layers: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
    eps: f64,
    tied: bool,
}

impl Cfg {
    fn new(c: &LlamaConfig) -> Self {
        Cfg {
            layers: c.num_hidden_layers,
            hq: c.num_attention_heads,
            hkv: c.num_kv_heads(),
            hd: c.head_dim(),
            eps: c.rms_norm_eps,
            tied: c.tie_word_embeddings,
        }
    }
}

struct Layer<'a> {
    w: &'a HashMap<String, Tensor>,
    cfg: &'a Cfg,
    rope: &'a RotaryEmbedding,
    pos: &'a [u32],
    i: usize,
}

impl Layer<'_> {
    fn w(&self, name: &str) -> Result<&Tensor> {
        let k = format!("model.layers.{}.{name}", self.i);
        self.w.get(&k).with_context(|| format!("weight {k}"))
    }

    fn heads(&self, x: &Tensor, h: usize) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        Ok(x.reshape((b, n, h, self.cfg.hd))?)
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = q.dim(1)?;
        let spec = AttnSpec::new(
            1.0 / (self.cfg.hd as f32).sqrt(),
            MaskKind::Causal,
            Positions::range(0, n),
            Positions::range(0, n),
        );
        let (o, lse) = flash_ring::flash_fwd(q, k, v, &spec)?;
        let (b, n, h, d) = o.dims4()?;
        Ok((o.reshape((b, n, h * d))?, lse))
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        bail!("usage: llama_trace MODEL_DIR INPUTS OUT");
    }
    let dir = std::path::Path::new(&args[1]);
    let config_path = dir.join("config.json");
    let config = LlamaConfig::from_file(&config_path)?;
    let cfg = Cfg::new(&config);
    let dev = Device::Cpu;
    // The checkpoint's tensors (`model*.safetensors`: one file or shards), as f32.
    let mut w = HashMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("model") && name.ends_with(".safetensors") {
            for (k, t) in candle_core::safetensors::load(&path, &dev)? {
                w.insert(k, t.to_dtype(DType::F32)?);
            }
        }
    }
    let inp = candle_core::safetensors::load(&args[2], &dev)?;
    let get = |k: &str| -> Result<&Tensor> { inp.get(k).with_context(|| format!("input {k}")) };
    let ids = get("input_ids")?.to_dtype(DType::U32)?;
    let n = ids.dim(1)?;
    let pos: Vec<u32> = (0..n as u32).collect();
    let (theta, scaling) = config.rope(&config_path)?;
    let rope = RotaryEmbedding::new(cfg.hd, theta, &scaling)?;
    let mut out: HashMap<String, Tensor> = HashMap::new();
    let emb = w
        .get("model.embed_tokens.weight")
        .context("model.embed_tokens.weight")?;
    let mut x = emb.embedding(&ids.flatten_all()?)?.unsqueeze(0)?;
    out.insert("run.embed".into(), x.clone());
    for i in 0..cfg.layers {
        let l = Layer {
            w: &w,
            cfg: &cfg,
            rope: &rope,
            pos: &pos,
            i,
        };
        // Each op on the reference's input (local error) and on our own previous output.
        for mode in ["op", "run"] {
            let r = |name: &str, own: &Tensor| -> Result<Tensor> {
                if mode == "op" {
                    Ok(get(&format!("{i}.{name}"))?.clone())
                } else {
                    Ok(own.clone())
                }
            };
            let put = |out: &mut HashMap<String, Tensor>, name: &str, t: &Tensor| {
                out.insert(format!("{mode}.{i}.{name}"), t.clone());
            };
            let xin = r("x", &x)?;
            let n1 = rms_norm(&xin, l.w("input_layernorm.weight")?, cfg.eps)?;
            put(&mut out, "n1", &n1);
            let n1r = r("n1", &n1)?;
            let ql = linear(&n1r, l.w("self_attn.q_proj.weight")?, None)?;
            let kl = linear(&n1r, l.w("self_attn.k_proj.weight")?, None)?;
            let vl = linear(&n1r, l.w("self_attn.v_proj.weight")?, None)?;
            put(&mut out, "ql", &ql);
            put(&mut out, "kl", &kl);
            let q = l.rope.apply(&l.heads(&r("ql", &ql)?, cfg.hq)?, l.pos)?;
            let k = l.rope.apply(&l.heads(&r("kl", &kl)?, cfg.hkv)?, l.pos)?;
            let v = l.heads(&vl, cfg.hkv)?;
            put(&mut out, "q", &q);
            put(&mut out, "k", &k);
            put(&mut out, "v", &v);
            let (o, lse) = l.attention(&r("q", &q)?, &r("k", &k)?, &r("v", &v)?)?;
            put(&mut out, "o", &o);
            put(&mut out, "lse", &lse);
            let a = linear(&r("o", &o)?, l.w("self_attn.o_proj.weight")?, None)?;
            put(&mut out, "a", &a);
            let h = (&xin + &a)?;
            put(&mut out, "h", &h);
            let hr = r("h", &h)?;
            let n2 = rms_norm(&hr, l.w("post_attention_layernorm.weight")?, cfg.eps)?;
            put(&mut out, "n2", &n2);
            let n2r = r("n2", &n2)?;
            let g = linear(&n2r, l.w("mlp.gate_proj.weight")?, None)?;
            let u = linear(&n2r, l.w("mlp.up_proj.weight")?, None)?;
            put(&mut out, "g", &g);
            put(&mut out, "u", &u);
            let s = swiglu(&r("g", &g)?, &r("u", &u)?)?;
            put(&mut out, "s", &s);
            let dn = linear(&r("s", &s)?, l.w("mlp.down_proj.weight")?, None)?;
            put(&mut out, "d", &dn);
            let y = (&hr + &dn)?;
            put(&mut out, "y", &y);
            if mode == "run" {
                x = y;
            }
        }
    }
    let head = if cfg.tied {
        emb
    } else {
        w.get("lm_head.weight").context("lm_head.weight")?
    };
    let norm_w = w.get("model.norm.weight").context("model.norm.weight")?;
    for (mode, xin) in [("op", get("final.x")?.clone()), ("run", x.clone())] {
        let nf = rms_norm(&xin, norm_w, cfg.eps)?;
        out.insert(format!("{mode}.final.n"), nf.clone());
        let nr = if mode == "op" {
            get("final.n")?.clone()
        } else {
            nf
        };
        out.insert(
            format!("{mode}.logits"),
            linear(&nr, head, None)?.squeeze(0)?,
        );
    }
    let out: HashMap<String, Tensor> = out
        .into_iter()
        .map(|(k, v)| Ok((k, v.contiguous()?)))
        .collect::<Result<_>>()?;
    candle_core::safetensors::save(&out, &args[3])?;
    Ok(())
}
