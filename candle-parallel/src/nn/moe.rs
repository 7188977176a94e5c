//! The mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE): a softmax top-k
//! router, SwiGLU experts, an optional shared expert with a sigmoid gate, and the router's
//! load-balancing loss ([`RouterAux`]).
//!
//! Routing is dropless by default: every token reaches its `k` experts. With a capacity factor
//! `f` ([`MoeConfig::with_capacity_factor`]) an expert takes at most `ceil(f · T · k / E)` of
//! the micro-batch's `T · k` (token, expert) assignments, those with the highest router
//! probability (Megatron's `probs` drop policy; exact ties go to the earlier token: sequence,
//! then position, [`SparseMoe::forward_at`]).
//! The decision is taken over every rank holding the micro-batch's tokens (an all-gather of the
//! assignments' probabilities), so any layout drops what one rank drops. A dropped assignment
//! contributes nothing (its routing weight is zeroed, the others are not renormalised); the
//! load-balancing loss sees the routing before dropping, and [`RouterStats::dropped_fraction`]
//! reports the share dropped. The tokens are sorted by expert
//! and each expert multiplies all of its rows in one product (a loop over experts, never over
//! tokens); the weighted outputs are added back in expert order, as transformers'
//! `index_add_` does. Top-k ties break as `torch.topk` breaks them on the CPU (no index rule:
//! the order libstdc++'s selection leaves, [`super::topk`]).
//!
//! Parallel layout: the router is a replicated weight applied to this rank's tokens outside
//! the tensor-parallel region, like a norm. Each expert's MLP is split over tp as Megatron
//! splits a dense MLP (gate and up by rows, down by columns); the experts' partial outputs are
//! weighted and summed first, then reduced once (all-reduce, or reduce-scatter under TP-sp).
//! Under sequence parallelism each rank routes its own tokens; the load-balancing statistics
//! are summed over the ranks that hold the micro-batch's tokens.
//!
//! Padding: a pass may say which of its tokens count in the routing statistics
//! ([`Pass::routed`](super::Pass::routed), transformers' `attention_mask`). Padding tokens are
//! routed and computed like any token (and take capacity under a capacity factor), but the
//! load-balancing loss, its gradient, the loads and the dropped share leave them out, as
//! transformers' `load_balancing_loss_func` does given an attention mask.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};

use super::{
    Adapters, ColumnParallelLinear, LinearConfig, Mlp, MlpConfig, ParallelCtx, ParamBuilder,
    RowParallelLinear, TpGroup,
};
use crate::collectives::{
    all_to_all_v, copy_to_parallel_region, record, reduce_from_parallel_region, reduce_scatter,
};
use crate::comm::{Comm, ReduceOp};
use crate::error::{Error, Result};
use crate::nn::linear::linear;
use crate::nn::topk::torch_top_k;
use crate::ops::swiglu;

/// The shape and checkpoint names of a [`SparseMoe`].
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub hidden_size: usize,
    /// Each expert's hidden units (Mixtral's `intermediate_size`, Qwen's
    /// `moe_intermediate_size`).
    pub expert_intermediate_size: usize,
    pub num_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Renormalise the `k` chosen probabilities to sum to one (Mixtral always does; Qwen's
    /// `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// The router's name (`gate`).
    pub router: String,
    /// The experts' folder (`experts`): expert `e` is at `{experts}.{e}`.
    pub experts: String,
    /// The names of an expert's gate, up and down projections (`gate_proj`, `up_proj`,
    /// `down_proj`; Mixtral: `w1`, `w3`, `w2`).
    pub expert_names: [String; 3],
    /// Qwen2-MoE's shared expert: its hidden units; it is at `shared_expert` (a SwiGLU MLP) and
    /// its gate at `shared_expert_gate` (`(1, hidden)`).
    pub shared_expert: Option<usize>,
    /// Token dropping: each expert takes at most `ceil(f · T · k / E)` assignments of a
    /// micro-batch of `T` tokens (`None`: dropless, as transformers).
    pub capacity_factor: Option<f64>,
}

impl MoeConfig {
    /// `num_experts` SwiGLU experts of `expert_intermediate_size` units, `top_k` per token,
    /// Qwen's names (`gate`, `experts.{e}.gate_proj`, ...), no renormalisation, no shared
    /// expert. Errors when `top_k` is not in `1..=num_experts`.
    pub fn new(
        hidden_size: usize,
        expert_intermediate_size: usize,
        num_experts: usize,
        top_k: usize,
    ) -> Result<Self> {
        if num_experts == 0 || top_k == 0 || top_k > num_experts {
            return Err(Error::invalid(
                "mixture of experts",
                format!(
                    "{top_k} experts per token (num_experts_per_tok) of {num_experts} \
                     experts: must be between 1 and the number of experts"
                ),
            ));
        }
        Ok(Self {
            hidden_size,
            expert_intermediate_size,
            num_experts,
            top_k,
            norm_topk_prob: false,
            router: "gate".into(),
            experts: "experts".into(),
            expert_names: ["gate_proj".into(), "up_proj".into(), "down_proj".into()],
            shared_expert: None,
            capacity_factor: None,
        })
    }

    pub fn with_norm_topk_prob(mut self, on: bool) -> Self {
        self.norm_topk_prob = on;
        self
    }

    /// Other names for an expert's gate, up and down projections (Mixtral: `w1`, `w3`, `w2`).
    pub fn with_expert_names(mut self, gate: &str, up: &str, down: &str) -> Self {
        self.expert_names = [gate.into(), up.into(), down.into()];
        self
    }

    pub fn with_shared_expert(mut self, intermediate_size: Option<usize>) -> Self {
        self.shared_expert = intermediate_size;
        self
    }

    /// Token dropping with capacity factor `factor` (`None`: dropless). Errors unless it is a
    /// finite number above 0.
    pub fn with_capacity_factor(mut self, factor: Option<f64>) -> Result<Self> {
        if let Some(f) = factor {
            if !f.is_finite() || f <= 0.0 {
                return Err(Error::invalid(
                    "mixture of experts",
                    format!("capacity factor {f}: must be a finite number above 0"),
                ));
            }
        }
        self.capacity_factor = factor;
        Ok(self)
    }

    /// The most assignments an expert takes of a micro-batch of `tokens` tokens (`None`:
    /// unlimited).
    pub fn capacity(&self, tokens: usize) -> Option<usize> {
        self.capacity_factor.map(|f| {
            (f * tokens as f64 * self.top_k as f64 / self.num_experts as f64).ceil() as usize
        })
    }

    /// The parameters of one block, relative to its folder: name and shape as in the
    /// checkpoint.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i) = (self.hidden_size, self.expert_intermediate_size);
        let mut out = vec![(format!("{}.weight", self.router), vec![self.num_experts, h])];
        for e in 0..self.num_experts {
            let [g, u, d] = &self.expert_names;
            let p = |n: &str| format!("{}.{e}.{n}.weight", self.experts);
            out.push((p(g), vec![i, h]));
            out.push((p(u), vec![i, h]));
            out.push((p(d), vec![h, i]));
        }
        if let Some(s) = self.shared_expert {
            for (n, shape) in [
                ("gate_proj", vec![s, h]),
                ("up_proj", vec![s, h]),
                ("down_proj", vec![h, s]),
            ] {
                out.push((format!("shared_expert.{n}.weight"), shape));
            }
            out.push(("shared_expert_gate.weight".into(), vec![1, h]));
        }
        out
    }

    /// Parameters a token multiplies in one block: the router, `k` experts and the shared
    /// expert (for the FLOPs of a sparse model).
    pub fn active_matmul_params(&self) -> usize {
        let h = self.hidden_size;
        let expert = 3 * h * self.expert_intermediate_size;
        let shared = self.shared_expert.map_or(0, |s| 3 * h * s + h);
        self.num_experts * h + self.top_k * expert + shared
    }
}

