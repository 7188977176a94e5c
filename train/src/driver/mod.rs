//! The run driver: the one loop over a run's steps for every model and objective, with what a
//! training run does around its steps: the progress bar or log lines ([`progress`]), the
//! metrics and evaluation logs (`metrics.jsonl`, `eval.jsonl`, continued by a resumed run),
//! held-out evaluation, checkpoints (every `save_every` steps, at the end and on Ctrl-C; the
//! last `keep` kept), the peak memory, and the loss chart ([`plot`]).
//!
//! A command builds, on every rank, a [`Task`] (its trainer and data: what one step and one
//! evaluation are) and calls [`run`] with the run's [`RunOptions`]; world rank 0 writes and
//! prints. [`interrupt_flag`] is installed once per process before the ranks start.
//!
//! Contract: [`run`] is collective over the world (every rank calls it with the same options);
//! it returns the run's history (the resumed run's earlier steps included) on every rank.

pub mod plot;
pub mod progress;
pub mod tasks;
pub mod tensorboard;
pub mod trace;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_parallel::comm::{Comm, ReduceOp};

use crate::checkpoint::{self, EvalPoint, History};
use crate::error::{Error, Result};
use crate::trainer::{StepStats, TrainModel, Trainer};
use progress::{peak_rss_mib, Progress, StepLine};

/// What one step of a task reports to the driver.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    pub stats: StepStats,
    /// Task-specific fields of the step's `metrics.jsonl` line (counts, loss parts, rewards).
    pub metrics: serde_json::Map<String, serde_json::Value>,
    /// Quantities of the step written as rates (`name` per second of the step): e.g.
    /// `("tokens_per_sec", tokens)`, `("images_per_sec", images)`.
    pub rates: Vec<(&'static str, f64)>,
    /// Tokens the step processed, for the progress line's tokens/s and MFU.
    pub tokens: f64,
}

impl StepOutcome {
    /// A step with no task-specific fields: `tokens` processed, written as `tokens_per_sec`.
    pub fn new(stats: StepStats, tokens: f64) -> Self {
        Self {
            stats,
            metrics: serde_json::Map::new(),
            rates: vec![("tokens_per_sec", tokens)],
            tokens,
        }
    }

    /// Adds a field to the step's metrics line.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.metrics.insert(key.into(), value.into());
        self
    }
}

/// What changes in a run before a step (a length curriculum's next phase): the line the run
/// logs (and writes to TensorBoard as `run/change`), and the model FLOPs per token of the steps
/// from here (for the MFU).
#[derive(Debug, Clone)]
pub struct Change {
    pub message: String,
    pub flops_per_token: f64,
}

/// What a run trains: one optimizer step and one held-out evaluation, on every rank.
pub trait Task {
    type Model: TrainModel;

    /// The task's trainer (its step count, checkpoints).
    fn trainer(&self) -> &Trainer<Self::Model>;

    /// Gets the task ready for its trainer's next step, before it runs: what changed for the
    /// steps from here, `None` when nothing did (the default). Called by every rank at the same
    /// step, and first before a run's (or a resumed run's) first step.
    fn before_step(&mut self) -> Result<Option<Change>> {
        Ok(None)
    }

    /// Runs the next optimizer step. Collective over the world.
    fn step(&mut self) -> Result<StepOutcome>;

    /// The held-out loss and its count at the current step, `None` when the task has no
    /// evaluation data. Collective over the world.
    fn eval(&mut self) -> Result<Option<(f64, u64)>> {
        Ok(None)
    }

    /// The held-out loss by position bucket at the current step, `None` when the task does not
    /// give it. Collective over the world.
    fn eval_by_position(&mut self) -> Result<Option<Vec<crate::evaluation::PositionBucket>>> {
        Ok(None)
    }

    /// The passkey retrieval of the model at the current step (`--eval-passkey`), `None` when
    /// the task does not give it. Collective over the world.
    fn eval_passkey(&mut self) -> Result<Option<crate::passkey::PasskeyReport>> {
        Ok(None)
    }
}

