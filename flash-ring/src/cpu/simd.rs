//! Vectorised building blocks: a register-blocked small-matrix multiply and the row operations
//! of the online softmax. Each has an AVX-512 and an AVX2+FMA implementation (the best one is
//! chosen at run time) and a portable one; all compute the same thing in f32.

use std::sync::OnceLock;

/// Instruction set used by the CPU kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// x86-64 AVX-512F (16 f32 lanes), on a CPU that also has AVX2 and FMA (all of them do).
    Avx512,
    /// x86-64 AVX2 with FMA (8 f32 lanes): AMD Zen 1-3, and Intel parts without AVX-512.
    Avx2,
    /// Plain Rust loops (any target; auto-vectorised where the compiler can).
    Portable,
}

/// The variable that picks the kernels' default instruction set (`avx512`, `avx2` or
/// `portable`, one this CPU has): to run a whole program, a model's tests say, on a narrower
/// set than the CPU's best (the kernels' ISA-specific code then gets exercised on one machine).
pub const ISA_ENV: &str = "FLASH_RING_ISA";

/// The instruction set the kernels use by default: `FLASH_RING_ISA` when it names one this CPU
/// has, otherwise the best of this machine (detected once). An unusable value is ignored here
/// and reported by `isa_from_env`, which every kernel call checks
/// (`KernelConfig { isa: None, .. }`).
pub fn detect() -> Isa {
    match isa_from_env() {
        Ok(Some(isa)) => isa,
        _ => best(),
    }
}

/// `FLASH_RING_ISA` (read once): `None` when unset or empty; the error names the variable.
pub fn isa_from_env() -> Result<Option<Isa>, String> {
    static ENV: OnceLock<Result<Option<Isa>, String>> = OnceLock::new();
    super::env_choice(&ENV, ISA_ENV, |v| isa_choice(v, &available()))
}

/// The instruction set named `name` (`avx512`, `avx2`, `portable`, any case) if it is among
/// `available`; the error says which names exist or that this CPU lacks it.
pub fn isa_choice(name: &str, available: &[Isa]) -> Result<Isa, String> {
    let isa = match name.to_ascii_lowercase().as_str() {
        "avx512" => Isa::Avx512,
        "avx2" => Isa::Avx2,
        "portable" => Isa::Portable,
        _ => return Err("expected avx512, avx2 or portable".into()),
    };
    if available.contains(&isa) {
        Ok(isa)
    } else {
        Err(format!(
            "this CPU cannot run {isa:?} (it has {available:?})"
        ))
    }
}

/// The best instruction set of this machine (detected once).
fn best() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") && avx2_fma() {
                return Isa::Avx512;
            }
            if avx2_fma() {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    })
}

#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// Every instruction set this machine can run, best first (for tests and benchmarks).
pub fn available() -> Vec<Isa> {
    let mut all = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if best() == Isa::Avx512 {
            all.push(Isa::Avx512);
        }
        if avx2_fma() {
            all.push(Isa::Avx2);
        }
    }
    all.push(Isa::Portable);
    all
}

/// Coefficients `c1..c5` of the vector kernels' `2^f = 1 + f (c1 + f (c2 + f (c3 + f (c4 + f c5))))`
/// on `[-0.5, 0.5]` (Horner with FMAs in f32): a minimax fit of the relative error with the
/// constant term pinned to 1, so that `2^0` is exactly 1 as in the portable code. Max relative
/// error 1.62e-7 (1.4 ulp). The earlier free fit had 2.13e-7 and `2^0 = 1.0000001`: every row's
/// largest probability, and so the one-hot rows of attention sinks, carried that factor.
/// (`c1` is a fitted value, not `ln 2`.)
#[allow(clippy::approx_constant)]
const EXP2_POLY: [f32; 5] = [
    0.693_147,
    0.240_222_42,
    0.055_507_217,
    0.009_671_511,
    0.001_326_821_5,
];

/// Below this `|x|`, the kernels' `tanh(x) = x P(x^2)` with `P` of [`TANH_POLY`]; at and above,
/// `sign(x) (1 - e) / (1 + e)` with `e = 2^(-2 |x| log2 e) <= e^-1.25` (so `1 - e >= 0.71`:
/// no cancellation).
const TANH_SPLIT: f32 = 0.625;

/// Coefficients of `P(u)`, highest power first, with `tanh(x) / x = P(x^2)` on
/// `|x| < TANH_SPLIT` (Horner in `u = x^2`): a Chebyshev fit of degree 5 in `u` on
/// `[0, TANH_SPLIT^2]`, max error 3.9e-9 (a sixteenth of an f32 ulp at 1); the fitted constant
/// `0.999999996` is 1 in f32, so `tanh(x) = x` exactly for tiny `x`.
#[allow(clippy::excessive_precision)]
const TANH_POLY: [f32; 6] = [
    -0.005_657_135_184_38,
    0.020_588_191_454_6,
    -0.053_720_107_656_6,
    0.133_311_140_557,
    -0.333_332_598_629,
    1.0,
];

/// Width of a column chunk of the right-hand operand (two 16-lane vectors).
pub const CHUNK: usize = 32;

/// Strided operands of `C (m x n) (+)= A (m x k) * B (k x n)`.
///
/// `a(r, t) = a[r * a_rs + t * a_ks]`; B is stored in column chunks of [`CHUNK`] columns:
/// `b(t, col) = b[(col / CHUNK) * b_cs + t * b_rs + col % CHUNK]`; `c(r, col) = c[r * c_rs + col]`.
/// `n` must be a multiple of 16. With `accumulate` C is added to, otherwise overwritten.
#[derive(Clone, Copy, Debug)]
pub struct MatMul {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_rs: usize,
    pub a_ks: usize,
    pub b_rs: usize,
    pub b_cs: usize,
    pub c_rs: usize,
    pub accumulate: bool,
}

impl MatMul {
    /// Checks the slices against the strides; false when C is empty (nothing to do). Panics
    /// (internal bug, never user input) when a slice is too short.
    fn check(&self, a: &[f32], b: &[f32], c: &[f32]) -> bool {
        let s = *self;
        if s.m == 0 || s.n == 0 {
            return false;
        }
        assert!(
            s.n.is_multiple_of(16),
            "matmul: n = {} not a multiple of 16",
            s.n
        );
        if s.k > 0 {
            let a_need = (s.m - 1) * s.a_rs + (s.k - 1) * s.a_ks + 1;
            let last_chunk = (s.n - 1) / CHUNK;
            let last_w = s.n - last_chunk * CHUNK;
            let b_need = last_chunk * s.b_cs + (s.k - 1) * s.b_rs + last_w;
            assert!(a.len() >= a_need, "matmul: a too short");
            assert!(b.len() >= b_need, "matmul: b too short");
        }
        assert!(c.len() >= (s.m - 1) * s.c_rs + s.n, "matmul: c too short");
        true
    }

    /// Runs the product. Panics (internal bug, never user input) when a slice is too short.
    pub fn run(&self, isa: Isa, a: &[f32], b: &[f32], c: &mut [f32]) {
        if !self.check(a, b, c) {
            return;
        }
        let s = *self;
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the extents were checked above and `Isa::Avx512` is only produced by
            // `detect()` on a CPU with AVX-512F.
            Isa::Avx512 => unsafe {
                avx512::matmul(&s, s.k.max(1), a.as_ptr(), b.as_ptr(), c.as_mut_ptr())
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; `Isa::Avx2` is only used on a CPU with AVX2 and FMA.
            Isa::Avx2 => unsafe { avx2::matmul(&s, a.as_ptr(), b.as_ptr(), c.as_mut_ptr()) },
            _ => portable::matmul(&s, a, b, c),
        }
    }

