//! Checkpoints that store projections fused (Phi-3: `self_attn.qkv_proj` holds the rows of q,
//! then k, then v; `mlp.gate_up_proj` those of gate, then up), for a model that runs the parts.
//!
//! Loading reads them through [`FusedSource`], a view of the checkpoint under the parts' names
//! (`self_attn.k_proj.weight`: rows `q..q + kv` of `self_attn.qkv_proj.weight`), so each part
//! is split over the tensor-parallel group like any column-parallel weight: a rank gets its
//! heads of q, of k and of v, never a contiguous slice of the fused matrix. Saving fuses the
//! parts back ([`FusedLayout::fuse`]) into the checkpoint's names. A LoRA adapter of a fused
//! module keeps PEFT's layout: `qkv_proj.lora_A.weight` (one `A`, shared by the parts, under
//! the fused name) and `qkv_proj.lora_B.weight` (the parts' `B` rows, split and fused like the
//! weight).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_parallel::nn::{Shard, TensorSource};

use crate::error::{Error, Result};

/// transformers' name of Phi-3's fused q/k/v projection.
pub const FUSED_QKV: &str = "qkv_proj";
/// transformers' name of Phi-3's fused gate/up projection.
pub const FUSED_GATE_UP: &str = "gate_up_proj";

/// A's name below a fused module: stored under the fused name, never split.
const SHARED_A: &str = "lora_A.weight";

/// One fused projection: `module.fused` holds the rows of `module.parts[0]`, then of
/// `parts[1]`, ...
#[derive(Debug, Clone)]
struct Group {
    module: &'static str,
    fused: &'static str,
    /// Part names and their rows.
    parts: Vec<(&'static str, usize)>,
}

impl Group {
    fn total(&self) -> usize {
        self.parts.iter().map(|(_, r)| r).sum()
    }

    fn rows(&self, index: usize) -> Range<usize> {
        let start: usize = self.parts[..index].iter().map(|(_, r)| r).sum();
        start..start + self.parts[index].1
    }
}

/// Where a part's tensor lives in the checkpoint.
struct Located<'a> {
    group: &'a Group,
    /// The fused tensor's name.
    fused: String,
    /// Which part.
    index: usize,
}

/// Which projections of a decoder a checkpoint stores fused, with the parts' sizes.
#[derive(Debug, Clone)]
pub struct FusedLayout {
    groups: Vec<Group>,
}