/// How a run is driven (the command line's flags).
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Output directory: `metrics.jsonl`, `eval.jsonl`, `step-N/` checkpoints, `loss.png`.
    pub out: PathBuf,
    /// Optimizer steps of the whole run.
    pub steps: u64,
    /// Save a checkpoint every K steps (0: only at the end and on Ctrl-C).
    pub save_every: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// Evaluate every K steps (0: only after the last step).
    pub eval_every: u64,
    /// A progress line every N steps when stderr is not a terminal.
    pub log_every: u64,
    /// Files copied into every checkpoint (config, tokenizer...).
    pub extra_files: Vec<(String, Vec<u8>)>,
    /// Largest weight file of a checkpoint (`--max-shard-size`); larger models are split.
    pub max_shard_bytes: usize,
    /// Model FLOPs per token (for the MFU of the progress line), and the machine's matmul
    /// rate in GFLOP/s; NaN when unknown.
    pub flops_per_token: f64,
    pub peak_gflops: f64,
    /// What `peak_gflops` is (printed at the start: MFU is only as meaningful as its peak).
    pub peak_source: String,
    /// The first line the run prints (what trains, on what).
    pub banner: String,
    /// Whether the ranks are local threads (one process: one peak-memory figure).
    pub local_ranks: bool,
    /// Steps with a non-finite loss or gradient norm that are skipped (no update, logged)
    /// before the run stops on the next one (`--skip-nonfinite-steps`; 0: stop on the first).
    pub skip_nonfinite_steps: u64,
    /// Directory of TensorBoard event files (`--tensorboard`): every number of
    /// `metrics.jsonl` (`train/<key>`) and `eval.jsonl` (`eval/<key>`), the banner and the
    /// command line.
    pub tensorboard: Option<PathBuf>,
    /// Check every layer's output in forward and every gradient for NaN and infinity and stop
    /// at the first, naming the step, rank, micro-batch and module (`--detect-anomaly`; see
    /// `candle_parallel::nn::anomaly`).
    pub detect_anomaly: bool,
}

impl RunOptions {
    pub fn metrics_path(&self) -> PathBuf {
        self.out.join("metrics.jsonl")
    }

    pub fn eval_path(&self) -> PathBuf {
        self.out.join("eval.jsonl")
    }
}

/// The checkpoint a run resumes from (`--resume`: the last complete checkpoint in the output
/// directory) and its state.
#[derive(Debug, Clone)]
pub struct Resume {
    pub dir: PathBuf,
    pub state: checkpoint::TrainerState,
}

impl Resume {
    /// The last checkpoint in `out` when `resume`, `None` otherwise. Errors when `out` holds
    /// no checkpoint or its state cannot be read.
    pub fn find(resume: bool, out: &Path) -> Result<Option<Self>> {
        // What an interrupted save left is never a checkpoint.
        for p in checkpoint::clean_partial(out)? {
            eprintln!(
                "removed the partial checkpoint {} (an interrupted save)",
                p.display()
            );
        }
        if !resume {
            return Ok(None);
        }
        let (_, dir) = checkpoint::list_checkpoints(out).pop().ok_or_else(|| {
            Error::Invalid(format!("--resume: no checkpoint in {}", out.display()))
        })?;
        let state = checkpoint::read_state(&dir)?;
        eprintln!("resuming from {} (step {})", dir.display(), state.step);
        Ok(Some(Self { dir, state }))
    }

    /// The history a run continues: the resumed run's, or none.
    pub fn history(resume: Option<&Self>) -> History {
        resume.map(|r| r.state.history.clone()).unwrap_or_default()
    }

    /// Restores `trainer` (its model loaded from [`Resume::dir`]): optimizer state and step.
    pub fn restore<M: TrainModel>(&self, trainer: &mut Trainer<M>) -> Result<()> {
        checkpoint::restore(trainer, &self.dir, &self.state)
    }
}

