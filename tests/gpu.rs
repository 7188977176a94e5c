//! The GPU test suite: `cargo test -p cpl-integration-tests --features cuda-tests --test gpu`
//! (add `,nccl` for the NCCL tests). Built only with the `cuda-tests` feature, which a user
//! turns on on a machine with a CUDA GPU: without one every test fails with a message saying so
//! (never a silent pass).
//!
//! Each test computes on CUDA and compares with the CPU result of the same inputs:
//! - flash-ring's CUDA kernels (NVRTC) forward and backward for every mask kind, soft-cap, GQA,
//!   head dims 64/80/128/256, f32/bf16/f16, run twice for bit-identity; and through autograd;
//! - flash attention (the composite path on CUDA) forward and backward against flash-ring's CPU
//!   kernels, for causal, full, documents, windows, zigzag and striped blocks, GQA, head dims 64
//!   and 128, in f32 (relative max-norm error 1e-5: both are f32 arithmetic, cuBLAS may use a
//!   different summation order; TF32 is off by candle's default) and bf16 (2e-2: bf16 inputs
//!   and outputs, f32 arithmetic on both sides);
//! - a NaN key: the CUDA kernels' out and lse NaN exactly where the CPU kernels' are;
//! - the LSE merge on CUDA against the CPU merge (1e-6);
//! - with `nccl` and 2+ GPUs, the NCCL communicator's collectives against the local backend's
//!   results on the same inputs (bit-identical: both reduce in rank order in f32), in f32 and
//!   bf16, with an uneven all-reduce, a scalar staged from the CPU, broadcast, exchange, barrier
//!   and a split;
//! - three training steps of the GQA fixture on 2 local ranks on one GPU against the CPU.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use flash_ring::{AttnSpec, MaskKind, Positions};

/// GPU `ordinal` with one stream of its own, shared by every rank thread that uses it (as
/// `cpl --device` opens it; candle's `Device::new_cuda` gives each thread its own stream).
fn cuda_at(ordinal: usize) -> Device {
    match candle_core::cuda::CudaDevice::new_with_stream(ordinal) {
        Ok(d) => Device::Cuda(d),
        Err(e) => panic!("the cuda-tests suite needs a CUDA GPU (ordinal {ordinal}): {e}"),
    }
}

fn cuda() -> Device {
    cuda_at(0)
}