/// The name transformers 5 and PEFT give an expert's fused gate and up projections (one LoRA
/// `A` for both, its `B` rows split between them).
pub const EXPERT_GATE_UP: &str = "gate_up_proj";
/// The name transformers 5 and PEFT give the experts' down projections.
pub const EXPERT_DOWN: &str = "down_proj";

/// One expert's SwiGLU projections: this rank's rows of gate and up `(i/P, hidden)` and columns
/// of down `(hidden, i/P)`, with their LoRA adapters when targeted (see [`SparseMoe::new`]).
#[derive(Debug, Clone)]
struct Expert {
    gate: ColumnParallelLinear,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
    /// Where the gradients of the adapter factors replicated over tp (gate's and up's `A`,
    /// down's `B`) are summed in the graph: each tensor-parallel rank's backward gives only its
    /// rows' (or columns') part of them.
    sum_over: Option<Comm>,
}

impl Expert {
    /// Expert `vb` (`...experts.3`); `gate_up` and `down`: the model's adapters for the
    /// experts' `gate_up_proj` and `down_proj` ([`Adapters::for_parameter`]).
    fn new(
        cfg: &MoeConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        adapters: &ExpertAdapters,
        sum_over: Option<Comm>,
    ) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.expert_intermediate_size);
        let [g, u, d] = &cfg.expert_names;
        let gate_up = with_adapters(&vb, adapters.gate_up.as_ref());
        let fused = gate_up.pp(EXPERT_GATE_UP);
        let column = |name: &str| {
            ColumnParallelLinear::new_part(&LinearConfig::new(h, i), gate_up.pp(name), &fused, ctx)
        };
        let down = with_adapters(&vb, adapters.down.as_ref());
        Ok(Self {
            gate: column(g)?,
            up: column(u)?,
            down: RowParallelLinear::new(&LinearConfig::new(i, h), down.pp(d), ctx)?,
            sum_over,
        })
    }

    /// `t` (a replicated adapter factor) with its gradient summed over tp when needed.
    fn summed(&self, t: &Tensor) -> Result<Tensor> {
        match &self.sum_over {
            Some(c) => Ok(copy_to_parallel_region(t, c)?),
            None => Ok(t.clone()),
        }
    }

    /// `x` `(n, hidden)` → `(n, hidden)`, a partial sum over tp.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut g = linear(x, self.gate.weight(), None)?;
        let mut u = linear(x, self.up.weight(), None)?;
        if let (Some(lg), Some(lu)) = (self.gate.lora(), self.up.lora()) {
            if lg.enabled() {
                // One `A` for gate and up (the fused `gate_up_proj`'s), `B` split by rows.
                let lg = lg.with_weights(self.summed(&lg.a)?, lg.b.clone());
                let hx = lg.down(x)?;
                g = (g + lg.up(&hx)?)?;
                u = (u + lu.up(&hx)?)?;
            }
        }
        let hidden = swiglu(&g, &u)?;
        let y = linear(&hidden, self.down.weight(), None)?;
        match self.down.lora() {
            Some(l) if l.enabled() => {
                let l = l.with_weights(l.a.clone(), self.summed(&l.b)?);
                Ok((y + l.up(&l.down(&hidden)?)?)?)
            }
            _ => Ok(y),
        }
    }
}

/// The adapters of the experts' two projections of one block, when the model has adapters.
#[derive(Debug, Clone, Default)]
struct ExpertAdapters {
    gate_up: Option<Arc<Adapters>>,
    down: Option<Arc<Adapters>>,
}

/// `vb` building with `adapters` (the base frozen), or as it is without.
fn with_adapters(vb: &ParamBuilder, adapters: Option<&Arc<Adapters>>) -> ParamBuilder {
    match adapters {
        Some(a) => vb.clone().with_adapters(Some(a.clone())),
        None => vb.clone(),
    }
}

/// `vb` with the model's adapters for the directly adapted parameter `name` (PEFT's
/// `target_parameters`), if the model has adapters.
fn for_parameter(vb: &ParamBuilder, name: &str) -> Option<Arc<Adapters>> {
    vb.adapters().map(|a| a.for_parameter(name))
}

/// The sparse feed-forward block; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct SparseMoe {
    /// `(num_experts, hidden)`, replicated (a layer of this rank alone: no tensor parallelism).
    router: ColumnParallelLinear,
    experts: Vec<Expert>,
    /// The shared expert and its gate `(1, hidden)` (replicated, like the router).
    shared: Option<(Mlp, ColumnParallelLinear)>,
    cfg: MoeConfig,
    tp: TpGroup,
    /// Where the router's statistics go, and this block's index there.
    aux: Option<(Arc<RouterAux>, usize)>,
    /// Expert parallelism: the group over which the experts are divided (this rank holds
    /// `experts`, from `first_expert` on).
    ep: Option<Comm>,
    first_expert: usize,
    /// [`ParallelCtx::token_groups`]: where a capacity decision is taken.
    token_groups: Vec<Comm>,
}

impl SparseMoe {
    /// Loads the block under `vb` (`mlp`, or Mixtral's `block_sparse_moe`). With `aux`, the
    /// router records its statistics as block `layer` of `aux`, and its logits receive the
    /// load-balancing loss's gradient ([`RouterAux`]). Under the context's expert parallelism
    /// ([`ParallelCtx::with_expert_parallel`]) this rank holds its slice of the experts
    /// ([`SparseMoe::new_with_ep`]). Errors when tp does not divide the experts' hidden units.
    ///
    /// LoRA (the builder's adapters, [`ParamBuilder::with_adapters`]) reaches the block as PEFT
    /// reaches transformers 5's: through `target_parameters`. The router is adapted when
    /// `<block>.gate.weight` is targeted, every expert's gate and up projections when
    /// `<block>.experts.gate_up_proj` is (one `A` of the fused projection's rank shared by
    /// both, `B` rows split between them and over tp), their down projections when
    /// `<block>.experts.down_proj` is (`A` split over tp by columns, `B` replicated). The
    /// shared expert and its gate are linear layers targeted by module name. Each expert's
    /// adapters are its own parameters (under expert parallelism on its rank alone); the
    /// factors replicated over tp have their gradients summed over tp in the graph, except
    /// under TP-sp without expert parallelism, where the trainer sums them like any replicated
    /// parameter.
    pub fn new(
        cfg: &MoeConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        aux: Option<(Arc<RouterAux>, usize)>,
    ) -> Result<Self> {
        Self::new_with_ep(cfg, vb, ctx, aux, ctx.expert_parallel().cloned())
    }