/// Runs `task` to `opts.steps` from its trainer's step (0, or a resumed run's), continuing
/// `history` (see the [module docs](self)). Collective over `world`; `interrupted` is the flag
/// of [`interrupt_flag`]. Ctrl-C on any rank saves a checkpoint and ends with an error telling
/// to resume.
pub fn run<T: Task>(
    task: &mut T,
    world: &Comm,
    opts: &RunOptions,
    mut history: History,
    interrupted: &AtomicBool,
) -> Result<History> {
    let main = world.rank() == 0;
    let first = task.trainer().step;
    candle_parallel::nn::anomaly::set_detect_anomaly(opts.detect_anomaly);
    // Lines of steps after the resume point (from a run that died later) are dropped.
    let mut metrics = main
        .then(|| JsonLines::continue_at(&opts.metrics_path(), first))
        .transpose()?;
    let mut evals = main
        .then(|| JsonLines::continue_at(&opts.eval_path(), first + 1))
        .transpose()?;
    if main {
        eprintln!("{}", opts.banner);
        if opts.flops_per_token.is_finite() && opts.peak_gflops.is_finite() {
            eprintln!(
                "MFU against {:.1} GFLOP/s: {}",
                opts.peak_gflops, opts.peak_source
            );
        }
    }
    let mut board = match (&opts.tensorboard, main) {
        (Some(dir), true) => Some(open_board(dir, first, &opts.banner)?),
        _ => None,
    };
    let mut progress = main.then(|| Progress::new(opts.steps, opts.log_every));
    let start = Instant::now();
    let mut skipped = 0;
    let mut flops_per_token = opts.flops_per_token;
    while task.trainer().step < opts.steps {
        if let Some(change) = task.before_step()? {
            flops_per_token = change.flops_per_token;
            if let Some(b) = board.as_mut() {
                b.text("run/change", task.trainer().step, &change.message)?;
            }
            if let Some(p) = progress.as_mut() {
                p.message(&change.message);
            }
        }
        let t0 = Instant::now();
        trace::at_step(task.trainer().step);
        let outcome = match task.step() {
            Ok(out) => Some(out),
            Err(Error::NonFinite { step, what }) if skipped < opts.skip_nonfinite_steps => {
                skipped += 1;
                let note = format!(
                    "step {step}: {what}: skipped ({skipped} of --skip-nonfinite-steps {})",
                    opts.skip_nonfinite_steps
                );
                if let Some(f) = metrics.as_mut() {
                    f.write(&serde_json::json!({"step": step, "skipped": what}))?;
                }
                if let Some(b) = board.as_mut() {
                    b.text("train/skipped", step, &what)?;
                }
                match progress.as_mut() {
                    Some(p) => p.message(&note),
                    None if main => eprintln!("{note}"),
                    None => {}
                }
                None
            }
            Err(e @ (Error::NonFinite { .. } | Error::Anomaly { .. })) => {
                return Err(stopped_nonfinite(e, opts))
            }
            Err(e) => return Err(e),
        };
        let step = task.trainer().step;
        if let Some(out) = outcome {
            let dt = t0.elapsed().as_secs_f64();
            let s = out.stats;
            history.steps.push(s);
            let tps = out.tokens / dt;
            let mfu = tps * flops_per_token / (opts.peak_gflops * 1e9);
            if let Some(f) = metrics.as_mut() {
                let mut line = serde_json::json!({
                    "step": s.step, "loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm,
                    "seconds": dt, "peak_rss_mib": peak_rss_mib(),
                    "attention_scores": s.attention_scores,
                    "comm_bytes_sent": s.comm_bytes_sent,
                });
                if let Some(o) = line.as_object_mut() {
                    for (k, v) in &out.rates {
                        o.insert((*k).into(), serde_json::json!(v / dt));
                    }
                    o.extend(out.metrics.clone());
                    if let Some(b) = s.pp_bubble {
                        o.insert("pp_bubble".into(), serde_json::json!(b));
                    }
                    if mfu.is_finite() {
                        o.insert("mfu".into(), serde_json::json!(mfu));
                    }
                    if let Some(b) = s.attention_work_max_over_mean {
                        o.insert("attention_work_max_over_mean".into(), serde_json::json!(b));
                    }
                    if let Some(r) = s.ranks {
                        let ratio = r.compute_max / r.compute_mean.max(1e-12);
                        o.extend(serde_json::Map::from_iter([
                            ("compute_max_s".into(), serde_json::json!(r.compute_max)),
                            ("compute_mean_s".into(), serde_json::json!(r.compute_mean)),
                            ("comm_max_s".into(), serde_json::json!(r.comm_max)),
                            ("comm_mean_s".into(), serde_json::json!(r.comm_mean)),
                            ("slowest_rank".into(), serde_json::json!(r.slowest_rank)),
                            ("compute_max_over_mean".into(), serde_json::json!(ratio)),
                        ]));
                    }
                }
                f.write(&line)?;
                if let Some(b) = board.as_mut() {
                    write_scalars(b, "train", s.step, &line)?;
                }
            }
            if let Some(p) = progress.as_mut() {
                let done = (step - first).max(1);
                p.step(&StepLine {
                    step,
                    loss: s.loss,
                    lr: s.lr,
                    grad_norm: s.grad_norm,
                    tokens_per_sec: tps,
                    mfu,
                    eta_secs: start.elapsed().as_secs_f64() / done as f64
                        * (opts.steps - step) as f64,
                    extra: [
                        ("aux", "router_aux_loss"),
                        ("load", "expert_load_max_over_mean"),
                        ("dropped", "expert_dropped_fraction"),
                    ]
                    .into_iter()
                    .filter_map(|(label, key)| {
                        out.metrics
                            .get(key)
                            .and_then(|v| v.as_f64())
                            .map(|v| (label, v))
                    })
                    .collect(),
                });
            }
        }
        let eval_due = opts.eval_every > 0 && step.is_multiple_of(opts.eval_every);
        if eval_due || step == opts.steps {
            let eval = tracing::info_span!("eval").in_scope(|| task.eval())?;
            let by_position = match eval {
                Some(_) => tracing::info_span!("eval").in_scope(|| task.eval_by_position())?,
                None => None,
            };
            let passkey = tracing::info_span!("eval").in_scope(|| task.eval_passkey())?;
            let mut line = serde_json::json!({ "step": step });
            if let (Some((loss, tokens)), Some(o)) = (eval, line.as_object_mut()) {
                let point = EvalPoint { step, loss, tokens };
                history.evals.push(point);
                if let serde_json::Value::Object(p) =
                    serde_json::to_value(point).map_err(invalid)?
                {
                    o.extend(p);
                }
            }
            if let (Some(b), Some(o)) = (&by_position, line.as_object_mut()) {
                o.insert(
                    "by_position".into(),
                    serde_json::to_value(b).map_err(invalid)?,
                );
            }
            if let (Some(p), Some(o)) = (&passkey, line.as_object_mut()) {
                o.insert("passkey".into(), serde_json::to_value(p).map_err(invalid)?);
            }
            if eval.is_some() || passkey.is_some() {
                if let Some(f) = evals.as_mut() {
                    f.write(&line)?;
                }
                if let Some(b) = board.as_mut() {
                    write_scalars(b, "eval", step, &line)?;
                    for p in by_position.iter().flatten() {
                        let tag = format!("eval/loss_by_position/{:06}-{:06}", p.from, p.to);
                        b.scalar(&tag, step, p.loss)?;
                    }
                    if let Some(p) = &passkey {
                        write_passkey(b, step, p)?;
                    }
                }
            }
            if let Some(p) = progress.as_mut() {
                let mut parts = Vec::new();
                if let Some((loss, tokens)) = eval {
                    parts.push(format!("eval loss {loss:.4} ({tokens} tokens)"));
                }
                if let Some(k) = &passkey {
                    parts.push(format!(
                        "passkey accuracy {:.3} ({} cells)",
                        k.accuracy,
                        k.cells.len()
                    ));
                }
                if !parts.is_empty() {
                    p.message(&format!("step {step}: {}", parts.join(", ")));
                }
            }
        }
        if let Some(b) = board.as_mut() {
            b.flush()?;
        }
        tracing::info_span!("checkpoint").in_scope(|| {
            save_or_stop(
                task.trainer(),
                opts,
                world,
                interrupted,
                &history,
                progress.as_mut(),
            )
        })?;
        if main {
            pause_for_tests(&opts.out, step);
        }
    }
    drop(progress);
    report_peak_memory(world, opts, &task.trainer().cfg.memory)?;
    Ok(history)
}

