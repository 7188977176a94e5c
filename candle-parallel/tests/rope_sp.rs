//! Sequence-length-dependent RoPE (dynamic NTK, longrope, partial rotation) under sequence
//! parallelism: a rank holds only a shard of the positions, yet must rotate with the frequencies
//! of the whole sequence (transformers' `max(position_ids) + 1` over the batch). Checked at two
//! levels:
//! - the op: every shard of a zigzag or contiguous split rotated with
//!   [`RotaryEmbedding::apply_seq`] and the global length is bit-identical to the rows of the
//!   whole sequence rotated on one rank (and the shard's own `max + 1` would not be), and the
//!   composite path equals the kernel;
//! - the module: [`ParallelAttention`] with such a rope on ring (zigzag) and ulysses layouts of 2
//!   and 4 local ranks equals the single-rank output (1e-5 relative: the attention's blockwise
//!   softmax merges in another order; the rotation itself is exact).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::{AttnMask, SeqLayout, SpConfig, Strategy};
use candle_parallel::comm::{Comm, LocalWorld};
use candle_parallel::nn::{
    AttentionConfig, ParallelAttention, ParallelCtx, ParamBuilder, ParamMode, Pass, TensorMap,
    TpActivations,
};
use candle_parallel::ops::{RopeScaling, RotaryEmbedding};
use candle_parallel::DeviceMesh;
use rand::rngs::StdRng;
use rand::SeedableRng;

mod common;

const HEAD_DIM: usize = 16;
const HEADS: usize = 4;
const HIDDEN: usize = 32;
/// Longer than the ropes' original context (16): the scaled frequencies apply.
const SEQ: usize = 48;

fn ropes() -> Vec<(&'static str, RotaryEmbedding)> {
    let dynamic = RopeScaling::Dynamic {
        factor: 2.0,
        max_position_embeddings: 16,
    };
    let longrope = RopeScaling::LongRope {
        short_factor: vec![1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0],
        long_factor: vec![1.0, 1.5, 2.0, 4.0, 8.0, 12.0, 16.0, 20.0],
        original_max_position_embeddings: 16,
        attention_factor: 1.2,
    };
    vec![
        (
            "dynamic",
            RotaryEmbedding::new(HEAD_DIM, 10_000.0, &dynamic).unwrap(),
        ),
        (
            "longrope",
            RotaryEmbedding::new(HEAD_DIM, 10_000.0, &longrope).unwrap(),
        ),
        (
            "longrope partial",
            RotaryEmbedding::with_rotary_dim(HEAD_DIM, 12, 10_000.0, &{
                let RopeScaling::LongRope {
                    short_factor,
                    long_factor,
                    ..
                } = &longrope
                else {
                    unreachable!()
                };
                RopeScaling::LongRope {
                    short_factor: short_factor[..6].to_vec(),
                    long_factor: long_factor[..6].to_vec(),
                    original_max_position_embeddings: 16,
                    attention_factor: 1.2,
                }
            })
            .unwrap(),
        ),
    ]
}

/// The zigzag split of `0..s` over `p` ranks (rank r: chunks r and 2p - 1 - r) and the
/// contiguous one.
fn splits(s: usize, p: usize) -> Vec<Vec<Vec<u32>>> {
    let c = s / (2 * p);
    let zigzag = (0..p)
        .map(|r| {
            (r * c..(r + 1) * c)
                .chain((2 * p - 1 - r) * c..(2 * p - r) * c)
                .map(|i| i as u32)
                .collect()
        })
        .collect();
    let n = s / p;
    let contiguous = (0..p)
        .map(|r| (r * n..(r + 1) * n).map(|i| i as u32).collect())
        .collect();
    vec![zigzag, contiguous]
}

