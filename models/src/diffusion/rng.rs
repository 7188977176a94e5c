//! The random draws of diffusion training and sampling.

/// A deterministic stream of uniform and normal numbers (splitmix64, Box–Muller): one per
/// (seed, global sample), stable across crate versions and platforms.
pub struct DrawStream {
    state: u64,
    spare: Option<f64>,
}

impl DrawStream {
    pub fn new(seed: u64, sample: u64) -> Self {
        let mut s = Self {
            state: seed ^ sample.wrapping_mul(0xD1B5_4A32_D192_ED03),
            spare: None,
        };
        s.next_u64();
        s
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `(0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u, v) = (self.uniform(), self.uniform());
        let r = (-2.0 * u.ln()).sqrt();
        let a = 2.0 * std::f64::consts::PI * v;
        self.spare = Some(r * a.sin());
        r * a.cos()
    }
}