/// The event file of a run starting at step `first` (a restart marker when resuming), with the
/// banner and the command line as text.
fn open_board(dir: &Path, first: u64, banner: &str) -> Result<tensorboard::EventWriter> {
    let mut b = tensorboard::EventWriter::create(dir)?;
    if first > 0 {
        b.restart(first)?;
    }
    let command: Vec<String> = std::env::args().collect();
    b.text("run/banner", first, banner)?;
    b.text("run/command", first, &format!("`{}`", command.join(" ")))?;
    eprintln!("TensorBoard events in {}", b.path().display());
    Ok(b)
}

/// Every number of a metrics line but its step, as scalars `<prefix>/<key>` at `step`.
fn write_scalars(
    b: &mut tensorboard::EventWriter,
    prefix: &str,
    step: u64,
    line: &serde_json::Value,
) -> Result<()> {
    for (k, v) in line.as_object().into_iter().flatten() {
        if let (Some(x), false) = (v.as_f64(), k == "step") {
            b.scalar(&format!("{prefix}/{k}"), step, x)?;
        }
    }
    Ok(())
}

/// A passkey evaluation as scalars at `step`: `eval/passkey/accuracy` and, per cell,
/// `eval/passkey/<length>-<depth>` (its accuracy) and `eval/passkey_answer_loglik/<length>-<depth>`.
fn write_passkey(
    b: &mut tensorboard::EventWriter,
    step: u64,
    p: &crate::passkey::PasskeyReport,
) -> Result<()> {
    b.scalar("eval/passkey/accuracy", step, p.accuracy)?;
    for c in &p.cells {
        let cell = format!("{:06}-{:.2}", c.length, c.depth);
        b.scalar(&format!("eval/passkey/{cell}"), step, c.accuracy)?;
        b.scalar(
            &format!("eval/passkey_answer_loglik/{cell}"),
            step,
            c.answer_loglik,
        )?;
    }
    Ok(())
}

