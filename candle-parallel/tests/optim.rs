//! AdamW (fp32 master weights), gradient clipping across ranks and LR schedules.
//!
//! The reference is `tests/fixtures/optim/adamw.safetensors`, written by
//! `scripts/make_optim_fixture.py` (torch.optim.AdamW + clip_grad_norm_ + transformers'
//! get_cosine_schedule_with_warmup, in float64).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::optim::{
    clip_coefficient, clip_grad_norm, decays, global_grad_norm, to_f32, AdamW, AdamWConfig, Decay,
    LrSchedule, OptimParam,
};
use candle_parallel::{Comm, LocalWorld};

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;
type Grads = Vec<(String, Tensor)>;

/// Sorted, as the optimizer keeps them.
const NAMES: [&str; 3] = ["head.weight", "norm.weight", "proj.weight"];
const STEPS: usize = 3;

fn fixture() -> HashMap<String, Tensor> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/optim/adamw.safetensors"
    );
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{path}: {e} (rerun scripts/make_optim_fixture.py)"))
}

fn fixture_cfg() -> (AdamWConfig, LrSchedule) {
    let cfg = AdamWConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let sched = LrSchedule {
        peak_lr: 1e-2,
        min_lr: 0.0,
        warmup_steps: 1,
        total_steps: 10,
        decay: Decay::Cosine,
    };
    (cfg, sched)
}

fn no_shard(_: &str) -> Option<Comm> {
    None
}

/// Fresh `Var`s holding the fixture's initial parameters, in `dtype`.
fn fixture_params(fx: &HashMap<String, Tensor>, dtype: DType) -> Res<Vec<OptimParam>> {
    NAMES
        .iter()
        .map(|n| {
            let t = fx[&format!("init.{n}")].to_dtype(dtype)?;
            Ok(OptimParam::new(*n, Var::from_tensor(&t)?))
        })
        .collect()
}

fn fixture_grads(fx: &HashMap<String, Tensor>, step: usize) -> Vec<(String, Tensor)> {
    NAMES
        .iter()
        .map(|n| (n.to_string(), fx[&format!("grad.{step}.{n}")].clone()))
        .collect()
}

/// One training step as a trainer runs it: schedule, clip (max norm 1), AdamW.
fn train_step(
    opt: &mut AdamW,
    sched: &LrSchedule,
    fx: &HashMap<String, Tensor>,
    step: usize,
) -> Res<(f64, f64)> {
    let lr = sched.lr(opt.step_count());
    let mut grads = fixture_grads(fx, step);
    let norm = clip_grad_norm(&mut grads, 1.0, &no_shard)?;
    opt.step(&grads, lr)?;
    Ok((lr, norm))
}

fn rel_err(a: &Tensor, b: &Tensor) -> Res<f64> {
    Ok(testkit::rel_err(a, b))
}

fn bits(t: &Tensor) -> Res<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

#[test]
fn matches_torch_adamw_with_clipping_and_cosine_schedule() -> Res<()> {
    let fx = fixture();
    let (cfg, sched) = fixture_cfg();
    let params = fixture_params(&fx, DType::F32)?;
    let flags: Vec<bool> = params.iter().map(|p| p.weight_decay).collect();
    assert_eq!(flags, [true, false, true], "2-D params decay, 1-D do not");
    let vars: Vec<Var> = params.iter().map(|p| p.var.clone()).collect();
    let mut opt = AdamW::new(params, cfg)?;
    let ref_lr = fx["lr"].to_vec1::<f64>()?;
    let ref_norm = fx["grad_norm"].to_vec1::<f64>()?;
    assert!(
        ref_norm[0] > 1.0 && ref_norm[1] < 1.0 && ref_norm[2] > 1.0,
        "fixture must clip on steps 0 and 2 only: {ref_norm:?}"
    );
    for s in 0..STEPS {
        let (lr, norm) = train_step(&mut opt, &sched, &fx, s)?;
        assert!(
            (lr - ref_lr[s]).abs() <= 1e-12 * ref_lr[s].abs(),
            "step {s}: lr {lr} vs torch {}",
            ref_lr[s]
        );
        let norm_err = (norm - ref_norm[s]).abs() / ref_norm[s];
        assert!(norm_err <= 1e-5, "step {s}: norm {norm} vs {}", ref_norm[s]);
        assert_eq!(opt.step_count(), s as u64 + 1);
        for (n, var) in NAMES.iter().zip(&vars) {
            let err = rel_err(var.as_tensor(), &fx[&format!("param.{s}.{n}")])?;
            eprintln!("step {s}, {n}: rel err {err:.2e}, norm err {norm_err:.2e}");
            assert!(err <= 1e-5, "step {s}, {n}: rel err {err:e}");
        }
    }
    // Step 0 runs with lr 0 (transformers' warmup starts at 0): the params must not have moved.
    assert_eq!(ref_lr[0], 0.0);
    Ok(())
}

