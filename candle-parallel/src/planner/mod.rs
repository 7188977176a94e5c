//! The layout planner behind `cpl plan --auto`: which parallel layout to run for a model, a
//! sequence length and a cluster.
//!
//! - [`Hardware`] ([`hardware`]): the cluster (nodes, devices per node, per-device matmul and
//!   attention rates, memory, intra- and inter-node bandwidth and latency), read from TOML.
//! - [`ModelShape`]: the transformer's shape (what the cost depends on).
//! - [`Candidate`] and [`predict`] ([`cost`]): one layout with its memory plan, and its predicted
//!   step time (compute, exposed communication, pipeline bubble, recomputation) and memory per
//!   rank (weights, optimizer states, gradients, activations, loss chunk, communication buffers).
//!   The attention traffic comes from [`traffic`], the same per-rank formulas the strategies'
//!   tests assert against the communicators' counters.
//! - [`search`](fn@search): every layout of a world that the model, the sequence and the memory allow,
//!   ranked by predicted step time.
//! - [`kendall_tau`]: how well a predicted ranking agrees with a measured one.
//!
//! The model is analytic and deliberately simple (the papers' own analysis: LoongTrain sec. 4,
//! USP's communication table, WallFacer's formulas): it is a ranking tool. What it leaves out is
//! listed in `docs/planner.md`, next to its validation against runs on this machine.

pub mod cost;
pub mod hardware;
pub mod search;
pub mod traffic;

pub use cost::{
    attention_time, predict, window_density, AttentionTime, Candidate, MemoryBreakdown, Prediction,
    TimeBreakdown,
};
pub use hardware::Hardware;
pub use search::{search, Request, SearchResult};
pub use traffic::{expert_traffic, uniform_remote_rows, ExpertTraffic};

use crate::error::{Error, Result};

/// Bytes in a GiB (the unit of the planner's memory reports).
pub const GIB: f64 = (1u64 << 30) as f64;

/// The shape of a decoder-only transformer (LLaMA family): everything the cost model needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelShape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    /// The LM head shares the embedding matrix.
    pub tied_embeddings: bool,
    /// The sparse feed-forward blocks of a mixture-of-experts model (`None`: dense).
    #[serde(default)]
    pub moe: Option<MoeShape>,
    /// The layers with sliding-window attention (`None`: every layer global).
    #[serde(default)]
    pub window: Option<WindowShape>,
}

/// The sliding-window layers of a model (Mistral, Gemma 2 and 3's local layers, Qwen2 with
/// `use_sliding_window`): `windowed_layers` of the layers see the last `window` tokens
/// (`pq - pk < window`), the others the whole sequence. One window for all of them: every
/// family of the registry has one (a model with several would be described by its largest,
/// which costs no less than it). When [`WindowShape::layer_mask`] says which layers are
/// windowed, each pipeline stage is costed by its own layers (Qwen2's windowed layers are the
/// upper ones: the last stages are cheaper); otherwise windowed and global layers are averaged
/// over the stages, as dense and sparse ones are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WindowShape {
    /// Tokens a query sees, itself included.
    pub window: usize,
    pub windowed_layers: usize,
    /// Bit `l` set: layer `l` is windowed (models of up to 128 layers; `None`: not known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_mask: Option<u128>,
}

/// The sparse blocks of a mixture-of-experts model ([`crate::nn::moe`]): `sparse_layers` of
/// the layers have a router, `experts` SwiGLU experts of `expert_intermediate` units of which a
/// token uses `top_k`, and optionally a shared expert with its sigmoid gate; the other layers
/// have the dense MLP of `intermediate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MoeShape {
    pub experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    /// The shared expert's hidden units (0: none).
    pub shared_intermediate: usize,
    pub sparse_layers: usize,
}

impl MoeShape {
    /// Parameters of one expert (gate, up and down projections).
    pub fn expert_params(&self, hidden: usize) -> u64 {
        3 * (hidden * self.expert_intermediate) as u64
    }

    /// Parameters of a sparse block that are not experts: the router, the shared expert and
    /// its gate.
    pub fn dense_params(&self, hidden: usize) -> u64 {
        let h = hidden as u64;
        let shared = if self.shared_intermediate > 0 {
            3 * h * self.shared_intermediate as u64 + h
        } else {
            0
        };
        self.experts as u64 * h + shared
    }
}

