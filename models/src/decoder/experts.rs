//! LoRA adapters of a mixture of experts in PEFT's format under transformers 5, for a model
//! that holds one adapter per expert.
//!
//! transformers 5 keeps a sparse block's experts as two 3-D parameters, `mlp.experts.gate_up_proj`
//! `(E, 2I, H)` (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` `(E, H,
//! I)`, and PEFT adapts them with `target_parameters` (`lora.ParamWrapper`): one LoRA per
//! parameter, its factors stacked over the experts. With `R` the parameter's rank:
//!
//! - `lora_A.weight` `(R·E, in)`: expert `e`'s `A_e` `(R, in)` is rows `e·R .. (e+1)·R`;
//! - `lora_B.weight` `(out, R·E)`: expert `e`'s `B_e` `(out, R)` is columns `e, e+E, e+2E, ..`
//!   (`B.reshape(out, R, E)[:, :, e]`);
//! - expert `e`'s weight is `W_e + s · B_e A_e`, `s = alpha / R` (`alpha / √R` with rsLoRA).
//!
//! When both parameters are adapted the wrappers nest: `gate_up_proj`'s factors are stored as
//! `mlp.experts.base_layer.lora_A.weight` / `lora_B.weight` and `down_proj`'s as
//! `mlp.experts.lora_A.weight` / `lora_B.weight`; when one is, it is `mlp.experts.lora_*`. The
//! router (`mlp.gate.weight`, `target_parameters` `gate.weight`) has a plain `(r, H)` / `(E, r)`
//! pair at `mlp.gate.lora_*`. Mixtral's block is `mlp` in memory, `block_sparse_moe` in the
//! checkpoint.
//!
//! The model (see `candle_parallel::nn::moe`) holds expert `e`'s adapters under the checkpoint's
//! per-expert names: `experts.e.gate_up_proj.lora_A.weight` (shared by gate and up),
//! `experts.e.<gate>.lora_B.weight` and `experts.e.<up>.lora_B.weight` (the rows of the fused `B_e`),
//! `experts.e.<down>.lora_A.weight` and `lora_B.weight`. [`ExpertsSource`] reads an adapter under
//! those names; [`ExpertsLayout::fuse`] writes them back in PEFT's.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_parallel::nn::{MoeConfig, Shard, TensorSource};

use crate::error::{Error, Result};

/// PEFT's (transformers 5's) folder of the sparse block.
const PEFT_FOLDER: &str = "mlp";
const FUSED_A: &str = "gate_up_proj";

/// A sparse block's adapter names, in the model's and in PEFT's layout.
#[derive(Debug, Clone)]
pub struct ExpertsLayout {
    /// The block's folder in the checkpoint (`mlp`, `block_sparse_moe`).
    folder: String,
    block: MoeConfig,
}

/// One adapter tensor of the model, by what it is.
#[derive(Debug, Clone, PartialEq)]
enum Part {
    /// The router's `lora_A` or `lora_B` (`ab` = "A" / "B").
    Router(&'static str),
    /// Expert `e`'s `A` of the fused gate/up projection.
    GateUpA(usize),
    /// Expert `e`'s rows of the fused `B`: gate (0) or up (1).
    GateUpB(usize, usize),
    /// Expert `e`'s down projection's `A` or `B`.
    Down(usize, &'static str),
}

/// A model name split: `head` (up to and including `model.layers.N`) and the part.
struct Parsed {
    head: String,
    part: Part,
}

/// Which parameter a PEFT experts tensor adapts.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Param {
    GateUp,
    Down,
}

impl ExpertsLayout {
    pub fn new(folder: &str, block: &MoeConfig) -> Self {
        Self {
            folder: folder.to_string(),
            block: block.clone(),
        }
    }