#[test]
fn schedules_match_transformers() {
    // transformers 5.23 get_{cosine,linear,constant}_schedule_with_warmup(warmup 3, total 10),
    // base lr 3e-4: optimizer.param_groups[0]["lr"] before each of 11 optimizer steps.
    let cosine = [
        0.0,
        9.999999999999999e-05,
        0.00019999999999999998,
        0.0003,
        0.0002851453301853628,
        0.00024352347027881003,
        0.00018337814009344714,
        0.00011662185990655284,
        5.6476529721189974e-05,
        1.4854669814637143e-05,
        0.0,
    ];
    let linear = [
        0.0,
        9.999999999999999e-05,
        0.00019999999999999998,
        0.0003,
        0.0002571428571428571,
        0.00021428571428571427,
        0.0001714285714285714,
        0.00012857142857142855,
        8.57142857142857e-05,
        4.285714285714285e-05,
        0.0,
    ];
    let constant = [
        0.0,
        9.999999999999999e-05,
        0.00019999999999999998,
        0.0003,
        0.0003,
        0.0003,
        0.0003,
        0.0003,
        0.0003,
        0.0003,
        0.0003,
    ];
    for (decay, expect) in [
        (Decay::Cosine, cosine),
        (Decay::Linear, linear),
        (Decay::Constant, constant),
    ] {
        let s = LrSchedule {
            peak_lr: 3e-4,
            min_lr: 0.0,
            warmup_steps: 3,
            total_steps: 10,
            decay,
        };
        for (step, want) in expect.iter().enumerate() {
            let got = s.lr(step as u64);
            assert!(
                (got - want).abs() <= 1e-12 * want.abs(),
                "{decay:?} step {step}: {got} vs transformers {want}"
            );
        }
        // Past the end: linear/cosine hold min_lr (transformers' cosine would rise again).
        let floor = LrSchedule { min_lr: 1e-5, ..s };
        let end = if decay == Decay::Constant { 3e-4 } else { 1e-5 };
        for step in [10, 11, 25] {
            assert!(
                (floor.lr(step) - end).abs() < 1e-18,
                "{decay:?} step {step}"
            );
        }
    }
}

