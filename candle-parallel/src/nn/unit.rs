//! Units: the groups of parameters a plan acts on from outside the model, like FSDP's wrapping
//! of each transformer block and torchtitan's per-block activation checkpointing.
//!
//! A model holds each block (and the parameters at its ends) as a [`Unit`], built through
//! [`Unit::new`] with the block's own `fn new(cfg, vb, ctx)` constructor: the unit records the
//! parameters the constructor loaded (a [`ParamBuilder::scope`]), so nothing is found by
//! parsing parameter names. A [`crate::plan::MemoryPlan`] then walks the model's units
//! ([`crate::plan::Parallelize`]) and
//! - shards them (ZeRO-3, [`Unit::shard`]): the unit keeps only this rank's flat chunk of each
//!   parameter (a `Var` the optimizer trains directly) and rebuilds the module from the
//!   all-gathered tensors through the same constructor for each use; with gradients the gather
//!   is differentiable, its backward reduce-scatters each whole parameter's gradient into the
//!   chunks' (summed over the sharding group);
//! - sets their activation checkpointing ([`Unit::set_checkpointing`]): [`Unit::forward`] of a
//!   [`Block`] then runs under [`crate::recompute::checkpoint`], the parameter gradients of the
//!   recomputation going to the context's sink ([`super::ParallelCtx::backward`]).
//!
//! Model code does not change with either: it calls [`Unit::forward`] (blocks) or [`Unit::get`].

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};

use super::lora::Adapters;
use super::{Param, ParamBuilder, Pass, Shard};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::recompute::{checkpoint, Checkpointing};
use crate::sharding::FlatShard;

/// A module that maps activations to activations of the same layout (a transformer block),
/// and can therefore be recomputed.
pub trait Block: Clone + Send + Sync + 'static {
    /// `x` `(batch, tokens', hidden)` → the same shape. Collective as the block's layers are.
    fn forward(&self, x: &Tensor, pass: &Pass) -> Result<Tensor>;
}

/// Whether a unit's parameters are gathered with their gradient path ([`Track::Grad`]) or as
/// plain tensors (inference, and the forward of a checkpointed block that keeps nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Track {
    Grad,
    NoGrad,
}

/// One parameter of a sharded unit: this rank's chunk and what rebuilds the whole.
#[derive(Debug, Clone)]
pub struct ShardedParam {
    /// The checkpoint name.
    pub name: String,
    /// The tensor-parallel split of the parameter (as loaded).
    pub shard: Shard,
    /// The shape of the whole parameter, as in the checkpoint.
    pub global_shape: Vec<usize>,
    /// The shape of this rank's tensor-parallel slice (what the module computes with).
    pub local_shape: Vec<usize>,
    /// How the slice is cut over the sharding group.
    pub flat: FlatShard,
    /// This rank's chunk, `(flat.chunk,)` in the parameter's dtype.
    pub var: Var,
    /// Whether the parameter trains (false: a frozen base weight under LoRA, gathered without
    /// a gradient path).
    pub trainable: bool,
    /// An expert held by this expert-parallel rank alone ([`Param::expert_parallel`]), sharded
    /// over the ranks that hold the same experts.
    pub expert_parallel: bool,
}

type Build<T> = Arc<dyn Fn(ParamBuilder) -> Result<T> + Send + Sync>;

/// The parameters of a unit sharded over a ZeRO-3 group.
struct Sharded {
    params: Vec<ShardedParam>,
    group: Comm,
    /// The sharding group of the experts' parameters (expert parallelism).
    experts: Option<Comm>,
    dtype: DType,
    device: Device,
}

impl Sharded {
    /// The group `p` is sharded over.
    fn group_of(&self, p: &ShardedParam) -> &Comm {
        match (&self.experts, p.expert_parallel) {
            (Some(e), true) => e,
            _ => &self.group,
        }
    }
}

#[derive(Clone)]
enum State<T> {
    Resident(T),
    Sharded(Arc<Sharded>),
}