/// Test hook (never set in normal use): with `CPL_TEST_PAUSE_STEP=<n>`, world rank 0 stops
/// for good once step `n` is done (its metrics written, its checkpoint saved if one was due),
/// leaving a file `PAUSED-<n>` in the output directory, so a test can kill the run at a step it
/// chose, not at a time it guessed (`bin/tests/common/resume.rs`).
fn pause_for_tests(out: &Path, step: u64) {
    let want = std::env::var("CPL_TEST_PAUSE_STEP")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    if want == Some(step) {
        let _ = std::fs::write(out.join(format!("PAUSED-{step}")), b"");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
}

/// The error that ends a run at a non-finite step: what happened, and that no checkpoint was
/// written after the last good step.
fn stopped_nonfinite(e: Error, opts: &RunOptions) -> Error {
    let last = match checkpoint::list_checkpoints(&opts.out).pop() {
        Some((_, dir)) => format!(
            "the last checkpoint, {}, is from a good step and untouched (continue with --resume)",
            dir.display()
        ),
        None => format!("no checkpoint was written to {}", opts.out.display()),
    };
    let advice = match e {
        Error::NonFinite { .. } => {
            "Lower --lr or check the data; --skip-nonfinite-steps N skips up to N such steps"
        }
        _ => "The module named is where the first NaN or infinity appeared",
    };
    Error::Invalid(format!("{e}. The run stopped: {last}. {advice}"))
}

/// After a run, on the process that holds world rank 0: prints the loss's first and last
/// values and draws `loss.png` titled `title`. Nothing when the run took no step.
pub fn finish(history: &History, opts: &RunOptions, title: &str) -> Result<()> {
    let (Some(first), Some(last)) = (history.steps.first(), history.steps.last()) else {
        return Ok(());
    };
    eprintln!(
        "loss {:.4} -> {:.4} over {} steps; metrics in {}; last checkpoint {}",
        first.loss,
        last.loss,
        history.steps.len(),
        opts.metrics_path().display(),
        checkpoint::step_dir(&opts.out, last.step + 1).display()
    );
    let png = opts.out.join("loss.png");
    plot::loss_curve(&history.steps, &history.evals, title, &png)?;
    eprintln!("loss curve in {}", png.display());
    Ok(())
}

/// Every rank's peak memory (one process for local ranks), printed by world rank 0.
/// Collective over `world`.
fn report_peak_memory(
    world: &Comm,
    opts: &RunOptions,
    memory: &candle_parallel::plan::MemoryPlan,
) -> Result<()> {
    let mine = peak_rss_mib().unwrap_or(f64::NAN);
    let peaks = world
        .all_gather(&Tensor::new(&[mine], &Device::Cpu)?, 0)?
        .to_vec1::<f64>()?;
    if world.rank() != 0 || !mine.is_finite() {
        return Ok(());
    }
    if opts.local_ranks {
        eprintln!(
            "peak memory: {mine:.0} MiB (RSS of this process, {} local rank(s); ZeRO {}, \
             checkpointing {})",
            world.size(),
            memory.zero,
            memory.checkpointing
        );
    } else {
        let max = peaks.iter().copied().fold(f64::MIN, f64::max);
        let min = peaks.iter().copied().fold(f64::MAX, f64::min);
        eprintln!("peak memory per rank (RSS): max {max:.0} MiB, min {min:.0} MiB");
    }
    Ok(())
}

/// Set by Ctrl-C (the handler is installed here): [`run`] checks it after each step and stops
/// with a checkpoint. Without the handler Ctrl-C would kill the run without its checkpoint:
/// not optional. Call once per process.
pub fn interrupt_flag() -> Result<Arc<AtomicBool>> {
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)).map_err(|e| {
        Error::Invalid(format!(
            "installing the Ctrl-C handler (needed to save a checkpoint on Ctrl-C): {e}"
        ))
    })?;
    Ok(interrupted)
}

