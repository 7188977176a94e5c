//! The sparse mixture-of-experts block (`nn::moe`) at the library level, against a dense
//! float64 reference written here with plain differentiable candle ops: every expert on every
//! token, weighted by the router's top-k probabilities (zero elsewhere), plus the sigmoid-gated
//! shared expert, and transformers' load-balancing loss `E Σ_e c_e p_e / T²` over both blocks of
//! a micro-batch. Two blocks record into one `RouterAux`; the loss of a micro-batch is
//! `Σ out ⊙ g + coef · aux · n` over its `n` tokens, scaled by `SCALE` before backward.
//!
//! Layouts: one rank, tp2, tp2 with TP-sp, dp2 with the experts divided over ep2, tp2 x dp2
//! with ep2 (the rows travel between ranks of one tensor-parallel coordinate), dp4 with ep4
//! on 2 tokens per rank (most experts receive no row on most ranks), and ring2 (each rank holds
//! half of every sequence; the labelled tokens are summed over the sequence group). On every
//! rank the output, the input gradient and the loss equal the reference's for its tokens,
//! every parameter this rank holds receives the reference gradient of its shard (an expert's on
//! its owner alone under ep; otherwise summed over the ranks that hold different tokens where
//! they do), and the router statistics equal the reference's. f32 against f64: 1e-5 relative.
//!
//! Pipelined (one rank, tp2 TP-sp, dp2 ep2, ring2, each block on its own emulated stage): the
//! statistics travel forward and the routers' gradient totals back through `RouterAux`'s
//! carries, with another micro-batch's forward in between, and give the same.

mod common;
use common::world;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_parallel::attention::{SpConfig, Strategy};
use candle_parallel::mesh::Dim;
use candle_parallel::nn::{
    MoeConfig, ParamBuilder, ParamMode, RouterAux, SparseMoe, TensorMap, TpActivations,
};
use candle_parallel::plan::Layout;
use candle_parallel::MeshConfig;
use rand::rngs::StdRng;
use rand::SeedableRng;

const TOL: f64 = 1e-5;
/// The balancing loss's coefficient.
const COEF: f64 = 0.3;
/// The factor the summed loss is scaled by before backward (the gradient the routers' nodes
/// scale by).
const SCALE: f64 = 0.25;
/// Blocks per micro-batch, each with its own weights under `mlp{b}`.
const BLOCKS: usize = 2;

fn cfg_qwen() -> MoeConfig {
    // 8 experts, top-2 renormalised, a shared expert.
    MoeConfig::new(16, 8, 8, 2)
        .unwrap()
        .with_norm_topk_prob(true)
        .with_shared_expert(Some(12))
}

fn cfg_mixtral_names() -> MoeConfig {
    // 4 experts, top-3 not renormalised, Mixtral's names, no shared expert.
    MoeConfig::new(16, 8, 4, 3)
        .unwrap()
        .with_expert_names("w1", "w3", "w2")
}

/// Random weights of `BLOCKS` blocks of `cfg`, named `mlp{b}.{name}`, the router's scaled up so
/// that its probabilities are spread.
fn weights(cfg: &MoeConfig, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = HashMap::new();
    for b in 0..BLOCKS {
        for (name, shape) in cfg.parameter_shapes() {
            let t = common::rand_t(&mut rng, &shape);
            let t = if name.starts_with(&cfg.router) {
                (t * 3.0).unwrap()
            } else {
                t
            };
            out.insert(format!("mlp{b}.{name}"), t);
        }
    }
    out
}

/// The indices of the `k` largest of `row`, largest first, ties to the lower index.
fn reference_top_k(row: &[f64], k: usize) -> Vec<usize> {
    let mut chosen: Vec<usize> = Vec::new();
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (e, &p) in row.iter().enumerate() {
            if chosen.contains(&e) {
                continue;
            }
            if best.is_none_or(|b| p > row[b]) {
                best = Some(e);
            }
        }
        chosen.push(best.unwrap());
    }
    chosen
}

fn silu(x: &Tensor) -> Result<Tensor> {
    x * (x.neg()?.exp()? + 1.0)?.recip()?
}

fn swiglu_mlp(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let h = (silu(&x.matmul(&gate.t()?)?)? * x.matmul(&up.t()?)?)?;
    h.matmul(&down.t()?)
}

struct Reference {
    /// `(batch, tokens, hidden)`.
    out: Tensor,
    dx: Tensor,
    grads: HashMap<String, Tensor>,
    /// Per micro-batch: (aux, busiest expert over the mean in the most unbalanced block).
    stats: Vec<(f64, f64)>,
}