#[test]
fn bf16_params_keep_f32_master_weights() -> Res<()> {
    let dev = Device::Cpu;
    // Values exactly representable in bf16.
    let init = Tensor::new(
        &[[0.75f32, 1.0, 1.25, 1.5], [-0.75, -1.0, -1.25, -1.5]],
        &dev,
    )?
    .to_dtype(DType::BF16)?;
    let var = Var::from_tensor(&init)?;
    let param = OptimParam {
        name: "w".into(),
        var: var.clone(),
        weight_decay: false,
    };
    let cfg = AdamWConfig {
        weight_decay: 0.0,
        ..Default::default()
    };
    let mut opt = AdamW::new(vec![param], cfg)?;
    let lr = 1e-4;
    // A pure-bf16 update of this size rounds back to the same value: it would stall.
    let pure = init.affine(1.0, -lr)?;
    assert_eq!(
        bits(&pure)?,
        bits(&init)?,
        "bf16 p - 1e-4 should round to p"
    );
    let grad = Tensor::full(0.5f32, (2, 4), &dev)?.to_dtype(DType::BF16)?;
    for _ in 0..100 {
        opt.step(&[("w".to_string(), grad.clone())], lr)?;
    }
    let state: HashMap<String, Tensor> = opt.state_tensors()?.into_iter().collect();
    let master = &state["master.w"];
    assert_eq!(master.dtype(), DType::F32);
    // The master moved by about 100 * lr (Adam's normalised step is about lr per step).
    let moved = (master - init.to_dtype(DType::F32)?)?.to_vec2::<f32>()?;
    for row in &moved {
        for &d in row {
            assert!((-0.0101..=-0.0095).contains(&d), "master moved by {d}");
        }
    }
    assert_eq!(var.dtype(), DType::BF16);
    assert_eq!(
        bits(var.as_tensor())?,
        bits(&master.to_dtype(DType::BF16)?)?,
        "the bf16 param is the master cast to bf16"
    );
    let moved =
        testkit::values(&(var.as_tensor().to_dtype(DType::F32)? - init.to_dtype(DType::F32)?)?);
    assert!(
        moved.iter().all(|x| x.abs() > 0.0),
        "every bf16 param element moved (and none is NaN)"
    );
    Ok(())
}