    /// [`SparseMoe::new`] with expert parallelism over `ep` (when it has more than one rank):
    /// rank `r` of `ep` loads and runs experts `r · E/P .. (r + 1) · E/P` only, the ranks of `ep`
    /// hold different tokens (data or sequence parallel ranks), and each token's hidden state
    /// travels to the ranks of its experts and back by [`all_to_all_v`]. The parameters of
    /// the experts are this rank's alone: their gradients sum the contributions of every rank's
    /// tokens and must not be summed over `ep` again. Under tensor parallelism each expert is
    /// split over tp as without `ep`, and the rows travel between the ranks of `ep`, which share
    /// their tensor-parallel coordinate. Errors when `P` does not divide the experts.
    pub fn new_with_ep(
        cfg: &MoeConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        aux: Option<(Arc<RouterAux>, usize)>,
        ep: Option<Comm>,
    ) -> Result<Self> {
        let ep = ep.filter(|c| c.size() > 1);
        let (first_expert, local) = match &ep {
            None => (0, cfg.num_experts),
            Some(c) => {
                if !cfg.num_experts.is_multiple_of(c.size()) {
                    return Err(Error::Layout(format!(
                        "expert parallelism over {} ranks does not divide the {} experts \
                         (num_experts)",
                        c.size(),
                        cfg.num_experts
                    )));
                }
                let per = cfg.num_experts / c.size();
                (c.rank() * per, per)
            }
        };
        // The router and the shared expert's gate are replicated and applied to this rank's
        // tokens outside the tensor-parallel region.
        let solo = ctx.without_tp();
        let router_vb = vb.pp(&cfg.router);
        let router_adapters = for_parameter(&router_vb, &format!("{}.weight", router_vb.prefix()));
        let router = ColumnParallelLinear::new(
            &LinearConfig::new(cfg.hidden_size, cfg.num_experts),
            with_adapters(&router_vb, router_adapters.as_ref()),
            &solo,
        )?;
        let experts_vb = match &ep {
            Some(_) => vb.pp(&cfg.experts).expert_parallel(),
            None => vb.pp(&cfg.experts),
        };
        let param =
            |name: &str| for_parameter(&experts_vb, &format!("{}.{name}", experts_vb.prefix()));
        let adapters = ExpertAdapters {
            gate_up: param(EXPERT_GATE_UP),
            down: param(EXPERT_DOWN),
        };
        // Under TP-sp the trainer sums replicated parameters' gradients over tp (each rank's
        // part); an expert's under expert parallelism only over the ranks holding it.
        let tp = ctx.tp();
        let sum_over =
            (tp.size() > 1 && (!tp.sequence_parallel() || ep.is_some())).then(|| tp.comm().clone());
        let experts = (first_expert..first_expert + local)
            .map(|e| Expert::new(cfg, experts_vb.pp(e), ctx, &adapters, sum_over.clone()))
            .collect::<Result<Vec<_>>>()?;
        let shared = match cfg.shared_expert {
            Some(i) => Some((
                Mlp::new(
                    &MlpConfig::swiglu(cfg.hidden_size, i),
                    vb.pp("shared_expert"),
                    ctx,
                )?,
                ColumnParallelLinear::new(
                    &LinearConfig::new(cfg.hidden_size, 1),
                    vb.pp("shared_expert_gate"),
                    &solo,
                )?,
            )),
            None => None,
        };
        if let Some((aux, _)) = &aux {
            if aux.num_experts != cfg.num_experts {
                return Err(Error::invalid(
                    "mixture of experts",
                    format!(
                        "router statistics for {} experts given to a block of {}",
                        aux.num_experts, cfg.num_experts
                    ),
                ));
            }
        }
        Ok(Self {
            router,
            experts,
            shared,
            cfg: cfg.clone(),
            tp: ctx.tp().clone(),
            aux,
            ep,
            first_expert,
            token_groups: ctx.token_groups(),
        })
    }

