//! Device mesh: coordinates and groups of 16 ranks in both placements and two orders, config
//! errors, and the communicators of a `DeviceMesh` on a local world.

use std::collections::BTreeSet;

use candle_core::{Device, Tensor};
use candle_parallel::comm::LocalWorld;
use candle_parallel::mesh::{Coords, DeviceMesh, Dim, MeshConfig, MeshLayout, Placement};
use candle_parallel::Error;

const HF: Placement = Placement::HeadFirst;
const CF: Placement = Placement::ContextFirst;

/// tp 2 x ulysses 2 x ring 2 x dp 2 (pp 1).
fn cfg_tp(order: &[Dim], placement: Placement) -> MeshConfig {
    MeshConfig::default()
        .with_tp(2)
        .with_ulysses(2)
        .with_ring(2)
        .with_dp(2)
        .with_order(order)
        .with_placement(placement)
}

/// ulysses 2 x ring 2 x pp 2 x dp 2 (tp 1): the two orders differ in where pp and dp go.
fn cfg_pp(order: &[Dim], placement: Placement) -> MeshConfig {
    MeshConfig::default()
        .with_ulysses(2)
        .with_ring(2)
        .with_pp(2)
        .with_dp(2)
        .with_order(order)
        .with_placement(placement)
}

fn layout(cfg: &MeshConfig) -> MeshLayout {
    MeshLayout::new(cfg, 16).expect("valid 16-rank mesh")
}

/// Every non-empty subset of the five dims.
fn all_dim_sets() -> Vec<Vec<Dim>> {
    (1u32..32)
        .map(|m| {
            Dim::ALL
                .into_iter()
                .enumerate()
                .filter(|(i, _)| m & (1 << i) != 0)
                .map(|(_, d)| d)
                .collect()
        })
        .collect()
}

/// Checks every rank's coordinates against hand-written digit strings (character `r` is the
/// coordinate of rank `r`), one per dim; dims not listed must be 0 everywhere.
fn check_coords(l: &MeshLayout, expected: &[(Dim, &str)]) {
    for dim in Dim::ALL {
        let digits = expected
            .iter()
            .find(|(d, _)| *d == dim)
            .map(|(_, s)| s.to_string())
            .unwrap_or_else(|| "0".repeat(16));
        let got: String = (0..16)
            .map(|r| char::from(b'0' + l.coord(r, dim) as u8))
            .collect();
        assert_eq!(got, digits, "{dim} coordinates of {:?}", l.order());
    }
}

/// Checks the groups of `dims` (as `MeshLayout::groups` lists them, and as seen from each member).
/// `expected` lists the groups separated by `|`, each as its world ranks in group-rank order.
/// [`check_groups`] of every `(dims, expected)`.
fn check_all_groups(l: &MeshLayout, cases: &[(&[Dim], &str)]) {
    for (dims, expected) in cases {
        check_groups(l, dims, expected);
    }
}

fn check_groups(l: &MeshLayout, dims: &[Dim], expected: &str) {
    let want: Vec<Vec<usize>> = expected
        .split('|')
        .map(|g| {
            g.split_whitespace()
                .map(|r| r.parse().expect("rank number"))
                .collect()
        })
        .collect();
    assert_eq!(
        l.groups(dims),
        want,
        "groups of {dims:?} with order {:?}",
        l.order()
    );
    for group in &want {
        for (i, &r) in group.iter().enumerate() {
            assert_eq!(&l.group_ranks(r, dims), group);
            assert_eq!(l.group_rank(r, dims), i);
        }
    }
}

