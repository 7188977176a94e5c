//! AdamW with fp32 master weights and fp32 moments (torch.optim.AdamW semantics).

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Shape, Storage, Tensor};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::{widened_in_parallel, OptimParam};
use crate::error::{Error, Result};
use crate::ops::Elem;

/// Elements per parallel work item of the update (the update is element-wise, so how the work is
/// split does not change any result).
const CHUNK: usize = 1 << 14;

/// AdamW hyper-parameters. `Default` is torch's: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
/// weight decay 0.01.
///
/// `lr` is the nominal (peak) learning rate, kept for configuration files: [`AdamW::step`] uses
/// the learning rate it is given (from the schedule), not this one. `weight_decay` applies to the
/// parameters whose [`OptimParam::weight_decay`] is true; the others get none.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWConfig {
    fn validate(&self) -> Result<()> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        let checks = [
            (ok(self.lr), "lr must be finite and >= 0"),
            (
                ok(self.beta1) && self.beta1 < 1.0,
                "beta1 must be in [0, 1)",
            ),
            (
                ok(self.beta2) && self.beta2 < 1.0,
                "beta2 must be in [0, 1)",
            ),
            (ok(self.eps), "eps must be finite and >= 0"),
            (
                ok(self.weight_decay),
                "weight_decay must be finite and >= 0",
            ),
        ];
        for (good, msg) in checks {
            if !good {
                return Err(Error::invalid("AdamW::new", format!("{msg} ({self:?})")));
            }
        }
        Ok(())
    }
}

/// The optimizer state of one parameter: flat f32 buffers in the parameter's row-major order.
struct Slot {
    param: OptimParam,
    shape: Shape,
    master: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
}

/// AdamW with fp32 master weights and fp32 moments, whatever the parameters' dtype.
///
/// Each parameter has an f32 master copy (taken from the `Var` at construction or restored by
/// [`AdamW::load_state`]), and f32 first and second moments, all on the CPU. A step updates the
/// master and then sets the `Var` to `master.to_dtype(var dtype)` on the `Var`'s device, so a bf16
/// parameter keeps receiving updates smaller than its own precision.
///
/// The update is torch.optim.AdamW's (single-tensor path), computed in f32, step `t` counting
/// from 1, with `wd` the config's weight decay for decayed parameters and 0 otherwise:
///
/// ```text
/// p  = p * (1 - lr * wd)                       (decoupled weight decay, before the Adam update)
/// m  = lerp(m, g, 1 - beta1)
/// v  = v * beta2 + (1 - beta2) * g * g
/// p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// ```
///
/// Deterministic: element-wise in a fixed order of operations, independent of thread count.
/// Parameters are kept sorted by name.
pub struct AdamW {
    cfg: AdamWConfig,
    slots: Vec<Slot>,
    step: u64,
}

fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
}

/// Flat f32 copy of `t` on the CPU.
fn f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Runs `f` on `t`'s elements as f32: borrowed in place when `t` is a contiguous f32 CPU tensor
/// (a gradient, read once by the update), else converted ([`f32_vec`]).
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(v)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&v[start..end]));
        }
    }
    match widened_in_parallel(t)? {
        Some(v) => Ok(f(&v)),
        None => Ok(f(&f32_vec(t)?)),
    }
}

/// Copies the master weights into a CPU `Var`'s own buffer, in place, rounded to its dtype (f32,
/// bf16 or f16; the rounding of candle's `to_dtype`): what `Var::set` of the converted master
/// weights does, without building them as a tensor first, and in parallel.
struct CopyMaster<'a>(&'a [f32]);

impl CopyMaster<'_> {
    fn copy_into<T: Elem>(&self, dst: &mut [T]) -> candle_core::Result<()> {
        if dst.len() != self.0.len() {
            candle_core::bail!(
                "adamw-copy-master: {} master weights for {} elements",
                self.0.len(),
                dst.len()
            );
        }
        dst.par_chunks_mut(CHUNK)
            .zip(self.0.par_chunks(CHUNK))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d = T::from_f32(s)));
        Ok(())
    }
}

impl InplaceOp1 for CopyMaster<'_> {
    fn name(&self) -> &'static str {
        "adamw-copy-master"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        on_float_param(self, "adamw-copy-master", storage, layout)
    }
}

impl ParamWrite for CopyMaster<'_> {
    fn write<T: Elem>(&self, dst: &mut [T]) -> candle_core::Result<()> {
        self.copy_into(dst)
    }
}

