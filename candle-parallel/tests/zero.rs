//! ZeRO sharding helpers (`FlatShard`, `ZeroGroups`) on 1 to 4 local ranks against the
//! single-device tensors, on random non-zero data and shapes whose element count does not
//! divide over the ranks (padding) or is smaller than the group:
//! - `take` then `gather` gives back the tensor bit for bit, the chunks tile it in rank order and
//!   the padding is zeros;
//! - `reduce_scatter` (stage 2) gives each rank its chunk of the sum of every rank's gradient,
//!   accumulated in f32 (also from bf16 gradients);
//! - `gather_differentiable` (stage 3) gathers the parameter and sums every rank's gradient of
//!   its chunk into the shard, as the single-device gradient of the summed loss;
//! - `ZeroGroups` cuts the data-parallel ranks into sharding and replica groups, and the hybrid
//!   reduction (reduce-scatter in the sharding group, all-reduce over the replica group) equals
//!   the single-device sum;
//! - a wrong shape, group or sharding size is an error, not a panic.
//!
//! f32 comparisons: `max|a - b| / max|ref|` at most 1e-5 (sums of up to 4 values).

mod common;
use common::{assert_close, grad};
use common::{rand_t, world};

use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::comm::{LocalWorld, ReduceOp};
use candle_parallel::mesh::{DeviceMesh, MeshConfig};
use candle_parallel::optim::{FlatShard, ZeroGroups};
use rand::rngs::StdRng;
use rand::SeedableRng;

const TOL: f64 = 1e-5;
/// Element counts 1 (fewer than the ranks), 10, 12 and 42.
const SHAPES: [&[usize]; 4] = [&[1], &[2, 5], &[3, 4], &[7, 3, 2]];