impl FusedLayout {
    /// Phi-3's: `self_attn.qkv_proj` of q (`q_rows`), k and v (`kv_rows` each), and
    /// `mlp.gate_up_proj` of gate and up (`intermediate` each).
    pub fn phi3(q_rows: usize, kv_rows: usize, intermediate: usize) -> Self {
        Self {
            groups: vec![
                Group {
                    module: "self_attn",
                    fused: FUSED_QKV,
                    parts: vec![("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)],
                },
                Group {
                    module: "mlp",
                    fused: FUSED_GATE_UP,
                    parts: vec![("gate_proj", intermediate), ("up_proj", intermediate)],
                },
            ],
        }
    }

    /// The fused tensor a part's tensor (`..self_attn.k_proj.weight`, `.bias`,
    /// `.lora_B.weight`) is rows of; `None` for any other name.
    fn locate(&self, name: &str) -> Option<Located<'_>> {
        let segs: Vec<&str> = name.split('.').collect();
        for i in 0..segs.len().saturating_sub(2) {
            let suffix = segs[i + 2..].join(".");
            if suffix == SHARED_A {
                continue;
            }
            for group in &self.groups {
                if segs[i] != group.module {
                    continue;
                }
                if let Some(index) = group.parts.iter().position(|(p, _)| *p == segs[i + 1]) {
                    let mut fused: Vec<&str> = segs.clone();
                    fused[i + 1] = group.fused;
                    return Some(Located {
                        group,
                        fused: fused.join("."),
                        index,
                    });
                }
            }
        }
        None
    }

    /// The model's names of a checkpoint tensor: a fused tensor's parts (its `lora_A` keeps
    /// the fused name), any other tensor its own name.
    fn expand(&self, name: &str) -> Vec<String> {
        let segs: Vec<&str> = name.split('.').collect();
        for i in 0..segs.len().saturating_sub(2) {
            if segs[i + 2..].join(".") == SHARED_A {
                continue;
            }
            if let Some(group) = self
                .groups
                .iter()
                .find(|g| g.module == segs[i] && g.fused == segs[i + 1])
            {
                return group
                    .parts
                    .iter()
                    .map(|(p, _)| {
                        let mut part = segs.clone();
                        part[i + 1] = p;
                        part.join(".")
                    })
                    .collect();
            }
        }
        vec![name.to_string()]
    }

    /// `items` by the checkpoint's names: the parts of each fused tensor (in any order, with
    /// any prefix such as PEFT's `base_model.model.`) replaced by `cat` of them in the fused
    /// order, under the fused name, where the first part was. Errors name a fused tensor one of
    /// whose parts is missing.
    pub fn fuse<T>(
        &self,
        items: Vec<(String, T)>,
        cat: impl Fn(&str, Vec<T>) -> Result<T>,
    ) -> Result<Vec<(String, T)>> {
        let mut out: Vec<(String, Option<T>)> = Vec::with_capacity(items.len());
        let mut pending: HashMap<String, (usize, Vec<Option<T>>)> = HashMap::new();
        for (name, t) in items {
            let Some(loc) = self.locate(&name) else {
                out.push((name, Some(t)));
                continue;
            };
            let entry = pending.entry(loc.fused.clone()).or_insert_with(|| {
                out.push((loc.fused.clone(), None));
                let parts = loc.group.parts.iter().map(|_| None).collect();
                (out.len() - 1, parts)
            });
            entry.1[loc.index] = Some(t);
        }
        for (fused, (slot, parts)) in pending {
            let parts: Vec<T> = parts.into_iter().collect::<Option<_>>().ok_or_else(|| {
                Error::Invalid(format!(
                    "cannot write `{fused}`: some of the projections fused into it are missing"
                ))
            })?;
            out[slot].1 = Some(cat(&fused, parts)?);
        }
        Ok(out
            .into_iter()
            .filter_map(|(n, t)| t.map(|t| (n, t)))
            .collect())
    }

    /// Whole tensors under the checkpoint's names (see [`FusedLayout::fuse`]), parts joined
    /// along their rows, sorted by name.
    pub fn fuse_tensors(&self, tensors: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        let mut out = self.fuse(tensors, |_, parts| Ok(Tensor::cat(&parts, 0)?))?;
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Parameter shapes under the checkpoint's names (parts' rows added).
    pub fn fuse_shapes(&self, shapes: Vec<(String, Vec<usize>)>) -> Vec<(String, Vec<usize>)> {
        let joined = self.fuse(shapes, |_, parts| {
            let mut s = parts[0].clone();
            s[0] = parts.iter().map(|p| p[0]).sum();
            Ok(s)
        });
        // Every part of a decoder's shapes is present, so joining cannot fail.
        joined.unwrap_or_default()
    }
}

/// A checkpoint under the model's names: the parts of its fused tensors read as row ranges of
/// them (see the [module docs](self)).
pub struct FusedSource {
    inner: Arc<dyn TensorSource>,
    layout: FusedLayout,
}

impl FusedSource {
    pub fn new(inner: Arc<dyn TensorSource>, layout: FusedLayout) -> Self {
        Self { inner, layout }
    }