    /// `C (+)= A B` with the depth summed in chains of `chain` products: each chain sums from
    /// zero, and the chains' sums are added in depth order to C (with `accumulate`) or to the
    /// first one's. The same bits as [`MatMul::run`] over each chain in turn, the first with
    /// this call's `accumulate` and the others with it set (which is what the other instruction
    /// sets do). On AVX-512 the running sum of the chains stays in registers beside the
    /// chain's own (8 rows by 32 columns, 16 accumulators each): C is written once per block
    /// instead of once per chain (Zen 4, 2048 x 384 x 1536 and similar: 2-6% faster than a
    /// call per chain of 64). [`MatMul::run`] is this with one chain.
    pub fn run_chained(&self, isa: Isa, chain: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
        assert!(chain > 0, "matmul: empty chain");
        if !self.check(a, b, c) {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 {
            // SAFETY: the extents were checked above and `Isa::Avx512` is only produced by
            // `detect()` on a CPU with AVX-512F.
            unsafe { avx512::matmul(self, chain, a.as_ptr(), b.as_ptr(), c.as_mut_ptr()) };
            return;
        }
        let mut t0 = 0;
        while t0 < self.k.max(1) {
            let len = chain.min(self.k - t0);
            let part = MatMul {
                k: len,
                accumulate: self.accumulate || t0 > 0,
                ..*self
            };
            part.run(isa, &a[t0 * self.a_ks..], &b[t0 * self.b_rs..], c);
            t0 += len.max(1);
        }
    }
}

/// Largest element of `x` (`-inf` when empty). NaN elements are skipped (attention's rows:
/// the caller decides what a NaN score means), or, with `NAN`, make the result NaN (a loss
/// row: a NaN logit must give a NaN loss, as PyTorch's does).
pub fn row_max<const NAN: bool>(isa: Isa, x: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (see `detect`); the kernel stays inside `x`.
        Isa::Avx512 => unsafe { avx512::row_max::<NAN>(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (see `Isa::Avx2`); the kernel stays in its slices.
        Isa::Avx2 => unsafe { avx2::row_max::<NAN>(x) },
        _ => portable::row_max::<NAN>(x),
    }
}

/// `x[j] = 2^(x[j] - m)` (0 for `-inf` and NaN; `x[j] - m` above 127 is clamped to 127, so
/// every result is finite) and returns the sum of the results. `m` must be finite.
pub fn exp2_shift_sum(isa: Isa, x: &mut [f32], m: f32) -> f32 {
    let (n, p) = (x.len(), x.as_mut_ptr());
    // SAFETY: source and destination are `x` (one pointer), read before written, element by
    // element.
    unsafe { shift_sum::<false, true>(isa, p, p, n, m) }
}

/// `x[j] = 2^((x[j] - shift) log2 e)`, each `(x[j] - shift) log2 e` rounded to f32 as written
/// (so `exp2_shift_sum` of those values, bit for bit), and the sum of the results.
pub fn exp_shift_sum(isa: Isa, x: &mut [f32], shift: f32) -> f32 {
    let (n, p) = (x.len(), x.as_mut_ptr());
    // SAFETY: as above.
    unsafe { shift_sum::<true, true>(isa, p, p, n, shift) }
}

/// The sum of `e^(x[j] - shift)` as [`exp_shift_sum`] computes it (the same bits), `x` unchanged.
pub fn exp_shift_sum_of(isa: Isa, x: &[f32], shift: f32) -> f32 {
    // SAFETY: with `STORE = false` nothing is written through the pointer.
    unsafe { shift_sum::<true, false>(isa, x.as_ptr(), x.as_ptr() as *mut f32, x.len(), shift) }
}

/// The kernels above: reads `n` elements at `src`, writes them at `dst` when `STORE` (`src`
/// and `dst` may be the same; each element is read before it is written).
///
/// # Safety
/// `src` readable and (with `STORE`) `dst` writable for `n` elements.
unsafe fn shift_sum<const NATURAL: bool, const STORE: bool>(
    isa: Isa,
    src: *const f32,
    dst: *mut f32,
    n: usize,
    m: f32,
) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (see `detect`); the caller's contract covers the memory.
        Isa::Avx512 => avx512::shift_sum::<NATURAL, STORE>(src, dst, n, m),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (see `Isa::Avx2`); as above.
        Isa::Avx2 => avx2::shift_sum::<NATURAL, STORE>(src, dst, n, m),
        _ => {
            let mut s = 0.0f32;
            for j in 0..n {
                let e = portable::exp2(portable::shifted::<NATURAL>(*src.add(j), m));
                if STORE {
                    *dst.add(j) = e;
                }
                s += e;
            }
            s
        }
    }
}

/// `x *= a`.
pub fn scale_row(isa: Isa, x: &mut [f32], a: f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { avx512::scale_row(x, a) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (see `Isa::Avx2`); the kernel stays in its slices.
        Isa::Avx2 => unsafe { avx2::scale_row(x, a) },
        _ => x.iter_mut().for_each(|v| *v *= a),
    }
}