/// The values of `t` (on any device) as f64 on the host.
fn host_f64(t: &Tensor) -> Vec<f64> {
    t.to_device(&Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .expect("to host")
}

/// Max-norm relative error of `a` against `r` (`-inf` entries must match and are left out).
fn rel(a: &Tensor, r: &Tensor) -> f64 {
    testkit::rel_err_floor(&host_f64(a), &host_f64(r), 1e-30)
}

fn random(shape: (usize, usize, usize, usize), seed: u64, dtype: DType) -> Tensor {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let x = ((i as u64 + 1) * 2654435761 + seed * 97) % 1000;
            (x as f32 / 500.0 - 1.0) + 1e-3
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("tensor")
}

fn zigzag(n: usize, p: usize, r: usize) -> Positions {
    let c = n / (2 * p);
    let mut v: Vec<u32> = (r * c..(r + 1) * c).map(|x| x as u32).collect();
    v.extend(((2 * p - 1 - r) * c..(2 * p - r) * c).map(|x| x as u32));
    Positions::list(v)
}

fn specs(d: usize) -> Vec<(&'static str, AttnSpec, usize, usize)> {
    let s = 1.0 / (d as f32).sqrt();
    let n = 512;
    let docs = flash_ring::doc_ids_from_cu_seqlens(&[0, 70, 71, 300, 512]).expect("docs");
    let striped = Positions::list((0..n as u32).filter(|i| i % 4 == 1).collect::<Vec<_>>());
    let (zq, zk) = (zigzag(n, 2, 0), zigzag(n, 2, 1));
    vec![
        ("causal", AttnSpec::dense(s, MaskKind::Causal, n, n), n, n),
        (
            "full",
            AttnSpec::dense(s, MaskKind::Full, 300, 500),
            300,
            500,
        ),
        (
            "causal docs",
            AttnSpec::dense(s, MaskKind::Causal, n, n).with_doc_ids(docs.clone()),
            n,
            n,
        ),
        (
            "causal window",
            AttnSpec::dense(s, MaskKind::Causal, n, n).with_window(100),
            n,
            n,
        ),
        (
            "zigzag",
            AttnSpec::new(s, MaskKind::Causal, zq.clone(), zk.clone())
                .with_doc_ids(docs as Arc<[u32]>),
            zq.len(),
            zk.len(),
        ),
        (
            "striped k",
            AttnSpec::new(s, MaskKind::Causal, Positions::range(0, n), striped.clone()),
            n,
            striped.len(),
        ),
    ]
}

#[test]
fn composite_attention_on_cuda_matches_the_cpu_kernels() {
    let dev = cuda();
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        for d in [64, 128] {
            for (name, spec, sq, sk) in specs(d) {
                let q = random((1, sq, 8, d), 1, dtype);
                let k = random((1, sk, 2, d), 2, dtype);
                let v = random((1, sk, 2, d), 3, dtype);
                let dout = random((1, sq, 8, d), 4, dtype);
                let (o, l) = flash_ring::flash_fwd(&q, &k, &v, &spec).expect("cpu fwd");
                let g = flash_ring::flash_bwd_f32(&q, &k, &v, &o, &l, &dout, &spec).expect("cpu");
                let on = |t: &Tensor| t.to_device(&dev).expect("to cuda");
                let (qc, kc, vc, dc) = (on(&q), on(&k), on(&v), on(&dout));
                // The composite path explicitly: flash_fwd on CUDA takes the kernels.
                let cc = flash_ring::CompositeConfig::default();
                let (oc, lc) =
                    flash_ring::composite::forward(&qc, &kc, &vc, &spec, &cc).expect("cuda fwd");
                assert!(
                    oc.device().is_cuda() && lc.device().is_cuda(),
                    "stays on CUDA"
                );
                let gc =
                    flash_ring::composite::backward(&qc, &kc, &vc, &oc, &lc, &dc, &spec, &cc, true)
                        .expect("cuda bwd");
                for (what, a, b) in [
                    ("out", &oc, &o),
                    ("lse", &lc, &l),
                    ("dq", &gc.0, &g.0),
                    ("dk", &gc.1, &g.1),
                    ("dv", &gc.2, &g.2),
                ] {
                    let e = rel(a, b);
                    assert!(
                        e <= tol,
                        "{name} d={d} {dtype:?}: {what} rel err {e:.3e} > {tol}"
                    );
                }
            }
        }
    }
}

/// Every mask kind of `specs` plus a soft-cap, a full-mask window and rows with no allowed key.
fn kernel_specs(d: usize) -> Vec<(&'static str, AttnSpec, usize, usize)> {
    let s = 1.0 / (d as f32).sqrt();
    let mut v = specs(d);
    v.push((
        "causal softcap",
        AttnSpec::dense(s, MaskKind::Causal, 200, 200).with_softcap(5.0),
        200,
        200,
    ));
    v.push((
        "full window",
        AttnSpec::dense(s, MaskKind::Full, 150, 170).with_window(40),
        150,
        170,
    ));
    // q rows 0..50 see keys at positions 100.. only under a causal mask: no allowed key.
    v.push((
        "empty rows",
        AttnSpec::new(
            s,
            MaskKind::Causal,
            Positions::range(0, 120),
            Positions::range(60, 90),
        ),
        120,
        90,
    ));
    v
}