    /// The model's adapter name `name`, parsed; `None` for any other name.
    fn parse(&self, name: &str) -> Option<Parsed> {
        let sep = format!(".{}.", self.folder);
        let at = name.find(&sep)?;
        let (head, rest) = (&name[..at], &name[at + sep.len()..]);
        let ab = |s: &str| match s {
            "lora_A.weight" => Some("A"),
            "lora_B.weight" => Some("B"),
            _ => None,
        };
        let part = if let Some(t) = rest.strip_prefix(&format!("{}.", self.block.router)) {
            Part::Router(ab(t)?)
        } else {
            let t = rest.strip_prefix(&format!("{}.", self.block.experts))?;
            let (e, t) = t.split_once('.')?;
            let e: usize = e.parse().ok()?;
            let (module, t) = t.split_once('.')?;
            let ab = ab(t)?;
            let [g, u, d] = &self.block.expert_names;
            match (module, ab) {
                (FUSED_A, "A") => Part::GateUpA(e),
                (m, "B") if m == g => Part::GateUpB(e, 0),
                (m, "B") if m == u => Part::GateUpB(e, 1),
                (m, ab) if m == d => Part::Down(e, ab),
                _ => return None,
            }
        };
        Some(Parsed {
            head: head.to_string(),
            part,
        })
    }

    /// The folder of the expert whose adapter `name` is (`model.layers.0.mlp.experts.3.`), if
    /// it is an expert's: under expert parallelism a rank holds only some experts.
    pub fn expert_folder(&self, name: &str) -> Option<String> {
        let parsed = self.parse(name)?;
        let e = match parsed.part {
            Part::GateUpA(e) | Part::GateUpB(e, _) | Part::Down(e, _) => e,
            Part::Router(_) => return None,
        };
        Some(format!(
            "{}.{}.{}.{e}.",
            parsed.head, self.folder, self.block.experts
        ))
    }

    /// PEFT's name of the router's or a wrapper's factor (`ab`) under `head`.
    fn peft_name(head: &str, what: &str, ab: &str) -> String {
        format!("{head}.{PEFT_FOLDER}.{what}.lora_{ab}.weight")
    }

    /// `(out, in)` of an expert's adapted parameter.
    fn dims(&self, p: Param) -> (usize, usize) {
        let (h, i) = (self.block.hidden_size, self.block.expert_intermediate_size);
        match p {
            Param::GateUp => (2 * i, h),
            Param::Down => (h, i),
        }
    }

    /// Whole tensors under the model's names (any prefix, such as PEFT's `base_model.model.`)
    /// with the experts' and routers' adapters replaced by PEFT's tensors (see the
    /// [module docs](self)); other tensors as they are. Errors name a block missing some
    /// expert's factor.
    pub fn fuse(&self, tensors: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(tensors.len());
        // Per layer head: the parts of its experts' adapters.
        let mut blocks: BTreeMap<String, BTreeMap<String, Tensor>> = BTreeMap::new();
        for (name, t) in tensors {
            match self.parse(&name) {
                None => out.push((name, t)),
                Some(Parsed {
                    head,
                    part: Part::Router(ab),
                }) => out.push((Self::peft_name(&head, &self.block.router, ab), t)),
                Some(Parsed { head, part }) => {
                    let key = match part {
                        Part::GateUpA(e) => format!("gu.A.{e}"),
                        Part::GateUpB(e, p) => format!("gu.B{p}.{e}"),
                        Part::Down(e, ab) => format!("d.{ab}.{e}"),
                        Part::Router(_) => unreachable!("handled above"),
                    };
                    blocks.entry(head).or_default().insert(key, t);
                }
            }
        }
        let n = self.block.num_experts;
        for (head, mut parts) in blocks {
            let has_gu = parts.keys().any(|k| k.starts_with("gu."));
            let has_d = parts.keys().any(|k| k.starts_with("d."));
            let mut take = |key: String| {
                parts.remove(&key).ok_or_else(|| {
                    Error::Invalid(format!(
                        "cannot write the experts' adapters of `{head}`: `{key}` (an expert's \
                         factor) is missing"
                    ))
                })
            };
            let mut fused: Vec<(String, Tensor)> = Vec::new();
            if has_gu {
                let a: Vec<Tensor> = (0..n)
                    .map(|e| take(format!("gu.A.{e}")))
                    .collect::<Result<_>>()?;
                let b: Vec<Tensor> = (0..n)
                    .map(|e| -> Result<Tensor> {
                        let g = take(format!("gu.B0.{e}"))?;
                        let u = take(format!("gu.B1.{e}"))?;
                        Ok(Tensor::cat(&[&g, &u], 0)?)
                    })
                    .collect::<Result<_>>()?;
                let at = if has_d {
                    "experts.base_layer"
                } else {
                    "experts"
                };
                fused.push((Self::peft_name(&head, at, "A"), Tensor::cat(&a, 0)?));
                fused.push((Self::peft_name(&head, at, "B"), stack_columns(&b)?));
            }
            if has_d {
                let a: Vec<Tensor> = (0..n)
                    .map(|e| take(format!("d.A.{e}")))
                    .collect::<Result<_>>()?;
                let b: Vec<Tensor> = (0..n)
                    .map(|e| take(format!("d.B.{e}")))
                    .collect::<Result<_>>()?;
                fused.push((Self::peft_name(&head, "experts", "A"), Tensor::cat(&a, 0)?));
                fused.push((Self::peft_name(&head, "experts", "B"), stack_columns(&b)?));
            }
            out.extend(fused);
        }
        Ok(out)
    }
}

/// `(out, R·E)` from `E` blocks `(out, R)`: column `k·E + e` is block `e`'s column `k`.
fn stack_columns(blocks: &[Tensor]) -> Result<Tensor> {
    let (out, r) = blocks[0].dims2()?;
    Ok(Tensor::stack(blocks, 2)?
        .reshape((out, r * blocks.len()))?
        .contiguous()?)
}

/// Block `e` `(out, R)` of a `(out, R·E)` PEFT `B` (columns `e, e+E, ..`).
fn column_block(b: &Tensor, e: usize, experts: usize) -> candle_parallel::Result<Tensor> {
    let (out, re) = b.dims2()?;
    let r = re / experts;
    Ok(b.reshape((out, r, experts))?
        .narrow(2, e, 1)?
        .reshape((out, r))?)
}

/// An adapter under the model's names (see the [module docs](self)): the experts' factors
/// cut from PEFT's stacked tensors, the router's renamed; any other name passes through.
pub struct ExpertsSource {
    inner: Arc<dyn TensorSource>,
    layout: ExpertsLayout,
}

impl ExpertsSource {
    pub fn new(inner: Arc<dyn TensorSource>, layout: ExpertsLayout) -> Self {
        Self { inner, layout }
    }