impl ModelShape {
    /// Errors naming the field that is zero or inconsistent.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("num_hidden_layers", self.layers),
            ("hidden_size", self.hidden),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate),
            ("vocab_size", self.vocab),
        ] {
            if v == 0 {
                return Err(Error::Layout(format!("model shape: {name} is 0")));
            }
        }
        if let Some(m) = &self.moe {
            for (name, v) in [
                ("num_experts (num_local_experts)", m.experts),
                ("num_experts_per_tok", m.top_k),
                ("moe_intermediate_size", m.expert_intermediate),
            ] {
                if v == 0 {
                    return Err(Error::Layout(format!("model shape: {name} is 0")));
                }
            }
            if m.top_k > m.experts {
                return Err(Error::Layout(format!(
                    "model shape: {} experts per token (num_experts_per_tok) of {} experts",
                    m.top_k, m.experts
                )));
            }
            if m.sparse_layers > self.layers {
                return Err(Error::Layout(format!(
                    "model shape: {} sparse layers of {} layers",
                    m.sparse_layers, self.layers
                )));
            }
        }
        if let Some(w) = &self.window {
            if w.window == 0 {
                return Err(Error::Layout("model shape: sliding_window is 0".into()));
            }
            if w.windowed_layers > self.layers {
                return Err(Error::Layout(format!(
                    "model shape: {} sliding-window layers of {} layers",
                    w.windowed_layers, self.layers
                )));
            }
            if let Some(m) = w.layer_mask {
                let inside = if self.layers >= 128 {
                    m
                } else {
                    m & ((1u128 << self.layers) - 1)
                };
                if self.layers > 128 || inside != m || m.count_ones() as usize != w.windowed_layers
                {
                    return Err(Error::Layout(format!(
                        "model shape: a window layer mask of {} layers for {} windowed layers \
                         of {} (at most 128)",
                        m.count_ones(),
                        w.windowed_layers,
                        self.layers
                    )));
                }
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(Error::Layout(format!(
                "model shape: {} attention heads are not a multiple of {} kv heads",
                self.heads, self.kv_heads
            )));
        }
        Ok(())
    }

    /// Parameters of one dense decoder layer: q, k, v, o, the SwiGLU MLP and two norms.
    pub fn layer_params(&self) -> u64 {
        self.attention_params() + 3 * (self.hidden * self.intermediate) as u64
    }

    /// Parameters of a layer outside its feed-forward block: q, k, v, o and two norms.
    pub fn attention_params(&self) -> u64 {
        let (h, q, kv) = (
            self.hidden as u64,
            (self.heads * self.head_dim) as u64,
            (self.kv_heads * self.head_dim) as u64,
        );
        2 * h * q + 2 * h * kv + 2 * h
    }

    /// Parameters of one sparse decoder layer (the dense layer's without a mixture of
    /// experts): attention, norms, router, every expert, the shared expert.
    pub fn sparse_layer_params(&self) -> u64 {
        match &self.moe {
            Some(m) => {
                self.attention_params()
                    + m.dense_params(self.hidden)
                    + m.experts as u64 * m.expert_params(self.hidden)
            }
            None => self.layer_params(),
        }
    }

    /// Layers with a sparse block (0 for a dense model).
    pub fn sparse_layers(&self) -> usize {
        self.moe.map_or(0, |m| m.sparse_layers.min(self.layers))
    }

    /// Layers with a sliding window, and the window (`None` when no layer has one).
    /// Whether layer `l` is windowed: `None` when the model does not say which are
    /// ([`WindowShape::layer_mask`]).
    pub fn layer_is_windowed(&self, l: usize) -> Option<bool> {
        match self.window {
            None => Some(false),
            Some(w) if w.windowed_layers == 0 => Some(false),
            Some(w) => w.layer_mask.map(|m| l < 128 && (m >> l) & 1 == 1),
        }
    }

    pub fn windowed_layers(&self) -> Option<(usize, usize)> {
        self.window
            .filter(|w| w.windowed_layers > 0)
            .map(|w| (w.windowed_layers.min(self.layers), w.window))
    }

    /// Parameters of the embedding (and of the LM head unless tied) and the final norm.
    pub fn outer_params(&self) -> u64 {
        let e = (self.vocab * self.hidden) as u64;
        let head = if self.tied_embeddings { 0 } else { e };
        e + head + self.hidden as u64
    }

    /// All parameters.
    pub fn params(&self) -> u64 {
        let sparse = self.sparse_layers() as u64;
        (self.layers as u64 - sparse) * self.layer_params()
            + sparse * self.sparse_layer_params()
            + self.outer_params()
    }
}