/// Structural invariants that hold for any layout.
fn check_invariants(l: &MeshLayout) {
    let w = l.world_size();
    for r in 0..w {
        let c = l.coords(r);
        assert_eq!(
            l.rank_of(&c).expect("in range"),
            r,
            "round trip of rank {r}"
        );
        for dim in Dim::ALL {
            assert!(c[dim] < l.degree(dim));
            assert_eq!(c.get(dim), l.coord(r, dim));
        }
    }
    for dims in all_dim_sets() {
        let size: usize = dims.iter().map(|&d| l.degree(d)).product();
        assert_eq!(l.group_size(&dims), size);
        assert_eq!(l.num_groups(&dims) * size, w);
        // Same group no matter how the caller orders the dims.
        let reversed: Vec<Dim> = dims.iter().rev().copied().collect();
        let mut seen = vec![false; w];
        let mut indices = BTreeSet::new();
        for r in 0..w {
            let g = l.group_ranks(r, &dims);
            assert_eq!(g, l.group_ranks(r, &reversed));
            assert_eq!(g.len(), size, "group of {dims:?} around rank {r}");
            assert!(g.windows(2).all(|p| p[0] < p[1]), "ascending: {g:?}");
            assert_eq!(g[l.group_rank(r, &dims)], r);
            assert_eq!(l.group_rank(r, &dims), l.group_rank(r, &reversed));
            let idx = l.group_index(r, &dims);
            assert!(idx < l.num_groups(&dims));
            let c = l.coords(r);
            for &m in &g {
                // Members agree on every coordinate outside `dims` and on the group.
                let cm = l.coords(m);
                for dim in Dim::ALL.into_iter().filter(|d| !dims.contains(d)) {
                    assert_eq!(cm[dim], c[dim]);
                }
                assert_eq!(l.group_ranks(m, &dims), g);
                assert_eq!(l.group_index(m, &dims), idx);
            }
            if g[0] == r {
                // First member: the group is new; its ranks are not in any earlier group.
                assert!(indices.insert(idx), "group index {idx} reused");
                for &m in &g {
                    assert!(!seen[m], "rank {m} in two groups of {dims:?}");
                    seen[m] = true;
                }
            }
        }
        assert!(
            seen.iter().all(|&s| s),
            "groups of {dims:?} cover the world"
        );
        assert_eq!(indices.len(), l.num_groups(&dims));
    }
    // The group of all dims is the world, in world-rank order.
    for r in 0..w {
        assert_eq!(l.group_ranks(r, &Dim::ALL), (0..w).collect::<Vec<_>>());
        assert_eq!(l.group_rank(r, &Dim::ALL), r);
        assert_eq!(l.group_ranks(r, &[]), vec![r]);
    }
}

#[test]
fn effective_orders() {
    let d = MeshConfig::default_order();
    let l3 = MeshConfig::llama3_order();
    use Dim::*;
    assert_eq!(d, vec![Tp, Ulysses, Ring, Dp, Pp]);
    assert_eq!(l3, vec![Tp, Ulysses, Ring, Pp, Dp]);
    assert_eq!(layout(&cfg_pp(&d, HF)).order(), [Tp, Ulysses, Ring, Dp, Pp]);
    assert_eq!(layout(&cfg_pp(&d, CF)).order(), [Tp, Ring, Ulysses, Dp, Pp]);
    assert_eq!(
        layout(&cfg_pp(&l3, HF)).order(),
        [Tp, Ulysses, Ring, Pp, Dp]
    );
    assert_eq!(
        layout(&cfg_pp(&l3, CF)).order(),
        [Tp, Ring, Ulysses, Pp, Dp]
    );
    // The placement, not the listed order, decides ulysses vs ring; other slots are kept.
    let odd = [Ring, Dp, Tp, Ulysses, Pp];
    assert_eq!(
        layout(&cfg_pp(&odd, HF)).order(),
        [Ulysses, Dp, Tp, Ring, Pp]
    );
    assert_eq!(
        layout(&cfg_pp(&odd, CF)).order(),
        [Ring, Dp, Tp, Ulysses, Pp]
    );
}

