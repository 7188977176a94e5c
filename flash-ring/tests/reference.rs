//! Flash forward/backward against the float64 reference: out, lse, dq, dk, dv within 1e-5
//! (f32) and 1e-2 (bf16, f16) max-norm relative error (see `common::rel`).

mod common;

use std::sync::Arc;

use candle_core::DType;
use common::Case;
use flash_ring::{AttnSpec, Isa, KernelConfig, MaskKind, Positions};

const F32_TOL: f64 = 1e-5;
const HALF_TOL: f64 = 1e-2;

fn dense(mask: MaskKind, sq: usize, sk: usize, d: usize) -> AttnSpec {
    AttnSpec::dense(1.0 / (d as f32).sqrt(), mask, sq, sk)
}

fn small_tiles() -> KernelConfig {
    KernelConfig {
        q_tile: 16,
        k_tile: 32,
        isa: None,
    }
}

#[test]
fn every_head_dim_f32() {
    for d in [32, 64, 80, 96, 128] {
        for mask in [MaskKind::Causal, MaskKind::Full] {
            Case::new(2, 150, 150, 4, 2, d, dense(mask, 150, 150, d)).check(F32_TOL);
        }
    }
}

#[test]
fn odd_head_dims_f32() {
    // Head dims that are not multiples of 16 (padded internally).
    for d in [1, 8, 40, 72] {
        Case::new(1, 40, 50, 2, 1, d, dense(MaskKind::Causal, 40, 50, d)).check(F32_TOL);
    }
}

#[test]
fn seq_lengths_f32() {
    // Default tiles are 128: lengths below, at, between and above tile multiples.
    for s in [1, 17, 128, 129, 256, 300] {
        for mask in [MaskKind::Causal, MaskKind::Full] {
            Case::new(1, s, s, 2, 2, 64, dense(mask, s, s, 64)).check(F32_TOL);
        }
    }
    // Different q and k lengths (k positions start at 0; causal rows may be empty below).
    for (sq, sk) in [(1, 300), (300, 1), (17, 200), (200, 17)] {
        Case::new(1, sq, sk, 2, 1, 64, dense(MaskKind::Full, sq, sk, 64)).check(F32_TOL);
        Case::new(1, sq, sk, 2, 1, 64, dense(MaskKind::Causal, sq, sk, 64)).check(F32_TOL);
    }
}

#[test]
fn seq_lengths_small_tiles_f32() {
    for s in [1, 17, 31, 32, 33, 100] {
        Case::new(2, s, s, 2, 1, 64, dense(MaskKind::Causal, s, s, 64))
            .cfg(small_tiles())
            .check(F32_TOL);
    }
}

#[test]
fn gqa_ratios_f32() {
    for hkv in [8, 4, 2, 1] {
        for mask in [MaskKind::Causal, MaskKind::Full] {
            Case::new(2, 140, 140, 8, hkv, 64, dense(mask, 140, 140, 64)).check(F32_TOL);
        }
    }
}

/// Zigzag chunk pair of rank `r` of `p` over a sequence of `n` (n % 2p == 0) as positions.
fn zigzag(n: usize, p: usize, r: usize) -> Positions {
    let c = n / (2 * p);
    let mut v: Vec<u32> = (r * c..(r + 1) * c).map(|x| x as u32).collect();
    v.extend(((2 * p - 1 - r) * c..(2 * p - r) * c).map(|x| x as u32));
    Positions::list(v)
}