    /// `x` `(batch, tokens', hidden)` → the same shape. Collective over tp (and the ranks
    /// holding the tokens under a capacity factor). Capacity ties go to the earlier rank and
    /// row: see [`SparseMoe::forward_at`].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_at(x, None, None)
    }

    /// [`SparseMoe::forward`] for tokens at sequence `positions` (the pass's positions of this
    /// rank's tokens; under TP-sp this tensor-parallel rank holds its contiguous part of them):
    /// under a capacity factor, assignments of equal probability go to the earlier sequence of
    /// the batch, then the earlier position, whatever the layout. `routed` (the pass's
    /// [`Pass::routed`](super::Pass::routed), `batch · positions.len()` flags, sequence-major)
    /// says which tokens count in the routing statistics (`None`: all).
    pub fn forward_at(
        &self,
        x: &Tensor,
        positions: Option<&[u32]>,
        routed: Option<&[bool]>,
    ) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let k = self.cfg.top_k;
        let xs = x.reshape((b * s, h))?;
        let routed = self.local_flags(routed, b, s)?;
        // The router, in f32 as transformers' `softmax(.., dtype=float)`.
        let mut logits = self.router.forward(&xs)?.to_dtype(DType::F32)?;
        if let Some((aux, _)) = &self.aux {
            logits = aux.attach(&logits, routed.as_deref())?;
        }
        let probs = router_softmax(&logits)?;
        let host = probs.to_vec2::<f32>()?;
        let mut chosen: Vec<u32> = host.iter().flat_map(|row| torch_top_k(row, k)).collect();
        let kept = self.within_capacity(&host, &chosen, s, positions, x.device())?;
        if let Some((aux, layer)) = &self.aux {
            aux.record(*layer, &host, &chosen, kept.as_deref(), routed.as_deref());
        }
        let idx = Tensor::from_vec(chosen.clone(), (b * s, k), x.device())?;
        let mut weights = probs.gather(&idx, 1)?;
        if self.cfg.norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        if let Some(kept) = &kept {
            // A dropped assignment: weight 0, and the expert id past the last (no rows).
            let mask: Vec<f32> = kept.iter().map(|&x| if x { 1.0 } else { 0.0 }).collect();
            weights = weights.mul(&Tensor::from_vec(mask, (b * s, k), x.device())?)?;
            for (c, &keep) in chosen.iter_mut().zip(kept) {
                if !keep {
                    *c = self.cfg.num_experts as u32;
                }
            }
        }
        let weights = weights.to_dtype(x.dtype())?.reshape((b, s, k))?;
        let idx = Tensor::from_vec(chosen, (b, s, k), x.device())?;
        let out = self.tensor_parallel(x, &weights, &idx)?;
        match &self.shared {
            None => Ok(out),
            Some((mlp, gate)) => {
                let g = gate.forward(x)?;
                let g = (g.neg()?.exp()? + 1.0)?.recip()?;
                Ok((out + mlp.forward(x)?.broadcast_mul(&g)?)?)
            }
        }
    }

    /// The experts on `x` `(batch, tokens', hidden)` with their routing `weights` and chosen
    /// experts `idx` `(batch, tokens', k)`, each expert split over tp: every expert here, or
    /// under expert parallelism the rows sent to the ranks of their experts
    /// ([`SparseMoe::dispatch`], between the ranks of the same tensor-parallel coordinate).
    /// Collective over tp (and `ep`).
    fn tensor_parallel(&self, x: &Tensor, weights: &Tensor, idx: &Tensor) -> Result<Tensor> {
        let (h, k) = (self.cfg.hidden_size, self.cfg.top_k);
        // Into the tensor-parallel region: every rank of the group computes its share of each
        // expert for all of the group's tokens.
        let entered = self.tp.enter(x)?;
        let weights = self.tp.enter(weights)?.flatten_all()?;
        let chosen = self.group_choices(idx)?;
        let (bg, sg) = (entered.dim(0)?, entered.dim(1)?);
        let xs = entered.reshape((bg * sg, h))?;
        let out = match &self.ep {
            Some(ep) => self.dispatch(&xs, &weights, &chosen, ep)?,
            None => {
                let mut rows: Vec<(Vec<u32>, Vec<u32>)> =
                    vec![(Vec::new(), Vec::new()); self.experts.len()];
                // Dropped assignments carry the id `num_experts`: no expert takes them.
                for (slot, &e) in chosen.iter().enumerate() {
                    if let Some((tokens, slots)) = rows.get_mut(e as usize) {
                        tokens.push((slot / k) as u32);
                        slots.push(slot as u32);
                    }
                }
                self.run_experts(&xs, rows, Some(&weights), 0)?
            }
        };
        let out = out.reshape((bg, sg, h))?;
        Ok(if self.tp.size() == 1 {
            out
        } else if self.tp.sequence_parallel() {
            reduce_scatter(&out, self.tp.comm(), 1)?
        } else {
            reduce_from_parallel_region(&out, self.tp.comm())?
        })
    }

    /// This rank's experts on the rows of `xs` `(n, hidden)`: `rows[i]` lists the rows expert
    /// `first_expert + i` takes and the routing weights' slots (in `weights`, flat) that scale
    /// them; without weights the rows are returned unscaled. Returns `(n, hidden)`, each row
    /// the sum over its experts. An expert without rows runs on row `dummy` with weight 0:
    /// every rank's graph has the same nodes in the same order whatever its routing (the
    /// backward collectives of ZeRO-3 and recomputation follow that order), and its weights get
    /// exact zeros.
    fn run_experts(
        &self,
        xs: &Tensor,
        rows: Vec<(Vec<u32>, Vec<u32>)>,
        weights: Option<&Tensor>,
        dummy: u32,
    ) -> Result<Tensor> {
        let dev = xs.device();
        // Every expert's weighted rows, in expert order, then one scatter-add: a token's rows are
        // added in expert order (as one addition per expert would add them, bit for bit), and
        // the graph keeps one `(Σ rows, hidden)` tensor instead of an `(n, hidden)` sum per
        // expert (128 of them per layer for Qwen3-MoE's experts).
        let mut all_tokens: Vec<u32> = Vec::new();
        let mut parts: Vec<Tensor> = Vec::with_capacity(self.experts.len());
        for (expert, (mut tokens, mut slots)) in self.experts.iter().zip(rows) {
            let mut mask = vec![1f32; tokens.len()];
            if tokens.is_empty() {
                (tokens, slots, mask) = (vec![dummy], vec![0], vec![0.0]);
            }
            let m = tokens.len();
            all_tokens.extend_from_slice(&tokens);
            let tokens = Tensor::from_vec(tokens, m, dev)?;
            let mask = Tensor::from_vec(mask, (m, 1), dev)?.to_dtype(xs.dtype())?;
            let w = match weights {
                Some(w) => {
                    let slots = Tensor::from_vec(slots, m, dev)?;
                    w.index_select(&slots, 0)?.unsqueeze(1)?.mul(&mask)?
                }
                None => mask,
            };
            let y = expert.forward(&xs.index_select(&tokens, 0)?)?;
            parts.push(y.broadcast_mul(&w)?);
        }
        let m = all_tokens.len();
        let rows = Tensor::cat(&parts, 0)?;
        Ok(xs
            .zeros_like()?
            .index_add(&Tensor::from_vec(all_tokens, m, dev)?, &rows, 0)?)
    }

    /// Expert parallelism on this rank's tokens `xs` `(n, hidden)` with their routing `weights`
    /// `(n · k,)` and chosen experts: the rows go to the ranks of their experts (sorted by
    /// expert), run there, come back, and are weighted and summed per token. Collective over
    /// `ep`.
    fn dispatch(&self, xs: &Tensor, weights: &Tensor, chosen: &[u32], ep: &Comm) -> Result<Tensor> {
        let (k, h) = (self.cfg.top_k, self.cfg.hidden_size);
        let per = self.experts.len();
        let dev = xs.device();
        // Every kept assignment (a dropped one carries the id `num_experts`), sorted by expert.
        let mut order: Vec<u32> = (0..chosen.len() as u32)
            .filter(|&slot| (chosen[slot as usize] as usize) < self.cfg.num_experts)
            .collect();
        order.sort_by_key(|&slot| (chosen[slot as usize], slot));
        let mut send_counts = vec![0usize; ep.size()];
        for &slot in &order {
            send_counts[chosen[slot as usize] as usize / per] += 1;
        }
        let m = order.len();
        let tokens = Tensor::from_vec(order.iter().map(|&s| s / k as u32).collect(), m, dev)?;
        let ids: Vec<f32> = order.iter().map(|&s| chosen[s as usize] as f32).collect();
        let (x_recv, recv_counts) = all_to_all_v(&xs.index_select(&tokens, 0)?, ep, &send_counts)?;
        let (ids, _) = ep.all_to_all_v(&Tensor::from_vec(ids, (m, 1), dev)?, &send_counts)?;
        let ids = ids.flatten_all()?.to_vec1::<f32>()?;
        // One zero row past the received ones: the input of experts that received none.
        let n = x_recv.dim(0)?;
        let x_ext = Tensor::cat(&[&x_recv, &Tensor::zeros((1, h), xs.dtype(), dev)?], 0)?;
        let mut rows: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); per];
        for (row, &e) in ids.iter().enumerate() {
            let local = e as usize - self.first_expert;
            rows.get_mut(local)
                .ok_or_else(|| {
                    Error::invalid("expert parallelism", format!("expert {e} is not here"))
                })?
                .0
                .push(row as u32);
        }
        let y_ext = self.run_experts(&x_ext, rows, None, n as u32)?;
        // The dummy row's output, times 0, keeps the experts in the graph when no row came.
        let dangling = y_ext.narrow(0, n, 1)?.sum_all()?;
        let dangling = (&dangling * dangling.zeros_like()?)?;
        let (y_back, _) = all_to_all_v(&y_ext.narrow(0, 0, n)?, ep, &recv_counts)?;
        let order = Tensor::from_vec(order, m, dev)?;
        let w = weights.index_select(&order, 0)?.unsqueeze(1)?;
        let out = xs
            .zeros_like()?
            .index_add(&tokens, &y_back.broadcast_mul(&w)?, 0)?;
        Ok(out.broadcast_add(&dangling)?)
    }

    /// The flags of `routed` (the pass's, `batch · n` for `n` tokens per sequence) for this
    /// rank's `b · s` rows: all of them, or under TP-sp this tensor-parallel rank's contiguous
    /// part of each sequence. `None` when every token counts.
    fn local_flags(
        &self,
        routed: Option<&[bool]>,
        b: usize,
        s: usize,
    ) -> Result<Option<Vec<bool>>> {
        let Some(r) = routed else {
            return Ok(None);
        };
        if r.len() == b * s {
            return Ok(Some(r.to_vec()));
        }
        if self.tp.sequence_parallel() && r.len() == b * s * self.tp.size() {
            let (n, at) = (s * self.tp.size(), self.tp.rank() * s);
            return Ok(Some(
                (0..b)
                    .flat_map(|i| r[i * n + at..i * n + at + s].iter().copied())
                    .collect(),
            ));
        }
        Err(Error::invalid(
            "mixture of experts",
            format!("{} routing flags for {b} sequences of {s} tokens", r.len()),
        ))
    }

    /// Under a capacity factor, which of this rank's assignments (`chosen`, `k` per row of the
    /// router probabilities `probs`, `s` rows per sequence at `positions`) keep their expert: the assignments of every rank holding
    /// the micro-batch's tokens are gathered (the same number from each) and each expert keeps
    /// its `capacity` most probable ([`keep_within_capacity`]). `None` when dropless.
    /// Collective over the token groups.
    fn within_capacity(
        &self,
        probs: &[Vec<f32>],
        chosen: &[u32],
        s: usize,
        positions: Option<&[u32]>,
        dev: &candle_core::Device,
    ) -> Result<Option<Vec<bool>>> {
        if self.cfg.capacity_factor.is_none() {
            return Ok(None);
        }
        let positions = match positions {
            None => None,
            Some(p) if p.len() == s => Some(p),
            // TP-sp: this rank's contiguous part of the sequence-parallel rank's tokens.
            Some(p) if self.tp.sequence_parallel() && p.len() == s * self.tp.size() => {
                Some(&p[self.tp.rank() * s..(self.tp.rank() + 1) * s])
            }
            Some(p) => {
                return Err(Error::invalid(
                    "mixture of experts",
                    format!("{} positions for {s} tokens per sequence", p.len()),
                ))
            }
        };
        let k = self.cfg.top_k;
        let n = chosen.len();
        // Per assignment: its probability, expert, and its token's (sequence, position), or
        // the row here when no positions are known (ids and positions are exact in f32 up to
        // 2^24).
        let mut rows = Vec::with_capacity(4 * n);
        for (slot, &e) in chosen.iter().enumerate() {
            let token = slot / k;
            let (seq, pos) = match positions {
                Some(p) => (token / s, p[token % s] as usize),
                None => (0, token),
            };
            rows.extend([probs[token][e as usize], e as f32, seq as f32, pos as f32]);
        }
        let mut all = Tensor::from_vec(rows, (n, 4), dev)?;
        let mut offset = 0;
        for g in &self.token_groups {
            if g.size() > 1 {
                let len = all.dim(0)?;
                all = g.all_gather(&all, 0)?;
                offset += g.rank() * len;
            }
        }
        let all = all.to_vec2::<f32>()?;
        let tokens = all.len() / k;
        let capacity = self.cfg.capacity(tokens).unwrap_or(usize::MAX);
        let p: Vec<f32> = all.iter().map(|r| r[0]).collect();
        let e: Vec<u32> = all.iter().map(|r| r[1] as u32).collect();
        let order: Vec<(u32, u32)> = all.iter().map(|r| (r[2] as u32, r[3] as u32)).collect();
        let keep = keep_within_capacity(&p, &e, &order, self.cfg.num_experts, capacity);
        Ok(Some(keep[offset..offset + n].to_vec()))
    }

    /// The chosen experts `(batch, tokens', k)` of every token of the tensor-parallel group,
    /// flattened like the entered activations (gathered under TP-sp). Collective over tp under
    /// TP-sp.
    fn group_choices(&self, idx: &Tensor) -> Result<Vec<u32>> {
        let idx = if self.tp.sequence_parallel() {
            let f = idx.to_dtype(DType::F32)?;
            self.tp.comm().all_gather(&f, 1)?.to_dtype(DType::U32)?
        } else {
            idx.clone()
        };
        Ok(idx.flatten_all()?.to_vec1::<u32>()?)
    }
}