#[test]
fn tp_ulysses_ring_dp_head_first() {
    use Dim::*;
    let l = layout(&cfg_tp(&MeshConfig::default_order(), HF));
    check_coords(
        &l,
        &[
            (Tp, "0101010101010101"),
            (Ulysses, "0011001100110011"),
            (Ring, "0000111100001111"),
            (Dp, "0000000011111111"),
        ],
    );
    check_all_groups(
        &l,
        &[
            (&[Tp], "0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10 11 | 12 13 | 14 15"),
            (
                &[Ulysses],
                "0 2 | 1 3 | 4 6 | 5 7 | 8 10 | 9 11 | 12 14 | 13 15",
            ),
            (
                &[Ring],
                "0 4 | 1 5 | 2 6 | 3 7 | 8 12 | 9 13 | 10 14 | 11 15",
            ),
            (&[Dp], "0 8 | 1 9 | 2 10 | 3 11 | 4 12 | 5 13 | 6 14 | 7 15"),
            (&[Pp], "0|1|2|3|4|5|6|7|8|9|10|11|12|13|14|15"),
            (
                &[Ring, Ulysses],
                "0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15",
            ),
            (
                &[Dp, Ring, Ulysses],
                "0 2 4 6 8 10 12 14 | 1 3 5 7 9 11 13 15",
            ),
            (&[Tp, Dp], "0 1 8 9 | 2 3 10 11 | 4 5 12 13 | 6 7 14 15"),
        ],
    );
    check_invariants(&l);
}

#[test]
fn tp_ulysses_ring_dp_context_first() {
    use Dim::*;
    let l = layout(&cfg_tp(&MeshConfig::default_order(), CF));
    check_coords(
        &l,
        &[
            (Tp, "0101010101010101"),
            (Ring, "0011001100110011"),
            (Ulysses, "0000111100001111"),
            (Dp, "0000000011111111"),
        ],
    );
    check_all_groups(
        &l,
        &[
            (
                &[Ring],
                "0 2 | 1 3 | 4 6 | 5 7 | 8 10 | 9 11 | 12 14 | 13 15",
            ),
            (
                &[Ulysses],
                "0 4 | 1 5 | 2 6 | 3 7 | 8 12 | 9 13 | 10 14 | 11 15",
            ),
        ],
    );
    // Same members as head-first (the sp pair spans the same ranks), different roles inside.
    check_all_groups(
        &l,
        &[
            (
                &[Ulysses, Ring],
                "0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15",
            ),
            (
                &[Dp, Ring, Ulysses],
                "0 2 4 6 8 10 12 14 | 1 3 5 7 9 11 13 15",
            ),
            (
                &[Ulysses, Dp],
                "0 4 8 12 | 1 5 9 13 | 2 6 10 14 | 3 7 11 15",
            ),
        ],
    );
    assert_eq!(
        l.coords(6),
        Coords {
            tp: 0,
            ulysses: 1,
            ring: 1,
            pp: 0,
            dp: 0
        }
    );
    check_invariants(&l);
}

#[test]
fn default_order_with_pp_head_first() {
    use Dim::*;
    let l = layout(&cfg_pp(&MeshConfig::default_order(), HF));
    check_coords(
        &l,
        &[
            (Ulysses, "0101010101010101"),
            (Ring, "0011001100110011"),
            (Dp, "0000111100001111"),
            (Pp, "0000000011111111"),
        ],
    );
    check_all_groups(
        &l,
        &[
            (
                &[Ulysses],
                "0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10 11 | 12 13 | 14 15",
            ),
            (
                &[Ring],
                "0 2 | 1 3 | 4 6 | 5 7 | 8 10 | 9 11 | 12 14 | 13 15",
            ),
            (&[Dp], "0 4 | 1 5 | 2 6 | 3 7 | 8 12 | 9 13 | 10 14 | 11 15"),
            (&[Pp], "0 8 | 1 9 | 2 10 | 3 11 | 4 12 | 5 13 | 6 14 | 7 15"),
            (
                &[Dp, Ring, Ulysses],
                "0 1 2 3 4 5 6 7 | 8 9 10 11 12 13 14 15",
            ),
            (&[Pp, Dp], "0 4 8 12 | 1 5 9 13 | 2 6 10 14 | 3 7 11 15"),
        ],
    );
    check_invariants(&l);
}

#[test]
fn default_order_with_pp_context_first() {
    use Dim::*;
    let l = layout(&cfg_pp(&MeshConfig::default_order(), CF));
    check_coords(
        &l,
        &[
            (Ring, "0101010101010101"),
            (Ulysses, "0011001100110011"),
            (Dp, "0000111100001111"),
            (Pp, "0000000011111111"),
        ],
    );
    check_all_groups(
        &l,
        &[
            (
                &[Ring],
                "0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10 11 | 12 13 | 14 15",
            ),
            (
                &[Ulysses],
                "0 2 | 1 3 | 4 6 | 5 7 | 8 10 | 9 11 | 12 14 | 13 15",
            ),
            (&[Dp], "0 4 | 1 5 | 2 6 | 3 7 | 8 12 | 9 13 | 10 14 | 11 15"),
            (
                &[Ulysses, Dp],
                "0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15",
            ),
        ],
    );
    check_invariants(&l);
}

