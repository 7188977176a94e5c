//! `cpl`: the command line of candle-parallel.
//!
//! Subcommands grow with the project (train, finetune, eval, generate, bench). Today: `demo`
//! runs collectives across local ranks and reports their traffic; `plan` shows how a world of
//! ranks is cut into tensor/sequence/pipeline/data-parallel groups.

mod demo;
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
}

fn main() {
    let cli = Cli::parse();
    let result: Result<()> = match cli.command {
        None => demo::run(&demo::DemoArgs::default()),
        Some(Command::Demo(args)) => demo::run(&args),
        Some(Command::Plan(args)) => layout::plan(&args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