/// Logit soft-cap of a row of scores: `x[j] = post * tanh(pre * x[j])` and, given `deriv`
/// (as long as `x`), `deriv[j] = 1 - tanh^2(pre * x[j])` (computed as `(1 - t)(1 + t)`).
///
/// The kernels' `tanh`: `x P(x^2)` below [`TANH_SPLIT`] ([`TANH_POLY`]), `(1 - e) / (1 + e)`
/// with the kernels' `e = 2^(-2 |x| log2 e)` above; within about 3 ulp of the exact value
/// (the portable code: the same formulas with libm's `exp2`). NaN stays NaN, `+-inf` gives
/// `+-1`.
pub fn softcap_row(isa: Isa, x: &mut [f32], pre: f32, post: f32, deriv: Option<&mut [f32]>) {
    if let Some(d) = &deriv {
        assert!(d.len() >= x.len(), "softcap_row: deriv too short");
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (see `detect`); the kernel stays inside `x` and `deriv`
        // (checked above).
        Isa::Avx512 => unsafe { avx512::softcap_row(x, pre, post, deriv) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (see `Isa::Avx2`); the kernel stays in its slices.
        Isa::Avx2 => unsafe { avx2::softcap_row(x, pre, post, deriv) },
        _ => match deriv {
            Some(d) => x.iter_mut().zip(d.iter_mut()).for_each(|(v, d)| {
                let t = portable::tanh(pre * *v);
                *v = post * t;
                *d = (1.0 - t) * (1.0 + t);
            }),
            None => x
                .iter_mut()
                .for_each(|v| *v = post * portable::tanh(pre * *v)),
        },
    }
}

/// `g[j] *= d[j]` over `g` (`d` at least as long).
pub fn mul_row(isa: Isa, g: &mut [f32], d: &[f32]) {
    assert!(d.len() >= g.len(), "mul_row: d too short");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (see `detect`); both slices hold `g.len()` elements.
        Isa::Avx512 => unsafe { avx512::mul_row(g, d) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (see `Isa::Avx2`); the kernel stays in its slices.
        Isa::Avx2 => unsafe { avx2::mul_row(g, d) },
        _ => g.iter_mut().zip(d).for_each(|(g, d)| *g *= d),
    }
}

/// Backward row step: `p[j] = e^(p[j] ln 2 - lse)`, the probabilities from scores `p[j]` in
/// log2 units and the row's natural-log `lse`, then `g[j] = p[j] * (g[j] - d)` (dS from dP).
/// `lse` must be finite; `p` as long as `g`.
///
/// The score goes back to natural units as `p[j] * ln 2` rounded, the product the forward's
/// `lse = (m + log2 l) * ln 2` rounds, and is then compared with `lse` in natural units: for a
/// one-hot row (l = 1) the dominant key gets exactly `e^0 = 1`. Converting `lse` to log2 units
/// instead (`lse * log2 e`) would not give back `m` and would scale the whole row's P, and the
/// gradients, by about `1 + |lse| * 6e-8`.
pub fn p_ds_row(isa: Isa, p: &mut [f32], g: &mut [f32], lse: f32, d: f32) {
    assert!(p.len() >= g.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (see `detect`); both slices hold `g.len()` elements.
        Isa::Avx512 => unsafe { avx512::p_ds_row(p, g, lse, d) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (see `Isa::Avx2`); the kernel stays in its slices.
        Isa::Avx2 => unsafe { avx2::p_ds_row(p, g, lse, d) },
        _ => {
            for (pv, gv) in p.iter_mut().zip(g.iter_mut()) {
                *pv = portable::p_of(*pv, lse);
                *gv = *pv * (*gv - d);
            }
        }
    }
}

/// `out[r] = sum_t a[r * a_rs + t] * b[r * b_rs + t]` over `t < len`, for every `r <
/// out.len()`, each summed in index order with the rounding of this ISA's [`MatMul`] (one fused
/// multiply-add per term on AVX2 and AVX-512, a product then a sum in the portable code).
///
/// The backward's `D = rowsum(dO * O)` must use this order: when a softmax row is one-hot, `O` is
/// the dominant key's value and `D` then equals that key's `dP` (a [`MatMul`] entry) bit for bit,
/// so that `dS = P (dP - D)` is exactly 0, as it is mathematically. Any other summation order
/// leaves a rounding difference that `dS` turns into gradients of about 1e-5 where the true ones
/// are 0. Panics (internal bug) when a slice is too short.
pub fn row_dots(
    isa: Isa,
    a: &[f32],
    a_rs: usize,
    b: &[f32],
    b_rs: usize,
    len: usize,
    out: &mut [f32],
) {
    let rows = out.len();
    if rows == 0 {
        return;
    }
    if len > 0 {
        assert!(a.len() >= (rows - 1) * a_rs + len, "row_dots: a too short");
        assert!(b.len() >= (rows - 1) * b_rs + len, "row_dots: b too short");
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: both vector ISAs imply FMA (see `detect`); the extents were checked above.
        Isa::Avx512 | Isa::Avx2 => unsafe { fma_row_dots(a, a_rs, b, b_rs, len, out) },
        _ => {
            for (r, o) in out.iter_mut().enumerate() {
                let (ar, br) = (&a[r * a_rs..r * a_rs + len], &b[r * b_rs..r * b_rs + len]);
                *o = ar.iter().zip(br).fold(0.0f32, |s, (x, y)| s + x * y);
            }
        }
    }
}

/// [`row_dots`] with a fused multiply-add per term; eight rows at a time, so that their
/// dependency chains overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn fma_row_dots(
    a: &[f32],
    a_rs: usize,
    b: &[f32],
    b_rs: usize,
    len: usize,
    out: &mut [f32],
) {
    const G: usize = 8;
    for (g, o) in out.chunks_mut(G).enumerate() {
        let r0 = g * G;
        let mut acc = [0.0f32; G];
        for t in 0..len {
            for (r, s) in acc.iter_mut().enumerate().take(o.len()) {
                *s = a[(r0 + r) * a_rs + t].mul_add(b[(r0 + r) * b_rs + t], *s);
            }
        }
        o.copy_from_slice(&acc[..o.len()]);
    }
}

/// Walks C in blocks of at most `mr` rows by one column chunk of [`CHUNK`] columns, calling
/// `block(chunk, first_row, rows)` for each, in the order that keeps operands in L1: when A is
/// column-major (`a_rs == 1`, a transposed tile) a strip of A's rows stays while the chunks of B
/// go by; otherwise a chunk of B (`k x 32`) stays while A's rows stream by.
#[cfg(target_arch = "x86_64")]
#[inline]
fn for_each_block(s: &MatMul, mr: usize, mut block: impl FnMut(usize, usize, usize)) {
    let chunks = s.n.div_ceil(CHUNK);
    if s.a_rs == 1 {
        let mut i = 0;
        while i < s.m {
            let rows = (s.m - i).min(mr);
            for ch in 0..chunks {
                block(ch, i, rows);
            }
            i += rows;
        }
    } else {
        for ch in 0..chunks {
            let mut i = 0;
            while i < s.m {
                let rows = (s.m - i).min(mr);
                block(ch, i, rows);
                i += rows;
            }
        }
    }
}

/// `log2(e) - LOG2_E`: the f32 constant's own rounding error, for [`exp_in_place`].
const LOG2E_LO: f32 = 1.925_963e-8;

/// `x[j] = e^(x[j])` within 2.5e-7 relative (2 ulps) at every argument: `2^t` of the
/// kernels' exponential at `t = x log2 e` rounded to f32, times `1 + ln 2 (x log2 e - t)` with
/// that rounding error taken exactly (an FMA, and the constant's own error). `2^t` alone is off
/// by up to `|t|` ulps of the result (`t`'s rounding). `t` below -126 (`-inf`, NaN) gives 0,
/// above 127 `2^127` (finite, uncorrected), as [`exp2_shift_sum`].
pub fn exp_in_place(isa: Isa, x: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { avx512::exp_in_place(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (see `Isa::Avx2`); the kernel stays in its slices.
        Isa::Avx2 => unsafe { avx2::exp_in_place(x) },
        _ => x.iter_mut().for_each(|v| *v = portable::exp(*v)),
    }
}

mod portable {
    use super::{MatMul, CHUNK, TANH_POLY, TANH_SPLIT};
    use std::f32::consts::{LN_2, LOG2_E};

    /// Scalar `2^x` with the same convention as the vector ones (0 below -126, NaN included;
    /// arguments above 127 clamped to 127, so the result stays finite).
    #[inline]
    pub fn exp2(x: f32) -> f32 {
        if x >= -126.0 {
            x.min(127.0).exp2()
        } else {
            0.0
        }
    }

    /// See `super::row_max`.
    pub fn row_max<const NAN: bool>(x: &[f32]) -> f32 {
        if NAN && x.iter().any(|v| v.is_nan()) {
            return f32::NAN;
        }
        x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }

    /// The exponent of `shift_sum` in log2 units: `x - m`, or with `NATURAL` `(x - m) log2 e`
    /// (`exp_shifted`'s two passes subtracted a shift of 0 there, which changes no bit).
    #[inline(always)]
    pub fn shifted<const NATURAL: bool>(x: f32, m: f32) -> f32 {
        if NATURAL {
            (x - m) * LOG2_E
        } else {
            x - m
        }
    }

    /// See `super::exp_in_place` (`mul_add`: an FMA where the target has one).
    #[inline]
    pub fn exp(x: f32) -> f32 {
        let t = x * LOG2_E;
        let e = exp2(t);
        if (-126.0..127.0).contains(&t) {
            let lo = x.mul_add(LOG2_E, -t) + x * super::LOG2E_LO;
            e * LN_2.mul_add(lo, 1.0)
        } else {
            e
        }
    }

    /// Scalar `tanh` with the formulas of the vector kernels (see `softcap_row`).
    #[inline]
    pub fn tanh(x: f32) -> f32 {
        if x.is_nan() {
            return x;
        }
        let a = x.abs();
        if a < TANH_SPLIT {
            let u = x * x;
            let p = TANH_POLY[1..].iter().fold(TANH_POLY[0], |p, &c| p * u + c);
            x * p
        } else {
            let e = exp2(a * (-2.0 * LOG2_E));
            ((1.0 - e) / (1.0 + e)).copysign(x)
        }
    }

    /// `e^(s ln 2 - lse)` for a score `s` in log2 units, see `p_ds_row`.
    #[inline]
    pub fn p_of(s: f32, lse: f32) -> f32 {
        exp2((s * LN_2 - lse) * LOG2_E)
    }

    /// Like the vector kernels, each output sums this call's `k` products from 0 and is then
    /// added to C (with `accumulate`): successive calls over depth chunks do not extend one
    /// running sum in C (which `gemm`'s short accumulation chains rely on).
    pub fn matmul(s: &MatMul, a: &[f32], b: &[f32], c: &mut [f32]) {
        let mut acc = [0.0f32; CHUNK];
        for r in 0..s.m {
            let crow = &mut c[r * s.c_rs..r * s.c_rs + s.n];
            let mut col0 = 0;
            while col0 < s.n {
                let w = (s.n - col0).min(CHUNK);
                let acc = &mut acc[..w];
                acc.fill(0.0);
                for t in 0..s.k {
                    let av = a[r * s.a_rs + t * s.a_ks];
                    let bo = (col0 / CHUNK) * s.b_cs + t * s.b_rs;
                    for (x, bv) in acc.iter_mut().zip(&b[bo..bo + w]) {
                        *x += av * bv;
                    }
                }
                let dst = &mut crow[col0..col0 + w];
                if s.accumulate {
                    dst.iter_mut().zip(acc.iter()).for_each(|(d, x)| *d += x);
                } else {
                    dst.copy_from_slice(acc);
                }
                col0 += w;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{for_each_block, MatMul, CHUNK, EXP2_POLY, TANH_POLY, TANH_SPLIT};
    use std::arch::x86_64::*;
    use std::f32::consts::{LN_2, LOG2_E};

    /// Register block: `MR` rows x `NV` 16-lane vectors of C over a depth `k` summed in
    /// chains of `chain` products. `r` sums one chain from zero; a single chain is stored (or,
    /// with `accumulate`, added) to C as it is; over several, `total` takes the first chain's
    /// sum (added to C's block with `accumulate`) and then each further one in depth order, and
    /// is stored once. `MR <= 8` with `NV = 2` is 16 accumulators per set: while a later chain
    /// runs, `total` lives beside `r` (the compiler keeps the chain's loop in registers).
    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel<const MR: usize, const NV: usize>(
        k: usize,
        chain: usize,
        a: *const f32,
        a_rs: usize,
        a_ks: usize,
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
        accumulate: bool,
    ) {
        // Independent row pointers with a shared offset: no serial address chain across rows.
        let rows: [*const f32; MR] = std::array::from_fn(|i| a.add(i * a_rs));
        let mut off = 0usize;
        let mut bp = b;
        let mut total = [[_mm512_setzero_ps(); NV]; MR];
        let mut t0 = 0;
        loop {
            let len = chain.min(k - t0);
            let mut r = [[_mm512_setzero_ps(); NV]; MR];
            for _ in 0..len {
                let mut bv = [_mm512_setzero_ps(); NV];
                for (v, x) in bv.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(bp.add(v * 16));
                }
                for (i, ri) in r.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*rows[i].add(off));
                    for v in 0..NV {
                        ri[v] = _mm512_fmadd_ps(av, bv[v], ri[v]);
                    }
                }
                off += a_ks;
                bp = bp.add(b_rs);
            }
            let last = t0 + len >= k;
            if t0 == 0 && last {
                store_block(&r, c, c_rs, accumulate);
                return;
            }
            if t0 == 0 {
                total = r;
                if accumulate {
                    for (i, ti) in total.iter_mut().enumerate() {
                        for (v, x) in ti.iter_mut().enumerate() {
                            *x = _mm512_add_ps(_mm512_loadu_ps(c.add(i * c_rs + v * 16)), *x);
                        }
                    }
                }
            } else {
                for (ti, ri) in total.iter_mut().zip(&r) {
                    for v in 0..NV {
                        ti[v] = _mm512_add_ps(ti[v], ri[v]);
                    }
                }
            }
            t0 += len;
            if last {
                break;
            }
        }
        store_block(&total, c, c_rs, false);
    }

    /// Writes (or, with `accumulate`, adds) a register block to C: row `i`, vector `v` at
    /// `c + i * c_rs + 16 v`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn store_block<const MR: usize, const NV: usize>(
        r: &[[__m512; NV]; MR],
        c: *mut f32,
        c_rs: usize,
        accumulate: bool,
    ) {
        for (i, ri) in r.iter().enumerate() {
            for (v, x) in ri.iter().enumerate() {
                let cp = c.add(i * c_rs + v * 16);
                let y = if accumulate {
                    _mm512_add_ps(_mm512_loadu_ps(cp), *x)
                } else {
                    *x
                };
                _mm512_storeu_ps(cp, y);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel_rows<const NV: usize>(
        rows: usize,
        k: usize,
        chain: usize,
        a: *const f32,
        a_rs: usize,
        a_ks: usize,
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
        acc: bool,
    ) {
        match rows {
            1 => kernel::<1, NV>(k, chain, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
            2 => kernel::<2, NV>(k, chain, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
            3 => kernel::<3, NV>(k, chain, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
            4 => kernel::<4, NV>(k, chain, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
            5 => kernel::<5, NV>(k, chain, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
            6 => kernel::<6, NV>(k, chain, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
            7 => kernel::<7, NV>(k, chain, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
            _ => kernel::<8, NV>(k, chain, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
        }
    }

    /// See [`MatMul::run_chained`] (a `chain` of at least `k` is [`MatMul::run`]); the caller
    /// has checked the extents.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn matmul(s: &MatMul, chain: usize, a: *const f32, b: *const f32, c: *mut f32) {
        let full = s.n / CHUNK;
        for_each_block(s, 8, |ch, i, rows| {
            let (ap, bp, cp) = (
                a.add(i * s.a_rs),
                b.add(ch * s.b_cs),
                c.add(i * s.c_rs + ch * CHUNK),
            );
            let (k, ars, aks, brs, crs, acc) = (s.k, s.a_rs, s.a_ks, s.b_rs, s.c_rs, s.accumulate);
            if ch < full {
                kernel_rows::<2>(rows, k, chain, ap, ars, aks, bp, brs, cp, crs, acc);
            } else {
                // `n` is a multiple of 16: the last, partial chunk is one vector wide.
                kernel_rows::<1>(rows, k, chain, ap, ars, aks, bp, brs, cp, crs, acc);
            }
        });
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn tail_mask(rem: usize) -> __mmask16 {
        ((1u32 << rem) - 1) as __mmask16
    }

    /// See `super::row_max`: `_mm512_max_ps(v, m)` returns its second operand `m` when `v` is
    /// NaN, so NaNs are skipped; with `NAN` an unordered compare of each vector with itself
    /// marks them.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn row_max<const NAN: bool>(x: &[f32]) -> f32 {
        let n = x.len();
        let p = x.as_ptr();
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut m0 = ninf;
        let mut m1 = ninf;
        let mut nan: __mmask16 = 0;
        let mut j = 0;
        let mut take = |m: __m512, v: __m512| {
            if NAN {
                nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            }
            _mm512_max_ps(v, m)
        };
        while j + 32 <= n {
            m0 = take(m0, _mm512_loadu_ps(p.add(j)));
            m1 = take(m1, _mm512_loadu_ps(p.add(j + 16)));
            j += 32;
        }
        while j + 16 <= n {
            m0 = take(m0, _mm512_loadu_ps(p.add(j)));
            j += 16;
        }
        if j < n {
            let v = _mm512_mask_loadu_ps(ninf, tail_mask(n - j), p.add(j));
            m1 = take(m1, v);
        }
        if NAN && nan != 0 {
            return f32::NAN;
        }
        _mm512_reduce_max_ps(_mm512_max_ps(m0, m1))
    }

    /// `2^x`, 0 below -126 (so `-inf` and NaN give 0), relative error below 1.7e-7 and
    /// exactly 1 at 0 (see `EXP2_POLY`); inputs above 127 are clamped, as on every instruction
    /// set (the attention kernels only pass `x <= 0` up to rounding; `exp_shifted`'s callers, a
    /// GELU's `e^{-2u}` among them, rely on a finite result).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp2(x: __m512) -> __m512 {
        let valid = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(-126.0));
        let x = _mm512_min_ps(x, _mm512_set1_ps(127.0));
        let n = _mm512_roundscale_ps::<0x08>(x);
        let f = _mm512_sub_ps(x, n);
        // 2^f on [-0.5, 0.5], see `EXP2_POLY`: 1 + f (c1 + f (c2 + ...)).
        let mut p = _mm512_set1_ps(EXP2_POLY[4]);
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[3]));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[2]));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[1]));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[0]));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0));
        _mm512_maskz_mov_ps(valid, _mm512_scalef_ps(p, n))
    }

    /// `e^x` of 16 lanes, see `super::exp_in_place`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp(x: __m512) -> __m512 {
        let t = _mm512_mul_ps(x, _mm512_set1_ps(LOG2_E));
        let lo = _mm512_fmadd_ps(
            x,
            _mm512_set1_ps(super::LOG2E_LO),
            _mm512_fmsub_ps(x, _mm512_set1_ps(LOG2_E), t),
        );
        let e = exp2(t);
        let ok = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(t, _mm512_set1_ps(127.0))
            & _mm512_cmp_ps_mask::<_CMP_GE_OQ>(t, _mm512_set1_ps(-126.0));
        let c = _mm512_fmadd_ps(lo, _mm512_set1_ps(LN_2), _mm512_set1_ps(1.0));
        _mm512_mask_mul_ps(e, ok, e, c)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_in_place(x: &mut [f32]) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let mut j = 0;
        while j + 16 <= n {
            _mm512_storeu_ps(p.add(j), exp(_mm512_loadu_ps(p.add(j))));
            j += 16;
        }
        if j < n {
            let k = tail_mask(n - j);
            _mm512_mask_storeu_ps(p.add(j), k, exp(_mm512_maskz_loadu_ps(k, p.add(j))));
        }
    }

    /// See `super::shift_sum`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn shifted<const NATURAL: bool>(x: __m512, m: __m512) -> __m512 {
        if NATURAL {
            _mm512_mul_ps(_mm512_sub_ps(x, m), _mm512_set1_ps(LOG2_E))
        } else {
            _mm512_sub_ps(x, m)
        }
    }

    /// See `super::shift_sum`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn shift_sum<const NATURAL: bool, const STORE: bool>(
        src: *const f32,
        dst: *mut f32,
        n: usize,
        m: f32,
    ) -> f32 {
        let mv = _mm512_set1_ps(m);
        let mut s0 = _mm512_setzero_ps();
        let mut s1 = _mm512_setzero_ps();
        let mut j = 0;
        while j + 32 <= n {
            let e0 = exp2(shifted::<NATURAL>(_mm512_loadu_ps(src.add(j)), mv));
            let e1 = exp2(shifted::<NATURAL>(_mm512_loadu_ps(src.add(j + 16)), mv));
            if STORE {
                _mm512_storeu_ps(dst.add(j), e0);
                _mm512_storeu_ps(dst.add(j + 16), e1);
            }
            s0 = _mm512_add_ps(s0, e0);
            s1 = _mm512_add_ps(s1, e1);
            j += 32;
        }
        while j < n {
            let k = tail_mask((n - j).min(16));
            let e = exp2(shifted::<NATURAL>(_mm512_maskz_loadu_ps(k, src.add(j)), mv));
            let e = _mm512_maskz_mov_ps(k, e);
            if STORE {
                _mm512_mask_storeu_ps(dst.add(j), k, e);
            }
            s0 = _mm512_add_ps(s0, e);
            j += 16;
        }
        _mm512_reduce_add_ps(_mm512_add_ps(s0, s1))
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn scale_row(x: &mut [f32], a: f32) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let av = _mm512_set1_ps(a);
        let mut j = 0;
        while j < n {
            let k = tail_mask((n - j).min(16));
            let v = _mm512_maskz_loadu_ps(k, p.add(j));
            _mm512_mask_storeu_ps(p.add(j), k, _mm512_mul_ps(v, av));
            j += 16;
        }
    }

    /// `tanh(x)`, see `super::softcap_row`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn tanh(x: __m512) -> __m512 {
        let a = _mm512_abs_ps(x);
        let u = _mm512_mul_ps(x, x);
        let mut p = _mm512_set1_ps(TANH_POLY[0]);
        for &c in &TANH_POLY[1..] {
            p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(c));
        }
        let small = _mm512_mul_ps(x, p);
        let one = _mm512_set1_ps(1.0);
        let e = exp2(_mm512_mul_ps(a, _mm512_set1_ps(-2.0 * LOG2_E)));
        let r = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        let sign = _mm512_and_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN));
        let large = _mm512_castsi512_ps(_mm512_or_epi32(_mm512_castps_si512(r), sign));
        let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, _mm512_set1_ps(TANH_SPLIT));
        let y = _mm512_mask_blend_ps(is_small, large, small);
        // NaN (unordered with itself) stays NaN.
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), y, x)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn softcap_row(x: &mut [f32], pre: f32, post: f32, deriv: Option<&mut [f32]>) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let dp = deriv.map(|d| d.as_mut_ptr());
        let (prev, postv, one) = (
            _mm512_set1_ps(pre),
            _mm512_set1_ps(post),
            _mm512_set1_ps(1.0),
        );
        let mut j = 0;
        while j < n {
            let k = tail_mask((n - j).min(16));
            let t = tanh(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, p.add(j)), prev));
            _mm512_mask_storeu_ps(p.add(j), k, _mm512_mul_ps(postv, t));
            if let Some(dp) = dp {
                let dv = _mm512_mul_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));
                _mm512_mask_storeu_ps(dp.add(j), k, dv);
            }
            j += 16;
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn mul_row(g: &mut [f32], d: &[f32]) {
        let n = g.len();
        let (gp, dp) = (g.as_mut_ptr(), d.as_ptr());
        let mut j = 0;
        while j < n {
            let k = tail_mask((n - j).min(16));
            let v = _mm512_mul_ps(
                _mm512_maskz_loadu_ps(k, gp.add(j)),
                _mm512_maskz_loadu_ps(k, dp.add(j)),
            );
            _mm512_mask_storeu_ps(gp.add(j), k, v);
            j += 16;
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn p_ds_row(pr: &mut [f32], gr: &mut [f32], lse: f32, d: f32) {
        let n = gr.len();
        let pp = pr.as_mut_ptr();
        let gp = gr.as_mut_ptr();
        let lv = _mm512_set1_ps(lse);
        let (ln2, log2e) = (_mm512_set1_ps(LN_2), _mm512_set1_ps(LOG2_E));
        let dv = _mm512_set1_ps(d);
        let mut j = 0;
        while j < n {
            let k = tail_mask((n - j).min(16));
            // (s ln 2 - lse) log2 e with separate roundings, as `portable::p_of`.
            let s = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, pp.add(j)), ln2);
            let p = exp2(_mm512_mul_ps(_mm512_sub_ps(s, lv), log2e));
            _mm512_mask_storeu_ps(pp.add(j), k, p);
            let g = _mm512_maskz_loadu_ps(k, gp.add(j));
            _mm512_mask_storeu_ps(gp.add(j), k, _mm512_mul_ps(p, _mm512_sub_ps(g, dv)));
            j += 16;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{for_each_block, portable, MatMul, CHUNK, EXP2_POLY, TANH_POLY, TANH_SPLIT};
    use std::arch::x86_64::*;
    use std::f32::consts::{LN_2, LOG2_E};

    /// Register block: `MR` rows x `NV` 8-lane vectors of C, accumulated over `k`. With
    /// `MR = 3, NV = 4` it uses all 16 registers: 12 accumulators, 3 broadcasts of A and one
    /// vector of B at a time.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel<const MR: usize, const NV: usize>(
        k: usize,
        a: *const f32,
        a_rs: usize,
        a_ks: usize,
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
        accumulate: bool,
    ) {
        let mut r = [[_mm256_setzero_ps(); NV]; MR];
        let rows: [*const f32; MR] = std::array::from_fn(|i| a.add(i * a_rs));
        let mut off = 0usize;
        let mut bp = b;
        for _ in 0..k {
            let av: [__m256; MR] = std::array::from_fn(|i| _mm256_set1_ps(*rows[i].add(off)));
            for v in 0..NV {
                let bv = _mm256_loadu_ps(bp.add(v * 8));
                for (ri, ai) in r.iter_mut().zip(&av) {
                    ri[v] = _mm256_fmadd_ps(*ai, bv, ri[v]);
                }
            }
            off += a_ks;
            bp = bp.add(b_rs);
        }
        for (i, ri) in r.iter().enumerate() {
            for (v, x) in ri.iter().enumerate() {
                let cp = c.add(i * c_rs + v * 8);
                let y = if accumulate {
                    _mm256_add_ps(_mm256_loadu_ps(cp), *x)
                } else {
                    *x
                };
                _mm256_storeu_ps(cp, y);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel_rows<const NV: usize>(
        rows: usize,
        k: usize,
        a: *const f32,
        a_rs: usize,
        a_ks: usize,
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
        acc: bool,
    ) {
        match rows {
            1 => kernel::<1, NV>(k, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
            2 => kernel::<2, NV>(k, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
            _ => kernel::<3, NV>(k, a, a_rs, a_ks, b, b_rs, c, c_rs, acc),
        }
    }

    /// See [`MatMul`]; the caller has checked the extents.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn matmul(s: &MatMul, a: *const f32, b: *const f32, c: *mut f32) {
        let full = s.n / CHUNK;
        for_each_block(s, 3, |ch, i, rows| {
            let (ap, bp, cp) = (
                a.add(i * s.a_rs),
                b.add(ch * s.b_cs),
                c.add(i * s.c_rs + ch * CHUNK),
            );
            let (k, ars, aks, brs, crs, acc) = (s.k, s.a_rs, s.a_ks, s.b_rs, s.c_rs, s.accumulate);
            if ch < full {
                kernel_rows::<4>(rows, k, ap, ars, aks, bp, brs, cp, crs, acc);
            } else {
                // `n` is a multiple of 16: the last, partial chunk is two vectors wide.
                kernel_rows::<2>(rows, k, ap, ars, aks, bp, brs, cp, crs, acc);
            }
        });
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hmax(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// `2^x`, 0 below -126 (so `-inf` and NaN give 0), relative error below 1.7e-7 and exactly
    /// 1 at 0 (the polynomial of the AVX-512 kernel, `EXP2_POLY`); inputs above 127 are clamped
    /// (the kernels only pass `x <= 0` up to rounding).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp2(x: __m256) -> __m256 {
        let valid = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-126.0));
        let x = _mm256_min_ps(x, _mm256_set1_ps(127.0));
        let n = _mm256_round_ps::<0x08>(x);
        let f = _mm256_sub_ps(x, n);
        let mut p = _mm256_set1_ps(EXP2_POLY[4]);
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[3]));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[2]));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[1]));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[0]));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0));
        // 2^n from its exponent bits; n is in [-126, 127] wherever `valid`.
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_and_ps(valid, _mm256_mul_ps(p, _mm256_castsi256_ps(e)))
    }

    /// See `super::row_max` and the AVX-512 kernel.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn row_max<const NAN: bool>(x: &[f32]) -> f32 {
        let n = x.len();
        let p = x.as_ptr();
        let mut m0 = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut m1 = m0;
        let mut nan = _mm256_setzero_ps();
        let mut j = 0;
        let mut take = |m: __m256, v: __m256| {
            if NAN {
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            }
            _mm256_max_ps(v, m)
        };
        while j + 16 <= n {
            m0 = take(m0, _mm256_loadu_ps(p.add(j)));
            m1 = take(m1, _mm256_loadu_ps(p.add(j + 8)));
            j += 16;
        }
        while j + 8 <= n {
            m0 = take(m0, _mm256_loadu_ps(p.add(j)));
            j += 8;
        }
        let tail = super::portable::row_max::<NAN>(&x[j..]);
        if NAN && (_mm256_movemask_ps(nan) != 0 || tail.is_nan()) {
            return f32::NAN;
        }
        hmax(_mm256_max_ps(m0, m1)).max(tail)
    }

    /// `e^x` of 8 lanes, see `super::exp_in_place`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp(x: __m256) -> __m256 {
        let t = _mm256_mul_ps(x, _mm256_set1_ps(LOG2_E));
        let lo = _mm256_fmadd_ps(
            x,
            _mm256_set1_ps(super::LOG2E_LO),
            _mm256_fmsub_ps(x, _mm256_set1_ps(LOG2_E), t),
        );
        let e = exp2(t);
        let ok = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_LT_OQ>(t, _mm256_set1_ps(127.0)),
            _mm256_cmp_ps::<_CMP_GE_OQ>(t, _mm256_set1_ps(-126.0)),
        );
        let c = _mm256_fmadd_ps(lo, _mm256_set1_ps(LN_2), _mm256_set1_ps(1.0));
        _mm256_blendv_ps(e, _mm256_mul_ps(e, c), ok)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_in_place(x: &mut [f32]) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let mut j = 0;
        while j + 8 <= n {
            _mm256_storeu_ps(p.add(j), exp(_mm256_loadu_ps(p.add(j))));
            j += 8;
        }
        for v in &mut x[j..] {
            *v = portable::exp(*v);
        }
    }

    /// See `super::shift_sum`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn shifted<const NATURAL: bool>(x: __m256, m: __m256) -> __m256 {
        if NATURAL {
            _mm256_mul_ps(_mm256_sub_ps(x, m), _mm256_set1_ps(LOG2_E))
        } else {
            _mm256_sub_ps(x, m)
        }
    }

    /// See `super::shift_sum`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn shift_sum<const NATURAL: bool, const STORE: bool>(
        src: *const f32,
        dst: *mut f32,
        n: usize,
        m: f32,
    ) -> f32 {
        let mv = _mm256_set1_ps(m);
        let mut s0 = _mm256_setzero_ps();
        let mut s1 = _mm256_setzero_ps();
        let mut j = 0;
        while j + 16 <= n {
            let e0 = exp2(shifted::<NATURAL>(_mm256_loadu_ps(src.add(j)), mv));
            let e1 = exp2(shifted::<NATURAL>(_mm256_loadu_ps(src.add(j + 8)), mv));
            if STORE {
                _mm256_storeu_ps(dst.add(j), e0);
                _mm256_storeu_ps(dst.add(j + 8), e1);
            }
            s0 = _mm256_add_ps(s0, e0);
            s1 = _mm256_add_ps(s1, e1);
            j += 16;
        }
        while j + 8 <= n {
            let e = exp2(shifted::<NATURAL>(_mm256_loadu_ps(src.add(j)), mv));
            if STORE {
                _mm256_storeu_ps(dst.add(j), e);
            }
            s0 = _mm256_add_ps(s0, e);
            j += 8;
        }
        let mut s = hsum(_mm256_add_ps(s0, s1));
        while j < n {
            let e = portable::exp2(portable::shifted::<NATURAL>(*src.add(j), m));
            if STORE {
                *dst.add(j) = e;
            }
            s += e;
            j += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scale_row(x: &mut [f32], a: f32) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let av = _mm256_set1_ps(a);
        let mut j = 0;
        while j + 8 <= n {
            _mm256_storeu_ps(p.add(j), _mm256_mul_ps(_mm256_loadu_ps(p.add(j)), av));
            j += 8;
        }
        x[j..].iter_mut().for_each(|v| *v *= a);
    }

    /// `tanh(x)`, see `super::softcap_row`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn tanh(x: __m256) -> __m256 {
        let sign_bit = _mm256_set1_ps(-0.0);
        let a = _mm256_andnot_ps(sign_bit, x);
        let u = _mm256_mul_ps(x, x);
        let mut p = _mm256_set1_ps(TANH_POLY[0]);
        for &c in &TANH_POLY[1..] {
            p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(c));
        }
        let small = _mm256_mul_ps(x, p);
        let one = _mm256_set1_ps(1.0);
        let e = exp2(_mm256_mul_ps(a, _mm256_set1_ps(-2.0 * LOG2_E)));
        let r = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        let large = _mm256_or_ps(r, _mm256_and_ps(sign_bit, x));
        let is_small = _mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(TANH_SPLIT));
        let y = _mm256_blendv_ps(large, small, is_small);
        // NaN (unordered with itself) stays NaN.
        _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softcap_row(x: &mut [f32], pre: f32, post: f32, mut deriv: Option<&mut [f32]>) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let dp = deriv.as_mut().map(|d| d.as_mut_ptr());
        let (prev, postv, one) = (
            _mm256_set1_ps(pre),
            _mm256_set1_ps(post),
            _mm256_set1_ps(1.0),
        );
        let mut j = 0;
        while j + 8 <= n {
            let t = tanh(_mm256_mul_ps(_mm256_loadu_ps(p.add(j)), prev));
            _mm256_storeu_ps(p.add(j), _mm256_mul_ps(postv, t));
            if let Some(dp) = dp {
                let dv = _mm256_mul_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
                _mm256_storeu_ps(dp.add(j), dv);
            }
            j += 8;
        }
        for i in j..n {
            let t = portable::tanh(pre * x[i]);
            x[i] = post * t;
            if let Some(d) = deriv.as_mut() {
                d[i] = (1.0 - t) * (1.0 + t);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn mul_row(g: &mut [f32], d: &[f32]) {
        let n = g.len();
        let (gp, dp) = (g.as_mut_ptr(), d.as_ptr());
        let mut j = 0;
        while j + 8 <= n {
            let v = _mm256_mul_ps(_mm256_loadu_ps(gp.add(j)), _mm256_loadu_ps(dp.add(j)));
            _mm256_storeu_ps(gp.add(j), v);
            j += 8;
        }
        g[j..].iter_mut().zip(&d[j..n]).for_each(|(g, d)| *g *= d);
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn p_ds_row(pr: &mut [f32], gr: &mut [f32], lse: f32, d: f32) {
        let n = gr.len();
        let pp = pr.as_mut_ptr();
        let gp = gr.as_mut_ptr();
        let lv = _mm256_set1_ps(lse);
        let (ln2, log2e) = (_mm256_set1_ps(LN_2), _mm256_set1_ps(LOG2_E));
        let dv = _mm256_set1_ps(d);
        let mut j = 0;
        while j + 8 <= n {
            // (s ln 2 - lse) log2 e with separate roundings, as `portable::p_of`.
            let s = _mm256_mul_ps(_mm256_loadu_ps(pp.add(j)), ln2);
            let p = exp2(_mm256_mul_ps(_mm256_sub_ps(s, lv), log2e));
            _mm256_storeu_ps(pp.add(j), p);
            let g = _mm256_loadu_ps(gp.add(j));
            _mm256_storeu_ps(gp.add(j), _mm256_mul_ps(p, _mm256_sub_ps(g, dv)));
            j += 8;
        }
        for (pv, gv) in pr[j..n].iter_mut().zip(gr[j..].iter_mut()) {
            *pv = portable::p_of(*pv, lse);
            *gv = *pv * (*gv - d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn matmul_isas_agree() {
        let mut seed = 1;
        let shapes: [(usize, usize, usize); 6] = [
            (1, 16, 1),
            (13, 48, 7),
            (8, 64, 64),
            (17, 80, 33),
            (4, 112, 129),
            (3, 32, 0),
        ];
        for &(m, n, k) in &shapes {
            for (a_rs, a_ks) in [(k.max(1), 1), (1, m)] {
                let a: Vec<f32> = (0..m * k.max(1) + m).map(|_| lcg(&mut seed)).collect();
                let b_cs = k.max(1) * 32;
                let b: Vec<f32> = (0..n.div_ceil(32) * b_cs).map(|_| lcg(&mut seed)).collect();
                let mm = MatMul {
                    m,
                    n,
                    k,
                    a_rs,
                    a_ks,
                    b_rs: 32,
                    b_cs,
                    c_rs: n + 3,
                    accumulate: true,
                };
                let c0: Vec<f32> = (0..m * (n + 3)).map(|_| lcg(&mut seed)).collect();
                let mut c1 = c0.clone();
                mm.run(Isa::Portable, &a, &b, &mut c1);
                for isa in available() {
                    let mut c2 = c0.clone();
                    mm.run(isa, &a, &b, &mut c2);
                    for (x, y) in c1.iter().zip(&c2) {
                        assert!((x - y).abs() < 1e-5, "{isa:?}: {x} vs {y}");
                    }
                }
            }
        }
    }

    /// `run_chained` gives the bits of `run` over each chain in turn (the first chain with the
    /// call's `accumulate`, the others with it set) on every instruction set: partial register
    /// blocks (1-9 rows), a last column chunk of one vector, depths shorter than, equal to and
    /// not a multiple of the chain, both layouts of A, overwriting and accumulating.
    #[test]
    fn chained_products_give_the_bits_of_one_call_per_chain() {
        let mut seed = 5;
        let shapes: [(usize, usize, usize); 7] = [
            (1, 16, 200),
            (6, 32, 64),
            (7, 48, 65),
            (9, 64, 130),
            (13, 80, 7),
            (20, 112, 191),
            (8, 32, 0),
        ];
        for &(m, n, k) in &shapes {
            for chain in [1usize, 16, 64] {
                for (a_rs, a_ks) in [(k.max(1) + 1, 1), (1, m + 2)] {
                    let a: Vec<f32> = (0..(m + 2) * (k + 1)).map(|_| lcg(&mut seed)).collect();
                    let b_cs = k.max(1) * 32;
                    let b: Vec<f32> = (0..n.div_ceil(32) * b_cs).map(|_| lcg(&mut seed)).collect();
                    let c0: Vec<f32> = (0..m * (n + 3)).map(|_| lcg(&mut seed)).collect();
                    for accumulate in [false, true] {
                        let mm = MatMul {
                            m,
                            n,
                            k,
                            a_rs,
                            a_ks,
                            b_rs: 32,
                            b_cs,
                            c_rs: n + 3,
                            accumulate,
                        };
                        for isa in available() {
                            let mut want = c0.clone();
                            let mut t0 = 0;
                            loop {
                                let len = chain.min(k - t0);
                                let part = MatMul {
                                    k: len,
                                    accumulate: accumulate || t0 > 0,
                                    ..mm
                                };
                                part.run(isa, &a[t0 * a_ks..], &b[t0 * 32..], &mut want);
                                t0 += len;
                                if t0 >= k {
                                    break;
                                }
                            }
                            let mut got = c0.clone();
                            mm.run_chained(isa, chain, &a, &b, &mut got);
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "{isa:?} m={m} n={n} k={k} chain={chain} a_rs={a_rs} acc={accumulate}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// `row_max::<true>` is NaN exactly when the row holds a NaN, wherever it sits (a full
    /// vector, the second accumulator, the tail, alone); `row_max::<false>` is then the
    /// maximum of the other elements. Every instruction set, lengths around the vector widths.
    #[test]
    fn row_max_nan_is_kept_or_skipped_on_every_isa() {
        let mut seed = 11;
        for isa in available() {
            for n in [
                1usize, 2, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 47, 48, 63, 64, 65, 130,
            ] {
                let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 50.0).collect();
                let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(row_max::<true>(isa, &x), max, "{isa:?} n={n}: no NaN");
                assert_eq!(row_max::<false>(isa, &x), max, "{isa:?} n={n}: no NaN");
                for at in 0..n {
                    let mut y = x.clone();
                    y[at] = f32::NAN;
                    let rest = y.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    assert!(
                        row_max::<true>(isa, &y).is_nan(),
                        "{isa:?} n={n}: NaN at {at}"
                    );
                    assert_eq!(
                        row_max::<false>(isa, &y),
                        rest,
                        "{isa:?} n={n}: NaN at {at}"
                    );
                }
            }
        }
    }

    /// `exp_in_place` against float64 on every instruction set: relative error below 2.5e-7
    /// (2 ulps; measured 2.43e-7 on AVX-512 and AVX2) at every argument from -87.3 to 88 (steps of 1/1024, so
    /// `t = x log2 e` takes every rounding), where `2^t` of the rounded `t` alone is off by up to
    /// 3e-6 near the ends; 0 below the range, `-inf` and NaN; `2^127` above it and at `inf`.
    #[test]
    fn exp_in_place_is_within_two_ulps_everywhere() {
        let xs: Vec<f32> = (-89_395..=90_112).map(|i| i as f32 / 1024.0).collect();
        for isa in available() {
            let mut e = xs.clone();
            exp_in_place(isa, &mut e);
            let mut worst = (0f64, 0f32);
            for (&x, &got) in xs.iter().zip(&e) {
                let want = (x as f64).exp();
                let rel = (got as f64 - want).abs() / want;
                if rel > worst.0 {
                    worst = (rel, x);
                }
            }
            assert!(
                worst.0 < 2.5e-7,
                "{isa:?}: relative error {:e} at {}",
                worst.0,
                worst.1
            );
            let mut ends = vec![
                -1e6,
                -100.0,
                -88.0,
                f32::NEG_INFINITY,
                f32::NAN,
                89.0,
                1e6,
                f32::INFINITY,
            ];
            exp_in_place(isa, &mut ends);
            let big = 2f32.powi(127);
            assert_eq!(ends, [0.0, 0.0, 0.0, 0.0, 0.0, big, big, big], "{isa:?}");
        }
    }

    /// `exp_shift_sum` (one pass) gives the bits of the two passes it replaced (`(x - shift)
    /// log2 e` stored, then `exp2_shift_sum` with shift 0), values and sum, and
    /// `exp_shift_sum_of` the same sum without writing: every ISA, lengths around the vector
    /// widths, `-inf`, NaN and arguments past both clamps.
    #[test]
    fn exp_shift_sum_is_the_two_pass_softmax_bit_for_bit() {
        let mut seed = 3;
        for isa in available() {
            for n in (0..70).chain([1000, 32003]) {
                let mut x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 40.0).collect();
                for (at, v) in [
                    (3, f32::NEG_INFINITY),
                    (5, f32::NAN),
                    (17, 300.0),
                    (33, -300.0),
                ] {
                    if at < n {
                        x[at] = v;
                    }
                }
                let shift = 7.25;
                let mut two = x.clone();
                two.iter_mut()
                    .for_each(|v| *v = (*v - shift) * std::f32::consts::LOG2_E);
                let s2 = exp2_shift_sum(isa, &mut two, 0.0);
                let s0 = exp_shift_sum_of(isa, &x, shift);
                let mut one = x.clone();
                let s1 = exp_shift_sum(isa, &mut one, shift);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&one), bits(&two), "{isa:?} n={n}: values");
                assert_eq!(s1.to_bits(), s2.to_bits(), "{isa:?} n={n}: sum");
                assert_eq!(
                    s0.to_bits(),
                    s2.to_bits(),
                    "{isa:?} n={n}: sum without stores"
                );
            }
        }
    }

    #[test]
    fn row_ops_isas_agree() {
        let mut seed = 7;
        for isa in available() {
            for n in [1usize, 5, 8, 9, 15, 16, 17, 31, 32, 47, 130] {
                let mut x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 50.0).collect();
                let masked = n > 1;
                if masked {
                    x[n / 2] = f32::NEG_INFINITY;
                }
                let m1 = row_max::<false>(Isa::Portable, &x);
                let m2 = row_max::<false>(isa, &x);
                assert_eq!(m1, m2, "{isa:?}");
                let mut y1 = x.clone();
                let mut y2 = x.clone();
                let s1 = exp2_shift_sum(Isa::Portable, &mut y1, m1);
                let s2 = exp2_shift_sum(isa, &mut y2, m2);
                assert!((s1 - s2).abs() <= 1e-6 * s1.abs(), "{isa:?}: {s1} vs {s2}");
                for (a, b) in y1.iter().zip(&y2) {
                    assert!(
                        (a - b).abs() <= 1e-6 * a.abs().max(1e-30),
                        "{isa:?}: {a} vs {b}"
                    );
                }
                if masked {
                    assert_eq!(y2[n / 2], 0.0);
                }
                let mut z1 = x.clone();
                let mut z2 = x.clone();
                scale_row(Isa::Portable, &mut z1, 0.37);
                scale_row(isa, &mut z2, 0.37);
                assert_eq!(z1, z2, "{isa:?}");
                let mut p1 = x.clone();
                let mut p2 = x.clone();
                let mut g1: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
                let mut g2 = g1.clone();
                p_ds_row(Isa::Portable, &mut p1, &mut g1, m1 + 0.5, 0.25);
                p_ds_row(isa, &mut p2, &mut g2, m1 + 0.5, 0.25);
                for (a, b) in p1.iter().zip(&p2).chain(g1.iter().zip(&g2)) {
                    assert!(
                        (a - b).abs() <= 1e-6 * a.abs().max(1e-30),
                        "{isa:?}: {a} vs {b}"
                    );
                }
                // Two rows: x[..n/2] (before the -inf) against y1 and against y1 shifted by one.
                let h = n / 2;
                let (mut d1, mut d2) = ([0.0f32; 2], [0.0f32; 2]);
                row_dots(Isa::Portable, &x, 0, &y1, 1, h, &mut d1);
                row_dots(isa, &x, 0, &y1, 1, h, &mut d2);
                for (a, b) in d1.iter().zip(&d2) {
                    assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{isa:?}");
                }
            }
        }
    }

    /// Arguments past both ends of f32's exponent range on every ISA: 0 below -126 (and for NaN
    /// and `-inf`), 2^127 at and above 127 (`+inf` included), never inf or NaN; in between the
    /// ISAs agree within 1e-6 relative.
    #[test]
    fn exp2_is_finite_past_the_exponent_range_on_every_isa() {
        let xs = [
            f32::NEG_INFINITY,
            -1e30,
            -200.0,
            -126.5,
            -30.0,
            0.0,
            30.0,
            126.5,
            127.0,
            127.6,
            128.0,
            200.0,
            1e30,
            f32::INFINITY,
            f32::NAN,
        ];
        for isa in available() {
            // Long enough for the vector loops and a masked tail.
            let mut x: Vec<f32> = xs.iter().cycle().take(3 * xs.len()).copied().collect();
            // (The sum of several 2^127 overflows, as it should.)
            exp2_shift_sum(isa, &mut x, 0.0);
            for (&arg, &got) in xs.iter().cycle().zip(&x) {
                let want = if arg.is_nan() || arg < -126.0 {
                    0.0
                } else {
                    (arg.min(127.0) as f64).exp2()
                };
                assert!(got.is_finite(), "{isa:?}: 2^{arg} = {got}");
                assert!(
                    (got as f64 - want).abs() <= 1e-6 * want,
                    "{isa:?}: 2^{arg} = {got}, want {want}"
                );
            }
        }
    }

    /// `row_dots` of a row of A with row j of V equals the `MatMul` entry (A V^T)[r, j] bit for
    /// bit, on every ISA (the backward's D relies on it).
    #[test]
    fn row_dots_equal_matmul_entries() {
        let mut seed = 11;
        let (m, n, k) = (7usize, 32usize, 80usize);
        let a: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed) * 3.0).collect();
        let v: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
        // V^T in one panel of 32 columns: element (t, j) at t * 32 + j.
        let mut vt = vec![0.0f32; k * n];
        for j in 0..n {
            for t in 0..k {
                vt[t * n + j] = v[j * k + t];
            }
        }
        for isa in available() {
            let mut c = vec![0.0f32; m * n];
            MatMul {
                m,
                n,
                k,
                a_rs: k,
                a_ks: 1,
                b_rs: n,
                b_cs: k * n,
                c_rs: n,
                accumulate: false,
            }
            .run(isa, &a, &vt, &mut c);
            for j in 0..n {
                let mut d = vec![0.0f32; m];
                row_dots(isa, &a, k, &v[j * k..], 0, k, &mut d);
                for r in 0..m {
                    assert_eq!(d[r].to_bits(), c[r * n + j].to_bits(), "{isa:?} ({r}, {j})");
                }
            }
        }
    }

    /// The soft-cap row op against f64 `tanh` on every ISA: within 3e-7 relative (about 3 ulp;
    /// 1e-37 absolute near 0) for `c tanh(x)`, 2e-7 absolute for `1 - tanh^2`; around the split
    /// between the two formulas, tiny, saturated and infinite arguments, NaN kept.
    #[test]
    fn softcap_row_matches_tanh() {
        let mut xs: Vec<f32> = (-6000..=6000).map(|i| i as f32 * 0.0021).collect();
        let split = [TANH_SPLIT, f32::from_bits(TANH_SPLIT.to_bits() - 1)];
        xs.extend(split.iter().flat_map(|&s| [s, -s]));
        xs.extend([0.0, -0.0, 1e-30, -1e-30, 1e-6, 9.0, 30.0, -30.0, 1e30]);
        xs.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
        for isa in available() {
            for (pre, post) in [(1.0f32, 1.0f32), (0.37, 50.0 * std::f32::consts::LOG2_E)] {
                let mut y = xs.clone();
                let mut dy = vec![0.0f32; xs.len()];
                softcap_row(isa, &mut y, pre, post, Some(&mut dy));
                let mut y2 = xs.clone();
                softcap_row(isa, &mut y2, pre, post, None);
                for (i, &x) in xs.iter().enumerate() {
                    assert_eq!(
                        y[i].to_bits(),
                        y2[i].to_bits(),
                        "{isa:?}: with/without deriv"
                    );
                    if x.is_nan() {
                        assert!(y[i].is_nan(), "{isa:?}: NaN not kept");
                        continue;
                    }
                    let t = ((pre * x) as f64).tanh();
                    let want = post as f64 * t;
                    let err = (y[i] as f64 - want).abs();
                    assert!(
                        err <= 3e-7 * want.abs() + 1e-37,
                        "{isa:?}: {post} tanh({pre} * {x}) = {}, want {want}",
                        y[i]
                    );
                    let dwant = 1.0 - t * t;
                    assert!(
                        (dy[i] as f64 - dwant).abs() <= 2e-7,
                        "{isa:?}: 1 - tanh^2({pre} * {x}) = {}, want {dwant}",
                        dy[i]
                    );
                }
            }
            let mut g: Vec<f32> = (0..37).map(|i| i as f32 - 3.5).collect();
            let d: Vec<f32> = (0..37).map(|i| 0.25 * i as f32).collect();
            let want: Vec<f32> = g.iter().zip(&d).map(|(a, b)| a * b).collect();
            mul_row(isa, &mut g, &d);
            assert_eq!(g, want, "{isa:?}: mul_row");
        }
    }

    #[test]
    fn the_best_isa_is_detected() {
        let all = available();
        assert_eq!(all[0], best());
        assert_eq!(all.last(), Some(&Isa::Portable));
        // Without FLASH_RING_ISA the default is the best; with it, the one it names.
        match isa_from_env() {
            Ok(Some(isa)) => assert_eq!(detect(), isa),
            _ => assert_eq!(detect(), best()),
        }
    }

    #[test]
    fn isa_names_parse_and_must_be_available() {
        let all = [Isa::Avx2, Isa::Portable];
        assert_eq!(isa_choice("AVX2", &all), Ok(Isa::Avx2));
        assert_eq!(isa_choice("portable", &all), Ok(Isa::Portable));
        let e = isa_choice("avx512", &all).expect_err("not available");
        assert!(e.contains("cannot run Avx512"), "{e}");
        let e = isa_choice("sse4", &all).expect_err("not a name");
        assert!(e.contains("avx512, avx2 or portable"), "{e}");
    }
}