#[test]
fn llama3_order_with_pp_head_first() {
    use Dim::*;
    let l = layout(&cfg_pp(&MeshConfig::llama3_order(), HF));
    check_coords(
        &l,
        &[
            (Ulysses, "0101010101010101"),
            (Ring, "0011001100110011"),
            (Pp, "0000111100001111"),
            (Dp, "0000000011111111"),
        ],
    );
    check_all_groups(
        &l,
        &[
            (
                &[Ulysses],
                "0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10 11 | 12 13 | 14 15",
            ),
            (&[Pp], "0 4 | 1 5 | 2 6 | 3 7 | 8 12 | 9 13 | 10 14 | 11 15"),
            (&[Dp], "0 8 | 1 9 | 2 10 | 3 11 | 4 12 | 5 13 | 6 14 | 7 15"),
            (
                &[Dp, Ring, Ulysses],
                "0 1 2 3 8 9 10 11 | 4 5 6 7 12 13 14 15",
            ),
        ],
    );
    assert_eq!(l.group_rank(9, &[Ulysses, Ring, Dp]), 5);
    assert_eq!(l.group_index(13, &[Dp, Ring, Ulysses]), 1);
    check_invariants(&l);
}

#[test]
fn llama3_order_with_pp_context_first() {
    use Dim::*;
    let l = layout(&cfg_pp(&MeshConfig::llama3_order(), CF));
    check_coords(
        &l,
        &[
            (Ring, "0101010101010101"),
            (Ulysses, "0011001100110011"),
            (Pp, "0000111100001111"),
            (Dp, "0000000011111111"),
        ],
    );
    check_all_groups(
        &l,
        &[
            (
                &[Ring],
                "0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10 11 | 12 13 | 14 15",
            ),
            (
                &[Ulysses],
                "0 2 | 1 3 | 4 6 | 5 7 | 8 10 | 9 11 | 12 14 | 13 15",
            ),
            (&[Pp], "0 4 | 1 5 | 2 6 | 3 7 | 8 12 | 9 13 | 10 14 | 11 15"),
            (&[Ring, Dp], "0 1 8 9 | 2 3 10 11 | 4 5 12 13 | 6 7 14 15"),
        ],
    );
    // Group ranks follow the mesh order (ring fastest here), not the caller's listing.
    assert_eq!(
        l.group_ranks(0, &[Dp, Ulysses, Ring]),
        vec![0, 1, 2, 3, 8, 9, 10, 11]
    );
    assert_eq!(l.group_rank(2, &[Dp, Ulysses, Ring]), 2);
    assert_eq!(
        l.coords(10),
        Coords {
            tp: 0,
            ulysses: 1,
            ring: 0,
            pp: 0,
            dp: 1
        }
    );
    assert_eq!(
        l.rank_of(&Coords {
            tp: 0,
            ulysses: 1,
            ring: 1,
            pp: 1,
            dp: 1
        })
        .ok(),
        Some(15)
    );
    check_invariants(&l);
}

#[test]
fn invariants_over_many_shapes() {
    let shapes = [
        (1, 1, 1, 1, 1, 1),
        (16, 1, 1, 1, 1, 16),
        (1, 4, 4, 1, 1, 16),
        (2, 3, 2, 1, 2, 24),
        (1, 2, 3, 2, 1, 12),
        (3, 1, 2, 2, 2, 24),
    ];
    let orders = [
        MeshConfig::default_order(),
        MeshConfig::llama3_order(),
        vec![Dim::Dp, Dim::Ring, Dim::Pp, Dim::Tp, Dim::Ulysses],
    ];
    for (tp, ulysses, ring, pp, dp, w) in shapes {
        for order in &orders {
            for placement in [HF, CF] {
                let cfg = MeshConfig {
                    tp,
                    ulysses,
                    ring,
                    pp,
                    dp,
                    order: order.clone(),
                    placement,
                };
                let l = MeshLayout::new(&cfg, w).expect("valid");
                check_invariants(&l);
                // The placement's inner dim comes first in the effective order.
                let pos = |d: Dim| l.order().iter().position(|&o| o == d);
                assert!(pos(placement.inner()) < pos(placement.outer()));
                assert!(l.stride(placement.inner()) <= l.stride(placement.outer()));
            }
        }
    }
}