    /// The PEFT tensors of `head`'s wrapper of parameter `p`: `(A name, B name)`, when stored.
    fn wrapper(&self, head: &str, p: Param) -> candle_parallel::Result<Option<(String, String)>> {
        let names = |at: &str| {
            (
                ExpertsLayout::peft_name(head, at, "A"),
                ExpertsLayout::peft_name(head, at, "B"),
            )
        };
        let (inner_a, inner_b) = names("experts.base_layer");
        let (outer_a, outer_b) = names("experts");
        if self.inner.contains(&inner_a) {
            // Both adapted: gate_up_proj is the inner wrapper (registered first).
            return Ok(Some(match p {
                Param::GateUp => (inner_a, inner_b),
                Param::Down => (outer_a, outer_b),
            }));
        }
        if !self.inner.contains(&outer_a) || !self.inner.contains(&outer_b) {
            return Ok(None);
        }
        // One adapted: which one, by the shapes (gate_up `B` has 2I rows and `A` H columns).
        let a = self.inner.shape(&outer_a)?;
        let b = self.inner.shape(&outer_b)?;
        let (out, inf) = self.layout.dims(Param::GateUp);
        let is_gate_up = a.get(1) == Some(&inf) && b.first() == Some(&out);
        Ok((is_gate_up == (p == Param::GateUp)).then_some((outer_a, outer_b)))
    }

    /// The whole model tensor `name` (parsed), read from the PEFT tensors.
    fn whole(&self, parsed: &Parsed, dev: &Device) -> candle_parallel::Result<Option<Tensor>> {
        let n = self.layout.block.num_experts;
        let missing = || None;
        let read = |name: &str| self.inner.read(name, Shard::replicated(), dev);
        let rows = |t: Tensor, e: usize| -> candle_parallel::Result<Tensor> {
            let r = t.dim(0)? / n;
            Ok(t.narrow(0, e * r, r)?)
        };
        Ok(Some(match &parsed.part {
            Part::Router(ab) => {
                let name = ExpertsLayout::peft_name(&parsed.head, &self.layout.block.router, ab);
                if !self.inner.contains(&name) {
                    return Ok(missing());
                }
                read(&name)?
            }
            Part::GateUpA(e) => match self.wrapper(&parsed.head, Param::GateUp)? {
                Some((a, _)) => rows(read(&a)?, *e)?,
                None => return Ok(missing()),
            },
            Part::GateUpB(e, p) => match self.wrapper(&parsed.head, Param::GateUp)? {
                Some((_, b)) => {
                    let i = self.layout.block.expert_intermediate_size;
                    column_block(&read(&b)?, *e, n)?.narrow(0, p * i, i)?
                }
                None => return Ok(missing()),
            },
            Part::Down(e, ab) => match self.wrapper(&parsed.head, Param::Down)? {
                Some((a, _)) if *ab == "A" => rows(read(&a)?, *e)?,
                Some((_, b)) => column_block(&read(&b)?, *e, n)?,
                None => return Ok(missing()),
            },
        }))
    }

