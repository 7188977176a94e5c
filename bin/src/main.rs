//! `cpl`: the command line of candle-parallel.
//!
//! Subcommands: `eval`, `generate`, `inspect` (models from Hugging Face checkpoints under any
//! parallel layout), `plan` (how a world of ranks is cut into groups), `demo` (collectives
//! across local ranks). `train`, `finetune` and `bench` come with later issues.

mod data;
mod demo;
mod eval;
mod generate;
mod inspect;
mod launch;
mod layout;

use anyhow::Result;
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
    /// Print the device mesh of a parallel layout: each rank's coordinates and groups.
    Plan(layout::LayoutArgs),
    /// Mean next-token loss, perplexity and token count of a model on a text, jsonl or token file.
    Eval(eval::EvalArgs),
    /// Continue a prompt with a model (KV cache; one rank or tensor parallel).
    Generate(generate::GenerateArgs),
    /// Show a model's architecture, parameter count, dtypes and checkpoint files.
    Inspect(inspect::InspectArgs),
}

fn main() {
    let cli = Cli::parse();
    let result: Result<()> = match cli.command {
        None => demo::run(&demo::DemoArgs::default()),
        Some(Command::Demo(args)) => demo::run(&args),
        Some(Command::Plan(args)) => layout::plan(&args),
        Some(Command::Eval(args)) => eval::run(&args),
        Some(Command::Generate(args)) => generate::run(&args),
        Some(Command::Inspect(args)) => inspect::run(&args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