fn layout_err(cfg: &MeshConfig, world: usize) -> String {
    match MeshLayout::new(cfg, world) {
        Err(e @ Error::Layout(_)) => e.to_string(),
        other => panic!("expected a layout error, got {other:?}"),
    }
}

#[test]
fn zero_degree_is_an_error_naming_the_dim() {
    for dim in Dim::ALL {
        let cfg = MeshConfig::default().with_degree(dim, 0);
        let msg = layout_err(&cfg, 1);
        assert!(msg.contains(&format!("{dim} degree is 0")), "{msg}");
        // Zero is reported even if the world size would also be wrong.
        let msg = layout_err(&cfg, 0);
        assert!(msg.contains(&format!("{dim} degree is 0")), "{msg}");
    }
}

#[test]
fn product_mismatch_is_an_error_with_the_formula() {
    let cfg = MeshConfig::default().with_tp(2).with_ring(4);
    let msg = layout_err(&cfg, 16);
    assert!(
        msg.contains("tp 2 x ulysses 1 x ring 4 x pp 1 x dp 1 = 8"),
        "{msg}"
    );
    assert!(msg.contains("16 ranks"), "{msg}");
    assert!(cfg.validate(8).is_ok());
    let huge = MeshConfig::default().with_tp(usize::MAX).with_dp(2);
    assert!(layout_err(&huge, 16).contains("overflows"));
}

#[test]
fn bad_order_is_an_error() {
    use Dim::*;
    let cases: [(&[Dim], &[&str]); 4] = [
        (
            &[Tp, Ring, Ring, Dp, Pp],
            &["ring appears 2 times", "ulysses is missing"],
        ),
        (&[Tp, Ulysses, Ring, Dp], &["pp is missing"]),
        (&[Tp, Ulysses, Ring, Dp, Pp, Tp], &["tp appears 2 times"]),
        (&[], &["tp is missing", "dp is missing"]),
    ];
    for (order, needles) in cases {
        let cfg = MeshConfig::default().with_order(order);
        let msg = layout_err(&cfg, 1);
        assert!(msg.contains("exactly once"), "{msg}");
        for n in needles {
            assert!(msg.contains(n), "{msg} lacks {n}");
        }
    }
}

#[test]
fn parse_dims_and_placements() {
    use Dim::*;
    for dim in Dim::ALL {
        assert_eq!(dim.to_string().parse::<Dim>().ok(), Some(dim));
    }
    assert_eq!("CP".parse::<Dim>().ok(), Some(Ring));
    assert_eq!("hp".parse::<Dim>().ok(), Some(Ulysses));
    assert_eq!(
        Dim::parse_list(" tp, cp ,pp,dp , ulysses").ok(),
        Some(vec![Tp, Ring, Pp, Dp, Ulysses])
    );
    let err = "sp"
        .parse::<Dim>()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("\"sp\""), "{err}");
    assert!(Dim::parse_list("tp,,dp").is_err());
    for p in [HF, CF] {
        assert_eq!(p.to_string().parse::<Placement>().ok(), Some(p));
    }
    assert_eq!("Context_First".parse::<Placement>().ok(), Some(CF));
    assert_eq!("hf".parse::<Placement>().ok(), Some(HF));
    assert!("ring-first".parse::<Placement>().is_err());
}