/// An in-place op on a parameter's elements, whatever its float dtype.
trait ParamWrite {
    fn write<T: Elem>(&self, dst: &mut [T]) -> candle_core::Result<()>;
}

/// Runs `op` on the elements of a contiguous f32, bf16 or f16 parameter (the `cpu_fwd` of the
/// optimizer's in-place ops); an error naming `name` for any other.
fn on_float_param(
    op: &impl ParamWrite,
    name: &str,
    storage: &mut CpuStorage,
    layout: &Layout,
) -> candle_core::Result<()> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{name}: not a contiguous parameter");
    };
    match storage {
        CpuStorage::F32(v) => op.write(&mut v[start..end]),
        CpuStorage::BF16(v) => op.write(&mut v[start..end]),
        CpuStorage::F16(v) => op.write(&mut v[start..end]),
        _ => candle_core::bail!("{name}: not an f32, bf16 or f16 parameter"),
    }
}

/// Per-step scalars of the update, in f32 as torch's float32 kernels use them.
struct Coefs {
    decay_mul: f32,
    beta1_weight: f32,
    beta2: f32,
    one_minus_beta2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
}

impl Coefs {
    fn apply(&self, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        // torch's lerp: self + w * (end - self) when w < 0.5, else end - (end - self) * (1 - w).
        let w = self.beta1_weight;
        let low = w < 0.5;
        let w_rest = 1.0 - w;
        for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            let mut x = *p;
            x *= self.decay_mul;
            *m = if low {
                *m + w * (g - *m)
            } else {
                g - (g - *m) * w_rest
            };
            *v = *v * self.beta2 + self.one_minus_beta2 * (g * g);
            let denom = v.sqrt() / self.bc2_sqrt + self.eps;
            x += -self.step_size * (*m / denom);
            *p = x;
        }
    }
}

/// The update of one parameter in one pass over its elements: each chunk of the gradient is
/// read (scaled by the clipping coefficient and rounded to its dtype where one is given), the
/// master weights and moments updated, and the parameter's own buffer written, rounded to its
/// dtype, while the chunk is in cache. Separately, for a bf16 parameter, the gradient's scaling,
/// its widening to f32, the update and the parameter's copy each went over the whole of it:
/// about 46 bytes of memory traffic per parameter where this moves 30 (the update is bound by
/// memory). The arithmetic and its order are those of `scaled`, [`Coefs::apply`] and
/// [`CopyMaster`], so the bits are too.
struct FusedUpdate<'a> {
    coefs: &'a Coefs,
    /// The clipping coefficient in f32, as `scaled` uses it.
    scale: Option<f32>,
    grad: GradSlice<'a>,
    /// The master weights and the two moments, taken by the (single) call of the op.
    state: Mutex<Option<[&'a mut [f32]; 3]>>,
}

