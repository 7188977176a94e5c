//! Picking the next token from logits (temperature, top-p) with a seeded generator: what
//! every model's `cpl generate` samples with.

/// A small deterministic generator (splitmix64) for sampling.
pub struct Rng(pub u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Picks the next token from `logits` (vocab) by temperature and top-p.
pub fn sample(logits: &[f32], temperature: f64, top_p: f64, rng: &mut Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &l)| {
                if l > best.1 {
                    (i, l)
                } else {
                    best
                }
            })
            .0 as u32
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l as f64 - max) / temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = Vec::new();
    let mut acc = 0.0;
    for (i, p) in probs {
        acc += p / total;
        kept.push((i, p));
        if acc >= top_p {
            break;
        }
    }
    let mass: f64 = kept.iter().map(|p| p.1).sum();
    let mut r = rng.next_f64() * mass;
    for (i, p) in &kept {
        r -= p;
        if r <= 0.0 {
            return *i as u32;
        }
    }
    kept.last().map(|k| k.0 as u32).unwrap_or_else(argmax)
}
