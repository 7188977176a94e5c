//! Progress of a training run on the terminal (an `indicatif` bar), in logs (a line every few
//! steps), and the process's peak memory.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Progress of `cpl train`: on a terminal, a bar updated after every step; otherwise (logs,
/// pipes) a line every `log_every` steps.
pub struct Progress {
    total: u64,
    log_every: u64,
    /// The bar, on a terminal.
    bar: Option<ProgressBar>,
}

/// What one step reports to [`Progress::step`].
pub struct StepLine {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_sec: f64,
    pub mfu: f64,
    pub eta_secs: f64,
    /// Further numbers shown after the loss, `(label, value)` (a mixture of experts' balancing
    /// loss and expert load).
    pub extra: Vec<(&'static str, f64)>,
}

impl Progress {
    pub fn new(total: u64, log_every: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            // The template is a constant: it parses.
            if let Ok(style) = ProgressStyle::with_template("[{bar:24}] {pos:>5}/{len}  {msg}") {
                bar.set_style(style.progress_chars("#>-"));
            }
            bar
        });
        Self {
            total,
            log_every: log_every.max(1),
            bar,
        }
    }

    pub fn step(&mut self, s: &StepLine) {
        let extra: String = s
            .extra
            .iter()
            .map(|(k, v)| format!("  {k} {v:.3}"))
            .collect();
        let stats = format!(
            "loss {:.4}{extra}  lr {:.2e}  |g| {:.3}  {:.0} tok/s  MFU {:.1}%  ETA {}",
            s.loss,
            s.lr,
            s.grad_norm,
            s.tokens_per_sec,
            100.0 * s.mfu,
            fmt_duration(s.eta_secs)
        );
        match &self.bar {
            Some(bar) => {
                bar.set_position(s.step);
                bar.set_message(stats);
            }
            None if s.step.is_multiple_of(self.log_every) || s.step == self.total => {
                eprintln!("step {:>5}/{}  {stats}", s.step, self.total);
            }
            None => {}
        }
    }

    /// Prints a message on its own line (above the bar on a terminal).
    pub fn message(&mut self, msg: &str) {
        match &self.bar {
            Some(bar) => bar.println(msg),
            None => eprintln!("{msg}"),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

pub fn fmt_duration(s: f64) -> String {
    let s = s.max(0.0) as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// The peak resident memory of this process so far (Linux `VmHWM`), in MiB; `None` where the
/// system does not report it.
pub fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The rate in GFLOP/s of `dtype` products of two `n x n` matrices (candle's matmul) on
/// `device`, best of `repeats` after a warm-up, each run ended by waiting for the device: the
/// reference of GFLOP/s and MFU figures.
pub fn matmul_gflops(
    device: &candle_core::Device,
    dtype: candle_core::DType,
    n: usize,
    repeats: usize,
) -> candle_core::Result<f64> {
    product_gflops(device, dtype, n, repeats, |a, b| a.matmul(b))
}

/// [`matmul_gflops`] of another product of two `(n, n)` tensors (flash-ring's, where it runs on
/// another library than candle's).
pub fn product_gflops(
    device: &candle_core::Device,
    dtype: candle_core::DType,
    n: usize,
    repeats: usize,
    product: impl Fn(
        &candle_core::Tensor,
        &candle_core::Tensor,
    ) -> candle_core::Result<candle_core::Tensor>,
) -> candle_core::Result<f64> {
    use candle_core::{Device, Tensor};
    let randn = || {
        Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    };
    let (a, b) = (randn()?, randn()?);
    let run = || -> candle_core::Result<()> {
        product(&a, &b)?;
        device.synchronize()
    };
    run()?;
    let mut best = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        let t = std::time::Instant::now();
        run()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n as f64).powi(3) / best / 1e9)
}