/// A contiguous CPU gradient's elements.
enum GradSlice<'a> {
    F32(&'a [f32]),
    BF16(&'a [half::bf16]),
    F16(&'a [half::f16]),
}

impl GradSlice<'_> {
    fn len(&self) -> usize {
        match self {
            GradSlice::F32(g) => g.len(),
            GradSlice::BF16(g) => g.len(),
            GradSlice::F16(g) => g.len(),
        }
    }
}

impl FusedUpdate<'_> {
    /// Updates `slot` from `g` in one pass where both the parameter and `g` are contiguous f32,
    /// bf16 or f16 CPU tensors with separate storages; false (nothing done) otherwise.
    fn run(slot: &mut Slot, g: &Tensor, coefs: &Coefs, clip: Option<f64>) -> Result<bool> {
        let Slot {
            param,
            master,
            exp_avg,
            exp_avg_sq,
            ..
        } = slot;
        let var = &param.var;
        let float = |d: DType| matches!(d, DType::F32 | DType::BF16 | DType::F16);
        if !(float(var.dtype()) && var.device().is_cpu() && var.is_contiguous()) {
            return Ok(false);
        }
        let (storage, layout) = g.storage_and_layout();
        let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) else {
            return Ok(false);
        };
        // A gradient sharing the parameter's storage (autograd never makes one) would be read
        // while the parameter is written.
        if std::ptr::eq(&*storage, &*var.storage_and_layout().0) {
            return Ok(false);
        }
        let grad = match cpu {
            CpuStorage::F32(v) => GradSlice::F32(&v[a..b]),
            CpuStorage::BF16(v) => GradSlice::BF16(&v[a..b]),
            CpuStorage::F16(v) => GradSlice::F16(&v[a..b]),
            _ => return Ok(false),
        };
        let op = FusedUpdate {
            coefs,
            scale: clip.map(|c| c as f32),
            grad,
            state: Mutex::new(Some([
                master.as_mut_slice(),
                exp_avg.as_mut_slice(),
                exp_avg_sq.as_mut_slice(),
            ])),
        };
        var.inplace_op1(&op)?;
        Ok(true)
    }

    /// The pass over the parameter's elements `dst` (see the type's doc).
    fn update<T: Elem>(&self, dst: &mut [T]) -> candle_core::Result<()> {
        let state = self
            .state
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{FUSED}: state lock poisoned")))?
            .take();
        let Some([p, m, v]) = state else {
            candle_core::bail!("{FUSED}: applied twice");
        };
        if [p.len(), m.len(), v.len(), self.grad.len()] != [dst.len(); 4] {
            candle_core::bail!(
                "{FUSED}: {} master weights and {} gradient elements for {} elements",
                p.len(),
                self.grad.len(),
                dst.len()
            );
        }
        match self.grad {
            GradSlice::F32(g) => self.chunks(p, m, v, g, dst),
            GradSlice::BF16(g) => self.chunks(p, m, v, g, dst),
            GradSlice::F16(g) => self.chunks(p, m, v, g, dst),
        }
        Ok(())
    }

    fn chunks<G: Elem, T: Elem>(
        &self,
        p: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[G],
        dst: &mut [T],
    ) {
        let (coefs, scale) = (self.coefs, self.scale);
        p.par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK))
            .zip(dst.par_chunks_mut(CHUNK))
            .for_each_init(Vec::new, |buf: &mut Vec<f32>, ((((p, m), v), g), dst)| {
                buf.clear();
                match scale {
                    // `scaled`'s `x * mul + 0`, rounded to the gradient's dtype.
                    Some(mul) => buf.extend(g.iter().map(|&x| G::round(x.to_f32() * mul + 0.0))),
                    None => buf.extend(g.iter().map(|&x| x.to_f32())),
                }
                coefs.apply(p, m, v, buf);
                dst.iter_mut()
                    .zip(p.iter())
                    .for_each(|(d, &s)| *d = T::from_f32(s));
            });
    }
}

/// [`FusedUpdate`]'s name in errors.
const FUSED: &str = "adamw-fused-update";

impl InplaceOp1 for FusedUpdate<'_> {
    fn name(&self) -> &'static str {
        FUSED
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        on_float_param(self, FUSED, storage, layout)
    }
}

impl ParamWrite for FusedUpdate<'_> {
    fn write<T: Elem>(&self, dst: &mut [T]) -> candle_core::Result<()> {
        self.update(dst)
    }
}