/// The blocks on `x` `(batch, tokens, hidden)`, micro-batch `d` being rows `d·rows..`: the loss
/// `SCALE · Σ_d (Σ out_d ⊙ g_d + COEF · aux_d · n_d)` and its gradients, in f64. The last
/// `pads[r]` tokens of row `r` are padding: routed, but left out of the statistics (transformers'
/// `load_balancing_loss_func` with an `attention_mask`; a micro-batch of padding alone has
/// `aux` 0 where transformers divides 0 by 0).
fn reference(
    cfg: &MoeConfig,
    w: &HashMap<String, Tensor>,
    x: &Tensor,
    g: &Tensor,
    rows: usize,
    pads: &[usize],
) -> Result<Reference> {
    let vars: HashMap<String, Var> = w
        .iter()
        .map(|(n, t)| Ok((n.clone(), Var::from_tensor(&t.to_dtype(DType::F64)?)?)))
        .collect::<Result<_>>()?;
    let p = |name: String| vars[&name].as_tensor().clone();
    let (b, s, h) = x.dims3()?;
    let (e, k) = (cfg.num_experts, cfg.top_k);
    let xv = Var::from_tensor(&x.to_dtype(DType::F64)?)?;
    let g = g.to_dtype(DType::F64)?;
    let mut loss = Tensor::zeros((), DType::F64, &Device::Cpu)?;
    let mut outs = Vec::new();
    let mut stats = Vec::new();
    for d in 0..b / rows {
        let n = rows * s;
        let xs = xv.as_tensor().narrow(0, d * rows, rows)?.reshape((n, h))?;
        // Per token of the micro-batch: whether it counts.
        let counted: Vec<bool> = (0..n).map(|t| t % s < s - pads[d * rows + t / s]).collect();
        let counted_col = Tensor::from_vec(
            counted
                .iter()
                .map(|&c| f64::from(u8::from(c)))
                .collect::<Vec<_>>(),
            (n, 1),
            &Device::Cpu,
        )?;
        let mut out = Tensor::zeros((n, h), DType::F64, &Device::Cpu)?;
        let mut counts = vec![0f64; e];
        let mut prob_sums = Tensor::zeros(e, DType::F64, &Device::Cpu)?;
        let mut load = 0f64;
        for blk in 0..BLOCKS {
            let name = |n: &str| format!("mlp{blk}.{n}");
            let z = xs.matmul(&p(name("gate.weight")).t()?)?;
            let ex = z.broadcast_sub(&z.max_keepdim(1)?.detach())?.exp()?;
            let probs = ex.broadcast_div(&ex.sum_keepdim(1)?)?;
            let host = probs.to_vec2::<f64>()?;
            let mut mask = vec![0f64; n * e];
            let mut block_counts = vec![0f64; e];
            for (t, row) in host.iter().enumerate() {
                for c in reference_top_k(row, k) {
                    mask[t * e + c] = 1.0;
                    if counted[t] {
                        block_counts[c] += 1.0;
                    }
                }
            }
            let mean = block_counts.iter().sum::<f64>() / e as f64;
            let busiest = block_counts
                .iter()
                .fold(0f64, |m, &c| testkit::max_or_nan(m, c));
            if mean > 0.0 {
                load = testkit::max_or_nan(load, busiest / mean);
            }
            for (c, bc) in counts.iter_mut().zip(&block_counts) {
                *c += bc;
            }
            prob_sums = (prob_sums + probs.broadcast_mul(&counted_col)?.sum(0)?)?;
            let mask = Tensor::from_vec(mask, (n, e), &Device::Cpu)?;
            let mut route = (&probs * &mask)?;
            if cfg.norm_topk_prob {
                route = route.broadcast_div(&route.sum_keepdim(1)?)?;
            }
            let [gn, un, dn] = &cfg.expert_names;
            for ex in 0..e {
                let en = |part: &str| p(name(&format!("{}.{ex}.{part}.weight", cfg.experts)));
                let y = swiglu_mlp(&xs, &en(gn), &en(un), &en(dn))?;
                out = (out + y.broadcast_mul(&route.narrow(1, ex, 1)?)?)?;
            }
            if cfg.shared_expert.is_some() {
                let sg = xs.matmul(&p(name("shared_expert_gate.weight")).t()?)?;
                let sg = (sg.neg()?.exp()? + 1.0)?.recip()?;
                let y = swiglu_mlp(
                    &xs,
                    &p(name("shared_expert.gate_proj.weight")),
                    &p(name("shared_expert.up_proj.weight")),
                    &p(name("shared_expert.down_proj.weight")),
                )?;
                out = (out + y.broadcast_mul(&sg)?)?;
            }
        }
        // transformers' load_balancing_loss_func over the blocks' concatenated routing.
        let tokens = (BLOCKS * counted.iter().filter(|&&c| c).count()) as f64;
        let c = Tensor::from_vec(counts, e, &Device::Cpu)?;
        let aux = if tokens == 0.0 {
            Tensor::zeros((), DType::F64, &Device::Cpu)?
        } else {
            ((c * prob_sums)?.sum_all()? * (e as f64 / (tokens * tokens)))?
        };
        stats.push((aux.to_scalar::<f64>()?, load));
        let gd = g.narrow(0, d * rows, rows)?.reshape((n, h))?;
        let lm = (&out * gd)?.sum_all()?;
        loss = (loss + lm + (aux * (COEF * n as f64))?)?;
        outs.push(out.reshape((rows, s, h))?);
    }
    let store = (loss * SCALE)?.backward()?;
    let grads = vars
        .iter()
        .map(|(n, v)| (n.clone(), store.get(v.as_tensor()).unwrap().clone()))
        .collect();
    Ok(Reference {
        out: Tensor::cat(&outs, 0)?,
        dx: store.get(xv.as_tensor()).unwrap().clone(),
        grads,
        stats,
    })
}