/// flash-ring's CUDA kernels (`flash_ring::cuda`, NVRTC), both sets, against the CPU kernels:
/// forward (out, lse) and backward (dq, dk, dv) for every mask kind, GQA 8:2, head dims 64, 80,
/// 128 and 256 (the tensor-core set serves 64, 80 and 128 in bf16/f16), f32 (1e-5 relative
/// max-norm: f32 arithmetic on both sides, only the summation order differs), bf16 and f16 (2e-2
/// and 1e-2: the outputs are rounded to the input dtype, and the tensor-core set rounds P, dO
/// and dS to it before their products, as FlashAttention-2 does); and bit-identical when run
/// twice (no atomics).
#[test]
fn cuda_kernels_match_the_cpu_kernels() {
    use flash_ring::cuda::KernelSet;
    let dev = cuda();
    let mut tensor_core_cases = 0;
    // Every mismatch is collected and reported together (a GPU session is short: one run must
    // say all that is wrong).
    let mut failures = Vec::new();
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 1e-2)] {
        for d in [64, 80, 128, 256] {
            for (name, spec, sq, sk) in kernel_specs(d) {
                let q = random((2, sq, 8, d), 11, dtype);
                let k = random((2, sk, 2, d), 12, dtype);
                let v = random((2, sk, 2, d), 13, dtype);
                let dout = random((2, sq, 8, d), 14, dtype);
                let (o, l) = flash_ring::flash_fwd(&q, &k, &v, &spec).expect("cpu fwd");
                let g = flash_ring::flash_bwd_f32(&q, &k, &v, &o, &l, &dout, &spec).expect("cpu");
                let on = |t: &Tensor| t.to_device(&dev).expect("to cuda");
                let (qc, kc, vc, dc) = (on(&q), on(&k), on(&v), on(&dout));
                for set in [KernelSet::Simt, KernelSet::TensorCore] {
                    if !set.serves(dtype, d) {
                        continue;
                    }
                    tensor_core_cases += usize::from(set == KernelSet::TensorCore);
                    let (oc, lc) = flash_ring::cuda::forward_with(set, &qc, &kc, &vc, &spec)
                        .expect("cuda fwd");
                    let bwd = || {
                        flash_ring::cuda::backward_with(
                            set, &qc, &kc, &vc, &oc, &lc, &dc, &spec, true,
                        )
                        .expect("cuda bwd")
                    };
                    let gc = bwd();
                    for (what, a, b) in [
                        ("out", &oc, &o),
                        ("lse", &lc, &l),
                        ("dq", &gc.0, &g.0),
                        ("dk", &gc.1, &g.1),
                        ("dv", &gc.2, &g.2),
                    ] {
                        assert!(a.device().is_cuda(), "{what} stays on CUDA");
                        let e = rel(a, b);
                        if e.is_nan() || e > tol {
                            failures.push(format!(
                                "{set:?} kernel {name} d={d} {dtype:?}: {what} rel err {e:.3e} > {tol}"
                            ));
                        }
                    }
                    if d == 128 && (dtype == DType::F32 || set == KernelSet::TensorCore) {
                        let (oc2, _) =
                            flash_ring::cuda::forward_with(set, &qc, &kc, &vc, &spec).expect("fwd");
                        let gc2 = bwd();
                        for (what, a, b) in [
                            ("out", &oc2, &oc),
                            ("dq", &gc2.0, &gc.0),
                            ("dk", &gc2.1, &gc.1),
                        ] {
                            let diff = (a.to_dtype(DType::F32).expect("f32")
                                - b.to_dtype(DType::F32).expect("f32"))
                            .and_then(|t| t.abs())
                            .and_then(|t| t.flatten_all())
                            .and_then(|t| t.max(0))
                            .and_then(|t| t.to_scalar::<f32>())
                            .expect("diff");
                            if diff != 0.0 {
                                failures.push(format!(
                                    "{set:?} kernel {name} d={d} {dtype:?}: {what} differs \
                                     between two runs by {diff:e}"
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(tensor_core_cases > 0, "the tensor-core set was exercised");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The differentiable entry point on CUDA tensors takes the kernels: gradients through
/// `flash_attention` match the CPU's (f32, 1e-5).
#[test]
fn cuda_kernels_serve_flash_attention_autograd() {
    let dev = cuda();
    let (sq, d) = (300, 64);
    let spec = AttnSpec::dense(0.125, MaskKind::Causal, sq, sq).with_window(90);
    let q = random((1, sq, 4, d), 21, DType::F32);
    let k = random((1, sq, 2, d), 22, DType::F32);
    let v = random((1, sq, 2, d), 23, DType::F32);
    let w = random((1, sq, 4, d), 24, DType::F32);
    let run = |dev: &Device| {
        let vars: Vec<candle_core::Var> = [&q, &k, &v]
            .iter()
            .map(|t| candle_core::Var::from_tensor(&t.to_device(dev).expect("dev")).expect("var"))
            .collect();
        let out = flash_ring::flash_attention(
            vars[0].as_tensor(),
            vars[1].as_tensor(),
            vars[2].as_tensor(),
            &spec,
        )
        .expect("attention");
        let loss = (out * w.to_device(dev).expect("w"))
            .and_then(|t| t.sum_all())
            .expect("loss");
        let grads = loss.backward().expect("backward");
        let mut res = vec![loss];
        for var in &vars {
            res.push(
                grads
                    .get(var.as_tensor())
                    .expect("every input gets a gradient")
                    .clone(),
            );
        }
        res
    };
    let (cpu, gpu) = (run(&Device::Cpu), run(&dev));
    for (what, a, b) in [("loss", 0, 0), ("dq", 1, 1), ("dk", 2, 2), ("dv", 3, 3)] {
        let e = rel(&gpu[a], &cpu[b]);
        assert!(e <= 1e-5, "autograd {what}: rel err {e:.3e}");
    }
}

/// Needs no GPU, only the NVRTC library (`scripts/check_gpu_bundle.sh` runs it on the CPU
/// machine): every kernel variant compiles for sm_80 and sm_90, its PTX holds the three entry
/// points, and the launch geometry keeps at most 32 dims per thread.
#[test]
fn nvrtc_compiles_every_kernel_variant() {
    use flash_ring::cuda::KernelSet;
    for arch in ["compute_80", "compute_90"] {
        for set in [KernelSet::Simt, KernelSet::TensorCore] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for d in [1, 16, 32, 64, 80, 96, 128, 160, 256] {
                    let served = set.serves(dtype, d);
                    let expect_served = match set {
                        KernelSet::Simt => true,
                        KernelSet::TensorCore => {
                            dtype != DType::F32 && d.is_multiple_of(16) && d <= 128
                        }
                    };
                    assert_eq!(served, expect_served, "{set:?} {dtype:?} d={d}");
                    if !served {
                        assert!(flash_ring::cuda::compile(set, dtype, d, arch).is_err());
                        continue;
                    }
                    let ptx = flash_ring::cuda::compile(set, dtype, d, arch)
                        .unwrap_or_else(|e| panic!("{set:?} {arch} {dtype:?} d={d}: {e}"));
                    for entry in flash_ring::cuda::ENTRY_POINTS {
                        assert!(
                            ptx.contains(&format!(".entry {entry}(")),
                            "{set:?} {arch} {dtype:?} d={d}: no entry {entry}"
                        );
                    }
                    assert!(
                        ptx.contains(&format!(".target sm_{}", &arch[8..])),
                        "{arch}: target"
                    );
                    if set == KernelSet::TensorCore {
                        assert!(ptx.contains("mma.sync.aligned.m16n8k16"), "{dtype:?} d={d}");
                        assert!(ptx.contains("ldmatrix.sync.aligned"), "{dtype:?} d={d}");
                    }
                    let (g, rows, tile) =
                        flash_ring::cuda::launch_geometry(set, dtype, d).expect("geometry");
                    match set {
                        KernelSet::Simt => {
                            assert!(
                                g.is_power_of_two()
                                    && d.div_ceil(g) <= 32
                                    && (g == 1 || d.div_ceil(g / 2) > 32)
                            );
                            assert_eq!(rows * g, 128);
                            assert_eq!(tile, if d <= 128 { 32 } else { 16 });
                        }
                        KernelSet::TensorCore => assert_eq!((g, rows, tile), (4, 64, 64)),
                    }
                }
            }
        }
    }
    // The host's tile spans: per 16 rows, (pmin, pmax, dmin, dmax); a partial last chunk.
    let pos: Vec<i32> = (0..40).map(|i| if i < 20 { 100 - i } else { i }).collect();
    let doc: Vec<i32> = (0..40).map(|i| i / 10).collect();
    assert_eq!(
        flash_ring::cuda::chunk_spans(&pos, Some(&doc)),
        vec![85, 100, 0, 1, 20, 84, 1, 3, 32, 39, 3, 3]
    );
    assert_eq!(
        flash_ring::cuda::chunk_spans(&pos[..16], None),
        vec![85, 100, 0, 0]
    );
    // The default: tensor cores for bf16/f16 where they serve, CUDA cores otherwise.
    assert_eq!(
        KernelSet::default_for(DType::BF16, 128),
        Some(KernelSet::TensorCore)
    );
    assert_eq!(
        KernelSet::default_for(DType::F16, 80),
        Some(KernelSet::TensorCore)
    );
    assert_eq!(
        KernelSet::default_for(DType::BF16, 72),
        Some(KernelSet::Simt)
    );
    assert_eq!(
        KernelSet::default_for(DType::F32, 128),
        Some(KernelSet::Simt)
    );
    assert_eq!(KernelSet::default_for(DType::BF16, 512), None);
    assert!(flash_ring::cuda::compile(KernelSet::Simt, DType::F32, 257, "compute_80").is_err());
    assert!(flash_ring::cuda::compile(KernelSet::Simt, DType::F64, 64, "compute_80").is_err());
    assert!(!flash_ring::cuda::supports(DType::F32, 0));
}

/// A NaN key poisons exactly the rows that may attend it, on the CUDA kernels as on the CPU's:
/// out and lse are NaN at the same places, the other entries within the kernels' tolerance.
#[test]
fn cuda_kernels_propagate_nan_scores_as_the_cpu() {
    use flash_ring::cuda::KernelSet;
    let dev = cuda();
    let (sq, d) = (200, 64);
    let mut failures = Vec::new();
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        for mask in [MaskKind::Causal, MaskKind::Full] {
            let spec = AttnSpec::dense(0.125, mask, sq, sq);
            let q = random((1, sq, 4, d), 31, dtype);
            let mut kv: Vec<f32> = random((1, sq, 2, d), 32, DType::F32)
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .expect("k");
            kv[(130 * 2) * d + 3] = f32::NAN; // key 130, kv head 0
            let k = Tensor::from_vec(kv, (1, sq, 2, d), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .expect("k");
            let v = random((1, sq, 2, d), 33, dtype);
            let (o, l) = flash_ring::flash_fwd(&q, &k, &v, &spec).expect("cpu fwd");
            let on = |t: &Tensor| t.to_device(&dev).expect("to cuda");
            for set in [KernelSet::Simt, KernelSet::TensorCore] {
                if !set.serves(dtype, d) {
                    continue;
                }
                let (oc, lc) =
                    flash_ring::cuda::forward_with(set, &on(&q), &on(&k), &on(&v), &spec)
                        .expect("cuda fwd");
                for (what, a, b) in [("out", &oc, &o), ("lse", &lc, &l)] {
                    let (a, b) = (host_f64(a), host_f64(b));
                    let nan_a: Vec<bool> = a.iter().map(|x| x.is_nan()).collect();
                    let nan_b: Vec<bool> = b.iter().map(|x| x.is_nan()).collect();
                    if !nan_b.iter().any(|&x| x) || nan_a != nan_b {
                        failures.push(format!("{set:?} {dtype:?} {mask:?}: {what}'s NaNs differ"));
                        continue;
                    }
                    let keep = |v: &[f64]| -> Vec<f64> {
                        v.iter().copied().filter(|x| !x.is_nan()).collect()
                    };
                    let e = testkit::rel_err_floor(&keep(&a), &keep(&b), 1e-30);
                    if e.is_nan() || e > tol {
                        failures.push(format!(
                            "{set:?} {dtype:?} {mask:?}: {what} rel err {e:.3e}"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn merge_on_cuda_matches_the_cpu() {
    let dev = cuda();
    let (oa, ob) = (
        random((2, 64, 4, 32), 5, DType::F32),
        random((2, 64, 4, 32), 6, DType::F32),
    );
    let la = random((2, 4, 64, 1), 7, DType::F32)
        .squeeze(3)
        .expect("lse")
        * 20.0;
    let lb = random((2, 4, 64, 1), 8, DType::F32)
        .squeeze(3)
        .expect("lse")
        * 20.0;
    let (la, lb) = (la.expect("scale"), lb.expect("scale"));
    let (o, l) = flash_ring::merge(&oa, &la, &ob, &lb).expect("cpu merge");
    let on = |t: &Tensor| t.to_device(&dev).expect("to cuda");
    let (oc, lc) = flash_ring::merge(&on(&oa), &on(&la), &on(&ob), &on(&lb)).expect("merge");
    assert!(rel(&oc, &o) <= 1e-6 && rel(&lc, &l) <= 1e-6);
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_collectives_match_the_local_backend() {
    use candle_parallel::comm::nccl::{new_id, NcclComm};
    use candle_parallel::comm::{LocalWorld, RecvSpec, ReduceOp};

    let gpus = candle_core::cuda::cudarc::driver::CudaContext::device_count().expect("count");
    assert!(
        gpus >= 2,
        "the NCCL test needs 2 GPUs (NCCL rejects two ranks on one GPU)"
    );
    let p = 2usize;
    // (2, 8, 3, 5): 240 elements; the 3-element narrow below gives uneven all-reduce chunks on
    // 2 ranks.
    let x = |r: usize, dtype: DType| random((2, 8, 3, 5), r as u64 + 10, dtype);
    type Outs = Vec<Tensor>;
    let ops = |c: &candle_parallel::comm::Comm, dev: &Device| -> candle_parallel::Result<Outs> {
        let r = c.rank();
        let mut out = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            let xr = x(r, dtype).to_device(dev)?;
            out.push(c.all_reduce(&xr, ReduceOp::Sum)?);
            out.push(
                c.all_reduce(
                    &xr.narrow(3, 0, 3)?
                        .narrow(0, 0, 1)?
                        .narrow(1, 0, 1)?
                        .contiguous()?,
                    ReduceOp::Avg,
                )?,
            );
            out.push(c.all_gather(&xr, 1)?);
            out.push(c.all_to_all(&xr, 1, 2)?);
            out.push(c.reduce_scatter(&xr, 1, ReduceOp::Max)?);
            out.push(c.broadcast(&xr, 1)?);
        }
        // A CPU scalar (a loss) is staged and comes back on the CPU.
        let loss = Tensor::new(&[r as f64 + 0.25], &Device::Cpu)?;
        let summed = c.all_reduce(&loss, ReduceOp::Sum)?;
        assert!(summed.device().is_cpu(), "a CPU input gives a CPU result");
        out.push(summed);
        // A ring step as one exchange.
        let xr = x(r, DType::F32).to_device(dev)?;
        let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
        let got = c
            .exchange(vec![(next, xr.clone())], vec![RecvSpec::like(prev, &xr)])?
            .wait()?;
        out.extend(got);
        c.barrier()?;
        // A split into singleton groups and one collective on it.
        let solo = c.split(r, 0)?;
        assert_eq!((solo.rank(), solo.size()), (0, 1));
        out.push(solo.all_reduce(&xr, ReduceOp::Sum)?);
        Ok(out)
    };
    let local = LocalWorld::run(p, |c| ops(&c, &Device::Cpu)).expect("local");
    let id = new_id().expect("nccl id");
    let results: Vec<Outs> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..p)
            .map(|r| {
                let ops = &ops;
                s.spawn(move || {
                    let dev = cuda_at(r);
                    let Device::Cuda(cuda) = &dev else {
                        unreachable!()
                    };
                    let c = NcclComm::world(cuda, r, p, &id).expect("nccl world");
                    ops(&c, &dev).expect("nccl ops")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    for (r, (a, b)) in results.iter().zip(&local).enumerate() {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(x.dims(), y.dims(), "rank {r} result {i}: shape");
            assert_eq!(
                rel(x, y),
                0.0,
                "rank {r} result {i} differs from the local backend"
            );
        }
    }
}

/// Three training steps of the GQA LLaMA fixture on 2 local ranks (ring attention) on CUDA and
/// on the CPU: the losses agree to 1e-4 relative (f32 both; the matmuls' summation orders
/// differ between cuBLAS and the CPU kernels, and three AdamW steps carry that difference), and
/// every parameter on CUDA received a gradient (the step would fail otherwise).
#[test]
fn training_steps_on_cuda_match_the_cpu() {
    use candle_parallel::attention::{SpConfig, Strategy};
    use candle_parallel::comm::LocalWorld;
    use candle_parallel::mesh::{DeviceMesh, MeshConfig};
    use candle_parallel::nn::{ParallelCtx, ParamMode, TpActivations};
    use candle_parallel::plan::MemoryPlan;
    use train::data::{PackedDataset, Packing, TokenStream};
    use train::trainer::{TrainConfig, Trainer};

    let gpu = cuda(); // one stream, shared by the two rank threads
    let files = cpl_integration_tests::fixture_files("gqa");
    let cfg = models::llama::LlamaConfig::from_file(&files.config).expect("config");
    let seq = 32;
    let ids: Vec<u32> = (0..4 * seq + 1)
        .map(|i| ((i as u64 * 2_654_435_761) % cfg.vocab_size as u64) as u32)
        .collect();
    let data = PackedDataset::new(
        TokenStream::from_sequences(&[ids], cfg.vocab_size).expect("tokens"),
        seq,
        Packing::Continuous,
    )
    .expect("data");
    let train = TrainConfig::constant_lr(seq, 3, 1e-3, 16, MemoryPlan::default());
    let run = |device: Device| -> Vec<f64> {
        let mut out = LocalWorld::run(2, |world| -> candle_parallel::Result<Vec<f64>> {
            let mesh = DeviceMesh::new(&MeshConfig::default().with_ring(2), world)?;
            let sp = SpConfig::new(Strategy::Ring, 1, 2);
            let ctx = ParallelCtx::new(&mesh, &sp, TpActivations::Replicated)?
                .with_device(device.clone());
            let err = |e: &dyn std::fmt::Display| candle_parallel::Error::Layout(e.to_string());
            let model = models::llama::load(&files, &ctx, Some(DType::F32), ParamMode::Trainable)
                .map_err(|e| err(&e))?
                .model;
            let mut t = Trainer::new(model, &mesh, &ctx, train.clone()).map_err(|e| err(&e))?;
            (0..3)
                .map(|_| t.step(&data).map(|s| s.loss).map_err(|e| err(&e)))
                .collect()
        })
        .expect("training");
        out.swap_remove(0)
    };
    let cpu = run(Device::Cpu);
    let on_gpu = run(gpu);
    for (i, (a, b)) in on_gpu.iter().zip(&cpu).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "step {i}: loss on CUDA {a} vs CPU {b}"
        );
    }
}
