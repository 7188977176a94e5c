//! The attention-work count ([`flash_ring::work`]): a sliding window cuts the scores the CPU
//! kernels compute from the causal triangle to about `seq × window`, forward and backward; the
//! count never falls below the pairs the mask allows (every allowed score is computed), and each
//! calling thread counts only its own calls.

use candle_core::{Device, Tensor};
use flash_ring::{flash_bwd_f32, flash_fwd, work, AttnSpec, MaskKind};

fn qkv(s: usize, h: usize, d: usize) -> (Tensor, Tensor, Tensor) {
    let t = |seed: u64| {
        let v: Vec<f32> = (0..s * h * d)
            .map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f32 / 1000.0) - 0.5)
            .collect();
        Tensor::from_vec(v, (1, s, h, d), &Device::Cpu).unwrap()
    };
    (t(1), t(2), t(3))
}

/// (forward, backward) scores of one call pair.
fn count(spec: &AttnSpec, s: usize, h: usize) -> (u64, u64) {
    let (q, k, v) = qkv(s, h, 32);
    work::take_scores();
    let (out, lse) = flash_fwd(&q, &k, &v, spec).unwrap();
    let fwd = work::take_scores();
    let dout = out.ones_like().unwrap();
    flash_bwd_f32(&q, &k, &v, &out, &lse, &dout, spec).unwrap();
    (fwd, work::take_scores())
}

#[test]
fn a_window_cuts_the_work_to_its_band() {
    let (s, h, w) = (1024usize, 2usize, 64usize);
    let causal = AttnSpec::dense(0.2, MaskKind::Causal, s, s);
    let (fc, bc) = count(&causal, s, h);
    let (fw, bw) = count(&causal.clone().with_window(w), s, h);
    let triangle = (h * s * (s + 1) / 2) as u64;
    let band = (h * (s * w - w * (w - 1) / 2)) as u64;
    for (what, got, allowed) in [
        ("causal forward", fc, triangle),
        ("causal backward", bc, triangle),
        ("windowed forward", fw, band),
        ("windowed backward", bw, band),
    ] {
        // Every allowed score is computed; tiles and 32-column strips round up by less than
        // one tile row of columns per strip (at most 2x here).
        assert!(
            got >= allowed,
            "{what}: {got} < the {allowed} allowed scores"
        );
        assert!(
            got <= 2 * allowed,
            "{what}: {got} > 2 x the {allowed} allowed scores"
        );
    }
    assert!(4 * fw < fc, "window {w} of {s}: {fw} vs causal {fc}");
    assert!(4 * bw < bc, "window {w} of {s}: {bw} vs causal {bc}");
}

#[test]
fn each_thread_counts_its_own_calls() {
    let spec = AttnSpec::dense(0.2, MaskKind::Full, 96, 96);
    work::take_scores();
    let other = std::thread::spawn(move || {
        let (q, k, v) = qkv(96, 1, 16);
        flash_fwd(&q, &k, &v, &spec).unwrap();
        work::scores()
    })
    .join()
    .unwrap();
    assert_eq!(other, 96 * 96, "the other thread's full 96 x 96 scores");
    assert_eq!(work::scores(), 0, "this thread ran nothing");
}