/// A module and its parameters, resident or sharded, run plainly or recomputed; see the
/// [module docs](self). Cheap to clone.
#[derive(Clone)]
pub struct Unit<T> {
    /// Where the unit was built (its checkpoint prefix).
    path: Vec<String>,
    build: Build<T>,
    /// The parameters as loaded (this rank's tensor-parallel slices), in load order.
    params: Vec<Param>,
    state: State<T>,
    checkpointing: Checkpointing,
    /// The LoRA adapters the module was built with (rebuilds get them too).
    adapters: Option<Arc<Adapters>>,
}

impl<T> std::fmt::Debug for Unit<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Resident(_) => "resident",
            State::Sharded(_) => "sharded",
        };
        write!(
            f,
            "Unit({:?}: {} params, {state}, checkpointing {})",
            self.path.join("."),
            self.params.len(),
            self.checkpointing
        )
    }
}

impl<T: Clone + Send + Sync + 'static> Unit<T> {
    /// Builds the module by `build` from `vb` (its constructor, e.g. `|vb| Layer::new(&cfg, vb,
    /// &ctx)`), recording the parameters it loads. Local.
    pub fn new(
        vb: &ParamBuilder,
        build: impl Fn(ParamBuilder) -> Result<T> + Send + Sync + 'static,
    ) -> Result<Self> {
        let (scoped, list) = vb.scope();
        let module = build(scoped)?;
        Ok(Self {
            path: vb.path().to_vec(),
            build: Arc::new(build),
            params: list.in_order(),
            state: State::Resident(module),
            checkpointing: Checkpointing::None,
            adapters: vb.adapters().cloned(),
        })
    }

    /// The unit's checkpoint prefix (`model.layers.3`).
    pub fn name(&self) -> String {
        self.path.join(".")
    }

    /// The parameters the unit loaded (this rank's tensor-parallel slices).
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The module with whole parameters: the resident one, or one rebuilt from the gathered
    /// shards (collective over the sharding group; with their gradient path under
    /// [`Track::Grad`]).
    pub fn get(&self, track: Track) -> Result<T> {
        match &self.state {
            State::Resident(m) => Ok(m.clone()),
            State::Sharded(s) => {
                let params = s
                    .params
                    .iter()
                    .map(|p| {
                        let chunk = p.var.as_tensor();
                        let group = s.group_of(p);
                        let tensor = match track {
                            Track::Grad if p.trainable => {
                                p.flat.gather_differentiable(chunk, group, &p.local_shape)?
                            }
                            Track::Grad | Track::NoGrad => {
                                p.flat.gather(&chunk.detach(), group, &p.local_shape)?
                            }
                        };
                        Ok(Param::value(&p.name, tensor, p.shard, &p.global_shape))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let vb = ParamBuilder::from_params(params, s.dtype, &s.device)
                    .at(&self.path)
                    .with_adapters(self.adapters.clone());
                (self.build)(vb)
            }
        }
    }

    /// ZeRO-3: replaces the resident parameters by this rank's flat chunks over `group` (every
    /// rank of `group` holding the same names and shapes; the experts of expert parallelism over
    /// `experts`, the ranks holding the same experts) and returns the chunks. Local; the whole
    /// tensors are freed once the caller drops the loaded parameter list.
    pub fn shard(&mut self, group: &Comm, experts: Option<&Comm>) -> Result<Vec<ShardedParam>> {
        let Some(first) = self.params.first() else {
            return Err(Error::invalid(
                "zero-3",
                format!("unit `{}` has no parameters to shard", self.name()),
            ));
        };
        let (dtype, device) = (first.tensor.dtype(), first.tensor.device().clone());
        let params = self
            .params
            .iter()
            .map(|p| {
                let g = match (experts, p.expert_parallel) {
                    (Some(e), true) => e,
                    _ => group,
                };
                let flat = FlatShard::new(p.tensor.elem_count(), g.rank(), g.size())?;
                let chunk = flat.take(&p.tensor.detach())?;
                Ok(ShardedParam {
                    name: p.name.clone(),
                    shard: p.shard,
                    global_shape: p.global_shape.clone(),
                    local_shape: p.tensor.dims().to_vec(),
                    flat,
                    var: Var::from_tensor(&chunk)?,
                    trainable: p.var.is_some(),
                    expert_parallel: p.expert_parallel,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.state = State::Sharded(Arc::new(Sharded {
            params: params.clone(),
            group: group.clone(),
            experts: experts.cloned(),
            dtype,
            device,
        }));
        // Keep names and shapes only: the loaded tensors must not stay alive here.
        for p in &mut self.params {
            p.var = None;
            p.tensor = Tensor::zeros(0, p.tensor.dtype(), p.tensor.device())?;
        }
        Ok(params)
    }

    /// Activation checkpointing of the unit (applies to [`Unit::forward`] of blocks).
    pub fn set_checkpointing(&mut self, mode: Checkpointing) {
        self.checkpointing = mode;
    }

    pub fn checkpointing(&self) -> Checkpointing {
        self.checkpointing
    }
}

impl<T: Block> Unit<T> {
    /// Runs the block on `x` under the unit's checkpointing mode (a `forward` tracing span
    /// named by the unit, and while tracing records, a `backward` one in the backward pass:
    /// `super::backward_span`); with anomaly detection on, checks its output
    /// ([`super::anomaly`]). Collective as the block is.
    pub fn forward(&self, x: &Tensor, pass: &Pass) -> Result<Tensor> {
        let span = tracing::info_span!("forward", unit = %self.path.join("."));
        let traced = !span.is_disabled() && x.track_op();
        let _span = span.entered();
        let y = if traced {
            super::backward_span::around(self.path.join("."), x, |x| {
                self.forward_unchecked(x, pass)
            })?
        } else {
            self.forward_unchecked(x, pass)?
        };
        if !super::anomaly::detect_anomaly() {
            return Ok(y);
        }
        super::anomaly::forward_output(y, &self.name())
    }

    fn forward_unchecked(&self, x: &Tensor, pass: &Pass) -> Result<Tensor> {
        if self.checkpointing == Checkpointing::None {
            return self.get(Track::Grad)?.forward(x, pass);
        }
        let unit = self.clone();
        let (ctx, mask) = (pass.ctx.clone(), pass.mask.clone());
        let positions: Arc<[u32]> = pass.positions.into();
        let seq_len = pass.seq_len;
        let cond = pass.cond.map(|c| c.detach());
        let routed: Option<Arc<[bool]>> = pass.routed.map(Into::into);
        let block: crate::recompute::Block = Arc::new(move |x, attention| {
            let track = if x.track_op() {
                Track::Grad
            } else {
                Track::NoGrad
            };
            let pass = Pass {
                ctx: &ctx,
                positions: &positions,
                seq_len,
                mask: &mask,
                attention,
                cond: cond.as_ref(),
                routed: routed.as_deref(),
            };
            unit.get(track)?.forward(x, &pass)
        });
        checkpoint(
            self.checkpointing,
            x,
            &pass.ctx.attention_handle(),
            pass.ctx.grad_sink(),
            block,
        )
    }
}

/// What a plan needs of a unit, whatever its module type.
pub trait UnitOps {
    /// The unit's checkpoint prefix.
    fn name(&self) -> String;
    /// The parameters as loaded (names, splits and shapes remain after sharding).
    fn params(&self) -> &[Param];
    /// See [`Unit::shard`].
    fn shard(&mut self, group: &Comm, experts: Option<&Comm>) -> Result<Vec<ShardedParam>>;
    /// See [`Unit::set_checkpointing`].
    fn set_checkpointing(&mut self, mode: Checkpointing);
}

impl<T: Clone + Send + Sync + 'static> UnitOps for Unit<T> {
    fn name(&self) -> String {
        Unit::name(self)
    }

    fn params(&self) -> &[Param] {
        Unit::params(self)
    }

    fn shard(&mut self, group: &Comm, experts: Option<&Comm>) -> Result<Vec<ShardedParam>> {
        Unit::shard(self, group, experts)
    }

    fn set_checkpointing(&mut self, mode: Checkpointing) {
        Unit::set_checkpointing(self, mode)
    }
}