/// The end of every step: saves a checkpoint every `save_every` steps, at the last step and
/// when Ctrl-C reached any rank (then stops with an error telling to resume). Collective over
/// `world`.
fn save_or_stop<M: TrainModel>(
    trainer: &Trainer<M>,
    opts: &RunOptions,
    world: &Comm,
    interrupted: &AtomicBool,
    history: &History,
    progress: Option<&mut Progress>,
) -> Result<()> {
    let stop = stop_requested(world, interrupted)?;
    let periodic = opts.save_every > 0 && trainer.step.is_multiple_of(opts.save_every);
    if periodic || stop || trainer.step == opts.steps {
        let dir = checkpoint::save_sharded(
            trainer,
            &opts.out,
            world,
            &opts.extra_files,
            history,
            opts.keep,
            opts.max_shard_bytes,
        )?;
        if let Some(p) = progress {
            p.message(&format!("saved {}", dir.display()));
        }
    }
    if stop {
        return Err(Error::Invalid(format!(
            "interrupted (Ctrl-C) after step {}; resume with --resume",
            trainer.step
        )));
    }
    Ok(())
}

/// Whether Ctrl-C reached any rank of `world` (collective over it).
fn stop_requested(world: &Comm, flag: &AtomicBool) -> Result<bool> {
    let stop = f32::from(flag.load(Ordering::SeqCst));
    Ok(world
        .all_reduce(&Tensor::new(&[stop], &Device::Cpu)?, ReduceOp::Max)?
        .to_vec1::<f32>()?[0]
        > 0.0)
}

/// A JSON-lines log (metrics, evaluations) continued by a resumed run.
pub struct JsonLines(std::fs::File, PathBuf);