/// One rank's run: its output and input gradient `(rows, tokens', hidden)`, its parameters'
/// gradients (name, shard of the whole gradient it holds, replicated or not), its statistics,
/// and its coordinates.
struct RankRun {
    out: Tensor,
    dx: Tensor,
    grads: Vec<(candle_parallel::nn::Param, Tensor)>,
    aux: f64,
    load: f64,
    labelled: f64,
    /// This rank's `Σ out ⊙ g`, and that plus the balancing term (`add_to_loss`).
    sum: f64,
    loss: f64,
    dp_rank: usize,
    tp_rank: usize,
    sp_rank: usize,
}

struct Case {
    name: &'static str,
    tp: usize,
    dp: usize,
    ep: usize,
    tp_sp: bool,
    /// Ring (sequence-parallel) ranks, each holding a part of every sequence.
    sp: usize,
    /// Each block on its own pipeline stage (emulated on each rank: block 0's forward, its
    /// statistics carried to block 1's, the loss and its backward, then block 0's backward
    /// with the carried totals; another micro-batch's forward runs in between).
    stages: bool,
}

fn run_case(
    cfg: &MoeConfig,
    w: &HashMap<String, Tensor>,
    x: &Tensor,
    g: &Tensor,
    case: &Case,
    pads: &[usize],
) -> Vec<RankRun> {
    let ranks = case.tp * case.dp * case.sp;
    let rows = x.dim(0).unwrap() / case.dp;
    let seq = x.dim(1).unwrap();
    world(ranks, |comm| {
        let mesh_cfg = MeshConfig::new()
            .with_tp(case.tp)
            .with_dp(case.dp)
            .with_ring(case.sp);
        let acts = if case.tp_sp {
            TpActivations::SequenceSharded
        } else {
            TpActivations::Replicated
        };
        let layout = Layout::new(mesh_cfg, SpConfig::new(Strategy::Ring, 1, case.sp), acts)
            .with_expert_parallel(case.ep);
        // One rank: expert parallelism over a group of one is none (its experts are not marked
        // expert-parallel).
        let solo = (ranks == 1).then(|| comm.clone());
        let (mesh, ctx) = layout.context(comm).map_err(candle_core::Error::wrap)?;
        let ep = solo.or_else(|| ctx.expert_parallel().cloned());
        let (dp_rank, tp_rank) = (mesh.comm(Dim::Dp).rank(), mesh.comm(Dim::Tp).rank());
        let sp_rank = mesh.comm(Dim::Ring).rank();
        let source = Arc::new(TensorMap::new(w.clone(), "random"));
        let (vb, params) =
            ParamBuilder::new(source, DType::F32, &Device::Cpu, ParamMode::Trainable);
        let aux = RouterAux::new(cfg.num_experts);
        let blocks = (0..BLOCKS)
            .map(|b| {
                // Staged: the blocks are layers 1 and 2 of a model whose layer 0 has none.
                let layer = if case.stages { b + 1 } else { b };
                let aux = Some((aux.clone(), layer));
                SparseMoe::new_with_ep(cfg, vb.pp(format!("mlp{b}")), &ctx, aux, ep.clone())
            })
            .collect::<candle_parallel::Result<Vec<_>>>()
            .map_err(candle_core::Error::wrap)?;
        // This rank's tokens: its micro-batch's rows, and its part of the sequence under TP-sp.
        let mut xr = x.narrow(0, dp_rank * rows, rows)?;
        let mut gr = g.narrow(0, dp_rank * rows, rows)?;
        if case.tp_sp {
            let part = seq / case.tp;
            xr = xr.narrow(1, tp_rank * part, part)?;
            gr = gr.narrow(1, tp_rank * part, part)?;
        }
        // The pass's routing flags: of this rank's rows, over the sequence-parallel rank's
        // part of the sequence (under TP-sp the block takes its tensor-parallel part).
        let (from, len) = (sp_rank * seq / case.sp, seq / case.sp);
        let routed: Option<Vec<bool>> = pads.iter().any(|&p| p > 0).then(|| {
            (dp_rank * rows..(dp_rank + 1) * rows)
                .flat_map(|r| (from..from + len).map(move |j| j < seq - pads[r]))
                .collect()
        });
        let routed = routed.as_deref();
        if case.sp > 1 {
            let part = seq / case.sp;
            xr = xr.narrow(1, sp_rank * part, part)?;
            gr = gr.narrow(1, sp_rank * part, part)?;
        }
        let xv = Var::from_tensor(&xr)?;
        let wrap = candle_core::Error::wrap;
        // The micro-batch's tokens: every rank's loss carries its balancing term.
        // (Under TP-sp every rank's loss covers the micro-batch; under sp its own part.)
        let count = rows * seq / case.sp;
        let (out, stats, sum, loss, stores) = if case.stages {
            // Stage 0 (block 0), then stage 1 (the others) with what stage 0 carried. The
            // stages' graphs are apart, as on two ranks. Micro-batch 3; micro-batch 5 (other
            // tokens) runs its forward on both stages before 3's backward, as GPipe would.
            let layers = BLOCKS + 1;
            let stage0 = |mb: usize, x: &Tensor| -> candle_parallel::Result<(Tensor, Vec<f64>)> {
                aux.begin_stage(mb, None, layers)?;
                let out = blocks[0].forward_at(x, None, routed)?;
                let carry = aux.forward_carry(&ctx, layers)?;
                assert_eq!(carry.len(), aux.forward_carry_len(layers));
                Ok((out, carry))
            };
            let stage1 = |mb: usize, x: &Tensor, out0: &Tensor, carried: &[f64]| {
                aux.begin_stage(mb, Some(carried), layers)?;
                let mut out = out0.clone();
                for b in &blocks[1..] {
                    out = (out + b.forward_at(x, None, routed)?)?;
                }
                let stats = aux.finish_stage(&ctx, count)?;
                let sum = (&out * &gr)?.sum_all()?;
                let loss = aux.add_to_loss(&sum, count, COEF)?;
                aux.park();
                candle_parallel::Result::Ok((out, stats, sum, loss))
            };
            let (out0, carried) = stage0(3, xv.as_tensor()).map_err(wrap)?;
            let received = Var::from_tensor(&out0.detach())?;
            let (out, stats, sum, loss) =
                stage1(3, xv.as_tensor(), received.as_tensor(), &carried).map_err(wrap)?;
            let other = (xv.as_tensor().detach() * 0.5)?;
            let (o, c) = stage0(5, &other).map_err(wrap)?;
            stage1(5, &other, &o, &c).map_err(wrap)?;
            aux.begin_backward(3, None).map_err(wrap)?;
            let late = (&loss * SCALE)?.backward()?;
            let back = aux.backward_carry();
            assert_eq!(back.len(), aux.backward_carry_len());
            aux.begin_backward(3, Some(&back)).map_err(wrap)?;
            let g0 = late
                .get(received.as_tensor())
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("no gradient into stage 1".into()))?;
            let early = (&out0 * &g0)?.sum_all()?.backward()?;
            (out, stats, sum, loss, vec![late, early])
        } else {
            aux.begin();
            let mut out = blocks[0]
                .forward_at(xv.as_tensor(), None, routed)
                .map_err(wrap)?;
            for b in &blocks[1..] {
                out = (out + b.forward_at(xv.as_tensor(), None, routed).map_err(wrap)?)?;
            }
            let stats = aux.finish_in(&ctx, count, &Device::Cpu).map_err(wrap)?;
            assert_eq!(aux.last_stats(), Some(stats.clone()));
            let sum = (&out * &gr)?.sum_all()?;
            let loss = aux.add_to_loss(&sum, count, COEF).map_err(wrap)?;
            let store = (&loss * SCALE)?.backward()?;
            (out, stats, sum, loss, vec![store])
        };
        let first = usize::from(case.stages);
        let want_layers: Vec<usize> = (first..first + BLOCKS).collect();
        let layers: Vec<usize> = stats.layer_loads.iter().map(|l| l.0).collect();
        assert_eq!(
            layers, want_layers,
            "{}: the layers with statistics",
            case.name
        );
        // A gradient summed over the stages' stores (each parameter is in one of them; the
        // input in both).
        let grad_of = |v: &Var| -> Option<Tensor> {
            let parts: Vec<&Tensor> = stores.iter().filter_map(|s| s.get(v.as_tensor())).collect();
            let first = (*parts.first()?).clone();
            parts[1..].iter().try_fold(first, |a, b| a + *b).ok()
        };
        let mut grads = Vec::new();
        for p in params.sorted() {
            let v = p.var.clone().expect("trainable");
            let gp = grad_of(&v).ok_or_else(|| {
                candle_core::Error::Msg(format!("{}: {} received no gradient", case.name, p.name))
            })?;
            grads.push((p, gp));
        }
        let dx = grad_of(&xv).ok_or_else(|| candle_core::Error::Msg("no input gradient".into()))?;
        Ok(RankRun {
            out,
            dx,
            grads,
            aux: stats.aux,
            load: stats.load_max_over_mean,
            labelled: stats.labelled_tokens,
            sum: sum.to_scalar::<f32>()? as f64,
            loss: loss.to_scalar::<f32>()? as f64,
            dp_rank,
            tp_rank,
            sp_rank,
        })
    })
}

