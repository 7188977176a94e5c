//! Parameters as model constructors load them.
//!
//! A model module is built by `fn new(cfg, vb, ctx)` where `vb` is a [`ParamBuilder`] whose path
//! mirrors the checkpoint keys (`vb.pp("self_attn").pp("q_proj")`), as in candle. The builder
//! reads from a [`TensorSource`] (a checkpoint, or tensors in memory: [`TensorMap`]) only this
//! rank's [`Shard`] of each parameter, converts it to the model dtype, makes it a [`Var`] when
//! the model is [`ParamMode::Trainable`], and records it as a [`Param`] (name, split, whole
//! shape), so that gradient reduction, ZeRO sharding and saving work on one list in name order.
//!
//! Why not candle's `VarBuilder`: its backend cannot be reached from a builder, and a module
//! that is gathered and rebuilt per use (ZeRO-3, see [`super::unit`]) must know which
//! parameters it loaded. [`ParamBuilder::scope`] gives a builder that also records into the
//! unit's own list; parameters already loaded (tied weights) are handed out again, not re-read.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};

use super::lora::Adapters;
use crate::error::{Error, Result};

/// How a parameter is split over the tensor-parallel group: rank `rank` of `world` holds the
/// `rank`-th of `world` equal blocks along `dim`. `world == 1`: replicated (the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub dim: usize,
    pub rank: usize,
    pub world: usize,
}

impl Default for Shard {
    fn default() -> Self {
        Self::replicated()
    }
}

impl Shard {
    pub fn replicated() -> Self {
        Self {
            dim: 0,
            rank: 0,
            world: 1,
        }
    }

    pub fn new(dim: usize, rank: usize, world: usize) -> Self {
        Self { dim, rank, world }
    }

    pub fn is_split(&self) -> bool {
        self.world > 1
    }

    /// The shape of the whole tensor whose block of this split has shape `local`.
    pub fn global_shape(&self, local: &[usize]) -> Result<Vec<usize>> {
        let mut g = local.to_vec();
        if self.is_split() {
            let d = g.get_mut(self.dim).ok_or_else(|| {
                Error::invalid(
                    "shard",
                    format!("split dim {} of shape {local:?}", self.dim),
                )
            })?;
            *d *= self.world;
        }
        Ok(g)
    }

    /// This split's block of a whole tensor (a view; errors when the dim does not divide).
    pub fn take(&self, whole: &Tensor) -> Result<Tensor> {
        if !self.is_split() {
            return Ok(whole.clone());
        }
        let size = whole.dim(self.dim)?;
        if !size.is_multiple_of(self.world) || self.rank >= self.world {
            return Err(Error::invalid(
                "shard",
                format!(
                    "cannot take block {} of {} along dim {} of shape {:?}",
                    self.rank,
                    self.world,
                    self.dim,
                    whole.dims()
                ),
            ));
        }
        let block = size / self.world;
        Ok(whole.narrow(self.dim, self.rank * block, block)?)
    }
}

/// One parameter of a model: its checkpoint name, its value on this rank and its split.
#[derive(Debug, Clone)]
pub struct Param {
    pub name: String,
    /// The (local) tensor's variable when the model is trainable.
    pub var: Option<Var>,
    pub tensor: Tensor,
    pub shard: Shard,
    /// The shape of the whole parameter, as in the checkpoint.
    pub global_shape: Vec<usize>,
    /// Held by this rank of the expert-parallel group alone (an expert's weights under `--ep`):
    /// the other ranks of the group hold other experts, and its gradient is summed over the
    /// ranks that replicate it ([`super::ParallelCtx::grad_group`]).
    pub expert_parallel: bool,
}

impl Param {
    /// A parameter value that is not a variable (gathered, saved, compared).
    pub fn value(name: &str, tensor: Tensor, shard: Shard, global_shape: &[usize]) -> Self {
        let (name, global_shape) = (name.to_string(), global_shape.to_vec());
        Self {
            name,
            var: None,
            tensor,
            shard,
            global_shape,
            expert_parallel: false,
        }
    }

    /// The same parameter marked as held by this expert-parallel rank alone (or not).
    pub fn with_expert_parallel(mut self, expert_parallel: bool) -> Self {
        self.expert_parallel = expert_parallel;
        self
    }
}