impl JsonLines {
    /// `path` with the lines of steps before `step` kept (a later run's are dropped).
    pub fn continue_at(path: &Path, step: u64) -> Result<Self> {
        let kept: Vec<String> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s < step)
            })
            .map(String::from)
            .collect();
        let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        for l in kept {
            writeln!(f, "{l}").map_err(|e| Error::io(path, e))?;
        }
        Ok(Self(f, path.to_path_buf()))
    }

    pub fn write(&mut self, line: &serde_json::Value) -> Result<()> {
        writeln!(self.0, "{line}").map_err(|e| Error::io(&self.1, e))?;
        self.0.flush().map_err(|e| Error::io(&self.1, e))
    }
}

fn invalid(e: impl std::fmt::Display) -> Error {
    Error::Invalid(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::TrainerState;
    use crate::trainer::TrainConfig;

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cpl-driver-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Writes a checkpoint directory `name` of `out` (its `trainer_state.json`) at `step`, with
    /// one evaluation in its history.
    fn checkpoint_at(out: &Path, name: &str, step: u64) -> PathBuf {
        let dir = out.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let memory = candle_parallel::plan::MemoryPlan::default();
        let state = TrainerState {
            step,
            global_batch: 2,
            config: TrainConfig::constant_lr(32, 20, 1e-3, 16, memory),
            history: History {
                steps: Vec::new(),
                evals: vec![EvalPoint {
                    step,
                    loss: 1.5,
                    tokens: 7,
                }],
            },
        };
        let json = serde_json::to_vec(&state).unwrap();
        std::fs::write(dir.join("trainer_state.json"), json).unwrap();
        dir
    }

    /// `--resume` picks the last complete checkpoint by step; with or without it, what an
    /// interrupted save left is removed first.
    #[test]
    fn resume_finds_the_last_complete_checkpoint() {
        let out = tmp("resume");
        let err = Resume::find(true, &out).unwrap_err().to_string();
        assert!(err.contains("no checkpoint"), "{err}");
        checkpoint_at(&out, "step-2", 2);
        let last = checkpoint_at(&out, "step-10", 10);
        let partial = checkpoint_at(&out, ".step-11.tmp-5", 11);
        assert!(Resume::find(false, &out).unwrap().is_none());
        assert!(
            !partial.exists(),
            "a partial save is removed without --resume too"
        );
        checkpoint_at(&out, ".step-11.tmp-5", 11);
        let r = Resume::find(true, &out)
            .unwrap()
            .expect("a checkpoint to resume");
        assert!(!partial.exists());
        assert_eq!(r.dir, last);
        assert_eq!(r.state.step, 10);
        let h = Resume::history(Some(&r));
        assert_eq!(h.evals.len(), 1);
        assert_eq!(h, r.state.history);
        assert_eq!(Resume::history(None), History::default());
        std::fs::remove_dir_all(&out).unwrap();
    }

    /// A resumed run's logs keep the lines of the steps before it and drop a later run's.
    #[test]
    fn logs_continue_at_the_resumed_step() {
        let out = tmp("jsonl");
        let path = out.join("metrics.jsonl");
        let lines: Vec<String> = (0..5).map(|s| format!("{{\"step\":{s}}}")).collect();
        std::fs::write(&path, format!("{}\nnot json\n", lines.join("\n"))).unwrap();
        let mut log = JsonLines::continue_at(&path, 2).unwrap();
        log.write(&serde_json::json!({ "step": 2 })).unwrap();
        drop(log);
        let text = std::fs::read_to_string(&path).unwrap();
        let want = format!("{}\n{}\n{}\n", lines[0], lines[1], lines[2]);
        assert_eq!(text, want);
        // A fresh run's log: none before it, and no file needed.
        let fresh = out.join("eval.jsonl");
        drop(JsonLines::continue_at(&fresh, 0).unwrap());
        assert_eq!(std::fs::read_to_string(&fresh).unwrap(), "");
        std::fs::remove_dir_all(&out).unwrap();
    }
}
