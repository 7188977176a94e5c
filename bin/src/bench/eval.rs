//! `cpl bench eval`: forward throughput of a causal LM of any family (the registry's) as
//! `cpl eval` measures it (the same scoring code): one sequence of --seq-len random tokens, a
//! warm-up pass, then --repeats timed passes (the slowest rank's time of each); tokens/s count
//! the scored tokens (--seq-len - 1), as `cpl eval` and `scripts/bench_eval.py` do.

use anyhow::Result;
use candle_parallel::mesh::Dim;
use candle_parallel::nn::ParamMode;
use serde_json::json;

use super::{at_least_one, random_tokens, LmBenchArgs, Throughput, Work};
use crate::launch::launch;
use train::evaluation::{activation_dtype, score, EvalReport};

#[derive(clap::Args, Debug, Clone)]
pub struct EvalBenchArgs {
    /// Timed forward passes (after a warm-up).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    #[command(flatten)]
    pub lm: LmBenchArgs,
}

pub fn run(args: &EvalBenchArgs) -> Result<()> {
    let a = &args.lm;
    a.layout.device.require_cpu_because(
        "cpl bench eval",
        "its timings do not synchronise a GPU (`cpl bench train` and `cpl bench attention` \
         measure one)",
    )?;
    at_least_one("--repeats", args.repeats)?;
    a.check()?;
    let model = a.resolve()?;
    let dtype = model.dtype(a.dtype);
    let vocab = model.desc.vocab;
    let reports = launch(&a.layout, |rank| {
        // One sequence per data-parallel rank, so every rank works and the tokens/s is the
        // layout's.
        let seqs: Vec<Vec<u32>> = (0..rank.mesh.size(Dim::Dp) as u64)
            .map(|i| random_tokens(a.seq_len, vocab, a.seed + i))
            .collect();
        let loaded = model.load(rank, dtype, ParamMode::Frozen, &a.layout)?;
        let act = activation_dtype(&loaded.params);
        let reports = (0..=args.repeats)
            .map(|_| {
                Ok(score(
                    &rank.mesh,
                    &rank.ctx,
                    loaded.model.as_ref(),
                    act,
                    &seqs,
                    &Default::default(),
                )?
                .0)
            })
            .collect::<Result<Vec<EvalReport>>>()?;
        Ok((act, reports))
    })?;
    let Some((dtype, reports)) = reports else {
        return Ok(());
    };
    let timed = &reports[1..];
    let seconds: Vec<f64> = timed.iter().map(|r| r.seconds).collect();
    let flops = model.desc.flops_per_token(a.seq_len, Work::Forward);
    let peak = a.peak(dtype)?;
    let rate = Throughput::new(&seconds, timed[0].tokens as f64, flops, peak);
    let loss = timed[0].loss;
    if a.json {
        return a.print_json(
            "eval",
            &model,
            dtype,
            &rate,
            json!({
                "repeats": args.repeats, "tokens": timed[0].tokens, "seconds": seconds,
                "loss": loss,
            }),
        );
    }
    let title = format!(
        "cpl bench eval: one sequence of {} tokens, best of {} forward passes after a warm-up, \
         {}, loss {loss:.4}",
        a.seq_len,
        args.repeats,
        dtype.as_str(),
    );
    a.print_table(&model, &title, &rate);
    Ok(())
}