/// Whether loaded parameters are variables (receive gradients) or plain tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamMode {
    Trainable,
    Frozen,
}

/// Where parameter values come from: a checkpoint (the model zoo's safetensors reader), or
/// tensors in memory ([`TensorMap`]).
pub trait TensorSource: Send + Sync {
    /// Where the tensors are, for messages.
    fn location(&self) -> String;

    fn contains(&self, name: &str) -> bool;

    /// The shape of the whole stored tensor `name`; an error naming it when absent.
    fn shape(&self, name: &str) -> Result<Vec<usize>>;

    /// `shard`'s block of `name` on `dev`, in the stored dtype (only that block is read).
    fn read(&self, name: &str, shard: Shard, dev: &Device) -> Result<Tensor>;

    /// Every tensor name, when the source can list them (adapters are checked to be used).
    fn names(&self) -> Option<Vec<String>> {
        None
    }
}

/// Whole tensors in memory as a [`TensorSource`] (random initialisation, tests).
pub struct TensorMap {
    tensors: HashMap<String, Tensor>,
    location: String,
}

impl TensorMap {
    /// `tensors` by checkpoint name; `location` names them in messages.
    pub fn new(tensors: HashMap<String, Tensor>, location: impl Into<String>) -> Self {
        Self {
            tensors,
            location: location.into(),
        }
    }

    fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| Error::Tensor {
            location: self.location.clone(),
            name: name.into(),
            msg: "missing".into(),
        })
    }
}

impl TensorSource for TensorMap {
    fn location(&self) -> String {
        self.location.clone()
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.get(name)?.dims().to_vec())
    }

    fn read(&self, name: &str, shard: Shard, dev: &Device) -> Result<Tensor> {
        Ok(shard.take(self.get(name)?)?.to_device(dev)?.contiguous()?)
    }

    fn names(&self) -> Option<Vec<String>> {
        Some(self.tensors.keys().cloned().collect())
    }
}

/// A shared, growing list of [`Param`]s (a model's, or one unit's).
#[derive(Clone, Default)]
pub struct ParamList(Arc<Mutex<Vec<Param>>>);

impl std::fmt::Debug for ParamList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ParamList({} params)", self.lock().len())
    }
}