/// `pads`: per row of the global batch, its trailing padding tokens (see [`reference`]).
fn check(cfg: &MoeConfig, seed: u64, case: &Case, rows: usize, seq: usize, pads: &[usize]) {
    let h = cfg.hidden_size;
    let w = weights(cfg, seed);
    let mut rng = StdRng::seed_from_u64(seed + 1);
    let b = rows * case.dp;
    let x = common::rand_t(&mut rng, &[b, seq, h]);
    let g = common::rand_t(&mut rng, &[b, seq, h]);
    let want = reference(cfg, &w, &x, &g, rows, pads).unwrap();
    let got = run_case(cfg, &w, &x, &g, case, pads);
    let what = |s: &str| {
        format!(
            "{} ({} experts, top-{}): {s}",
            case.name, cfg.num_experts, cfg.top_k
        )
    };
    let part = if case.tp_sp {
        seq / case.tp
    } else {
        seq / case.sp
    };
    // Gradients summed over the ranks that hold different tokens, by (name, tensor-parallel
    // rank), with the reference's block of that rank.
    let mut summed: HashMap<(String, usize), (Tensor, Tensor)> = HashMap::new();
    for run in &got {
        let at = format!("dp rank {} tp rank {}", run.dp_rank, run.tp_rank);
        let first = if case.tp_sp {
            run.tp_rank * part
        } else {
            run.sp_rank * part
        };
        let rows_of = |t: &Tensor| {
            t.narrow(0, run.dp_rank * rows, rows)
                .and_then(|t| t.narrow(1, first, part))
                .and_then(|t| t.to_dtype(DType::F32))
                .unwrap()
        };
        testkit::assert_close(
            &run.out,
            &rows_of(&want.out),
            TOL,
            &what(&format!("{at}: output")),
        );
        testkit::assert_close(
            &run.dx,
            &rows_of(&want.dx),
            TOL,
            &what(&format!("{at}: input gradient")),
        );
        let (aux, load) = want.stats[run.dp_rank];
        testkit::assert_close_scalar(run.aux, aux, TOL, &what(&format!("{at}: aux")));
        testkit::assert_close_scalar(run.load, load, TOL, &what(&format!("{at}: load")));
        testkit::assert_close_scalar(
            run.labelled,
            (rows * seq) as f64,
            0.0,
            &what(&format!("{at}: labelled tokens")),
        );
        // The loss carries COEF · aux · n for the n tokens this rank counts.
        let loss = run.sum + COEF * aux * (rows * seq / case.sp) as f64;
        testkit::assert_close_scalar(run.loss, loss, TOL, &what(&format!("{at}: loss")));
        let mut experts_here = 0;
        for (p, gp) in &run.grads {
            let shard = p
                .shard
                .take(&want.grads[&p.name].to_dtype(DType::F32).unwrap())
                .unwrap();
            let expert = p.name.contains(".experts.");
            if expert {
                experts_here += 1;
                assert_eq!(p.expert_parallel, case.ep > 1, "{}", what(&p.name));
            }
            // The router and the shared expert's gate see this rank's tokens; the shared
            // expert, the tensor-parallel group's; an expert, every token routed to it.
            let outside_tp = !expert && !p.name.contains(".shared_expert.");
            let partial = (!expert || (case.sp > 1 && case.ep == 1))
                && (case.dp > 1 || case.sp > 1 || (outside_tp && case.tp_sp));
            if partial {
                let tp_rank = if outside_tp && case.tp_sp {
                    0
                } else {
                    run.tp_rank
                };
                let key = (p.name.clone(), tp_rank);
                let acc = match summed.remove(&key) {
                    Some((s, _)) => (s + gp).unwrap(),
                    None => gp.clone(),
                };
                summed.insert(key, (acc, shard));
            } else {
                close_or_zero(gp, &shard, &what(&format!("{at}: {}", p.name)));
            }
        }
        // Each rank holds 1/ep of every block's experts (three projections each).
        assert_eq!(
            experts_here,
            BLOCKS * 3 * cfg.num_experts / case.ep,
            "{}",
            what(&at)
        );
    }
    for ((name, tp_rank), (sum, shard)) in &summed {
        close_or_zero(
            sum,
            shard,
            &what(&format!("{name} of tp rank {tp_rank} summed")),
        );
    }
}