/// Deterministic test values in [-2, 2).
fn pattern(shape: (usize, usize), seed: u32) -> Res<Tensor> {
    let n = shape.0 * shape.1;
    let v: Vec<f32> = (0..n as u32)
        .map(|i| {
            let x = (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 4096;
            x as f32 / 1024.0 - 2.0
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Full gradients: `a` (8, 6) sharded along dim 0, `c` (4, 8) sharded along dim 1, `b` (6)
/// replicated.
fn full_grads() -> Res<Vec<(String, Tensor)>> {
    Ok(vec![
        ("a".to_string(), pattern((8, 6), 1)?),
        ("b".to_string(), pattern((1, 6), 2)?.reshape(6)?),
        ("c".to_string(), pattern((4, 8), 3)?),
    ])
}

/// This shard's gradients (in an order that depends on the rank, which must not matter).
fn shard_grads(full: &[(String, Tensor)], rank: usize, p: usize) -> Res<Vec<(String, Tensor)>> {
    let a = full[0].1.narrow(0, rank * 8 / p, 8 / p)?;
    let c = full[2].1.narrow(1, rank * 8 / p, 8 / p)?;
    let mut g = vec![
        ("c".to_string(), c),
        ("a".to_string(), a),
        ("b".to_string(), full[1].1.clone()),
    ];
    if rank % 2 == 1 {
        g.reverse();
    }
    Ok(g)
}

/// Compares a rank's clipped shards with the slices of the single-rank clipped tensors.
fn check_clipped(
    got: &[(String, Tensor)],
    full: &[(String, Tensor)],
    rank: usize,
    p: usize,
) -> Res<()> {
    for (name, g) in got {
        let want = match name.as_str() {
            "a" => full[0].1.narrow(0, rank * 8 / p, 8 / p)?,
            "b" => full[1].1.clone(),
            _ => full[2].1.narrow(1, rank * 8 / p, 8 / p)?,
        };
        let err = rel_err(g, &want)?;
        assert!(
            err <= 1e-6,
            "rank {rank}/{p}, {name}: clipped rel err {err:e}"
        );
    }
    Ok(())
}

#[test]
fn global_norm_and_clip_across_ranks() -> Res<()> {
    let full = full_grads()?;
    let norm_full = global_grad_norm(&full, &no_shard)?;
    let expect = {
        let mut s = 0.0f64;
        for (_, g) in &full {
            for v in g.flatten_all()?.to_vec1::<f32>()? {
                s += (v as f64) * (v as f64);
            }
        }
        s.sqrt()
    };
    assert!((norm_full - expect).abs() <= 1e-12 * expect);
    let max_norm = norm_full / 3.0;
    let mut clipped_full = full.clone();
    let pre = clip_grad_norm(&mut clipped_full, max_norm, &no_shard)?;
    assert_eq!(pre, norm_full);
    let after = global_grad_norm(&clipped_full, &no_shard)?;
    assert!(
        (after - max_norm).abs() <= 1e-5 * max_norm,
        "{after} vs {max_norm}"
    );

    for p in [2usize, 4] {
        let out = LocalWorld::run(p, |comm| -> Res<(f64, f64, Grads)> {
            let r = comm.rank();
            let shard = |n: &str| (n != "b").then(|| comm.clone());
            let mut g = shard_grads(&full, r, p)?;
            let norm = global_grad_norm(&g, &shard)?;
            let pre = clip_grad_norm(&mut g, max_norm, &shard)?;
            Ok((norm, pre, g))
        })
        .map_err(|e| e.to_string())?;
        for (r, (norm, pre, g)) in out.iter().enumerate() {
            for v in [norm, pre] {
                let err = (v - norm_full).abs() / norm_full;
                assert!(err <= 1e-6, "world {p}, rank {r}: norm {v} vs {norm_full}");
            }
            check_clipped(g, &clipped_full, r, p)?;
        }
    }
    Ok(())
}

#[test]
fn global_norm_with_tensor_parallel_subgroups() -> Res<()> {
    // 4 ranks = 2 data-parallel replicas x 2 tensor-parallel shards: sharded params are reduced
    // over the tp group only, replicated params are counted once.
    let full = full_grads()?;
    let norm_full = global_grad_norm(&full, &no_shard)?;
    let out = LocalWorld::run(4, |comm| -> Res<f64> {
        let tp = comm.split(comm.rank() / 2, comm.rank())?;
        let g = shard_grads(&full, tp.rank(), tp.size())?;
        let shard = |n: &str| (n != "b").then(|| tp.clone());
        Ok(global_grad_norm(&g, &shard)?)
    })
    .map_err(|e| e.to_string())?;
    for (r, norm) in out.iter().enumerate() {
        let err = (norm - norm_full).abs() / norm_full;
        assert!(err <= 1e-6, "rank {r}: norm {norm} vs {norm_full}");
    }
    Ok(())
}

#[test]
fn state_round_trip_is_bit_identical() -> Res<()> {
    let fx = fixture();
    let (cfg, sched) = fixture_cfg();
    for dtype in [DType::F32, DType::BF16] {
        // Uninterrupted: 3 steps.
        let params = fixture_params(&fx, dtype)?;
        let vars: Vec<Var> = params.iter().map(|p| p.var.clone()).collect();
        let mut full = AdamW::new(params, cfg)?;
        for s in 0..STEPS {
            train_step(&mut full, &sched, &fx, s)?;
        }

        // 2 steps, checkpoint through a safetensors file.
        let mut first = AdamW::new(fixture_params(&fx, dtype)?, cfg)?;
        for s in 0..2 {
            train_step(&mut first, &sched, &fx, s)?;
        }
        let state: HashMap<String, Tensor> = first.state_tensors()?.into_iter().collect();
        assert_eq!(state.len(), 3 * NAMES.len());
        for n in NAMES {
            for k in ["exp_avg", "exp_avg_sq", "master"] {
                assert_eq!(state[&format!("{k}.{n}")].dtype(), DType::F32);
            }
        }
        let path = std::env::temp_dir().join(format!(
            "cpl_optim_state_{}_{dtype:?}.safetensors",
            std::process::id()
        ));
        candle_core::safetensors::save(&state, &path)?;
        let loaded = candle_core::safetensors::load(&path, &Device::Cpu)?;
        std::fs::remove_file(&path)?;

        // Fresh optimizer on fresh (initial) params, restored, then step 3.
        let params = fixture_params(&fx, dtype)?;
        let resumed_vars: Vec<Var> = params.iter().map(|p| p.var.clone()).collect();
        let mut resumed = AdamW::new(params, cfg)?;
        resumed.load_state(&loaded, first.step_count())?;
        assert_eq!(resumed.step_count(), 2);
        train_step(&mut resumed, &sched, &fx, 2)?;

        for ((n, a), b) in NAMES.iter().zip(&vars).zip(&resumed_vars) {
            assert_eq!(b.dtype(), dtype);
            assert_eq!(
                bits(a.as_tensor())?,
                bits(b.as_tensor())?,
                "{dtype:?} {n}: resumed params differ"
            );
        }
        for ((ka, ta), (kb, tb)) in full.state_tensors()?.iter().zip(resumed.state_tensors()?) {
            assert_eq!(ka, &kb);
            assert_eq!(
                bits(ta)?,
                bits(&tb)?,
                "{dtype:?} {ka}: resumed state differs"
            );
        }
    }
    Ok(())
}

#[test]
fn errors_name_the_parameter() -> Res<()> {
    let fx = fixture();
    let (cfg, _) = fixture_cfg();
    let params = fixture_params(&fx, DType::F32)?;
    let norm_var = params[1].var.clone();
    let mut opt = AdamW::new(params, cfg)?;
    let before = bits(norm_var.as_tensor())?;

    let mut grads = fixture_grads(&fx, 0);
    grads.retain(|(n, _)| n != "norm.weight");
    let e = opt.step(&grads, 1e-3).unwrap_err().to_string();
    assert!(e.contains("norm.weight"), "{e}");

    let mut grads = fixture_grads(&fx, 0);
    grads[2].1 = grads[2].1.t()?; // proj.weight (8, 6) -> (6, 8)
    let e = opt.step(&grads, 1e-3).unwrap_err().to_string();
    assert!(e.contains("proj.weight") && e.contains("shape"), "{e}");

    let mut grads = fixture_grads(&fx, 0);
    grads.push(("ghost.weight".into(), grads[0].1.clone()));
    let e = opt.step(&grads, 1e-3).unwrap_err().to_string();
    assert!(e.contains("ghost.weight"), "{e}");

    // Nothing was updated by the failed steps.
    assert_eq!(opt.step_count(), 0);
    assert_eq!(bits(norm_var.as_tensor())?, before);

    // Restoring: a missing and a mis-shaped entry name themselves.
    opt.step(&fixture_grads(&fx, 0), 1e-3)?;
    let state: HashMap<String, Tensor> = opt.state_tensors()?.into_iter().collect();
    let mut missing = state.clone();
    missing.remove("exp_avg_sq.head.weight");
    let e = opt.load_state(&missing, 1).unwrap_err().to_string();
    assert!(e.contains("exp_avg_sq.head.weight"), "{e}");
    let mut bad = state.clone();
    bad.insert(
        "master.proj.weight".into(),
        Tensor::zeros((6, 8), DType::F32, &Device::Cpu)?,
    );
    let e = opt.load_state(&bad, 1).unwrap_err().to_string();
    assert!(e.contains("master.proj.weight"), "{e}");
    opt.load_state(&state, 1)?;

    // Duplicate parameters and nonsense hyper-parameters are rejected at construction.
    let dup = vec![
        OptimParam::new("x", norm_var.clone()),
        OptimParam::new("x", norm_var.clone()),
    ];
    let e = AdamW::new(dup, cfg).err().expect("duplicate").to_string();
    assert!(e.contains("`x`"), "{e}");
    let bad_cfg = AdamWConfig { beta2: 1.0, ..cfg };
    assert!(AdamW::new(Vec::new(), bad_cfg).is_err());
    Ok(())
}

#[test]
fn defaults_and_decay_rule() {
    assert_eq!(
        AdamWConfig::default(),
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    );
    assert!(decays("layers.0.mlp.up.weight", &[64, 32]));
    assert!(decays("embed_tokens.weight", &[256, 32]));
    assert!(!decays("layers.0.input_layernorm.weight", &[32]));
    assert!(!decays("lm_head.bias", &[256]));
    assert!(!decays("scale", &[]));
}

/// The step reads a contiguous f32 gradient in place and writes an f32 parameter in place; a
/// strided or bf16 gradient is converted first. Every form of the same values gives the same
/// bits, the `Var` (and every tensor sharing its buffer) holds the master weights, and the
/// parameter's shape and dtype are unchanged.
#[test]
fn gradient_forms_give_the_same_update_and_the_var_is_written_in_place() -> Res<()> {
    let dev = Device::Cpu;
    let init = Tensor::new(&[[0.5f32, -1.0, 2.0], [0.25, 3.0, -0.75]], &dev)?;
    // Gradient values exact in bf16, so every form below holds the same numbers.
    let g = Tensor::new(&[[0.5f32, -0.25, 1.5], [2.0, -1.0, 0.125]], &dev)?;
    let forms = [
        g.clone(),
        g.t()?.contiguous()?.t()?, // strided view
        g.to_dtype(DType::BF16)?,
    ];
    let mut results = Vec::new();
    for grad in &forms {
        let var = Var::from_tensor(&init)?;
        let alias = var.as_tensor().clone(); // shares the Var's buffer
        let param = OptimParam {
            name: "w".into(),
            var: var.clone(),
            weight_decay: true,
        };
        let mut opt = AdamW::new(vec![param], AdamWConfig::default())?;
        for _ in 0..3 {
            opt.step(&[("w".to_string(), grad.clone())], 1e-2)?;
        }
        let state: HashMap<String, Tensor> = opt.state_tensors()?.into_iter().collect();
        assert_eq!(bits(var.as_tensor())?, bits(&state["master.w"])?);
        assert_eq!(bits(&alias)?, bits(var.as_tensor())?, "written in place");
        assert_eq!(var.dims(), &[2, 3]);
        assert_eq!(var.dtype(), DType::F32);
        assert_ne!(
            bits(var.as_tensor())?,
            bits(&init)?,
            "the step moved the weights"
        );
        results.push(bits(var.as_tensor())?);
    }
    assert_eq!(results[0], results[1], "strided gradient");
    assert_eq!(results[0], results[2], "bf16 gradient");
    Ok(())
}

/// The global norm's squared sums, for every dtype and layout a gradient comes in: against a
/// float64 sum (1e-12 relative: each square is exact in f64, the sums differ only in their
/// order), on tensors long enough for several of the parallel blocks (with a ragged end), and
/// the same bits on 1 and 3 threads.
#[test]
fn global_norm_of_every_dtype_and_layout_matches_float64_on_any_thread_count() -> Res<()> {
    let n = 3 * (1 << 15) + 123;
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618).sin() * (1.0 + (i % 7) as f32))
        .collect();
    let base = Tensor::from_vec(v, (n / 3, 3), &Device::Cpu)?;
    let cases: Vec<(&str, Tensor)> = vec![
        ("f32", base.clone()),
        ("bf16", base.to_dtype(DType::BF16)?),
        ("f16", base.to_dtype(DType::F16)?),
        ("f64", base.to_dtype(DType::F64)?),
        // A transposed view and a narrowed one: not contiguous from their buffer's start.
        ("f32 transposed", base.t()?),
        (
            "bf16 narrowed",
            base.to_dtype(DType::BF16)?.narrow(0, 5, 1000)?,
        ),
    ];
    for (what, g) in cases {
        let want = {
            let mut s = 0.0f64;
            for x in g.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()? {
                s += x * x;
            }
            s.sqrt()
        };
        let grads = vec![("w".to_string(), g)];
        let on = |threads: usize| -> Res<f64> {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()?;
            Ok(pool.install(|| global_grad_norm(&grads, &no_shard))?)
        };
        let (one, three) = (on(1)?, on(3)?);
        assert!(
            (one - want).abs() <= 1e-12 * want,
            "{what}: {one} vs float64 {want}"
        );
        assert_eq!(one.to_bits(), three.to_bits(), "{what}: 1 vs 3 threads");
    }
    Ok(())
}

/// Clipping scales each gradient as candle's `affine(coef, 0.0)` does (bf16/f16 through f32),
/// bit for bit, on gradients long enough for several of the parallel blocks, with negative
/// zeros (which `+ 0.0` turns positive), and on a transposed view (candle's own path).
#[test]
fn clipping_scales_every_dtype_and_layout_as_candle_affine() -> Res<()> {
    let n = 7 * 14_100;
    let v: Vec<f32> = (0..n)
        .map(|i| match i % 11 {
            0 => -0.0,
            _ => ((i as f32) * 0.377).cos() * 3.0,
        })
        .collect();
    let base = Tensor::from_vec(v, (n / 7, 7), &Device::Cpu)?;
    let mut grads: Grads = vec![
        ("a.f32".to_string(), base.clone()),
        ("b.bf16".to_string(), base.to_dtype(DType::BF16)?),
        ("c.f16".to_string(), base.to_dtype(DType::F16)?),
        ("d.transposed".to_string(), base.t()?),
    ];
    let before = grads.clone();
    let norm = global_grad_norm(&grads, &no_shard)?;
    let max_norm = norm / 3.0;
    clip_grad_norm(&mut grads, max_norm, &no_shard)?;
    let coef = max_norm / (norm + 1e-6);
    for ((name, got), (_, g)) in grads.iter().zip(&before) {
        let want = match g.dtype() {
            DType::BF16 | DType::F16 => g
                .to_dtype(DType::F32)?
                .affine(coef, 0.0)?
                .to_dtype(g.dtype())?,
            _ => g.affine(coef, 0.0)?,
        };
        assert_eq!(got.dtype(), g.dtype(), "{name}");
        assert_eq!(got.dims(), g.dims(), "{name}");
        assert_eq!(bits(got)?, bits(&want)?, "{name}");
    }
    Ok(())
}

/// `step_clipped` (the trainer's path: the clipping applied as the optimizer reads the
/// gradients, in one pass with the update and the parameter's write) gives the bits of
/// `clip_grad_norm` followed by `step`, for f32, bf16 and f16 parameters and gradients, clipped
/// and not, with negative zeros in the gradients, over several of the update's parallel chunks
/// with a ragged end, and on a transposed gradient (which takes the unfused path): the
/// parameter, its master weights and both moments after 3 steps.
#[test]
fn clipped_step_in_one_pass_equals_clip_then_step_bit_for_bit() -> Res<()> {
    let (rows, cols) = (3 * (1 << 14) / 8 + 11, 8);
    let n = rows * cols;
    let wave = |phase: f32, scale: f32| -> Res<Tensor> {
        let v: Vec<f32> = (0..n)
            .map(|i| match i % 13 {
                0 => -0.0,
                _ => ((i as f32) * 0.377 + phase).sin() * scale,
            })
            .collect();
        Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
    };
    let init = wave(0.3, 0.5)?;
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    for p_dtype in dtypes {
        for g_dtype in dtypes {
            for transposed in [false, true] {
                for max_norm in [Some(1.0), Some(1e9), None] {
                    let what = format!(
                        "param {p_dtype:?}, grad {g_dtype:?}, transposed {transposed}, \
                         max_norm {max_norm:?}"
                    );
                    let make = || -> Res<(Var, AdamW)> {
                        let var = Var::from_tensor(&init.to_dtype(p_dtype)?)?;
                        let param = OptimParam::new("w.weight", var.clone());
                        Ok((var, AdamW::new(vec![param], AdamWConfig::default())?))
                    };
                    let (var_a, mut fused) = make()?;
                    let (var_b, mut reference) = make()?;
                    for step in 0..3 {
                        let g = wave(1.0 + step as f32, 40.0)?.to_dtype(g_dtype)?;
                        let g = if transposed {
                            g.t()?.contiguous()?.t()?
                        } else {
                            g
                        };
                        let mut grads = vec![("w.weight".to_string(), g)];
                        let norm = global_grad_norm(&grads, &no_shard)?;
                        let clip = match max_norm {
                            Some(max) => clip_coefficient(norm, max)?,
                            None => None,
                        };
                        assert_eq!(
                            clip.is_some(),
                            max_norm == Some(1.0),
                            "{what}: the norm {norm} is clipped at 1 only"
                        );
                        fused.step_clipped(&grads, 1e-2, clip)?;
                        if let Some(max) = max_norm {
                            clip_grad_norm(&mut grads, max, &no_shard)?;
                        }
                        reference.step(&grads, 1e-2)?;
                    }
                    assert_eq!(var_a.dtype(), p_dtype, "{what}");
                    assert_eq!(bits(var_a.as_tensor())?, bits(var_b.as_tensor())?, "{what}");
                    assert_ne!(
                        bits(var_a.as_tensor())?,
                        bits(&init.to_dtype(p_dtype)?)?,
                        "{what}: the steps moved the weights"
                    );
                    let (sa, sb) = (fused.state_tensors()?, reference.state_tensors()?);
                    assert_eq!(sa.len(), 3, "{what}");
                    for ((name, a), (_, b)) in sa.iter().zip(&sb) {
                        assert_eq!(bits(a)?, bits(b)?, "{what}: {name}");
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn clip_coefficient_is_none_unless_clipping_and_rejects_bad_max_norms() -> Res<()> {
    assert_eq!(clip_coefficient(4.0, 1.0)?, Some(1.0 / (4.0 + 1e-6)));
    assert_eq!(clip_coefficient(0.5, 1.0)?, None);
    assert_eq!(clip_coefficient(f64::NAN, 1.0)?, None);
    assert_eq!(clip_coefficient(f64::INFINITY, 1.0)?, None);
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let err = clip_coefficient(2.0, bad).expect_err("a bad max_norm");
        assert!(err.to_string().contains("max_norm"), "{err}");
    }
    Ok(())
}

/// `to_f32` (the trainer's widening of each micro-batch's gradients) gives candle's
/// `to_dtype(F32)` bit for bit: bf16 and f16 over several parallel blocks, with NaN,
/// infinities, negative zero and subnormals; a narrowed view (read in place at its offset); a
/// transposed view (candle's path); and f32 as it is.
#[test]
fn to_f32_widens_every_float_dtype_and_layout_as_candle() -> Res<()> {
    let n = 17 * 5800; // three parallel blocks and a ragged end
    let v: Vec<f32> = (0..n)
        .map(|i| match i % 101 {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            3 => -0.0,
            4 => 1e-40,
            _ => ((i as f32) * 0.61).sin() * 1e3,
        })
        .collect();
    let base = Tensor::from_vec(v, (n, 1), &Device::Cpu)?;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let t = base.to_dtype(dtype)?;
        let views = [
            ("whole", t.clone()),
            ("narrowed", t.narrow(0, 7, n - 20)?),
            ("transposed", t.reshape((n / 17, 17))?.t()?),
        ];
        for (what, x) in views {
            let (got, want) = (to_f32(&x)?, x.to_dtype(DType::F32)?);
            assert_eq!(got.dtype(), DType::F32, "{dtype:?} {what}");
            assert_eq!(got.dims(), x.dims(), "{dtype:?} {what}");
            assert_eq!(bits(&got)?, bits(&want)?, "{dtype:?} {what}");
        }
    }
    Ok(())
}