    /// The fused tensor's name and this part's rows, checking the stored rows.
    fn part(&self, loc: &Located<'_>) -> candle_parallel::Result<(Vec<usize>, Range<usize>)> {
        let shape = self.inner.shape(&loc.fused)?;
        let total = loc.group.total();
        if shape.first() != Some(&total) {
            return Err(candle_parallel::Error::Tensor {
                location: self.inner.location(),
                name: loc.fused.clone(),
                msg: format!(
                    "has shape {shape:?}; the config's {} have {total} rows in all",
                    loc.group
                        .parts
                        .iter()
                        .map(|(p, r)| format!("{p} ({r})"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        Ok((shape, loc.group.rows(loc.index)))
    }
}

impl TensorSource for FusedSource {
    fn location(&self) -> String {
        self.inner.location()
    }

    fn contains(&self, name: &str) -> bool {
        match self.layout.locate(name) {
            Some(loc) => self.inner.contains(&loc.fused),
            None => self.inner.contains(name),
        }
    }

    fn shape(&self, name: &str) -> candle_parallel::Result<Vec<usize>> {
        match self.layout.locate(name) {
            Some(loc) => {
                let (mut shape, rows) = self.part(&loc)?;
                shape[0] = rows.len();
                Ok(shape)
            }
            None => self.inner.shape(name),
        }
    }

    /// A part's block: the fused tensor is read whole, then its rows are taken.
    fn read(&self, name: &str, shard: Shard, dev: &Device) -> candle_parallel::Result<Tensor> {
        match self.layout.locate(name) {
            Some(loc) => {
                let (_, rows) = self.part(&loc)?;
                let whole = self.inner.read(&loc.fused, Shard::replicated(), dev)?;
                let part = whole.narrow(0, rows.start, rows.len())?;
                Ok(shard.take(&part)?.contiguous()?)
            }
            None => self.inner.read(name, shard, dev),
        }
    }

    fn names(&self) -> Option<Vec<String>> {
        self.inner
            .names()
            .map(|n| n.iter().flat_map(|n| self.layout.expand(n)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_parallel::nn::TensorMap;

    fn layout() -> FusedLayout {
        FusedLayout::phi3(4, 2, 3)
    }

    #[test]
    fn parts_are_rows_of_the_fused_tensor_and_fuse_back() {
        let dev = Device::Cpu;
        let qkv = Tensor::arange(0f32, 16.0, &dev)
            .unwrap()
            .reshape((8, 2))
            .unwrap();
        let b = Tensor::arange(0f32, 8.0, &dev)
            .unwrap()
            .reshape((8, 1))
            .unwrap();
        let a = Tensor::ones((1, 2), candle_core::DType::F32, &dev).unwrap();
        let map = TensorMap::new(
            HashMap::from([
                ("m.0.self_attn.qkv_proj.weight".to_string(), qkv.clone()),
                ("m.0.self_attn.qkv_proj.lora_B.weight".to_string(), b),
                ("m.0.self_attn.qkv_proj.lora_A.weight".to_string(), a),
            ]),
            "test",
        );
        let src = FusedSource::new(Arc::new(map), layout());
        let k = src
            .read("m.0.self_attn.k_proj.weight", Shard::replicated(), &dev)
            .unwrap();
        assert_eq!(k.to_vec2::<f32>().unwrap(), [[8.0, 9.0], [10.0, 11.0]]);
        // tp rank 1 of 2 gets the second half of q's rows, not of the fused matrix.
        let q1 = src
            .read("m.0.self_attn.q_proj.weight", Shard::new(0, 1, 2), &dev)
            .unwrap();
        assert_eq!(q1.to_vec2::<f32>().unwrap(), [[4.0, 5.0], [6.0, 7.0]]);
        assert_eq!(
            src.shape("m.0.self_attn.v_proj.lora_B.weight").unwrap(),
            [2, 1]
        );
        assert_eq!(
            src.shape("m.0.self_attn.qkv_proj.lora_A.weight").unwrap(),
            [1, 2]
        );
        let mut names = src.names().unwrap();
        names.sort();
        assert_eq!(
            names,
            [
                "m.0.self_attn.k_proj.lora_B.weight",
                "m.0.self_attn.k_proj.weight",
                "m.0.self_attn.q_proj.lora_B.weight",
                "m.0.self_attn.q_proj.weight",
                "m.0.self_attn.qkv_proj.lora_A.weight",
                "m.0.self_attn.v_proj.lora_B.weight",
                "m.0.self_attn.v_proj.weight",
            ]
        );
        let parts: Vec<(String, Tensor)> = ["v_proj", "q_proj", "k_proj"]
            .iter()
            .map(|p| {
                let n = format!("m.0.self_attn.{p}.weight");
                let t = src.read(&n, Shard::replicated(), &dev).unwrap();
                (n, t)
            })
            .collect();
        let fused = layout().fuse_tensors(parts).unwrap();
        assert_eq!(fused.len(), 1);
        assert_eq!(fused[0].0, "m.0.self_attn.qkv_proj.weight");
        assert_eq!(
            fused[0].1.to_vec2::<f32>().unwrap(),
            qkv.to_vec2::<f32>().unwrap()
        );
    }

    #[test]
    fn a_missing_part_or_a_wrong_fused_shape_is_an_error() {
        let dev = Device::Cpu;
        let t = Tensor::zeros((3, 2), candle_core::DType::F32, &dev).unwrap();
        let e = layout()
            .fuse_tensors(vec![("l.mlp.gate_proj.weight".into(), t.clone())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("l.mlp.gate_up_proj.weight"), "{e}");
        let map = TensorMap::new(
            HashMap::from([("l.mlp.gate_up_proj.weight".to_string(), t)]),
            "test",
        );
        let e = FusedSource::new(Arc::new(map), layout())
            .shape("l.mlp.up_proj.weight")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gate_up_proj") && e.contains("6 rows"), "{e}");
    }
}
