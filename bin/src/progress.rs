//! Progress of a training run on the terminal, and the process's peak memory.

use std::io::{IsTerminal, Write};

/// Progress of `cpl train`: on a terminal, one bar redrawn after every step; otherwise (logs,
/// pipes) a line every `log_every` steps.
pub struct Progress {
    total: u64,
    log_every: u64,
    tty: bool,
    drawn: bool,
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
}

impl Progress {
    pub fn new(total: u64, log_every: u64) -> Self {
        Self {
            total,
            log_every: log_every.max(1),
            tty: std::io::stderr().is_terminal(),
            drawn: false,
        }
    }

    pub fn step(&mut self, s: &StepLine) {
        let stats = format!(
            "loss {:.4}  lr {:.2e}  |g| {:.3}  {:.0} tok/s  MFU {:.1}%  ETA {}",
            s.loss,
            s.lr,
            s.grad_norm,
            s.tokens_per_sec,
            100.0 * s.mfu,
            fmt_duration(s.eta_secs)
        );
        if self.tty {
            const WIDTH: u64 = 24;
            let filled = (WIDTH * s.step / self.total.max(1)).min(WIDTH) as usize;
            let bar = format!(
                "{}{}",
                "#".repeat(filled),
                "-".repeat(WIDTH as usize - filled)
            );
            eprint!("\r\x1b[2K[{bar}] {:>5}/{}  {stats}", s.step, self.total);
            let _ = std::io::stderr().flush();
            self.drawn = true;
            if s.step == self.total {
                self.end_line();
            }
        } else if s.step.is_multiple_of(self.log_every) || s.step == self.total {
            eprintln!("step {:>5}/{}  {stats}", s.step, self.total);
        }
    }

    /// Prints a message on its own line (below the bar on a terminal).
    pub fn message(&mut self, msg: &str) {
        self.end_line();
        eprintln!("{msg}");
    }

    fn end_line(&mut self) {
        if self.drawn {
            eprintln!();
            self.drawn = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.end_line();
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