/// Kendall's tau-b between two scorings of the same items (ties counted as neither concordant
/// nor discordant, normalised by the untied pairs of each). 1: same order, -1: reversed.
/// `None` with fewer than two items, mismatched lengths, or a scoring with every item tied.
pub fn kendall_tau(a: &[f64], b: &[f64]) -> Option<f64> {
    if a.len() != b.len() || a.len() < 2 {
        return None;
    }
    let (mut concordant, mut discordant, mut ties_a, mut ties_b) = (0i64, 0i64, 0i64, 0i64);
    for i in 0..a.len() {
        for j in i + 1..a.len() {
            let da = a[i].total_cmp(&a[j]) as i64;
            let db = b[i].total_cmp(&b[j]) as i64;
            match (da, db) {
                (0, 0) => {}
                (0, _) => ties_a += 1,
                (_, 0) => ties_b += 1,
                _ if da == db => concordant += 1,
                _ => discordant += 1,
            }
        }
    }
    let n1 = (concordant + discordant + ties_a) as f64;
    let n2 = (concordant + discordant + ties_b) as f64;
    if n1 == 0.0 || n2 == 0.0 {
        return None;
    }
    Some((concordant - discordant) as f64 / (n1 * n2).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kendall_tau_of_known_orders() {
        let a = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(kendall_tau(&a, &[10.0, 20.0, 30.0, 40.0]), Some(1.0));
        assert_eq!(kendall_tau(&a, &[4.0, 3.0, 2.0, 1.0]), Some(-1.0));
        // One swapped pair of 6: (5 - 1) / 6.
        let t = kendall_tau(&a, &[1.0, 3.0, 2.0, 4.0]).unwrap();
        assert!((t - 4.0 / 6.0).abs() < 1e-12, "{t}");
        assert_eq!(kendall_tau(&a, &[1.0, 1.0, 1.0, 1.0]), None);
        assert_eq!(kendall_tau(&a[..1], &a[..1]), None);
        assert_eq!(kendall_tau(&a, &a[..3]), None);
    }

    /// A tiny LLaMA counted by hand: hidden 8, 2 heads of 4, 1 kv head, intermediate 16,
    /// vocab 10: q 64 + k 32 + v 32 + o 64 + MLP 384 + norms 16 = 592 per layer; embedding 80,
    /// head 80, final norm 8.
    #[test]
    fn parameters_of_a_tiny_model() {
        let m = ModelShape {
            layers: 2,
            hidden: 8,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            intermediate: 16,
            vocab: 10,
            tied_embeddings: false,
            moe: None,
            window: None,
        };
        assert_eq!(m.layer_params(), 592);
        assert_eq!(m.outer_params(), 168);
        assert_eq!(m.params(), 2 * 592 + 168);
        assert!(ModelShape { kv_heads: 3, ..m }.validate().is_err());
        assert!(ModelShape { vocab: 0, ..m }.validate().is_err());
        let windowed = |window, windowed_layers| ModelShape {
            window: Some(WindowShape {
                window,
                windowed_layers,
                layer_mask: None,
            }),
            ..m
        };
        assert!(windowed(4, 2).validate().is_ok());
        assert_eq!(windowed(4, 2).windowed_layers(), Some((2, 4)));
        assert_eq!(windowed(4, 0).windowed_layers(), None);
        assert!(windowed(0, 2).validate().is_err());
        assert!(windowed(4, 3).validate().is_err());
        // The window changes no parameter.
        assert_eq!(windowed(4, 2).params(), m.params());
    }
}