    fn not_found(&self, name: &str) -> candle_parallel::Error {
        candle_parallel::Error::Tensor {
            location: self.inner.location(),
            name: name.into(),
            msg: "missing: the adapter does not target this layer".into(),
        }
    }
}

impl TensorSource for ExpertsSource {
    fn location(&self) -> String {
        self.inner.location()
    }

    fn contains(&self, name: &str) -> bool {
        match self.layout.parse(name) {
            Some(p) => matches!(self.whole(&p, &Device::Cpu), Ok(Some(_))),
            None => self.inner.contains(name),
        }
    }

    fn shape(&self, name: &str) -> candle_parallel::Result<Vec<usize>> {
        match self.layout.parse(name) {
            Some(p) => match self.whole(&p, &Device::Cpu)? {
                Some(t) => Ok(t.dims().to_vec()),
                None => Err(self.not_found(name)),
            },
            None => self.inner.shape(name),
        }
    }

    fn read(&self, name: &str, shard: Shard, dev: &Device) -> candle_parallel::Result<Tensor> {
        match self.layout.parse(name) {
            Some(p) => match self.whole(&p, dev)? {
                Some(t) => Ok(shard.take(&t.contiguous()?)?.contiguous()?),
                None => Err(self.not_found(name)),
            },
            None => self.inner.read(name, shard, dev),
        }
    }