fn flat_vec(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// The chunks of every rank in rank order, cut back to `numel` elements and shaped `shape`;
/// asserts that each chunk has the same length and that the padding is exactly zero.
fn assemble(chunks: &[Tensor], shape: &[usize], what: &str) -> Tensor {
    let numel: usize = shape.iter().product();
    let all = Tensor::cat(chunks, 0).unwrap();
    let padding = flat_vec(&all)[numel..].to_vec();
    assert!(
        padding.iter().all(|&x| x == 0.0),
        "{what}: padding {padding:?}"
    );
    all.narrow(0, 0, numel).unwrap().reshape(shape).unwrap()
}

#[test]
fn take_and_gather_give_back_the_tensor_exactly() {
    let mut rng = StdRng::seed_from_u64(1);
    for p in 1..=4 {
        for shape in SHAPES {
            let full = rand_t(&mut rng, shape);
            let numel = full.elem_count();
            let ranks = world(p, |comm| {
                let fs = FlatShard::new(numel, comm.rank(), comm.size())?;
                let mine = fs.take(&full)?;
                let back = fs.gather(&mine, &comm, shape)?;
                Ok((fs, mine, back))
            });
            let what = format!("p={p} shape={shape:?}");
            for (r, (fs, mine, back)) in ranks.iter().enumerate() {
                assert_eq!(fs.chunk, numel.div_ceil(p), "{what}");
                assert_eq!(mine.dims(), [fs.chunk], "{what}: rank {r} chunk");
                assert_eq!(back.dims(), shape, "{what}: rank {r} gathered shape");
                assert_eq!(flat_vec(back), flat_vec(&full), "{what}: rank {r}");
            }
            let chunks: Vec<Tensor> = ranks.iter().map(|(_, m, _)| m.clone()).collect();
            let tiled = assemble(&chunks, shape, &what);
            assert_eq!(flat_vec(&tiled), flat_vec(&full), "{what}: chunks");
            let valid: usize = ranks.iter().map(|(fs, _, _)| fs.valid()).sum();
            assert_eq!(valid, numel, "{what}: valid elements");
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_chunk_of_the_sum() {
    let mut rng = StdRng::seed_from_u64(2);
    for p in 1..=4 {
        for shape in SHAPES {
            for dtype in [DType::F32, DType::BF16] {
                // Rank r's gradient; the single-device reference sums them in f32.
                let fulls: Vec<Tensor> = (0..p)
                    .map(|_| rand_t(&mut rng, shape).to_dtype(dtype).unwrap())
                    .collect();
                let mut want = fulls[0].to_dtype(DType::F32).unwrap();
                for f in &fulls[1..] {
                    want = (want + f.to_dtype(DType::F32).unwrap()).unwrap();
                }
                let numel = want.elem_count();
                let chunks = world(p, |comm| {
                    let fs = FlatShard::new(numel, comm.rank(), comm.size())?;
                    Ok(fs.reduce_scatter(&fulls[comm.rank()], &comm)?)
                });
                let what = format!("p={p} shape={shape:?} {dtype:?}");
                for c in &chunks {
                    assert_eq!(c.dtype(), DType::F32, "{what}: accumulated in f32");
                }
                assert_close(&assemble(&chunks, shape, &what), &want, TOL, &what);
            }
        }
    }
}

#[test]
fn gathered_parameter_receives_the_summed_gradient_in_its_shard() {
    let mut rng = StdRng::seed_from_u64(3);
    for p in 1..=4 {
        for shape in SHAPES {
            let w = rand_t(&mut rng, shape);
            // Rank r's loss is Σ w² ⊙ G_r; the global loss is their sum.
            let gs: Vec<Tensor> = (0..p).map(|_| rand_t(&mut rng, shape)).collect();
            let wv = Var::from_tensor(&w).unwrap();
            let mut loss = wv.as_tensor().zeros_like().unwrap().sum_all().unwrap();
            for g in &gs {
                let part = (wv.as_tensor().sqr().unwrap() * g).unwrap().sum_all();
                loss = (loss + part.unwrap()).unwrap();
            }
            let want = grad(&loss.backward().unwrap(), &wv, "reference w").unwrap();
            let numel = w.elem_count();
            let ranks = world(p, |comm| {
                let fs = FlatShard::new(numel, comm.rank(), comm.size())?;
                let shard = Var::from_tensor(&fs.take(&w)?)?;
                let whole = fs.gather_differentiable(shard.as_tensor(), &comm, shape)?;
                let grads = (whole.sqr()? * &gs[comm.rank()])?.sum_all()?.backward()?;
                let g = grads.get(shard.as_tensor()).cloned().ok_or_else(|| {
                    candle_parallel::Error::Layout("test: no gradient for the shard".into())
                })?;
                Ok((whole.detach(), g))
            });
            let what = format!("p={p} shape={shape:?}");
            for (r, (whole, _)) in ranks.iter().enumerate() {
                assert_eq!(flat_vec(whole), flat_vec(&w), "{what}: rank {r} gathered");
            }
            let chunks: Vec<Tensor> = ranks.iter().map(|(_, g)| g.clone()).collect();
            assert_close(&assemble(&chunks, shape, &what), &want, TOL, &what);
        }
    }
}

#[test]
fn hybrid_groups_reduce_to_the_single_device_sum() {
    let mut rng = StdRng::seed_from_u64(4);
    let p = 4;
    let shape: &[usize] = &[3, 5];
    let fulls: Vec<Tensor> = (0..p).map(|_| rand_t(&mut rng, shape)).collect();
    let mut want = fulls[0].clone();
    for f in &fulls[1..] {
        want = (want + f).unwrap();
    }
    // (shard_size, expected shard group size, expected replica group size)
    for (shard_size, z, reps) in [
        (None, 4, 1),
        (Some(4), 4, 1),
        (Some(2), 2, 2),
        (Some(1), 1, 4),
    ] {
        let ranks = world(p, |comm| {
            let mesh = DeviceMesh::new(&MeshConfig::default().with_dp(p), comm)?;
            let zg = ZeroGroups::new(&mesh, shard_size)?;
            let fs = zg.flat_shard(want.elem_count())?;
            let mine = fs.reduce_scatter(&fulls[mesh.rank()], &zg.shard)?;
            let mine = zg.replica.all_reduce(&mine, ReduceOp::Sum)?;
            Ok((zg.shard.size(), zg.replica.size(), zg.replica.rank(), mine))
        });
        let what = format!("shard_size {shard_size:?}");
        for (r, (s, rep, _, _)) in ranks.iter().enumerate() {
            assert_eq!((*s, *rep), (z, reps), "{what}: rank {r} group sizes");
        }
        // Each sharding group (one per replica rank) holds the whole sum in its chunks.
        for group in 0..reps {
            let chunks: Vec<Tensor> = ranks
                .iter()
                .filter(|(_, _, g, _)| *g == group)
                .map(|(_, _, _, c)| c.clone())
                .collect();
            assert_eq!(chunks.len(), z, "{what}: sharding group {group}");
            let got = assemble(&chunks, shape, &what);
            assert_close(&got, &want, TOL, &format!("{what}: group {group}"));
        }
    }
}

#[test]
fn bad_input_is_an_error() {
    // Construction.
    assert!(FlatShard::new(10, 0, 0).is_err());
    assert!(FlatShard::new(10, 2, 2).is_err());
    let fs = FlatShard::new(10, 0, 2).unwrap();
    let eight = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
    assert!(fs.take(&eight).is_err());
    // Shapes and groups, detected before any communication (alike on every rank).
    let outcomes = LocalWorld::new(2)
        .with_timeout(Duration::from_secs(60))
        .launch_each(|comm| -> candle_parallel::Result<()> {
            let fs = FlatShard::new(10, comm.rank(), 2)?;
            let zeros = |n: usize| Tensor::zeros(n, DType::F32, &Device::Cpu);
            let expect_err = |r: candle_parallel::Result<Tensor>, what: &str| match r {
                Err(e) if !e.to_string().is_empty() => Ok(()),
                _ => Err(candle_parallel::Error::Layout(format!(
                    "test: {what}: no error"
                ))),
            };
            expect_err(
                fs.gather(&zeros(4)?, &comm, &[10]),
                "gather of a short shard",
            )?;
            let s = zeros(5)?;
            expect_err(
                fs.gather_differentiable(&zeros(6)?, &comm, &[10]),
                "long shard",
            )?;
            expect_err(fs.reduce_scatter(&zeros(9)?, &comm), "reduce_scatter of 9")?;
            // A shard made for a group of one, used on the group of two.
            let solo = FlatShard::new(10, 0, 1)?;
            expect_err(
                solo.gather(&zeros(10)?, &comm, &[10]),
                "gather on a wrong group",
            )?;
            expect_err(
                solo.reduce_scatter(&zeros(10)?, &comm),
                "reduce on a wrong group",
            )?;
            // The right group and shapes still work after the errors.
            let whole = fs.gather(&s, &comm, &[2, 5])?;
            assert_eq!(whole.dims(), [2, 5]);
            // Sharding sizes that do not divide the 2 data-parallel ranks.
            let mesh = DeviceMesh::new(&MeshConfig::default().with_dp(2), comm)?;
            for bad in [Some(0), Some(3)] {
                if ZeroGroups::new(&mesh, bad).is_ok() {
                    return Err(candle_parallel::Error::Layout(format!(
                        "test: shard size {bad:?} accepted"
                    )));
                }
            }
            Ok(())
        });
    for o in outcomes {
        o.unwrap();
    }
}

/// `ZeroGroups::with_experts` on 8 ranks (dp 8, and ring 2 x dp 4): with a sharding group of
/// `z` ranks and expert parallelism of `ep`, each rank's expert sharding group holds only ranks
/// with its experts (the same position in their expert-parallel group) and in its dense
/// sharding group, `max(1, z / ep)` of them; its replica group holds ranks with its experts at
/// the same position of their sharding groups, and the two together are every rank holding
/// its experts; the norm group is the sharding group times the expert-parallel group (the dense
/// sharding group when `ep` divides `z`, the expert-parallel group when `z` divides `ep`).
/// Without `--zero-group` (z = all 8) the experts are sharded over every rank holding them.
/// Sizes that do not divide one another are refused.
#[test]
fn expert_zero_groups_shard_each_expert_inside_a_dense_sharding_group() {
    use candle_parallel::attention::{SpConfig, Strategy};
    use candle_parallel::nn::TpActivations;
    use candle_parallel::plan::Layout;
    let members = |c: &candle_parallel::comm::Comm, me: usize| -> Vec<usize> {
        let t = Tensor::new(&[me as u32], &Device::Cpu).unwrap();
        let all = c.all_gather(&t, 0).unwrap().to_vec1::<u32>().unwrap();
        all.into_iter().map(|r| r as usize).collect()
    };
    let meshes = [
        (
            MeshConfig::new().with_dp(8),
            SpConfig::new(Strategy::Ring, 1, 1),
        ),
        (
            MeshConfig::new().with_ring(2).with_dp(4),
            SpConfig::new(Strategy::Ring, 1, 2),
        ),
        (
            MeshConfig::new().with_tp(2).with_dp(4),
            SpConfig::new(Strategy::Ring, 1, 1),
        ),
    ];
    for (mesh_cfg, sp) in meshes {
        let tokens = 8 / mesh_cfg.degree(candle_parallel::mesh::Dim::Tp);
        let cases = [
            (2, Some(4)),
            (2, Some(2)),
            (4, Some(2)),
            (2, None),
            (4, Some(8)),
        ];
        for (ep, z) in cases.into_iter().filter(|c| c.1.unwrap_or(0) <= tokens) {
            let what = format!("{mesh_cfg:?} ep {ep} zero group {z:?}");
            let got = world(8, |comm| {
                let me = comm.rank();
                let plan = Layout::new(mesh_cfg.clone(), sp.clone(), TpActivations::Replicated)
                    .with_expert_parallel(ep);
                let (mesh, ctx) = plan.context(comm).map_err(candle_core::Error::wrap)?;
                let groups = ZeroGroups::new(&mesh, z)
                    .and_then(|g| g.with_experts(&mesh, ctx.expert_groups()))
                    .map_err(candle_core::Error::wrap)?;
                let e = groups.experts.clone().expect("expert groups");
                let ex = ctx.expert_groups().expect("ep").clone();
                Ok((
                    members(&groups.shard, me),
                    members(&ex.ep, me),
                    members(&ex.replicas, me),
                    members(&e.shard, me),
                    members(&e.replica, me),
                    members(&e.norm, me),
                    members(&e.norm_tp, me),
                    members(&mesh.comm(candle_parallel::mesh::Dim::Tp), me),
                ))
            });
            let z = z.unwrap_or(tokens);
            for (me, (dense, ep_group, holders, shard, replica, norm, norm_tp, _)) in
                got.iter().enumerate()
            {
                let what = format!("{what}, rank {me}");
                let inside = |g: &[usize], of: &[usize]| g.iter().all(|r| of.contains(r));
                assert_eq!(dense.len(), z, "{what}");
                assert_eq!(shard.len(), (z / ep).max(1), "{what}: shard {shard:?}");
                assert!(
                    inside(shard, holders) && inside(shard, dense),
                    "{what}: {shard:?}"
                );
                assert!(inside(replica, holders), "{what}: replica {replica:?}");
                assert_eq!(shard.len() * replica.len(), holders.len(), "{what}");
                // My replica group: the ranks at my position of their sharding groups.
                let pos = shard.iter().position(|&r| r == me).unwrap();
                for r in replica {
                    let theirs = &got[*r].3;
                    assert_eq!(theirs.iter().position(|x| x == r), Some(pos), "{what}");
                }
                // The norm group: my shard's ranks' expert-parallel groups, together.
                let mut want: Vec<usize> = shard.iter().flat_map(|&r| got[r].1.clone()).collect();
                want.sort_unstable();
                let mut norm = norm.clone();
                norm.sort_unstable();
                assert_eq!(norm, want, "{what}: norm");
                // norm_tp: the norm group's ranks with their tensor-parallel groups.
                let mut want_tp: Vec<usize> = norm.iter().flat_map(|&r| got[r].7.clone()).collect();
                want_tp.sort_unstable();
                let mut norm_tp = norm_tp.clone();
                norm_tp.sort_unstable();
                assert_eq!(norm_tp, want_tp, "{what}: norm_tp");
                if z % ep == 0 {
                    let mut d = dense.clone();
                    d.sort_unstable();
                    assert_eq!(norm, d, "{what}: norm is the dense sharding group");
                } else {
                    let mut g = ep_group.clone();
                    g.sort_unstable();
                    assert_eq!(norm, g, "{what}: norm is the expert-parallel group");
                }
            }
        }
    }
    // Neither divides the other: 6 ranks, ep 2, sharding groups of 3.
    let err = LocalWorld::new(6)
        .with_timeout(Duration::from_secs(60))
        .launch(|comm| {
            let plan = Layout::new(
                MeshConfig::new().with_dp(6),
                candle_parallel::attention::SpConfig::new(
                    candle_parallel::attention::Strategy::Ring,
                    1,
                    1,
                ),
                candle_parallel::nn::TpActivations::Replicated,
            )
            .with_expert_parallel(2);
            let (mesh, ctx) = plan.context(comm)?;
            ZeroGroups::new(&mesh, Some(3))?.with_experts(&mesh, ctx.expert_groups())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("one must divide the other"), "{err}");
}