impl ParamList {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Param>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The parameters, sorted by name (the order every rank agrees on).
    pub fn sorted(&self) -> Vec<Param> {
        let mut v = self.lock().clone();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// The parameters in the order they were loaded.
    pub fn in_order(&self) -> Vec<Param> {
        self.lock().clone()
    }

    fn find(&self, name: &str, shard: Shard) -> Option<Param> {
        self.lock()
            .iter()
            .find(|p| p.name == name && p.shard == shard)
            .cloned()
    }

    fn add_once(&self, p: &Param) {
        let mut l = self.lock();
        if !l.iter().any(|q| q.name == p.name && q.shard == p.shard) {
            l.push(p.clone());
        }
    }
}

struct Store {
    /// `None`: only the parameters already in `all` exist (a module rebuilt from them).
    source: Option<Arc<dyn TensorSource>>,
    mode: ParamMode,
    /// Every parameter loaded through any builder of this store.
    all: ParamList,
}

/// Loads parameters for model constructors; see the [module docs](self). Cheap to clone.
#[derive(Clone)]
pub struct ParamBuilder {
    store: Arc<Store>,
    /// Unit lists that also record what is loaded through this builder.
    scopes: Vec<ParamList>,
    path: Vec<String>,
    dtype: DType,
    device: Device,
    /// LoRA adapters of the linear layers built through this builder (base parameters are then
    /// frozen; see [`super::lora`]).
    adapters: Option<Arc<Adapters>>,
    /// Parameters loaded through this builder are frozen whatever the store's mode (a frozen
    /// vision tower, or weights a model loads only to save them back).
    frozen: bool,
    /// Parameters loaded through this builder are this expert-parallel rank's alone
    /// ([`Param::expert_parallel`]).
    expert_parallel: bool,
}

impl std::fmt::Debug for ParamBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamBuilder")
            .field("prefix", &self.prefix())
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl ParamBuilder {
    /// A builder reading from `source` in `dtype` on `device`; the returned list sees every
    /// parameter the model loads.
    pub fn new(
        source: Arc<dyn TensorSource>,
        dtype: DType,
        device: &Device,
        mode: ParamMode,
    ) -> (Self, ParamList) {
        let all = ParamList::default();
        let store = Store {
            source: Some(source),
            mode,
            all: all.clone(),
        };
        (Self::over(store, dtype, device), all)
    }

    /// A builder that hands out exactly `params` (by name and split; tensors as they are, no
    /// copy, gradients flowing through them) and errors on any other name.
    pub fn from_params(params: Vec<Param>, dtype: DType, device: &Device) -> Self {
        let store = Store {
            source: None,
            mode: ParamMode::Frozen,
            all: ParamList(Arc::new(Mutex::new(params))),
        };
        Self::over(store, dtype, device)
    }

    fn over(store: Store, dtype: DType, device: &Device) -> Self {
        Self {
            store: Arc::new(store),
            scopes: Vec::new(),
            path: Vec::new(),
            dtype,
            device: device.clone(),
            adapters: None,
            frozen: false,
            expert_parallel: false,
        }
    }

    /// This builder (and every builder derived from it) loading parameters that this rank of the
    /// expert-parallel group holds alone: an expert's weights under expert parallelism.
    pub fn expert_parallel(mut self) -> Self {
        self.expert_parallel = true;
        self
    }

    /// This builder (and every builder derived from it) loading its parameters frozen: they are
    /// no [`Var`]s, receive no gradient and are not trained (they are still saved).
    pub fn frozen(mut self) -> Self {
        self.frozen = true;
        self
    }

    /// This builder (and every builder derived from it) with LoRA `adapters`: the linear layers
    /// they target load adapter weights, and every other parameter is loaded frozen.
    pub fn with_adapters(mut self, adapters: Option<Arc<Adapters>>) -> Self {
        self.adapters = adapters;
        self
    }

    /// The LoRA adapters of the model being built, if any.
    pub fn adapters(&self) -> Option<&Arc<Adapters>> {
        self.adapters.as_ref()
    }

    /// The adapters of the linear layer this builder is at, when LoRA targets it.
    pub fn adapters_here(&self) -> Option<&Arc<Adapters>> {
        self.adapters
            .as_ref()
            .filter(|a| a.cfg.targets.matches(&self.prefix()))
    }

    /// This rank's `shard` of adapter parameter `name` (local shape `shape`): already loaded,
    /// read from the adapters' source, or initialised ([`super::lora::initial_adapter`], the
    /// whole tensor drawn then split). Trainable when the model is.
    pub fn get_adapter(&self, shape: impl Into<Shape>, name: &str, shard: Shard) -> Result<Tensor> {
        let shape = shape.into();
        let full = self.full_name(name);
        if self.store.all.find(&full, shard).is_some() || self.store.source.is_none() {
            return self.get_with_hints(shape, name, shard);
        }
        let adapters = self.adapters.as_ref().ok_or_else(|| Error::Tensor {
            location: "model".into(),
            name: full.clone(),
            msg: "is an adapter but the model has no LoRA configuration".into(),
        })?;
        let want = shard.global_shape(shape.dims())?;
        let (t, stored) = match adapters.source() {
            Some(src) if src.contains(&full) => {
                let stored = src.shape(&full)?;
                if stored != want {
                    return Err(Error::Tensor {
                        location: src.location(),
                        name: full,
                        msg: format!(
                            "has shape {stored:?}, the LoRA configuration expects {want:?}"
                        ),
                    });
                }
                (src.read(&full, shard, &self.device)?, stored)
            }
            Some(src) => {
                return Err(Error::Tensor {
                    location: src.location(),
                    name: full,
                    msg: "missing: the adapter does not target this layer".into(),
                })
            }
            None => {
                let whole =
                    super::lora::initial_adapter(&full, &want, adapters.cfg.seed, &self.device)?;
                (shard.take(&whole)?.contiguous()?, want)
            }
        };
        let t = t.to_dtype(self.dtype)?;
        let p = self.record(
            &full,
            t,
            shard,
            stored,
            self.store.mode == ParamMode::Trainable,
        )?;
        for s in &self.scopes {
            s.add_once(&p);
        }
        Ok(p.tensor)
    }

    fn record(
        &self,
        name: &str,
        t: Tensor,
        shard: Shard,
        global_shape: Vec<usize>,
        trainable: bool,
    ) -> Result<Param> {
        let (var, tensor) = if trainable {
            let v = Var::from_tensor(&t)?;
            let t = v.as_tensor().clone();
            (Some(v), t)
        } else {
            (None, t)
        };
        let p = Param {
            name: name.into(),
            var,
            tensor,
            shard,
            global_shape,
            expert_parallel: self.expert_parallel,
        };
        self.store.all.add_once(&p);
        Ok(p)
    }

    /// The builder of the sub-module `s` (`vb.pp("q_proj")`).
    pub fn pp(&self, s: impl ToString) -> Self {
        let mut b = self.clone();
        b.path.push(s.to_string());
        b
    }

    /// The path segments of this builder.
    pub(crate) fn path(&self) -> &[String] {
        &self.path
    }

    /// This builder at `path` (a unit rebuilt where it was first built).
    pub(crate) fn at(mut self, path: &[String]) -> Self {
        self.path = path.to_vec();
        self
    }

    /// The dotted path of this builder (`model.layers.3.self_attn`).
    pub fn prefix(&self) -> String {
        self.path.join(".")
    }

    /// Whether parameters loaded through this builder (or adapters of its layers) train: the
    /// store is trainable and this builder is not frozen.
    pub fn trainable(&self) -> bool {
        self.store.mode == ParamMode::Trainable && !self.frozen
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// This builder, also recording what is loaded through it (and its sub-builders) into the
    /// returned list: the parameters of one unit.
    pub fn scope(&self) -> (Self, ParamList) {
        let list = ParamList::default();
        let mut b = self.clone();
        b.scopes.push(list.clone());
        (b, list)
    }

    fn full_name(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix())
        }
    }

