//! Shared helpers of the flash-ring integration tests.
//!
//! Error metric used everywhere: `rel(a, ref) = max_i |a_i - ref_i| / max(max_i |ref_i|, 1e-30)`
//! (max-norm relative error, `testkit`'s: a NaN anywhere fails; `-inf` entries must match exactly
//! and are left out of the norms).
#![allow(dead_code)]

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use flash_ring::reference::{attention_bwd_f64, attention_f64, RefShape};
use flash_ring::{AttnSpec, CompositeConfig, KernelConfig, MaskKind, Positions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The unit roundoff of f32.
pub const U: f64 = 1.0 / (1u64 << 24) as f64;

/// A `rows x cols` matrix with values from `f`, stored row-major (`col_major == false`) or
/// column-major behind `pad` leading `filler` elements (NaN: a stray read shows); returns the
/// storage and the view's strides.
pub fn store<T: Copy>(
    rows: usize,
    cols: usize,
    col_major: bool,
    pad: usize,
    filler: T,
    mut f: impl FnMut() -> T,
) -> (Vec<T>, usize, usize) {
    let mut data = vec![filler; pad + rows * cols];
    let (rs, cs) = if col_major { (1, rows) } else { (cols, 1) };
    for r in 0..rows {
        for c in 0..cols {
            data[pad + r * rs + c * cs] = f();
        }
    }
    (data, rs, cs)
}

/// `(sum_t a(t) b(t), sum_t |a(t) b(t)|)` over `t < k` in float64, and the bound that the dense
/// products' short chains guarantee for it: `(KC + ceil(k / KC) + 2) u` times the second (a
/// chain of at most KC products, then at most ceil(k / KC) chain sums).
pub fn exact_dot(k: usize, a: impl Fn(usize) -> f64, b: impl Fn(usize) -> f64) -> (f64, f64) {
    exact_dot_chains(k, flash_ring::cpu::gemm::KC, a, b)
}

/// [`exact_dot`] for chains of `kc` products (the bf16 dot products' `gemm_bf16::CHAIN`).
pub fn exact_dot_chains(
    k: usize,
    kc: usize,
    a: impl Fn(usize) -> f64,
    b: impl Fn(usize) -> f64,
) -> (f64, f64) {
    let (mut exact, mut mag) = (0.0f64, 0.0f64);
    for t in 0..k {
        let p = a(t) * b(t);
        exact += p;
        mag += p.abs();
    }
    (exact, (kc + k.div_ceil(kc) + 2) as f64 * U * mag)
}

/// Product shapes `(m, k, n)` both dense products are checked on: one element, odd sizes,
/// depths past one chain (`KC`) and past one super-chunk (1024), partial row and column blocks,
/// and empty operands.
pub const GEMM_SHAPES: [(usize, usize, usize); 10] = [
    (1, 1, 1),
    (3, 5, 7),
    (17, 64, 16),
    (25, 65, 33),
    (97, 130, 300),
    (200, 48, 50),
    (9, 1100, 40),
    (5, 0, 9),
    (0, 4, 3),
    (6, 7, 0),
];

/// The four layouts of A and B: (A column-major, B column-major).
pub const LAYOUTS: [(bool, bool); 4] = [(false, false), (false, true), (true, false), (true, true)];

/// `f` run on a fresh rayon pool of `threads` threads.
pub fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
        .install(f)
}

/// Asserts that `run` gives the same bits on pools of 1 and of each of `threads` threads.
pub fn assert_same_bits_on(threads: &[usize], run: impl Fn() -> Vec<f32> + Sync) {
    let one = on_threads(1, &run);
    for &t in threads {
        let other = on_threads(t, &run);
        assert!(
            one.iter()
                .zip(&other)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{t} threads differ from one"
        );
    }
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Uniform values in [-1, 1), never exactly zero.
pub fn randv(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x: f32 = r.random_range(-1.0..1.0);
            if x == 0.0 {
                0.5
            } else {
                x
            }
        })
        .collect()
}

/// Max-norm relative error, see the module docs (`+inf` on a NaN or an inf mismatch, so every
/// tolerance check fails).
pub fn rel(a: &[f64], r: &[f64]) -> f64 {
    testkit::rel_err_floor(a, r, 1e-30)
}