impl AdamW {
    /// An optimizer over `params` (sorted here by name). Errors on duplicate names, non-float
    /// parameters or invalid hyper-parameters.
    pub fn new(mut params: Vec<OptimParam>, cfg: AdamWConfig) -> Result<Self> {
        const OP: &str = "AdamW::new";
        cfg.validate()?;
        params.sort_by(|a, b| a.name.cmp(&b.name));
        for w in params.windows(2) {
            if w[0].name == w[1].name {
                return Err(Error::invalid(
                    OP,
                    format!("parameter `{}` is given twice", w[0].name),
                ));
            }
        }
        let mut slots = Vec::with_capacity(params.len());
        for param in params {
            let dtype = param.var.dtype();
            if !is_float(dtype) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "parameter `{}` has dtype {dtype:?}; AdamW needs a float dtype",
                        param.name
                    ),
                ));
            }
            let master = f32_vec(param.var.as_tensor())?;
            let n = master.len();
            slots.push(Slot {
                shape: param.var.shape().clone(),
                param,
                master,
                exp_avg: vec![0.0; n],
                exp_avg_sq: vec![0.0; n],
            });
        }
        Ok(Self {
            cfg,
            slots,
            step: 0,
        })
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// The parameters, sorted by name.
    pub fn params(&self) -> impl Iterator<Item = &OptimParam> {
        self.slots.iter().map(|s| &s.param)
    }

    /// Number of steps taken (the `t` of the last bias correction; 0 before the first step).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// One AdamW step with learning rate `lr`. `grads` holds `(name, gradient)` for every
    /// parameter, in any order and any float dtype and device (converted to f32 on the CPU).
    /// A missing, unknown, duplicated or mis-shaped gradient is an error naming the parameter,
    /// reported before anything is updated. Sets every `Var` in place.
    pub fn step(&mut self, grads: &[(String, Tensor)], lr: f64) -> Result<()> {
        self.step_clipped(grads, lr, None)
    }

    /// [`AdamW::step`] on the gradients times `clip` (the factor of
    /// [`super::clip_coefficient`]), with the bits of `clip_grad_norm` followed by `step` (each
    /// gradient element scaled in f32 and rounded to the gradient's dtype) but without writing
    /// the scaled gradients: where a parameter and its gradient are contiguous CPU tensors, the
    /// scaling, the update and the parameter's new value take one pass ([`FusedUpdate`]).
    pub fn step_clipped(
        &mut self,
        grads: &[(String, Tensor)],
        lr: f64,
        clip: Option<f64>,
    ) -> Result<()> {
        const OP: &str = "AdamW::step";
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::invalid(
                OP,
                format!("lr must be finite and >= 0, got {lr}"),
            ));
        }
        let mut by_name: HashMap<&str, &Tensor> = HashMap::with_capacity(grads.len());
        for (name, g) in grads {
            if by_name.insert(name.as_str(), g).is_some() {
                return Err(Error::invalid(
                    OP,
                    format!("gradient of `{name}` is given twice"),
                ));
            }
        }
        let mut ordered = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            let name = &slot.param.name;
            let g = by_name
                .remove(name.as_str())
                .ok_or_else(|| Error::invalid(OP, format!("no gradient for parameter `{name}`")))?;
            if g.shape() != &slot.shape {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "gradient of `{name}` has shape {:?}, the parameter has {:?}",
                        g.dims(),
                        slot.shape.dims()
                    ),
                ));
            }
            if !is_float(g.dtype()) {
                return Err(Error::invalid(
                    OP,
                    format!("gradient of `{name}` has non-float dtype {:?}", g.dtype()),
                ));
            }
            ordered.push(g);
        }
        if let Some(extra) = by_name.keys().min() {
            return Err(Error::invalid(
                OP,
                format!("gradient `{extra}` names no parameter of this optimizer"),
            ));
        }

        self.step += 1;
        let t = self.step as f64;
        let cfg = self.cfg;
        let bc1 = 1.0 - cfg.beta1.powf(t);
        let bc2 = 1.0 - cfg.beta2.powf(t);
        for (slot, g) in self.slots.iter_mut().zip(ordered) {
            let wd = if slot.param.weight_decay {
                cfg.weight_decay
            } else {
                0.0
            };
            let coefs = Coefs {
                decay_mul: (1.0 - lr * wd) as f32,
                beta1_weight: (1.0 - cfg.beta1) as f32,
                beta2: cfg.beta2 as f32,
                one_minus_beta2: (1.0 - cfg.beta2) as f32,
                step_size: (lr / bc1) as f32,
                bc2_sqrt: bc2.sqrt() as f32,
                eps: cfg.eps as f32,
            };
            if FusedUpdate::run(slot, g, &coefs, clip)? {
                continue;
            }
            let scaled_g;
            let g = match clip {
                Some(coef) => {
                    scaled_g = super::scaled(g, coef)?;
                    &scaled_g
                }
                None => g,
            };
            // The gradient is read in place where it can be; its borrow ends before the
            // parameter is written.
            with_f32(g, |g| {
                slot.master
                    .par_chunks_mut(CHUNK)
                    .zip(slot.exp_avg.par_chunks_mut(CHUNK))
                    .zip(slot.exp_avg_sq.par_chunks_mut(CHUNK))
                    .zip(g.par_chunks(CHUNK))
                    .for_each(|(((p, m), v), g)| coefs.apply(p, m, v, g))
            })?;
            Self::write_var(slot)?;
        }
        Ok(())
    }

    /// Sets the slot's `Var` to its master weights cast to the `Var`'s dtype and device.
    fn write_var(slot: &Slot) -> Result<()> {
        let var = &slot.param.var;
        let float = matches!(var.dtype(), DType::F32 | DType::BF16 | DType::F16);
        if float && var.device().is_cpu() && var.is_contiguous() {
            var.inplace_op1(&CopyMaster(&slot.master))?;
            return Ok(());
        }
        let t = Tensor::from_slice(&slot.master, slot.shape.clone(), &Device::Cpu)?
            .to_dtype(var.dtype())?
            .to_device(var.device())?;
        var.set(&t)?;
        Ok(())
    }

    /// The optimizer state for checkpoints: for every parameter (sorted by name) the f32 tensors
    /// `exp_avg.<name>`, `exp_avg_sq.<name>` and `master.<name>`, shaped as the parameter, on the
    /// CPU. The step count is [`AdamW::step_count`].
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(3 * self.slots.len());
        for slot in &self.slots {
            let name = &slot.param.name;
            for (prefix, buf) in [
                ("exp_avg", &slot.exp_avg),
                ("exp_avg_sq", &slot.exp_avg_sq),
                ("master", &slot.master),
            ] {
                let t = Tensor::from_slice(buf, slot.shape.clone(), &Device::Cpu)?;
                out.push((format!("{prefix}.{name}"), t));
            }
        }
        Ok(out)
    }

    /// Restores the state written by [`AdamW::state_tensors`] and the step count, and sets every
    /// `Var` to its restored master weights (cast to the `Var`'s dtype), so the parameters and the
    /// optimizer agree. Entries for parameters this optimizer does not hold are ignored (a rank
    /// may own a subset of the parameters); a missing or mis-shaped entry is an error naming it,
    /// reported before anything is changed. Any float dtype is accepted and converted to f32.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        const OP: &str = "AdamW::load_state";
        let mut loaded = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            let name = &slot.param.name;
            let mut bufs: [Vec<f32>; 3] = Default::default();
            for (buf, prefix) in bufs.iter_mut().zip(["exp_avg", "exp_avg_sq", "master"]) {
                let key = format!("{prefix}.{name}");
                let t = tensors.get(&key).ok_or_else(|| {
                    Error::invalid(OP, format!("missing optimizer state entry `{key}`"))
                })?;
                if t.shape() != &slot.shape {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "state entry `{key}` has shape {:?}, the parameter has {:?}",
                            t.dims(),
                            slot.shape.dims()
                        ),
                    ));
                }
                if !is_float(t.dtype()) {
                    return Err(Error::invalid(
                        OP,
                        format!("state entry `{key}` has non-float dtype {:?}", t.dtype()),
                    ));
                }
                *buf = f32_vec(t)?;
            }
            loaded.push(bufs);
        }
        for (slot, [exp_avg, exp_avg_sq, master]) in self.slots.iter_mut().zip(loaded) {
            slot.exp_avg = exp_avg;
            slot.exp_avg_sq = exp_avg_sq;
            slot.master = master;
            Self::write_var(slot)?;
        }
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    /// The one-pass update is taken where it can be: a contiguous CPU gradient of any float
    /// dtype for a CPU parameter of any float dtype (and it writes the parameter); not for a
    /// strided gradient, one sharing the parameter's storage, or an integer one (those take
    /// the unfused path; the same bits either way: `tests/optim.rs`).
    #[test]
    fn the_one_pass_is_taken_where_it_can_be() -> Result<()> {
        let dev = Device::Cpu;
        let coefs = Coefs {
            decay_mul: 1.0,
            beta1_weight: 0.1,
            beta2: 0.999,
            one_minus_beta2: 0.001,
            step_size: 0.5,
            bc2_sqrt: 1.0,
            eps: 1e-8,
        };
        let floats = [DType::F32, DType::BF16, DType::F16];
        for p_dtype in floats {
            for g_dtype in floats {
                let what = format!("param {p_dtype:?}, grad {g_dtype:?}");
                let w = Tensor::arange(0f32, 12.0, &dev)?
                    .reshape((3, 4))?
                    .to_dtype(p_dtype)?;
                let var = Var::from_tensor(&w)?;
                let param = OptimParam::new("w.weight", var.clone());
                let mut opt = AdamW::new(vec![param], AdamWConfig::default())?;
                let slot = &mut opt.slots[0];
                let g = Tensor::ones((3, 4), g_dtype, &dev)?;
                assert!(FusedUpdate::run(slot, &g, &coefs, None)?, "{what}");
                let moved = (var.as_tensor().to_dtype(DType::F32)? - w.to_dtype(DType::F32)?)?
                    .abs()?
                    .min_all()?
                    .to_scalar::<f32>()?;
                assert!(
                    moved > 0.1,
                    "{what}: the pass wrote every element ({moved})"
                );
                let strided = g.t()?.contiguous()?.t()?;
                assert!(
                    !FusedUpdate::run(slot, &strided, &coefs, Some(0.5))?,
                    "{what}"
                );
                if p_dtype == g_dtype {
                    let alias = var.as_tensor().clone();
                    assert!(!FusedUpdate::run(slot, &alias, &coefs, None)?, "{what}");
                }
                let ints = Tensor::ones((3, 4), DType::U32, &dev)?;
                assert!(!FusedUpdate::run(slot, &ints, &coefs, None)?, "{what}");
            }
        }
        Ok(())
    }
}