/// Which assignments keep their expert when each of `num_experts` takes at most `capacity`:
/// assignment `i` goes to expert `experts[i]` with router probability `probs[i]`; an expert
/// keeps its most probable assignments, exact ties to the lower `order[i]` (the token's
/// sequence and position), then the lower index.
pub fn keep_within_capacity(
    probs: &[f32],
    experts: &[u32],
    order: &[(u32, u32)],
    num_experts: usize,
    capacity: usize,
) -> Vec<bool> {
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); num_experts];
    for (i, &e) in experts.iter().enumerate() {
        if let Some(list) = by_expert.get_mut(e as usize) {
            list.push(i);
        }
    }
    let mut keep = vec![false; experts.len()];
    for mut list in by_expert {
        list.sort_by(|&a, &b| {
            probs[b]
                .total_cmp(&probs[a])
                .then(order[a].cmp(&order[b]))
                .then(a.cmp(&b))
        });
        for &i in list.iter().take(capacity) {
            keep[i] = true;
        }
    }
    keep
}

/// The softmax over experts of router logits `(tokens, E)`, differentiable (the shift by the
/// row maximum is detached: softmax does not depend on it).
fn router_softmax(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(1)?.detach();
    let ex = logits.broadcast_sub(&max)?.exp()?;
    Ok(ex.broadcast_div(&ex.sum_keepdim(1)?)?)
}

/// One block's router statistics over this rank's tokens of a micro-batch.
#[derive(Debug, Clone, Default)]
struct BlockStats {
    /// Per expert: tokens routed to it (over the `k` slots).
    counts: Vec<f64>,
    /// Per expert: the sum of its router probability over the tokens.
    probs: Vec<f64>,
    tokens: f64,
    /// (token, expert) assignments, and those dropped by the capacity.
    assignments: f64,
    dropped: f64,
}

/// The load-balancing statistics of the whole micro-batch, summed over its ranks.
#[derive(Debug, Clone)]
struct Totals {
    /// Per expert: Σ over blocks and tokens of the routed count.
    counts: Vec<f64>,
    /// Routed tokens: Σ over blocks of the micro-batch's tokens.
    tokens: f64,
    /// `coef · n` (the micro-batch's labelled tokens): the weight of the auxiliary loss in the
    /// summed loss.
    weight: f64,
}

#[derive(Debug, Default)]
struct AuxState {
    blocks: BTreeMap<usize, BlockStats>,
    /// The totals of the micro-batch whose backward runs next.
    totals: Option<Totals>,
    /// The gradient of the loss the auxiliary term was added to, per unit of the summed loss.
    seed: Option<f64>,
    last: Option<RouterStats>,
    /// Under a pipeline: the micro-batch whose forward runs on this stage now, the statistics
    /// its earlier stages carried here, and the totals of the micro-batches whose loss this
    /// (last) stage has computed and whose backward has not run yet.
    current: usize,
    carried: Option<Partial>,
    parked: HashMap<usize, Totals>,
}

/// The routing statistics of some of a micro-batch's sparse blocks, each block's summed over
/// the ranks that hold the micro-batch's tokens: what [`RouterAux::finish`] completes, and what
/// a pipeline stage carries to the next ([`RouterAux::forward_carry`]).
#[derive(Debug, Clone, PartialEq)]
struct Partial {
    /// Per expert: Σ over the blocks of the routed count.
    counts: Vec<f64>,
    /// Per expert: Σ over the blocks of its router probability.
    probs: Vec<f64>,
    tokens: f64,
    assignments: f64,
    dropped: f64,
    /// Per block, by layer (ascending): the busiest expert's tokens over the mean.
    layer_loads: Vec<(usize, f64)>,
}

impl Partial {
    fn empty(experts: usize) -> Self {
        Self {
            counts: vec![0.0; experts],
            probs: vec![0.0; experts],
            tokens: 0.0,
            assignments: 0.0,
            dropped: 0.0,
            layer_loads: Vec::new(),
        }
    }

    /// The statistics of both sets of blocks (disjoint layers).
    fn add(mut self, other: &Partial) -> Self {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        for (a, b) in self.probs.iter_mut().zip(&other.probs) {
            *a += b;
        }
        self.tokens += other.tokens;
        self.assignments += other.assignments;
        self.dropped += other.dropped;
        self.layer_loads.extend_from_slice(&other.layer_loads);
        self.layer_loads.sort_by_key(|(l, _)| *l);
        self
    }

    /// Length of [`Partial::encode`]'s vector for `experts` and a model of `layers` layers.
    fn encoded_len(experts: usize, layers: usize) -> usize {
        2 * experts + 3 + layers
    }