    /// Whether the source holds `name` (under this builder's path).
    pub fn contains(&self, name: &str) -> bool {
        let full = self.full_name(name);
        self.store.all.lock().iter().any(|p| p.name == full)
            || self
                .store
                .source
                .as_ref()
                .is_some_and(|s| s.contains(&full))
    }

    /// A replicated parameter `name` of shape `shape`.
    pub fn get(&self, shape: impl Into<Shape>, name: &str) -> Result<Tensor> {
        self.get_with_hints(shape, name, Shard::replicated())
    }

    /// This rank's `shard` of parameter `name` (under this builder's path), of local shape
    /// `shape`: read once (later calls, and tied weights, get the same tensor), converted to the
    /// builder's dtype, a [`Var`] when trainable, and recorded.
    pub fn get_with_hints(
        &self,
        shape: impl Into<Shape>,
        name: &str,
        shard: Shard,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let name = self.full_name(name);
        let p = match self.store.all.find(&name, shard) {
            Some(p) => {
                if p.tensor.dims() != shape.dims() {
                    return Err(Error::Tensor {
                        location: "loaded parameters".into(),
                        name,
                        msg: format!(
                            "has shape {:?}, the model expects {:?}",
                            p.tensor.dims(),
                            shape.dims()
                        ),
                    });
                }
                p
            }
            None => self.read(&name, &shape, shard)?,
        };
        for s in &self.scopes {
            s.add_once(&p);
        }
        Ok(p.tensor)
    }

    fn read(&self, name: &str, shape: &Shape, shard: Shard) -> Result<Param> {
        let source = self.store.source.as_ref().ok_or_else(|| Error::Tensor {
            location: "gathered parameters".into(),
            name: name.into(),
            msg: "is not among the parameters of this module".into(),
        })?;
        let stored = source.shape(name)?;
        let want = shard.global_shape(shape.dims())?;
        if stored != want {
            return Err(Error::Tensor {
                location: source.location(),
                name: name.into(),
                msg: format!("has shape {stored:?}, the model config expects {want:?}"),
            });
        }
        let t = source
            .read(name, shard, &self.device)?
            .to_dtype(self.dtype)?;
        // Under LoRA the base model is frozen.
        let trainable =
            self.store.mode == ParamMode::Trainable && self.adapters.is_none() && !self.frozen;
        self.record(name, t, shard, stored, trainable)
    }
}