/// The mask kinds of the issue on blocks of global positions.
fn mask_specs(d: usize) -> Vec<(&'static str, AttnSpec, usize, usize)> {
    let scale = 1.0 / (d as f32).sqrt();
    let n = 384; // whole sequence
                 // Documents of uneven lengths crossing the 128-row tile borders.
    let cu = [0usize, 50, 51, 190, 300, 384];
    let docs = flash_ring::doc_ids_from_cu_seqlens(&cu).expect("cu_seqlens");
    // Non-monotonic document ids (ids repeat after other documents).
    let odd_docs: Arc<[u32]> = (0..n as u32)
        .map(|i| (i / 37) % 3)
        .collect::<Vec<_>>()
        .into();
    let zq = zigzag(n, 2, 0); // rows 0..96 and 288..384
    let zk = zigzag(n, 2, 1); // rows 96..192 and 192..288
    let striped: Positions =
        Positions::list((0..n as u32).filter(|i| i % 3 == 1).collect::<Vec<_>>());
    let mut v = vec![
        (
            "full",
            AttnSpec::dense(scale, MaskKind::Full, 200, 200),
            200,
            200,
        ),
        (
            "causal",
            AttnSpec::dense(scale, MaskKind::Causal, 200, 200),
            200,
            200,
        ),
        (
            "causal offset block (k after q: all masked)",
            AttnSpec::new(
                scale,
                MaskKind::Causal,
                Positions::range(0, 100),
                Positions::range(150, 100),
            ),
            100,
            100,
        ),
        (
            "causal block k before q",
            AttnSpec::new(
                scale,
                MaskKind::Causal,
                Positions::range(200, 150),
                Positions::range(10, 170),
            ),
            150,
            170,
        ),
        (
            "causal docs (cu_seqlens)",
            AttnSpec::dense(scale, MaskKind::Causal, n, n).with_doc_ids(docs.clone()),
            n,
            n,
        ),
        (
            "full docs",
            AttnSpec::dense(scale, MaskKind::Full, n, n).with_doc_ids(docs.clone()),
            n,
            n,
        ),
        (
            "causal non-monotonic docs",
            AttnSpec::dense(scale, MaskKind::Causal, n, n).with_doc_ids(odd_docs),
            n,
            n,
        ),
        (
            "causal window",
            AttnSpec::dense(scale, MaskKind::Causal, 300, 300).with_window(70),
            300,
            300,
        ),
        (
            "full window",
            AttnSpec::dense(scale, MaskKind::Full, 300, 300).with_window(45),
            300,
            300,
        ),
        (
            "causal docs window",
            AttnSpec::dense(scale, MaskKind::Causal, n, n)
                .with_doc_ids(docs.clone())
                .with_window(60),
            n,
            n,
        ),
        (
            "zigzag q vs zigzag k, causal docs",
            AttnSpec::new(scale, MaskKind::Causal, zq.clone(), zk.clone())
                .with_doc_ids(docs.clone()),
            zq.len(),
            zk.len(),
        ),
        (
            "zigzag q vs zigzag k, causal",
            AttnSpec::new(scale, MaskKind::Causal, zq.clone(), zk.clone()),
            zq.len(),
            zk.len(),
        ),
        (
            "zigzag q vs own zigzag k, causal window",
            AttnSpec::new(scale, MaskKind::Causal, zq.clone(), zq.clone()).with_window(100),
            zq.len(),
            zq.len(),
        ),
        (
            "striped k, causal",
            AttnSpec::new(
                scale,
                MaskKind::Causal,
                Positions::range(0, n),
                striped.clone(),
            ),
            n,
            striped.len(),
        ),
    ];
    // Reversed row order (positions need not be sorted).
    let rev: Vec<u32> = (0..150u32).rev().collect();
    v.push((
        "reversed q rows, causal",
        AttnSpec::new(
            scale,
            MaskKind::Causal,
            Positions::list(rev),
            Positions::range(0, 150),
        ),
        150,
        150,
    ));
    v
}

#[test]
fn every_mask_f32() {
    for (name, spec, sq, sk) in mask_specs(64) {
        eprintln!("mask: {name}");
        Case::new(2, sq, sk, 4, 2, 64, spec.clone()).check(F32_TOL);
        Case::new(1, sq, sk, 2, 1, 64, spec)
            .cfg(small_tiles())
            .check(F32_TOL);
    }
}

#[test]
fn every_mask_bf16_f16() {
    for (name, spec, sq, sk) in mask_specs(64) {
        eprintln!("mask: {name}");
        Case::new(1, sq, sk, 4, 2, 64, spec.clone())
            .dtype(DType::BF16)
            .check(HALF_TOL);
        Case::new(1, sq, sk, 2, 1, 64, spec)
            .dtype(DType::F16)
            .check(HALF_TOL);
    }
}

#[test]
fn head_dims_and_gqa_bf16() {
    for d in [32, 64, 80, 96, 128] {
        Case::new(2, 150, 150, 4, 1, d, dense(MaskKind::Causal, 150, 150, d))
            .dtype(DType::BF16)
            .check(HALF_TOL);
    }
    for hkv in [8, 4, 2, 1] {
        Case::new(1, 17, 140, 8, hkv, 64, dense(MaskKind::Full, 17, 140, 64))
            .dtype(DType::BF16)
            .check(HALF_TOL);
    }
}

#[test]
fn portable_isa_matches_reference() {
    let portable = KernelConfig {
        isa: Some(Isa::Portable),
        ..KernelConfig::default()
    };
    for (_, spec, sq, sk) in mask_specs(80).into_iter().take(6) {
        Case::new(1, sq, sk, 2, 1, 80, spec)
            .cfg(portable.clone())
            .check(F32_TOL);
    }
}

#[test]
fn tile_shapes_f32() {
    for (q_tile, k_tile) in [(1, 32), (7, 64), (64, 256), (200, 96)] {
        let cfg = KernelConfig {
            q_tile,
            k_tile,
            isa: None,
        };
        let spec = dense(MaskKind::Causal, 130, 130, 64).with_window(50);
        Case::new(1, 130, 130, 2, 1, 64, spec)
            .cfg(cfg)
            .check(F32_TOL);
    }
}