#[test]
fn sharded_positions_rotate_as_the_whole_sequence() {
    let mut rng = StdRng::seed_from_u64(5);
    let x = common::rand_t(&mut rng, &[2, SEQ, 3, HEAD_DIM]);
    let all: Vec<u32> = (0..SEQ as u32).collect();
    for (name, rope) in ropes() {
        let whole = rope.apply(&x, &all).unwrap();
        // The composite (what runs off the CPU) rotates identically, partial rotation included.
        let composite = rope.apply_composite(&x, &all).unwrap();
        assert_eq!(
            common::max_abs(&(&composite - &whole).unwrap()),
            0.0,
            "{name}: composite"
        );
        let mut differs = false;
        for p in [2, 4] {
            for (split, shards) in splits(SEQ, p).into_iter().enumerate() {
                for pos in &shards {
                    let idx = Tensor::new(pos.as_slice(), &Device::Cpu).unwrap();
                    let xs = x.index_select(&idx, 1).unwrap();
                    let want = whole.index_select(&idx, 1).unwrap();
                    let got = rope.apply_seq(&xs, pos, SEQ).unwrap();
                    let d = common::max_abs(&(&got - &want).unwrap());
                    assert_eq!(d, 0.0, "{name}, {p} ranks, split {split}: shard {pos:?}");
                    // The shard's own length would scale differently on some rank.
                    let alone = rope.apply(&xs, pos).unwrap();
                    differs |= common::max_abs(&(&alone - &want).unwrap()) > 0.0;
                }
            }
        }
        assert!(
            differs,
            "{name}: the test needs a shard whose own length scales differently"
        );
        assert!(
            rope.apply_seq(&x.narrow(1, 0, 2).unwrap(), &[3, 60], SEQ)
                .is_err(),
            "a position beyond the sequence length is an error"
        );
    }
}

fn weights(seed: u64) -> HashMap<String, Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut w = HashMap::new();
    for (n, rows, cols) in [
        ("q_proj", HEADS * HEAD_DIM, HIDDEN),
        ("k_proj", HEADS * HEAD_DIM, HIDDEN),
        ("v_proj", HEADS * HEAD_DIM, HIDDEN),
        ("o_proj", HIDDEN, HEADS * HEAD_DIM),
    ] {
        let t = (common::rand_t(&mut rng, &[rows, cols]) * 0.3).unwrap();
        w.insert(format!("{n}.weight"), t);
    }
    w
}

/// The attention output `(1, SEQ, HIDDEN)` gathered from every rank of `cfg`'s layout.
fn run(cfg: &SpConfig, rope: &RotaryEmbedding, x: &Tensor) -> Tensor {
    let w = weights(11);
    let attn_cfg = AttentionConfig::new(HIDDEN, HEADS, HEADS, HEAD_DIM).with_rope(rope.clone());
    let out = LocalWorld::new(cfg.degree())
        .with_timeout(Duration::from_secs(120))
        .launch(|comm: Comm| -> candle_parallel::Result<Tensor> {
            let mesh = DeviceMesh::new(&cfg.mesh_config(), comm)?;
            let ctx = ParallelCtx::new(&mesh, cfg, TpActivations::Replicated)?;
            let source = Arc::new(TensorMap::new(w.clone(), "test weights"));
            let (vb, _) = ParamBuilder::new(source, DType::F32, &Device::Cpu, ParamMode::Frozen);
            let attn = ParallelAttention::new(&attn_cfg, vb, &ctx)?;
            let positions = ctx.attention_positions(SEQ)?;
            let mask = AttnMask::Causal;
            let pass = Pass::new(&ctx, &positions, &mask);
            assert_eq!(pass.seq_len, SEQ, "the pass carries the global length");
            let y = attn.forward(&ctx.shard_tokens(x)?, &pass)?;
            ctx.gather_tokens(&y)
        })
        .unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
    out.into_iter().next().unwrap()
}

#[test]
fn attention_under_sequence_parallelism_matches_one_rank() {
    let mut rng = StdRng::seed_from_u64(9);
    let x = common::rand_t(&mut rng, &[1, SEQ, HIDDEN]);
    let single = SpConfig::new(Strategy::Ring, 1, 1);
    for (name, rope) in ropes() {
        let want = run(&single, &rope, &x);
        for cfg in [
            SpConfig::new(Strategy::Ring, 1, 2).with_layout(SeqLayout::Zigzag),
            SpConfig::new(Strategy::Ring, 1, 4).with_layout(SeqLayout::Zigzag),
            SpConfig::new(Strategy::Ulysses, 2, 1),
        ] {
            let got = run(&cfg, &rope, &x);
            let e = common::rel_err(&got, &want);
            assert!(e <= 1e-5, "{name} {cfg:?}: rel err {e}");
        }
    }
}