/// `got` within `TOL` of `want`, or exactly zero where `want` is (an expert no token chose).
fn close_or_zero(got: &Tensor, want: &Tensor, what: &str) {
    if testkit::max_abs(want) == 0.0 {
        assert_eq!(
            testkit::max_abs(got),
            0.0,
            "{what}: an expert no token chose"
        );
    } else {
        testkit::assert_close(got, want, TOL, what);
    }
}

const CASES: [Case; 7] = [
    Case {
        name: "one rank",
        tp: 1,
        dp: 1,
        ep: 1,
        tp_sp: false,
        sp: 1,
        stages: false,
    },
    Case {
        name: "tp2",
        tp: 2,
        dp: 1,
        ep: 1,
        tp_sp: false,
        sp: 1,
        stages: false,
    },
    Case {
        name: "tp2 TP-sp",
        tp: 2,
        dp: 1,
        ep: 1,
        tp_sp: true,
        sp: 1,
        stages: false,
    },
    Case {
        name: "dp2 ep2",
        tp: 1,
        dp: 2,
        ep: 2,
        tp_sp: false,
        sp: 1,
        stages: false,
    },
    Case {
        name: "tp2 TP-sp x dp2 ep2",
        tp: 2,
        dp: 2,
        ep: 2,
        tp_sp: true,
        sp: 1,
        stages: false,
    },
    Case {
        name: "dp4 ep4",
        tp: 1,
        dp: 4,
        ep: 4,
        tp_sp: false,
        sp: 1,
        stages: false,
    },
    Case {
        name: "ring2",
        tp: 1,
        dp: 1,
        ep: 1,
        tp_sp: false,
        sp: 2,
        stages: false,
    },
];