#[test]
fn rank_of_out_of_range_and_describe() {
    let l = layout(&cfg_tp(&MeshConfig::default_order(), CF));
    let err = l.rank_of(&Coords {
        ring: 2,
        ..Coords::default()
    });
    assert!(matches!(err, Err(Error::Layout(ref m)) if m.contains("ring coordinate 2")));
    let d = l.describe();
    assert!(
        d.contains("mesh of 16 ranks = tp 2 x ulysses 2 x ring 2 x pp 1 x dp 2"),
        "{d}"
    );
    assert!(d.contains("context-first"), "{d}");
    assert!(
        d.contains("ring groups (8 of 2 ranks): [0, 2] [1, 3]"),
        "{d}"
    );
    assert!(!d.contains("pp groups"), "{d}");
}

/// Every rank builds a `DeviceMesh` and all-gathers its world rank over each communicator: the
/// result must be the expected member list, in group-rank order.
fn check_device_mesh(cfg: &MeshConfig, world: usize) {
    let products: Vec<Vec<Dim>> = vec![
        vec![Dim::Dp, Dim::Ring, Dim::Ulysses],
        vec![Dim::Ring, Dim::Ulysses],
        vec![Dim::Tp, Dim::Dp],
        vec![Dim::Pp, Dim::Dp],
        vec![Dim::Ulysses, Dim::Ring, Dim::Tp],
        Dim::ALL.to_vec(),
    ];
    let expected = MeshLayout::new(cfg, world).expect("valid");
    let gathered =
        |comm: &candle_parallel::Comm, rank: usize| -> candle_parallel::Result<Vec<usize>> {
            let x = Tensor::new(&[rank as u32], &Device::Cpu)?;
            let all = comm.all_gather(&x, 0)?.to_vec1::<u32>()?;
            Ok(all.into_iter().map(|r| r as usize).collect())
        };
    let results = LocalWorld::run(world, |comm| -> candle_parallel::Result<()> {
        let rank = comm.rank();
        let mesh = DeviceMesh::new(cfg, comm)?;
        assert_eq!(mesh.rank(), rank);
        assert_eq!(mesh.coords(), expected.coords(rank));
        for dim in Dim::ALL {
            let c = mesh.comm(dim);
            assert_eq!(c.size(), expected.degree(dim), "{dim} size");
            assert_eq!(c.size(), mesh.size(dim));
            assert_eq!(c.rank(), mesh.coord(dim), "{dim} rank");
            assert_eq!(
                gathered(&c, rank)?,
                expected.group_ranks(rank, &[dim]),
                "{dim} group"
            );
        }
        for dims in &products {
            let c = mesh.group(dims)?;
            let want = expected.group_ranks(rank, dims);
            assert_eq!(c.size(), want.len(), "{dims:?} size");
            assert_eq!(c.rank(), expected.group_rank(rank, dims), "{dims:?} rank");
            assert_eq!(gathered(&c, rank)?, want, "{dims:?} group");
        }
        // Cached: same communicator whatever the listing order.
        let a = mesh.group(&[Dim::Dp, Dim::Ring, Dim::Ulysses])?;
        let b = mesh.group(&[Dim::Ulysses, Dim::Dp, Dim::Ring])?;
        assert!(std::sync::Arc::ptr_eq(&a, &b));
        assert!(matches!(mesh.group(&[]), Err(Error::Layout(_))));
        assert!(matches!(
            mesh.group(&[Dim::Tp, Dim::Tp]),
            Err(Error::Layout(_))
        ));
        Ok(())
    });
    assert_eq!(results.expect("every rank succeeds").len(), world);
}

#[test]
fn device_mesh_16_ranks_both_placements_two_orders() {
    for order in [MeshConfig::default_order(), MeshConfig::llama3_order()] {
        for placement in [HF, CF] {
            check_device_mesh(&cfg_pp(&order, placement), 16);
            check_device_mesh(&cfg_tp(&order, placement), 16);
        }
    }
}

#[test]
fn device_mesh_rejects_a_wrong_world_on_every_rank() {
    let cfg = MeshConfig::default().with_ulysses(2).with_ring(2);
    let outcomes = LocalWorld::new(8).launch_each(|comm| DeviceMesh::new(&cfg, comm).map(|_| ()));
    assert_eq!(outcomes.len(), 8);
    for o in outcomes {
        let msg = o.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("= 4, but the world has 8 ranks"), "{msg}");
    }
}