/// [`rel`] with the denominator floored at `floor` instead of 1e-30.
pub fn rel_floor(a: &[f64], r: &[f64], floor: f64) -> f64 {
    testkit::rel_err_floor(a, r, floor)
}

/// Trainable copies of `q`, `k`, `v` (gradients are taken with respect to these).
pub fn vars(qkv: [&Tensor; 3]) -> [Var; 3] {
    qkv.map(|t| Var::from_tensor(t).expect("var"))
}

pub fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|x| x.flatten_all())
        .and_then(|x| x.to_vec1::<f64>())
        .expect("tensor to f64")
}

/// Values of `t` after rounding to `dtype` (what the kernel actually sees), as f64.
pub fn rounded(v: &[f32], dtype: DType) -> Vec<f64> {
    let t = Tensor::new(v, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("rounding");
    to_f64(&t)
}

/// Which implementation a [`Case`] checks.
#[derive(Clone, Copy, Debug)]
pub enum Path {
    /// The CPU kernels (`flash_fwd_with_config` / `flash_bwd_with_config`).
    Kernel,
    /// The composite path in candle ops (`flash_ring::composite`), forced on CPU tensors.
    Composite(CompositeConfig),
}

/// The default kernels, with bf16 products on the CPU's bf16 dot products wherever it has them
/// (Intel's CPUs included, where `Bf16Products::Auto` widens), so that the bf16 tests cover
/// those kernels on every CPU that has them.
pub fn kernels() -> KernelConfig {
    KernelConfig {
        bf16: flash_ring::Bf16Products::Dot,
        ..KernelConfig::default()
    }
}

pub struct Case {
    pub shape: RefShape,
    pub dtype: DType,
    pub spec: AttnSpec,
    pub cfg: KernelConfig,
    pub path: Path,
    pub seed: u64,
    /// Factor on q and k of [`Case::inputs`] (1: the default inputs, unchanged).
    pub qk_mul: f32,
}

impl Case {
    pub fn new(
        b: usize,
        sq: usize,
        sk: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        spec: AttnSpec,
    ) -> Self {
        Case {
            shape: RefShape {
                b,
                sq,
                sk,
                hq,
                hkv,
                d,
            },
            dtype: DType::F32,
            spec,
            cfg: kernels(),
            path: Path::Kernel,
            seed: 42,
            qk_mul: 1.0,
        }
    }

    /// Multiplies q and k of the inputs by `m` (larger logits, e.g. to saturate a soft-cap).
    pub fn qk_mul(mut self, m: f32) -> Self {
        self.qk_mul = m;
        self
    }

    pub fn dtype(mut self, dt: DType) -> Self {
        self.dtype = dt;
        self
    }

    pub fn cfg(mut self, cfg: KernelConfig) -> Self {
        self.cfg = cfg;
        self
    }

    /// Checks the composite path with tiles `cfg` instead of the CPU kernels.
    pub fn composite(mut self, cfg: CompositeConfig) -> Self {
        self.path = Path::Composite(cfg);
        self
    }

    pub fn shape(&self) -> RefShape {
        self.shape
    }

    /// Random q, k, v, dout (f32 values) for this case.
    pub fn inputs(&self) -> [Vec<f32>; 4] {
        let mut r = rng(self.seed);
        let nq = self.shape.b * self.shape.sq * self.shape.hq * self.shape.d;
        let nk = self.shape.b * self.shape.sk * self.shape.hkv * self.shape.d;
        // Scale q so the softmax is neither flat nor one-hot.
        let q: Vec<f32> = randv(&mut r, nq).iter().map(|x| x * 2.0).collect();
        let mut inputs = [q, randv(&mut r, nk), randv(&mut r, nk), randv(&mut r, nq)];
        if self.qk_mul != 1.0 {
            for x in inputs[..2].iter_mut().flatten() {
                *x *= self.qk_mul;
            }
        }
        inputs
    }

    pub fn tensors(&self) -> [Tensor; 4] {
        let [q, k, v, dout] = self.inputs();
        let dev = Device::Cpu;
        let mk = |x: Vec<f32>, s: usize, h: usize| {
            Tensor::from_vec(x, (self.shape.b, s, h, self.shape.d), &dev)
                .and_then(|t| t.to_dtype(self.dtype))
                .expect("tensor")
        };
        [
            mk(q, self.shape.sq, self.shape.hq),
            mk(k, self.shape.sk, self.shape.hkv),
            mk(v, self.shape.sk, self.shape.hkv),
            mk(dout, self.shape.sq, self.shape.hq),
        ]
    }

    /// Runs flash forward + backward and compares with the f64 reference computed from the
    /// inputs rounded to the case's dtype. Returns the worst relative error seen.
    pub fn check(&self, tol: f64) -> f64 {
        let [q, k, v, dout] = self.tensors();
        let (out, lse, dq, dk, dv) = match self.path {
            Path::Kernel => {
                let (out, lse) =
                    flash_ring::flash_fwd_with_config(&q, &k, &v, &self.spec, &self.cfg)
                        .expect("flash_fwd");
                let (dq, dk, dv) = flash_ring::flash_bwd_with_config(
                    &q, &k, &v, &out, &lse, &dout, &self.spec, &self.cfg, false,
                )
                .expect("flash_bwd");
                (out, lse, dq, dk, dv)
            }
            Path::Composite(cfg) => {
                let (out, lse) = flash_ring::composite::forward(&q, &k, &v, &self.spec, &cfg)
                    .expect("composite forward");
                let (dq, dk, dv) = flash_ring::composite::backward(
                    &q, &k, &v, &out, &lse, &dout, &self.spec, &cfg, false,
                )
                .expect("composite backward");
                (out, lse, dq, dk, dv)
            }
        };
        assert_eq!(out.dtype(), self.dtype);
        assert_eq!(dq.dtype(), self.dtype);
        assert_eq!(lse.dtype(), DType::F32);
        assert_eq!(lse.dims(), &[self.shape.b, self.shape.hq, self.shape.sq]);
        let (qf, kf, vf, df) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&dout));
        let (ro, rl) = attention_f64(&qf, &kf, &vf, self.shape(), &self.spec);
        let (rdq, rdk, rdv) = attention_bwd_f64(&qf, &kf, &vf, &df, self.shape(), &self.spec);
        // When every query sees a single key the softmax is constant and dq, dk are exactly 0
        // (the reference gives exact zeros, the kernel rounding noise): such an all-zero
        // gradient is measured against max|dv| instead of its own zero scale.
        let dv_scale = testkit::max_abs_values(&rdv);
        let floor = |r: &[f64]| {
            if r.iter().all(|&x| x == 0.0) {
                dv_scale.max(1e-30)
            } else {
                1e-30
            }
        };
        let errs = [
            ("out", rel(&to_f64(&out), &ro)),
            ("lse", rel(&to_f64(&lse), &rl)),
            ("dq", rel_floor(&to_f64(&dq), &rdq, floor(&rdq))),
            ("dk", rel_floor(&to_f64(&dk), &rdk, floor(&rdk))),
            ("dv", rel(&to_f64(&dv), &rdv)),
        ];
        let mut worst = 0.0f64;
        for (name, e) in errs {
            assert!(
                e <= tol,
                "{name}: rel err {e:.3e} > {tol:.0e} (b={} sq={} sk={} hq={} hkv={} d={} {:?} {:?} \
                 window {:?} docs {} softcap {:?})",
                self.shape.b,
                self.shape.sq,
                self.shape.sk,
                self.shape.hq,
                self.shape.hkv,
                self.shape.d,
                self.dtype,
                self.spec.mask,
                self.spec.window,
                self.spec.doc_ids.is_some(),
                self.spec.softcap
            );
            worst = testkit::max_or_nan(worst, e);
        }
        worst
    }
}

/// Zigzag positions of rank `r` of `p` for a sequence of `n` tokens (chunks `r` and `2p-1-r`).
pub fn zigzag(n: usize, p: usize, r: usize) -> Positions {
    let c = n / (2 * p);
    let mut v: Vec<u32> = (r * c..(r + 1) * c).map(|x| x as u32).collect();
    v.extend(((2 * p - 1 - r) * c..(2 * p - r) * c).map(|x| x as u32));
    Positions::list(v)
}

/// The mask kinds of the issue on blocks of global positions: (name, spec, seq_q, seq_k).
pub fn mask_specs(d: usize) -> Vec<(&'static str, AttnSpec, usize, usize)> {
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