/// The layouts of [`CASES`] whose blocks sit on two pipeline stages ([`Case::stages`]).
const STAGED: [Case; 4] = [
    Case {
        name: "two stages",
        tp: 1,
        dp: 1,
        ep: 1,
        tp_sp: false,
        sp: 1,
        stages: true,
    },
    Case {
        name: "two stages, tp2 TP-sp",
        tp: 2,
        dp: 1,
        ep: 1,
        tp_sp: true,
        sp: 1,
        stages: true,
    },
    Case {
        name: "two stages, dp2 ep2",
        tp: 1,
        dp: 2,
        ep: 2,
        tp_sp: false,
        sp: 1,
        stages: true,
    },
    Case {
        name: "two stages, ring2",
        tp: 1,
        dp: 1,
        ep: 1,
        tp_sp: false,
        sp: 2,
        stages: true,
    },
];

#[test]
fn sparse_block_matches_the_dense_reference_under_every_layout() {
    for case in CASES.iter().chain(&STAGED) {
        // dp4 ep4 on 2 tokens per rank: most experts receive no row on most ranks.
        let (rows, seq) = if case.dp == 4 { (1, 2) } else { (2, 6) };
        let none = vec![0; rows * case.dp];
        check(&cfg_qwen(), 11, case, rows, seq, &none);
        if case.dp != 4 {
            check(&cfg_mixtral_names(), 12, case, rows, seq, &none);
        }
    }
}

/// Padded sequences: the padding is routed and computed, but the balancing loss, its gradient
/// and the loads count only the other tokens, as transformers' `load_balancing_loss_func` does
/// with an `attention_mask`. Rows padded across the sequence-parallel and the TP-sp split, not
/// at all, and wholly (under dp4 whole micro-batches of padding: no statistics, aux 0).
#[test]
fn padding_is_routed_but_left_out_of_the_balancing_loss() {
    for case in CASES.iter().chain(&STAGED) {
        let (rows, seq) = if case.dp == 4 { (1, 2) } else { (2, 6) };
        let pads: Vec<usize> = (0..rows * case.dp)
            .map(|r| [4, 0, 1, 6][r % 4].min(seq))
            .collect();
        check(&cfg_qwen(), 13, case, rows, seq, &pads);
    }
}

/// The parameters a token multiplies, by hand: the router `E h`, `k` experts of `3 h i`, the
/// shared expert `3 h s` and its gate `h`.
#[test]
fn active_parameters_count_the_router_k_experts_and_the_shared_expert() {
    // 8 · 16 + 2 · 3 · 16 · 8 + 3 · 16 · 12 + 16
    assert_eq!(cfg_qwen().active_matmul_params(), 128 + 768 + 576 + 16);
    // 4 · 16 + 3 · 3 · 16 · 8
    assert_eq!(cfg_mixtral_names().active_matmul_params(), 64 + 1152);
}