    /// `[counts (E), probs (E), tokens, assignments, dropped, load of each of the model's
    /// `layers` layers (-1: no block ran)]`.
    fn encode(&self, layers: usize) -> Result<Vec<f64>> {
        let e = self.counts.len();
        let n = Self::encoded_len(e, layers);
        let mut v = Vec::with_capacity(n);
        v.extend_from_slice(&self.counts);
        v.extend_from_slice(&self.probs);
        v.extend([self.tokens, self.assignments, self.dropped]);
        v.resize(n, -1.0);
        for &(l, load) in &self.layer_loads {
            if l >= layers {
                return Err(Error::invalid(
                    "router load-balancing loss",
                    format!("a sparse block at layer {l} of a model of {layers} layers"),
                ));
            }
            v[2 * e + 3 + l] = load;
        }
        Ok(v)
    }

    fn decode(v: &[f64], experts: usize, layers: usize) -> Result<Self> {
        let e = experts;
        let n = Self::encoded_len(e, layers);
        if v.len() != n {
            return Err(Error::invalid(
                "router load-balancing loss",
                format!(
                    "{} carried statistics for {e} experts and {layers} layers (want {n})",
                    v.len()
                ),
            ));
        }
        Ok(Self {
            counts: v[..e].to_vec(),
            probs: v[e..2 * e].to_vec(),
            tokens: v[2 * e],
            assignments: v[2 * e + 1],
            dropped: v[2 * e + 2],
            layer_loads: v[2 * e + 3..]
                .iter()
                .enumerate()
                .filter(|(_, &x)| x >= 0.0)
                .map(|(l, &x)| (l, x))
                .collect(),
        })
    }
}

/// A micro-batch's routing, summed over its ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterStats {
    /// The load-balancing loss (without its coefficient).
    pub aux: f64,
    /// The busiest expert's tokens over the mean, in the most unbalanced sparse block (1:
    /// perfectly balanced).
    pub load_max_over_mean: f64,
    /// The micro-batch's labelled tokens.
    pub labelled_tokens: f64,
    /// The share of (token, expert) assignments the capacity dropped, over every sparse block
    /// (0 when dropless).
    pub dropped_fraction: f64,
    /// Per sparse block that ran (by its layer index, ascending): the busiest expert's tokens
    /// over the mean.
    pub layer_loads: Vec<(usize, f64)>,
}

/// The router's load-balancing loss of one micro-batch, as transformers'
/// `load_balancing_loss_func` computes it over all sparse blocks:
/// `aux = E · Σ_e (c_e / T) · (p_e / T)`, with `c_e` the tokens routed to expert `e` (over the
/// `k` slots), `p_e` the sum of its router probability, and `T` the routed tokens, each summed
/// over every sparse block and every token of the micro-batch (on every rank that holds some of
/// them). After a micro-batch's forward, [`RouterAux::finish`] sums the statistics over those
/// ranks, and [`RouterAux::add_to_loss`] adds `coef · aux · n` to a rank's summed LM loss over its
/// `n` labelled tokens, so that a loss divided by the batch's labelled tokens carries
/// `coef · aux` once per micro-batch, weighted like the micro-batch's LM loss.
///
/// The gradient does not flow through a tensor out of the blocks (which a recomputed block
/// could not return): each block's router logits pass through a node
/// (`RouterAux::attach`) whose backward adds `∂(coef · aux · n) / ∂logits` from the totals,
/// scaled by the gradient the summed loss received (recorded by [`RouterAux::add_to_loss`]'s
/// node, which runs first in the backward pass). It is therefore exact under activation
/// checkpointing and ZeRO-3. Contract: one micro-batch at a time ([`RouterAux::begin`] before
/// its forward, then `finish` and `add_to_loss`, its backward before the next `begin`), and
/// every rank's summed loss is scaled by the same factor before backward (the step's global
/// token count).
///
/// Under pipeline parallelism the routers of a micro-batch sit on several stages and the loss
/// on the last: each stage's statistics travel with the activation
/// ([`RouterAux::begin_stage`], [`RouterAux::forward_carry`]), the last stage completes them
/// ([`RouterAux::finish_stage`]) and keeps the totals until the micro-batch's backward
/// ([`RouterAux::park`]), and what the routers' gradient needs travels back with the
/// activation's gradient ([`RouterAux::begin_backward`], [`RouterAux::backward_carry`]).
/// Micro-batches may then interleave as the schedule runs them.
#[derive(Debug)]
pub struct RouterAux {
    num_experts: usize,
    state: Mutex<AuxState>,
}

