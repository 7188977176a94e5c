//! `cpl`: the command line of candle-parallel.
//!
//! Subcommands: `train` (with no arguments, like `cpl` alone: the bundled default job),
//! `data prepare` (tokenize a corpus once), `eval`, `generate`, `inspect` (models from Hugging
//! Face checkpoints, LLaMA or diffusers DiT, under any parallel layout), `plan` (how a world of ranks is cut into
//! groups), `demo` (collectives across local ranks), `finetune` (chat data, LoRA), `bench`
//! (this machine's attention, communication, training and evaluation throughput).

mod alloc;
mod args;
mod bench;
mod data_cmd;
mod demo;
mod dit_cmd;
mod eval;
mod finetune_cmd;
mod generate;
mod inspect;
mod launch;
mod layout;
mod llava_cmd;
mod model_arg;
mod plan_auto;
mod threads;
mod trace_cmd;
mod train_cmd;

use anyhow::{bail, Context, Result};

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "cpl",
    version,
    about = "Long-context parallel training on Candle"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run all-reduce, all-gather and all-to-all across local ranks and check the results.
    Demo(demo::DemoArgs),
    /// Print the device mesh of a parallel layout: each rank's coordinates and groups; with
    /// --pp > 1 also the pipeline schedule's per-rank timetable and bubble. `cpl plan --auto`
    /// chooses the layout: every layout of --world ranks for --model at --seq-len on --hardware,
    /// ranked by predicted step time.
    Plan(plan_auto::PlanArgs),
    /// Mean next-token loss, perplexity and token count of a model on a text, jsonl, Parquet or
    /// token file; for a DiT, its output (and DDPM loss) on an --inputs file.
    Eval(Box<args::EvalArgs>),
    /// Continue a prompt with a model (KV cache; one rank, tensor parallel or pipeline stages
    /// with --pp); for a DiT, a PNG grid of samples of --class-labels.
    Generate(args::GenerateArgs),
    /// Continued pretraining of a Hugging Face checkpoint under any layout, with ZeRO and
    /// activation checkpointing (no arguments: the bundled default); a diffusers DiT trains on
    /// latents or image folders (--objective ddpm|flow, --from-scratch).
    Train(Box<args::TrainArgs>),
    /// Fine-tuning on chat data: SFT or DPO (--stage), LoRA or full (--finetuning-type), every
    /// layout and memory flag of `cpl train`, LLaMA-Factory configs (--config x.yaml); no
    /// arguments: LoRA SFT of the bundled model on the bundled dialogue data. `cpl finetune
    /// merge` folds an adapter into its base.
    Finetune(finetune_cmd::FinetuneCli),
    /// Data preparation: `cpl data prepare` tokenizes a corpus (text, jsonl, Parquet) once into a
    /// `--tokens` file.
    #[command(subcommand)]
    Data(data_cmd::DataCommand),
    /// Show a model's architecture, parameter count, dtypes and checkpoint files, and list any tensor holding NaN or infinity (which loading refuses).
    Inspect(inspect::InspectArgs),
    /// Measure this machine: `cpl bench attention|comm|train|eval|matmul` (a table, or one JSON
    /// object with --json); `cpl bench calibrate` writes its hardware description for `cpl plan
    /// --auto`.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Read `--trace` files: `cpl trace summarize FILE...` prints per-rank totals and the
    /// slowest rank.
    #[command(subcommand)]
    Trace(trace_cmd::TraceCommand),
}

/// A closed pipe (`cpl inspect ... | head`) ends the program quietly, as for other command-line
/// tools, instead of making `println!` panic: restore the default action of SIGPIPE, which the
/// Rust runtime sets to ignore.
fn default_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in main, before any thread exists; SIG_DFL is a valid action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Turns the keys of a TOML config into command-line flags placed before the real ones.
fn args_with_config(raw: Vec<String>) -> Result<Vec<String>> {
    if raw.get(1).map(String::as_str) == Some("finetune") {
        return crate::finetune_cmd::expand_args(raw);
    }
    let Some(pos) = raw.iter().position(|a| a == "--config") else {
        return Ok(raw);
    };
    let Some(path) = raw.get(pos + 1) else {
        bail!("--config needs a file");
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("--config {path}: cannot read"))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("--config {path}: not valid TOML"))?;
    let mut flags = Vec::new();
    for (k, v) in table {
        let flag = format!("--{}", k.replace('_', "-"));
        if raw.contains(&flag) {
            continue;
        }
        match v {
            toml::Value::Boolean(true) => flags.push(flag),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => flags.extend([flag, s]),
            toml::Value::Integer(i) => flags.extend([flag, i.to_string()]),
            toml::Value::Float(f) => flags.extend([flag, f.to_string()]),
            toml::Value::Array(a) => {
                flags.push(flag.clone());
                for x in a {
                    match x {
                        toml::Value::String(s) => flags.push(s),
                        other => flags.push(other.to_string()),
                    }
                }
            }
            other => bail!("--config {path}: key {k:?} has an unsupported value {other}"),
        }
    }
    // Insert after the subcommand name.
    let sub = raw
        .iter()
        .position(|a| a == "train")
        .map(|i| i + 1)
        .unwrap_or(1);
    let mut out = raw[..sub].to_vec();
    out.extend(flags);
    out.extend(raw[sub..].iter().cloned());
    Ok(out)
}

fn main() {
    default_sigpipe();
    alloc::keep_freed_memory();
    threads::shorter_candle_spin();
    let raw: Vec<String> = std::env::args().collect();
    let raw = match args_with_config(raw) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    };
    let bare_train = raw.len() == 2 && raw[1] == "train";
    // Bad flags fail like every other error (exit 1); help and version exit 0.
    let cli = match Cli::try_parse_from(raw) {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let _ = e.print();
            std::process::exit(1);
        }
    };
    let result: Result<()> = match cli.command {
        None => train_cmd::run(&args::TrainArgs::embedded_default()),
        // `cpl train` alone is the README's main job, like `cpl`.
        Some(Command::Train(_)) if bare_train => {
            train_cmd::run(&args::TrainArgs::embedded_default())
        }
        Some(Command::Train(args)) => train_cmd::run(&args),
        Some(Command::Demo(args)) => demo::run(&args),
        Some(Command::Data(cmd)) => data_cmd::run(&cmd),
        Some(Command::Finetune(cli)) => finetune_cmd::run(&cli),
        Some(Command::Plan(args)) => plan_auto::plan(&args),
        Some(Command::Eval(args)) => eval::run(&args),
        Some(Command::Generate(args)) => generate::run(&args),
        Some(Command::Inspect(args)) => inspect::run(&args),
        Some(Command::Bench(cmd)) => bench::run(&cmd),
        Some(Command::Trace(cmd)) => trace_cmd::run(&cmd),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    /// clap checks a command's definition (unique names, valid groups) only when that
    /// command is parsed; this checks every subcommand at once, so a flag added to a shared
    /// argument struct cannot collide with one a subcommand flattens in unnoticed.
    #[test]
    fn every_command_definition_is_valid() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