#[test]
fn bad_configurations_and_calls_are_clear_errors() {
    for (experts, k) in [(0, 1), (4, 0), (4, 5)] {
        let err = MoeConfig::new(16, 8, experts, k).unwrap_err().to_string();
        assert!(
            err.contains("num_experts_per_tok"),
            "{experts} experts, top-{k}: {err}"
        );
    }
    assert_eq!(MoeConfig::new(16, 8, 4, 4).unwrap().top_k, 4);

    // Expert parallelism over 4 ranks of 6 experts; router statistics of another size.
    let cfg = MoeConfig::new(16, 8, 6, 2).unwrap();
    let w: HashMap<String, Tensor> = weights(&cfg, 3)
        .into_iter()
        .map(|(n, t)| (n.replacen("mlp0.", "mlp.", 1), t))
        .collect();
    let errs = world(4, |comm| {
        let layout = Layout::single();
        let (_mesh, ctx) = layout
            .context(candle_parallel::comm::solo())
            .map_err(candle_core::Error::wrap)?;
        let vb = |w: &HashMap<String, Tensor>| {
            let source = Arc::new(TensorMap::new(w.clone(), "random"));
            ParamBuilder::new(source, DType::F32, &Device::Cpu, ParamMode::Trainable).0
        };
        let ep = SparseMoe::new_with_ep(&cfg, vb(&w).pp("mlp"), &ctx, None, Some(comm))
            .unwrap_err()
            .to_string();
        let aux = Some((RouterAux::new(8), 0));
        let sizes = SparseMoe::new(&cfg, vb(&w).pp("mlp"), &ctx, aux)
            .unwrap_err()
            .to_string();
        Ok((ep, sizes))
    });
    for (ep, sizes) in errs {
        assert!(ep.contains("does not divide the 6 experts"), "{ep}");
        assert!(
            sizes.contains("router statistics for 8 experts given to a block of 6"),
            "{sizes}"
        );
    }

    // Routing flags must cover the pass's tokens: under tp2 without TP-sp a TP-sp-sized set
    // (twice the rows) is an error, as is any other length; under TP-sp it is this rank's part.
    let flagged = world(2, |comm| {
        let run = |acts: TpActivations, n: usize| -> candle_core::Result<Option<String>> {
            let layout = Layout::new(
                MeshConfig::new().with_tp(2),
                SpConfig::new(Strategy::Ring, 1, 1),
                acts,
            );
            let (_mesh, ctx) = layout
                .context(comm.clone())
                .map_err(candle_core::Error::wrap)?;
            let source = Arc::new(TensorMap::new(w.clone(), "random"));
            let vb = ParamBuilder::new(source, DType::F32, &Device::Cpu, ParamMode::Trainable).0;
            let block =
                SparseMoe::new(&cfg, vb.pp("mlp"), &ctx, None).map_err(candle_core::Error::wrap)?;
            let x = Tensor::ones((1, 2, cfg.hidden_size), DType::F32, &Device::Cpu)?;
            let flags = vec![true; n];
            Ok(block
                .forward_at(&x, None, Some(&flags))
                .err()
                .map(|e| e.to_string()))
        };
        Ok([
            run(TpActivations::Replicated, 4)?,
            run(TpActivations::Replicated, 3)?,
            run(TpActivations::SequenceSharded, 4)?,
            run(TpActivations::SequenceSharded, 3)?,
        ])
    });
    for [tp_sized, odd, tp_sp, tp_sp_odd] in flagged {
        for e in [&tp_sized, &odd, &tp_sp_odd] {
            let e = e.as_deref().unwrap_or("no error");
            assert!(
                e.contains("routing flags for 1 sequences of 2 tokens"),
                "{e}"
            );
        }
        assert_eq!(tp_sp, None, "TP-sp: the rank's part of 4 flags");
    }

    // add_to_loss needs finish first, and begin forgets the previous micro-batch's totals (but
    // not its statistics).
    let aux = RouterAux::new(4);
    let sum = Tensor::new(1f32, &Device::Cpu).unwrap();
    let before = aux.add_to_loss(&sum, 3, 0.1).unwrap_err().to_string();
    assert!(before.contains("add_to_loss before finish"), "{before}");
    let stats = aux
        .finish(3, &[], &candle_parallel::comm::solo(), &Device::Cpu)
        .unwrap();
    assert_eq!(stats.labelled_tokens, 3.0);
    assert_eq!(stats.aux, 0.0, "no block recorded");
    aux.add_to_loss(&sum, 3, 0.1).unwrap();
    aux.begin();
    assert_eq!(aux.last_stats(), Some(stats));
    let again = aux.add_to_loss(&sum, 3, 0.1).unwrap_err().to_string();
    assert!(again.contains("add_to_loss before finish"), "{again}");

    // Carried vectors of the wrong length (another model's, or a bug) are errors naming the
    // counts, forward and backward.
    let fwd = aux
        .begin_stage(0, Some(&[0.0; 7]), 2)
        .unwrap_err()
        .to_string();
    assert!(
        fwd.contains("7 carried statistics for 4 experts and 2 layers (want 13)"),
        "{fwd}"
    );
    let bwd = aux
        .begin_backward(0, Some(&[0.0; 8]))
        .unwrap_err()
        .to_string();
    assert!(
        bwd.contains("8 carried gradient statistics for 4 experts"),
        "{bwd}"
    );
    aux.begin_stage(0, Some(&[0.0; 13]), 2).unwrap();
    aux.begin_backward(0, Some(&[0.0; 7])).unwrap();
}