    /// PEFT's experts tensors expanded to the model's per-expert names.
    fn names(&self) -> Option<Vec<String>> {
        let l = &self.layout;
        let names = self.inner.names()?;
        let [g, u, d] = &l.block.expert_names;
        let mut out = Vec::new();
        for name in names {
            let sep = format!(".{PEFT_FOLDER}.");
            let Some(at) = name.find(&sep) else {
                out.push(name);
                continue;
            };
            let (head, rest) = (&name[..at], &name[at + sep.len()..]);
            let ab = if rest.ends_with("lora_A.weight") {
                "A"
            } else {
                "B"
            };
            let experts = |f: &dyn Fn(usize) -> Vec<String>| -> Vec<String> {
                (0..l.block.num_experts).flat_map(f).collect()
            };
            let at_expert = |e: usize, module: &str| {
                format!(
                    "{head}.{}.{}.{e}.{module}.lora_{ab}.weight",
                    l.folder, l.block.experts
                )
            };
            let param = match rest {
                "experts.base_layer.lora_A.weight" | "experts.base_layer.lora_B.weight" => {
                    Some(Param::GateUp)
                }
                "experts.lora_A.weight" | "experts.lora_B.weight" => {
                    match self.wrapper(head, Param::GateUp) {
                        Ok(Some((a, b))) if a == name || b == name => Some(Param::GateUp),
                        _ => Some(Param::Down),
                    }
                }
                _ => None,
            };
            match param {
                Some(Param::GateUp) if ab == "A" => {
                    out.extend(experts(&|e| vec![at_expert(e, FUSED_A)]))
                }
                Some(Param::GateUp) => {
                    out.extend(experts(&|e| vec![at_expert(e, g), at_expert(e, u)]))
                }
                Some(Param::Down) => out.extend(experts(&|e| vec![at_expert(e, d)])),
                None if rest.starts_with(&format!("{}.lora_", l.block.router)) => {
                    out.push(format!("{head}.{}.{rest}", l.folder))
                }
                None => out.push(name),
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_parallel::nn::TensorMap;
    use std::collections::HashMap;

    fn layout(folder: &str) -> ExpertsLayout {
        let block = MoeConfig::new(6, 4, 3, 2)
            .unwrap()
            .with_expert_names("w1", "w3", "w2");
        ExpertsLayout::new(folder, &block)
    }

    fn values(shape: (usize, usize), start: f32) -> Tensor {
        let n = shape.0 * shape.1;
        let v: Vec<f32> = (0..n).map(|i| start + i as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The model's per-expert factors fuse into PEFT's stacked tensors and read back the
    /// same, under either folder name, with one or both wrappers; B's columns are
    /// expert-minor.
    #[test]
    fn per_expert_factors_fuse_into_peft_tensors_and_read_back() {
        for (folder, with_down) in [("block_sparse_moe", true), ("mlp", false)] {
            let l = layout(folder);
            let head = "base_model.model.model.layers.1";
            let name = |e: usize, m: &str, ab: &str| {
                format!("{head}.{folder}.experts.{e}.{m}.lora_{ab}.weight")
            };
            let mut model = vec![(
                format!("{head}.{folder}.gate.lora_A.weight"),
                values((2, 6), 0.0),
            )];
            for e in 0..3 {
                let f = 100.0 * e as f32;
                model.push((name(e, "gate_up_proj", "A"), values((4, 6), f)));
                model.push((name(e, "w1", "B"), values((4, 4), f + 30.0)));
                model.push((name(e, "w3", "B"), values((4, 4), f + 60.0)));
                if with_down {
                    model.push((name(e, "w2", "A"), values((2, 4), f + 80.0)));
                    model.push((name(e, "w2", "B"), values((6, 2), f + 90.0)));
                }
            }
            let fused = l.fuse(model.clone()).unwrap();
            let fused: HashMap<String, Tensor> = fused.into_iter().collect();
            let gu = if with_down {
                "experts.base_layer"
            } else {
                "experts"
            };
            let gb = &fused[&format!("{head}.mlp.{gu}.lora_B.weight")];
            assert_eq!(gb.dims(), &[8, 12]);
            assert_eq!(
                fused[&format!("{head}.mlp.{gu}.lora_A.weight")].dims(),
                &[12, 6]
            );
            // Column k·E + e of B is expert e's column k: expert 1's (0, 1) entry at col 4.
            let v = gb.to_vec2::<f32>().unwrap();
            assert_eq!(v[0][4], 130.0 + 1.0);
            assert_eq!(v[4][2], 260.0);
            assert!(fused.contains_key(&format!("{head}.mlp.gate.lora_A.weight")));
            // The outer wrapper is the last target parameter: down's B (6, R·E = 2·3) when
            // down is adapted, otherwise gate_up's; a nested `base_layer` only with two.
            let outer = &fused[&format!("{head}.mlp.experts.lora_B.weight")];
            let want: &[usize] = if with_down { &[6, 6] } else { &[8, 12] };
            assert_eq!(outer.dims(), want);
            assert_eq!(
                fused.contains_key(&format!("{head}.mlp.experts.base_layer.lora_B.weight")),
                with_down
            );
            // Back, under the model's names.
            let peft: HashMap<String, Tensor> = fused
                .into_iter()
                .map(|(n, t)| (n.replace("base_model.model.", ""), t))
                .collect();
            let src = ExpertsSource::new(Arc::new(TensorMap::new(peft, "adapter")), l);
            let mut names = src.names().unwrap();
            names.sort();
            let mut want: Vec<String> = model
                .iter()
                .map(|(n, _)| n.replace("base_model.model.", ""))
                .collect();
            want.sort();
            assert_eq!(names, want);
            for (n, t) in &model {
                let n = n.replace("base_model.model.", "");
                let got = src.read(&n, Shard::replicated(), &Device::Cpu).unwrap();
                assert_eq!(
                    got.to_vec2::<f32>().unwrap(),
                    t.to_vec2::<f32>().unwrap(),
                    "{n}"
                );
                assert_eq!(src.shape(&n).unwrap(), t.dims(), "{n}");
            }
            // A tensor-parallel block of a part's B: its rows.
            let n = name(2, "w3", "B").replace("base_model.model.", "");
            let half = src.read(&n, Shard::new(0, 1, 2), &Device::Cpu).unwrap();
            assert_eq!(half.to_vec2::<f32>().unwrap()[0][0], 260.0 + 8.0);
        }
    }

    #[test]
    fn a_missing_expert_is_an_error_naming_the_block() {
        let l = layout("mlp");
        let t = values((4, 6), 0.0);
        let e = l
            .fuse(vec![(
                "model.layers.0.mlp.experts.0.gate_up_proj.lora_A.weight".into(),
                t,
            )])
            .unwrap_err();
        assert!(e.to_string().contains("model.layers.0"), "{e}");
    }
}