impl RouterAux {
    pub fn new(num_experts: usize) -> Arc<Self> {
        Arc::new(Self {
            num_experts,
            state: Mutex::new(AuxState::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AuxState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a micro-batch: forgets the previous one's statistics (but
    /// [`RouterAux::last_stats`]). Local.
    pub fn begin(&self) {
        let mut s = self.lock();
        s.blocks.clear();
        s.totals = None;
        s.seed = None;
    }

    /// Records block `layer`'s routing of this rank's tokens (a recomputation records the same
    /// again). `probs` `(tokens, E)`, `chosen` `(tokens · k)`, `kept` (per assignment, under a
    /// capacity factor) whether it kept its expert, `routed` (per token) whether it counts
    /// (`None`: all do).
    fn record(
        &self,
        layer: usize,
        probs: &[Vec<f32>],
        chosen: &[u32],
        kept: Option<&[bool]>,
        routed: Option<&[bool]>,
    ) {
        let e = self.num_experts;
        let k = chosen.len() / probs.len().max(1);
        let counts = |t: usize| routed.is_none_or(|r| r[t]);
        let mut stats = BlockStats {
            counts: vec![0.0; e],
            probs: vec![0.0; e],
            ..BlockStats::default()
        };
        for (t, row) in probs.iter().enumerate().filter(|(t, _)| counts(*t)) {
            stats.tokens += 1.0;
            for (s, &p) in stats.probs.iter_mut().zip(row) {
                *s += p as f64;
            }
            for slot in t * k..(t + 1) * k {
                stats.counts[chosen[slot] as usize] += 1.0;
                stats.assignments += 1.0;
                if kept.is_some_and(|m| !m[slot]) {
                    stats.dropped += 1.0;
                }
            }
        }
        self.lock().blocks.insert(layer, stats);
    }

    /// The router logits `(tokens, E)` f32 of a block, with a backward that adds the
    /// auxiliary loss's gradient once [`RouterAux::add_to_loss`] has run, to the tokens that
    /// count (`routed`, `None`: all). Local.
    fn attach(self: &Arc<Self>, logits: &Tensor, routed: Option<&[bool]>) -> Result<Tensor> {
        if !logits.track_op() {
            return Ok(logits.clone());
        }
        let me = self.clone();
        let z = logits.detach();
        let only = match routed {
            None => None,
            Some(r) => Some(Tensor::from_vec(
                r.iter()
                    .map(|&x| if x { 1f32 } else { 0.0 })
                    .collect::<Vec<_>>(),
                (r.len(), 1),
                z.device(),
            )?),
        };
        Ok(record(
            logits,
            "cpl-router-aux-gradient",
            |z| Ok(z.clone()),
            move |g| {
                let (totals, seed) = {
                    let s = me.lock();
                    (s.totals.clone(), s.seed)
                };
                let (Some(t), Some(seed)) = (totals, seed) else {
                    return Ok(g.clone());
                };
                if t.tokens == 0.0 || t.weight == 0.0 {
                    return Ok(g.clone());
                }
                // ∂/∂z_t of w · E Σ_e c_e p_te / T²: p_t ⊙ (c − p_t·c) · w E / T².
                let scale = seed * t.weight * me.num_experts as f64 / (t.tokens * t.tokens);
                let c = Tensor::from_vec(
                    t.counts.iter().map(|&c| c as f32).collect::<Vec<_>>(),
                    (1, t.counts.len()),
                    z.device(),
                )?;
                let p = router_softmax(&z)?;
                let pc = p.broadcast_mul(&c)?.sum_keepdim(1)?;
                let mut add = (p * c.broadcast_sub(&pc)?)?;
                if let Some(only) = &only {
                    add = add.broadcast_mul(only)?;
                }
                Ok((g + (add * scale)?.to_dtype(g.dtype())?)?)
            },
        )?)
    }

    /// After the micro-batch's forward: sums the statistics of this rank's blocks over
    /// `token_groups` (the ranks holding other tokens of the micro-batch: the sequence group,
    /// and tp under TP-sp) and this rank's `count` labelled tokens over `count_group`, and
    /// returns the micro-batch's [`RouterStats`] (also kept for [`RouterAux::last_stats`] and
    /// for the gradient of [`RouterAux::add_to_loss`]). Collective over the groups (every rank
    /// calls it, in the same order, with the same blocks).
    pub fn finish(
        &self,
        count: usize,
        token_groups: &[&Comm],
        count_group: &Comm,
        device: &candle_core::Device,
    ) -> Result<RouterStats> {
        let blocks = self.reduce_blocks(token_groups, device)?;
        self.complete(blocks, count, count_group, device)
    }

    /// This rank's blocks of the micro-batch, each summed over `token_groups`. Collective over
    /// them.
    fn reduce_blocks(
        &self,
        token_groups: &[&Comm],
        device: &candle_core::Device,
    ) -> Result<Partial> {
        let e = self.num_experts;
        let (layers, blocks): (Vec<usize>, Vec<BlockStats>) = self
            .lock()
            .blocks
            .iter()
            .map(|(l, b)| (*l, b.clone()))
            .unzip();
        let nb = blocks.len();
        // Per block: its experts' counts; then the probability sums, the routed tokens, the
        // assignments and the dropped ones.
        let mut v = vec![0f32; nb * e + e + 3];
        for (b, stats) in blocks.iter().enumerate() {
            for i in 0..e {
                v[b * e + i] = stats.counts[i] as f32;
                v[nb * e + i] += stats.probs[i] as f32;
            }
            v[nb * e + e] += stats.tokens as f32;
            v[nb * e + e + 1] += stats.assignments as f32;
            v[nb * e + e + 2] += stats.dropped as f32;
        }
        let mut t = Tensor::from_vec(v, nb * e + e + 3, device)?;
        for g in token_groups {
            if g.size() > 1 {
                t = g.all_reduce(&t, ReduceOp::Sum)?;
            }
        }
        let v = t.to_vec1::<f32>()?;
        let mut out = Partial::empty(e);
        for (b, &layer) in layers.iter().enumerate() {
            let row = &v[b * e..(b + 1) * e];
            for (c, &x) in out.counts.iter_mut().zip(row) {
                *c += x as f64;
            }
            let mean = row.iter().map(|&x| x as f64).sum::<f64>() / e as f64;
            let max = row.iter().fold(0f64, |m, &x| m.max(x as f64));
            out.layer_loads
                .push((layer, if mean > 0.0 { max / mean } else { 0.0 }));
        }
        for (p, &x) in out.probs.iter_mut().zip(&v[nb * e..nb * e + e]) {
            *p = x as f64;
        }
        out.tokens = v[nb * e + e] as f64;
        out.assignments = v[nb * e + e + 1] as f64;
        out.dropped = v[nb * e + e + 2] as f64;
        Ok(out)
    }

    /// The micro-batch's [`RouterStats`] from the statistics of all of its blocks, with this
    /// rank's `count` labelled tokens summed over `count_group`; keeps the totals for the
    /// gradient. Collective over `count_group`.
    fn complete(
        &self,
        blocks: Partial,
        count: usize,
        count_group: &Comm,
        device: &candle_core::Device,
    ) -> Result<RouterStats> {
        let e = self.num_experts;
        let n = Tensor::new(&[count as f32], device)?;
        let n = if count_group.size() > 1 {
            count_group.all_reduce(&n, ReduceOp::Sum)?
        } else {
            n
        };
        let labelled = n.to_vec1::<f32>()?[0] as f64;
        let aux = if blocks.tokens == 0.0 {
            0.0
        } else {
            let dot: f64 = blocks
                .counts
                .iter()
                .zip(&blocks.probs)
                .map(|(c, p)| c * p)
                .sum();
            e as f64 * dot / (blocks.tokens * blocks.tokens)
        };
        let stats = RouterStats {
            aux,
            load_max_over_mean: blocks.layer_loads.iter().fold(0f64, |m, l| m.max(l.1)),
            labelled_tokens: labelled,
            dropped_fraction: if blocks.assignments > 0.0 {
                blocks.dropped / blocks.assignments
            } else {
                0.0
            },
            layer_loads: blocks.layer_loads,
        };
        let mut s = self.lock();
        s.totals = Some(Totals {
            counts: blocks.counts,
            tokens: blocks.tokens,
            weight: 0.0,
        });
        s.seed = None;
        s.last = Some(stats.clone());
        Ok(stats)
    }

    /// [`RouterAux::finish`] over the ranks of `ctx` that hold the micro-batch's tokens: the
    /// sequence group, and the tensor-parallel group under TP-sp (each of its ranks routes its
    /// part of the tokens); `count` summed over the sequence group. Collective over those groups.
    pub fn finish_in(
        &self,
        ctx: &ParallelCtx,
        count: usize,
        device: &candle_core::Device,
    ) -> Result<RouterStats> {
        let groups = ctx.token_groups();
        let groups: Vec<&Comm> = groups.iter().collect();
        self.finish(count, &groups, ctx.sequence_group(), device)
    }

    /// The statistics of the last micro-batch [`RouterAux::finish`] summed.
    pub fn last_stats(&self) -> Option<RouterStats> {
        self.lock().last.clone()
    }

    /// After [`RouterAux::finish`]: `sum + coef · aux · count` (`sum` this rank's summed LM
    /// loss over its `count` labelled tokens). The result's backward records the gradient the
    /// loss receives, which the routers' nodes scale by. Local.
    pub fn add_to_loss(self: &Arc<Self>, sum: &Tensor, count: usize, coef: f64) -> Result<Tensor> {
        self.add_weighted(sum, count as f64, None, coef)
    }

    /// After [`RouterAux::finish`], for a loss that every rank holding the micro-batch's
    /// tokens computes whole and backpropagates through its own tokens (DPO's, over whole
    /// sequences): `sum + coef · aux · n`, with the routers' gradient that of `coef · aux · n`
    /// once (not of the labelled tokens summed over the ranks). `n`: the micro-batch's weight
    /// in the step's loss (DPO: its pairs). Local.
    pub fn add_to_whole_loss(
        self: &Arc<Self>,
        sum: &Tensor,
        n: usize,
        coef: f64,
    ) -> Result<Tensor> {
        self.add_weighted(sum, n as f64, Some(n as f64), coef)
    }

    /// `sum + coef · aux · n`, the gradient weighted by `coef · weight` (`None`: the labelled
    /// tokens [`RouterAux::finish`] summed).
    fn add_weighted(
        self: &Arc<Self>,
        sum: &Tensor,
        n: f64,
        weight: Option<f64>,
        coef: f64,
    ) -> Result<Tensor> {
        let aux = {
            let mut s = self.lock();
            let s = &mut *s;
            let (Some(last), Some(totals)) = (s.last.as_ref(), s.totals.as_mut()) else {
                return Err(Error::invalid(
                    "router load-balancing loss",
                    "add_to_loss before finish",
                ));
            };
            totals.weight = coef * weight.unwrap_or(last.labelled_tokens);
            last.aux
        };
        let add = coef * aux * n;
        let dtype = sum.dtype();
        let plus = move |s: &Tensor| -> Result<Tensor> {
            Ok((s.to_dtype(DType::F64)? + add)?.to_dtype(dtype)?)
        };
        if !sum.track_op() {
            return plus(sum);
        }
        let me = self.clone();
        let out = record(sum, "cpl-router-aux-loss", plus, move |g| {
            let seed = g.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            me.lock().seed = seed.first().copied();
            Ok(g.clone())
        })?;
        Ok(out)
    }

    /// Under a pipeline: the length of [`RouterAux::forward_carry`]'s vector for a model of
    /// `layers` decoder layers.
    pub fn forward_carry_len(&self, layers: usize) -> usize {
        Partial::encoded_len(self.num_experts, layers)
    }

    /// Under a pipeline: the length of [`RouterAux::backward_carry`]'s vector.
    pub fn backward_carry_len(&self) -> usize {
        self.num_experts + 3
    }

    /// Under a pipeline: micro-batch `micro_batch`'s forward starts on this stage, with the
    /// statistics of its blocks on the stages before (`carried`, what the previous stage's
    /// [`RouterAux::forward_carry`] returned; `None` on the first stage). Local.
    pub fn begin_stage(
        &self,
        micro_batch: usize,
        carried: Option<&[f64]>,
        layers: usize,
    ) -> Result<()> {
        let carried = carried
            .map(|v| Partial::decode(v, self.num_experts, layers))
            .transpose()?;
        self.begin();
        let mut s = self.lock();
        s.current = micro_batch;
        s.carried = carried;
        Ok(())
    }

    /// Under a pipeline, after this stage's layers: the statistics of the micro-batch's blocks
    /// so far (those carried here and this rank's, summed over `ctx`'s token groups), for the
    /// next stage's [`RouterAux::begin_stage`]. Collective over the token groups.
    pub fn forward_carry(&self, ctx: &ParallelCtx, layers: usize) -> Result<Vec<f64>> {
        self.stage_blocks(ctx)?.encode(layers)
    }

    /// The statistics carried to this stage plus this rank's blocks, summed over the token
    /// groups.
    fn stage_blocks(&self, ctx: &ParallelCtx) -> Result<Partial> {
        let groups = ctx.token_groups();
        let groups: Vec<&Comm> = groups.iter().collect();
        let mine = self.reduce_blocks(&groups, ctx.device())?;
        Ok(match self.lock().carried.take() {
            Some(before) => before.add(&mine),
            None => mine,
        })
    }

    /// Under a pipeline, on the last stage: [`RouterAux::finish_in`] over every block of the
    /// micro-batch (those carried here and this rank's). Then [`RouterAux::add_to_loss`] and
    /// [`RouterAux::park`]. Collective like `finish_in`.
    pub fn finish_stage(&self, ctx: &ParallelCtx, count: usize) -> Result<RouterStats> {
        let blocks = self.stage_blocks(ctx)?;
        self.complete(blocks, count, ctx.sequence_group(), ctx.device())
    }

    /// Under a pipeline, on the last stage after [`RouterAux::add_to_loss`]: keeps the
    /// micro-batch's totals until [`RouterAux::begin_backward`] asks for them (the schedule
    /// may run other micro-batches' forwards first). Local.
    pub fn park(&self) {
        let mut s = self.lock();
        if let Some(t) = s.totals.take() {
            let mb = s.current;
            s.parked.insert(mb, t);
        }
    }

    /// Under a pipeline: micro-batch `micro_batch`'s backward starts on this stage. `carried`
    /// is what the next stage's [`RouterAux::backward_carry`] returned; `None` on the last
    /// stage, whose totals [`RouterAux::park`] kept. Local.
    pub fn begin_backward(&self, micro_batch: usize, carried: Option<&[f64]>) -> Result<()> {
        let e = self.num_experts;
        let mut s = self.lock();
        match carried {
            None => {
                s.totals = s.parked.remove(&micro_batch);
                s.seed = None;
            }
            Some(v) if v.len() == self.backward_carry_len() => {
                s.seed = Some(v[0]);
                s.totals = Some(Totals {
                    weight: v[1],
                    tokens: v[2],
                    counts: v[3..].to_vec(),
                });
            }
            Some(v) => {
                return Err(Error::invalid(
                    "router load-balancing loss",
                    format!("{} carried gradient statistics for {e} experts", v.len()),
                ))
            }
        }
        Ok(())
    }

    /// Under a pipeline, after a micro-batch's backward on this stage: what its routers on the
    /// stages before need for their gradient (`[seed, weight, tokens, counts (E)]`; zeros when
    /// the loss does not include the balancing loss), for their
    /// [`RouterAux::begin_backward`]. Local.
    pub fn backward_carry(&self) -> Vec<f64> {
        let s = self.lock();
        let mut v = vec![0.0; self.backward_carry_len()];
        if let (Some(t), Some(seed)) = (&s.totals, s.seed) {
            v[0] = seed;
            v[1] = t.weight;
            v[2] = t.tokens;
            v[3..].copy_from_slice(&t.counts);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Capacity 2 per expert: expert 0 keeps its two most probable of three assignments; expert
    /// 1's exact tie goes to the earlier (sequence, position), whatever the assignment's index;
    /// expert 2 (one assignment) keeps it; an id past the experts (already dropped) stays
    /// dropped.
    #[test]
    fn each_expert_keeps_its_most_probable_assignments() {
        let probs = [0.5, 0.9, 0.7, 0.4, 0.4, 0.6, 0.3, 0.2];
        let experts = [0, 0, 0, 1, 1, 1, 2, 3];
        let order = [
            (0, 0),
            (0, 1),
            (0, 2),
            (0, 9),
            (0, 3),
            (1, 0),
            (0, 4),
            (0, 5),
        ];
        let keep = keep_within_capacity(&probs, &experts, &order, 3, 2);
        assert_eq!(
            keep,
            [false, true, true, false, true, true, true, false],
            "{keep:?}"
        );
        assert_eq!(
            keep_within_capacity(&probs, &experts, &order, 3, 0),
            [false; 8]
        );
        assert_eq!(
            keep_within_capacity(&probs, &experts, &order, 3, 8),
            [true, true, true, true, true, true, true, false]
        );
    }

    /// `ceil(f T k / E)`: 0.75 x 32 x 2 / 8 = 6, 1.1 x 10 x 2 / 8 = 2.75 -> 3; bad factors
    /// are errors naming the value.
    #[test]
    fn capacity_by_hand() {
        let cfg = MoeConfig::new(16, 8, 8, 2).unwrap();
        assert_eq!(cfg.capacity(32), None);
        let c = cfg.clone().with_capacity_factor(Some(0.75)).unwrap();
        assert_eq!(c.capacity(32), Some(6));
        let c = cfg.clone().with_capacity_factor(Some(1.1)).unwrap();
        assert_eq!(c.capacity(10), Some(3));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = cfg.clone().with_capacity_factor(Some(bad)).unwrap_err();
            assert!(e.to_string().contains("capacity factor"), "{e}");
        }
    }
}