/// `MeshLayout::expert_groups` (what `cpl plan --ep` prints) lists the ranks of the
/// communicators `ParallelCtx::with_expert_parallel` builds: on every rank of dp4 with ep2, tp2
/// x ring2 x dp2 (context-first placement) with ep2 and ulysses2 x ring2 with ep4, the world
/// ranks of its expert-parallel group and of its replica group, gathered over those groups,
/// are the listed group holding it, in order.
#[test]
fn expert_groups_of_the_layout_are_the_communicators_groups() {
    use candle_parallel::mesh::{MeshLayout, Placement};
    let cases = [
        (
            MeshConfig::new().with_dp(4),
            SpConfig::new(Strategy::Ring, 1, 1),
            2,
        ),
        (
            MeshConfig::new()
                .with_tp(2)
                .with_ring(2)
                .with_dp(2)
                .with_placement(Placement::ContextFirst),
            SpConfig::new(Strategy::Ring, 1, 2).with_placement(Placement::ContextFirst),
            2,
        ),
        (
            MeshConfig::new().with_ulysses(2).with_ring(2),
            SpConfig::new(Strategy::Usp, 2, 2),
            4,
        ),
    ];
    for (mesh_cfg, sp, ep) in cases {
        let n = mesh_cfg.world_size().unwrap();
        let layout = MeshLayout::new(&mesh_cfg, n).unwrap();
        let (groups, replicas) = layout.expert_groups(ep).unwrap();
        assert_eq!(groups.len() * ep, n, "{mesh_cfg:?}");
        let got = world(n, |comm| {
            let rank = comm.rank();
            let plan = Layout::new(mesh_cfg.clone(), sp.clone(), TpActivations::Replicated)
                .with_expert_parallel(ep);
            let (_, ctx) = plan.context(comm).map_err(candle_core::Error::wrap)?;
            let e = ctx.expert_groups().expect("expert groups").clone();
            let members = |c: &candle_parallel::comm::Comm| -> Result<Vec<usize>> {
                let me = Tensor::new(&[rank as u32], &Device::Cpu)?;
                let all = c.all_gather(&me, 0).map_err(candle_core::Error::wrap)?;
                Ok(all
                    .to_vec1::<u32>()?
                    .into_iter()
                    .map(|r| r as usize)
                    .collect())
            };
            Ok((rank, members(&e.ep)?, members(&e.replicas)?))
        });
        for (rank, ep_group, replica_group) in got {
            let listed = |gs: &[Vec<usize>]| gs.iter().find(|g| g.contains(&rank)).cloned();
            assert_eq!(Some(ep_group), listed(&groups), "{mesh_cfg:?} rank {rank}");
            assert_eq!(
                Some(replica_group),
                listed(&replicas),
                "{mesh_cfg:?} rank {rank}"
            );
        }
    }
    let layout = MeshLayout::new(&MeshConfig::new().with_dp(6), 6).unwrap();
    let err = layout.expert_groups(4).unwrap_err().to_string();
    assert!(
        err.contains("expert parallelism of 4 does not divide the 6 ranks"),
        "{err}"
    );
}

/// Under a capacity factor with padding: the dropped share counts the assignments of the
/// tokens that count only (padding takes capacity like any token, but is not reported), against
/// the experts' capacity recomputed here from the router's probabilities (top-2 of 8, capacity
/// `ceil(0.5 · 12 · 2 / 8)` = 2 over all 12 tokens, the last 4 padding).
#[test]
fn dropped_share_counts_the_tokens_that_count() {
    let cfg = cfg_qwen().with_capacity_factor(Some(0.5)).unwrap();
    let (n, pad) = (12, 4);
    let w: HashMap<String, Tensor> = weights(&cfg, 21)
        .into_iter()
        .filter_map(|(k, t)| k.strip_prefix("mlp0.").map(|k| (format!("mlp.{k}"), t)))
        .collect();
    let mut rng = StdRng::seed_from_u64(22);
    let x = common::rand_t(&mut rng, &[1, n, cfg.hidden_size]);
    // The routing by hand: softmax of x Wᵀ, top-2, then each expert's capacity.
    let logits = x
        .squeeze(0)
        .and_then(|x| x.matmul(&w["mlp.gate.weight"].t()?))
        .and_then(|l| l.to_vec2::<f32>())
        .unwrap();
    let probs: Vec<Vec<f32>> = logits
        .iter()
        .map(|row| {
            let m = row.iter().fold(f32::MIN, |a, &b| {
                testkit::max_or_nan(a as f64, b as f64) as f32
            });
            let ex: Vec<f32> = row.iter().map(|&v| (v - m).exp()).collect();
            let z: f32 = ex.iter().sum();
            ex.iter().map(|v| v / z).collect()
        })
        .collect();
    let (mut p, mut e, mut order) = (Vec::new(), Vec::new(), Vec::new());
    for (t, row) in probs.iter().enumerate() {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for &c in &idx[..cfg.top_k] {
            p.push(row[c]);
            e.push(c as u32);
            order.push((0, t as u32));
        }
    }
    let capacity = cfg.capacity(n).unwrap();
    assert_eq!(capacity, 2);
    let keep = candle_parallel::nn::moe::keep_within_capacity(&p, &e, &order, 8, capacity);
    let counted = (n - pad) * cfg.top_k;
    let dropped = keep[..counted].iter().filter(|&&k| !k).count();
    assert!(
        dropped > 0 && keep[counted..].iter().any(|&k| !k),
        "some of each dropped"
    );
    let (_mesh, ctx) = Layout::single()
        .context(candle_parallel::comm::solo())
        .unwrap();
    let source = Arc::new(TensorMap::new(w, "random"));
    let vb = ParamBuilder::new(source, DType::F32, &Device::Cpu, ParamMode::Trainable).0;
    let aux = RouterAux::new(8);
    let block = SparseMoe::new(&cfg, vb.pp("mlp"), &ctx, Some((aux.clone(), 0))).unwrap();
    let routed: Vec<bool> = (0..n).map(|t| t < n - pad).collect();
    aux.begin();
    block.forward_at(&x, None, Some(&routed)).unwrap();
    let stats = aux.finish_in(&ctx, n - pad, &Device::Cpu).unwrap();
    assert_eq!(stats.dropped_fraction, dropped as f64 / counted as f64);
}
