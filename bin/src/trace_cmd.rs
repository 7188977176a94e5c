//! `cpl trace summarize FILE...`: the per-rank totals of `--trace` files (one per process), the
//! slowest rank and its slowest spans, and how much of each rank's step time was
//! communication.

use std::path::PathBuf;

use anyhow::{bail, Result};

#[derive(clap::Subcommand, Debug)]
pub enum TraceCommand {
    /// Per-rank totals of trace files written by `--trace`: step, forward, backward,
    /// communication (and its bytes), optimizer, checkpoint time; the slowest rank and its
    /// three longest spans.
    Summarize(SummarizeArgs),
}

#[derive(clap::Args, Debug)]
pub struct SummarizeArgs {
    /// The trace files (one per process under mpirun).
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: &TraceCommand) -> Result<()> {
    let TraceCommand::Summarize(a) = cmd;
    let mut tracks = train::driver::trace::summarize(&a.files)?;
    tracks.retain(|t| t.rank.is_some());
    if tracks.is_empty() {
        bail!("the trace holds no step (was the run traced with --trace, and did it take a step?)");
    }
    tracks.sort_by_key(|t| t.rank);
    let secs =
        |t: &train::driver::trace::TrackSummary, k: &str| t.seconds.get(k).copied().unwrap_or(0.0);
    let slowest = tracks
        .iter()
        .max_by(|a, b| {
            let busy = |t| secs(t, "step") - secs(t, "comm");
            busy(a).total_cmp(&busy(b))
        })
        .map(|t| t.rank.unwrap_or(0));
    if a.json {
        let v = serde_json::json!({"ranks": tracks, "slowest_rank": slowest});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:>4}  {:>9}  {:>9}  {:>9}  {:>9}  {:>6}  {:>12}  {:>9}  {:>10}  {:>8}",
        "rank",
        "step s",
        "forward s",
        "backward",
        "comm s",
        "comm %",
        "comm bytes",
        "optimizer",
        "checkpoint",
        "hidden %"
    );
    for t in &tracks {
        let step = secs(t, "step");
        let hidden = t
            .hidden_share()
            .map_or("-".to_string(), |h| format!("{:.1}%", 100.0 * h));
        println!(
            "{:>4}  {:>9.3}  {:>9.3}  {:>9.3}  {:>9.3}  {:>5.1}%  {:>12}  {:>9.3}  {:>10.3}  {:>8}",
            t.rank.unwrap_or(0),
            step,
            secs(t, "forward"),
            secs(t, "backward"),
            secs(t, "comm"),
            100.0 * secs(t, "comm") / step.max(1e-12),
            t.bytes_sent,
            secs(t, "optimizer"),
            secs(t, "checkpoint"),
            hidden,
        );
    }
    if let Some(r) = slowest {
        println!("slowest rank (step time outside communication): {r}");
        if let Some(t) = tracks.iter().find(|t| t.rank == Some(r)) {
            for (name, detail, s) in &t.slowest {
                println!("  {s:>9.4} s  {name} {detail}");
            }
        }
    }
    Ok(())
}
