//! `cpl plan`: the mesh of a layout and its pipeline timetable; `cpl plan --auto` ranks the parallel layouts of a model, a sequence length and a cluster by
//! predicted step time ([`candle_parallel::planner`]), prints the best with their breakdown and
//! the `cpl train` flags of the winner; `--measure K` runs K of them here (`cpl bench train`
//! in a child process each) and reports how the predicted ranking and memory compare.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_parallel::attention::{SeqLayout, Strategy};
use candle_parallel::mesh::{Dim, MeshLayout};
use candle_parallel::nn::TpActivations;
use candle_parallel::pipeline::PipelineSchedule;
use candle_parallel::planner::cost::Workload;
use candle_parallel::planner::{
    kendall_tau, search, Candidate, Hardware, ModelShape, Prediction, Request, GIB,
};
use candle_parallel::recompute::Checkpointing;
use models::family::Work;
use serde_json::{json, Value};

use crate::args::DtypeArg;
use crate::layout::{LayoutArgs, PipelineArgs};

/// The flags of `cpl plan --auto`.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Automatic layout (--auto)")]
pub struct AutoArgs {
    /// Choose the layout: rank every layout of --world ranks for --model at --seq-len on
    /// --hardware by predicted step time.
    #[arg(long)]
    pub auto: bool,
    /// A model directory, its config.json, or a Hugging Face Hub id (any causal LM of the
    /// registry; for a mixture of experts the search includes expert parallelism, `--ep`).
    /// Without --auto, under --pp: the model's stages as --pp-layers cuts them and the bubble
    /// of the schedule run with their costs.
    #[arg(long)]
    pub model: Option<String>,
    /// Tokens per sequence (default without --auto: 4096).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Ranks (devices) to plan for.
    #[arg(long, requires = "auto")]
    pub world: Option<usize>,
    /// A hardware description (TOML, see `cpl bench calibrate`) or a preset: h100-node,
    /// h100-cluster, a100-hdr-cluster, a800-roce-cluster, l20-pcie-node, cpu-2core.
    #[arg(long, requires = "auto")]
    pub hardware: Option<String>,
    /// Tokens per optimizer step (a multiple of --seq-len; default: one sequence per rank).
    #[arg(long, requires = "auto")]
    pub global_batch_tokens: Option<usize>,
    /// Training dtype.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32, requires = "auto")]
    pub dtype: DtypeArg,
    /// Tokens per chunk of the vocab-parallel loss (as `cpl train --loss-chunk`).
    #[arg(long, default_value_t = 1024, requires = "auto")]
    pub loss_chunk: usize,
    /// Leave pipeline parallelism out.
    #[arg(long, requires = "auto")]
    pub no_pp: bool,
    /// Layouts to print.
    #[arg(long, default_value_t = 5, requires = "auto")]
    pub top: usize,
    /// Print every candidate with its prediction as JSON.
    #[arg(long, requires = "auto")]
    pub json: bool,
    /// Run K layouts spread over the ranking (pipeline-free ones: `cpl bench train` runs no
    /// pipeline) on local ranks of this machine, 3 steps each, and compare: Kendall's tau of
    /// predicted and measured throughput, predicted memory against the peak RSS. Random weights
    /// of the model's shape; a mixture of experts or a model with sliding-window layers runs its
    /// own checkpoint (--model must then be its directory or Hub id).
    #[arg(long, requires = "auto")]
    pub measure: Option<usize>,
}

/// The config.json of a model directory, the file itself, or a Hub id's.
fn model_config(model: &str) -> Result<std::path::PathBuf> {
    let path = Path::new(model);
    let looks_like_path = model.starts_with(['/', '.']) || model.ends_with(".json");
    Ok(if path.is_file() {
        path.to_path_buf()
    } else if path.is_dir() {
        path.join("config.json")
    } else if looks_like_path {
        bail!("no model config at {model} (a directory with config.json, or the file)");
    } else {
        models::hub::resolve(model)?.config
    })
}

/// The model's shape from a directory, a config.json or a Hub id.
fn model_shape(model: &str) -> Result<ModelShape> {
    let config = model_config(model)?;
    let family = models::family::detect(&config)?;
    let shape = (family.describe)(&config)?.planner_shape.with_context(|| {
        format!(
            "--model {model}: the planner models causal language models; {} is a {} model",
            config.display(),
            family.name
        )
    })?;
    shape
        .validate()
        .with_context(|| format!("model config {}", config.display()))?;
    Ok(shape)
}

/// The `cpl train` layout flags of a candidate.
fn layout_args(c: &Candidate, world: usize) -> LayoutArgs {
    let mesh = &c.layout.mesh;
    let sp = &c.layout.attention;
    let inferred = match (sp.ulysses > 1, sp.ring > 1) {
        (true, true) => Strategy::Usp,
        (true, false) => Strategy::Ulysses,
        _ => Strategy::Ring,
    };
    LayoutArgs {
        ranks: world,
        tp: mesh.degree(Dim::Tp),
        ulysses: mesh.degree(Dim::Ulysses),
        ring: mesh.degree(Dim::Ring),
        pp: mesh.degree(Dim::Pp),
        placement: sp.placement,
        cp_impl: (sp.strategy != inferred).then_some(sp.strategy),
        inner_ring: sp.inner_ring,
        team: sp.team,
        tp_sp: c.layout.tp == TpActivations::SequenceSharded,
        ep: c.layout.ep,
        // The planner's rings are zigzag (`cpl`'s default for causal models; for a
        // bidirectional one zigzag and contiguous split the scores alike) or contiguous.
        ring_layout: (sp.ring > 1 && sp.layout == SeqLayout::Contiguous).then_some(sp.layout),
        ..LayoutArgs::default()
    }
}

/// The memory flags of a candidate.
fn memory_flags(c: &Candidate) -> String {
    let mut f = Vec::new();
    if c.memory.zero.number() > 0 {
        f.push(format!("--zero {}", c.memory.zero.number()));
    }
    if c.memory.checkpointing != Checkpointing::None {
        f.push(format!("--checkpointing {}", c.memory.checkpointing));
    }
    f.join(" ")
}

fn describe(c: &Candidate, world: usize) -> String {
    let l = layout_args(c, world).flags();
    let l = l.trim_start_matches(&format!("--ranks {world}")).trim();
    let dp = c.layout.mesh.degree(Dim::Dp);
    let mut parts = vec![if l.is_empty() {
        "dp only".to_string()
    } else {
        l.to_string()
    }];
    if dp > 1 && !l.is_empty() {
        parts.push(format!("(dp {dp})"));
    }
    let m = memory_flags(c);
    if !m.is_empty() {
        parts.push(m);
    }
    parts.join(" ")
}

fn candidate_json(c: &Candidate, p: &Prediction, world: usize, tokens: f64) -> Value {
    json!({
        "layout": describe(c, world),
        "flags": format!("{} {}", layout_args(c, world).flags(), memory_flags(c)).trim(),
        "tp": c.layout.mesh.degree(Dim::Tp), "ulysses": c.layout.mesh.degree(Dim::Ulysses),
        "ring": c.layout.mesh.degree(Dim::Ring), "pp": c.layout.mesh.degree(Dim::Pp),
        "dp": c.layout.mesh.degree(Dim::Dp), "ep": c.layout.ep,
        "strategy": c.layout.attention.strategy.name(),
        "placement": c.layout.attention.placement.to_string(),
        "inner_ring": c.layout.attention.inner_ring, "team": c.layout.attention.team,
        "tp_sp": c.layout.tp == TpActivations::SequenceSharded,
        "zero": c.memory.zero.number(), "checkpointing": c.memory.checkpointing.to_string(),
        "predicted_tokens_per_sec": tokens / p.time.total,
        "prediction": p,
    })
}

pub fn run(args: &AutoArgs, layout: &LayoutArgs) -> Result<()> {
    if layout.flags() != LayoutArgs::default().flags() {
        bail!(
            "--auto chooses the layout: leave out {} (give the ranks as --world)",
            layout.flags()
        );
    }
    let need = |v: Option<usize>, flag: &str| v.with_context(|| format!("--auto needs {flag}"));
    let model_arg = args.model.as_deref().context("--auto needs --model")?;
    let seq_len = need(args.seq_len, "--seq-len")?;
    let world = need(args.world, "--world")?;
    let hw_arg = args.hardware.as_deref().with_context(|| {
        format!(
            "--auto needs --hardware (a TOML file from `cpl bench calibrate`, or a preset: {})",
            Hardware::preset_names().join(", ")
        )
    })?;
    if seq_len < 2 || world == 0 || args.loss_chunk == 0 || args.top == 0 {
        bail!("--seq-len must be at least 2, --world, --loss-chunk and --top at least 1");
    }
    let model = model_shape(model_arg).with_context(|| format!("--model {model_arg}"))?;
    if args.measure.is_some() && measures_checkpoint(&model) && Path::new(model_arg).is_file() {
        bail!(
            "--measure runs a mixture of experts or a model with sliding-window layers on its own \
             checkpoint (a random LLaMA of its shape would have neither): --model {model_arg} is \
             a config file; give the checkpoint's directory or Hub id"
        );
    }
    let hw = Hardware::load(hw_arg).with_context(|| format!("--hardware {hw_arg}"))?;
    let tokens = match args.global_batch_tokens {
        Some(t) => t,
        None => seq_len.checked_mul(world).with_context(|| {
            format!("--seq-len {seq_len} x --world {world} tokens per step overflow")
        })?,
    };
    if tokens == 0 || !tokens.is_multiple_of(seq_len) {
        bail!("--global-batch-tokens {tokens} is not a multiple of --seq-len {seq_len}");
    }
    let elem_bytes = DType::from(args.dtype).size_in_bytes();
    let req = Request {
        work: Workload {
            model,
            seq_len,
            sequences: tokens / seq_len,
            elem_bytes,
            loss_chunk: args.loss_chunk,
            attention_density: 0.5,
        },
        world,
        pipeline: !args.no_pp,
    };
    let found = search(&req, &hw).with_context(|| {
        format!("--auto for --model {model_arg} --seq-len {seq_len} --world {world} on {hw_arg}")
    })?;
    let tokens = tokens as f64;
    let measured = match args.measure {
        Some(k) => Some(measure(args, &req, &found.ranked, k, model_arg)?),
        None => None,
    };
    if args.json {
        let all: Vec<Value> = found
            .ranked
            .iter()
            .map(|(c, p)| candidate_json(c, p, world, tokens))
            .collect();
        let too_big: Vec<Value> = found
            .too_big
            .iter()
            .map(|(c, p)| candidate_json(c, p, world, tokens))
            .collect();
        let body = json!({
            "model": model, "seq_len": seq_len, "world": world, "hardware": hw,
            "global_batch_tokens": tokens, "dtype": format!("{:?}", args.dtype).to_lowercase(),
            "memory_per_rank_bytes": found.memory_per_rank,
            "ranked": all, "too_big": too_big, "measured": measured,
        });
        println!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(());
    }
    println!(
        "{} ranks on {}: {} layouts fit {:.1} GiB per rank ({} do not); {} tokens per step",
        world,
        hw.name,
        found.ranked.len(),
        found.memory_per_rank / GIB,
        found.too_big.len(),
        tokens
    );
    println!(
        "| # | layout | step s | tokens/s | compute | recompute | exposed comm | bubble | gradients | optimizer | GiB/rank |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (n, (c, p)) in found.ranked.iter().take(args.top).enumerate() {
        let t = &p.time;
        println!(
            "| {} | {} | {:.3} | {:.0} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} |",
            n + 1,
            describe(c, world),
            t.total,
            tokens / t.total,
            t.compute,
            t.recompute,
            t.exposed_comm,
            t.bubble,
            t.gradients,
            t.optimizer,
            p.memory.total / GIB
        );
    }
    let (best, p) = &found.ranked[0];
    let la = layout_args(best, world);
    let accum = if la.pp > 1 {
        format!("--micro-batches {}", p.micro_batches)
    } else {
        format!("--grad-accum {}", p.micro_batches)
    };
    println!(
        "\nrun the best:\ncpl train --model {model_arg} --seq-len {seq_len} --batch 1 {accum} {} {} --loss-chunk {}",
        la.flags(),
        memory_flags(best),
        args.loss_chunk
    );
    if let Some(m) = measured {
        print_measured(&m)?;
    }
    Ok(())
}

/// Whether `--measure` runs the model's own checkpoint (`cpl bench train --model`): a mixture of
/// experts or a model with sliding-window layers, which a random LLaMA of the shape would not
/// reproduce. Other models are measured on random weights of their shape.
fn measures_checkpoint(m: &candle_parallel::planner::ModelShape) -> bool {
    m.moe.is_some() || m.windowed_layers().is_some()
}

/// Runs `k` of the ranked pipeline-free layouts, spread from the best to the worst, with
/// `cpl bench train` (random weights of the model's shape, or the checkpoint itself where
/// [`measures_checkpoint`]) and returns the comparison.
fn measure(
    args: &AutoArgs,
    req: &Request,
    ranked: &[(Candidate, Prediction)],
    k: usize,
    model_arg: &str,
) -> Result<Value> {
    let m = &req.work.model;
    if k < 2 {
        bail!("--measure {k}: measure at least 2 layouts to compare a ranking");
    }
    let checkpoint = measures_checkpoint(m);
    if !checkpoint && m.head_dim * m.heads != m.hidden {
        bail!(
            "--measure builds a random model of --model's shape, whose head_dim must be hidden / \
             heads ({} / {}), not {}",
            m.hidden,
            m.heads,
            m.head_dim
        );
    }
    let pool: Vec<&(Candidate, Prediction)> = ranked
        .iter()
        .filter(|(c, _)| c.layout.mesh.degree(Dim::Pp) == 1)
        .collect();
    if pool.len() < 2 {
        bail!("--measure: fewer than 2 pipeline-free layouts fit");
    }
    let k = k.min(pool.len());
    let picks: Vec<usize> = (0..k)
        .map(|j| (j * (pool.len() - 1) + (k - 1) / 2) / (k - 1))
        .collect();
    let exe = std::env::current_exe().context("locating the cpl executable")?;
    let seq = req.work.seq_len;
    let mut rows = Vec::new();
    for (j, &i) in picks.iter().enumerate() {
        let (c, p) = pool[i];
        let la = layout_args(c, req.world);
        let mut cmd = Command::new(&exe);
        // The ranking compares tokens/s and memory; the MFU reference rate (a 2048^3 product
        // by default, seconds per layout) only needs a quick 512^3 measure here.
        cmd.args([
            "bench",
            "train",
            "--json",
            "--steps",
            "3",
            "--matmul-size",
            "512",
        ])
        .args(["--grad-accum", &p.micro_batches.to_string()])
        .args(["--seq-len", &seq.to_string()])
        .args(["--loss-chunk", &args.loss_chunk.to_string()])
        .args(["--dtype", &format!("{:?}", args.dtype).to_lowercase()]);
        if checkpoint {
            cmd.args(["--model", model_arg]);
        } else {
            cmd.args([
                "--layers",
                &m.layers.to_string(),
                "--hidden",
                &m.hidden.to_string(),
            ])
            .args([
                "--heads",
                &m.heads.to_string(),
                "--kv-heads",
                &m.kv_heads.to_string(),
            ])
            .args(["--intermediate", &m.intermediate.to_string()])
            .args(["--vocab", &m.vocab.to_string()]);
        }
        cmd.args(la.flags().split_whitespace())
            .args(memory_flags(c).split_whitespace());
        eprintln!(
            "measuring {}/{k}: {} ({} {model_arg})",
            j + 1,
            describe(c, req.world),
            if checkpoint {
                "checkpoint"
            } else {
                "model shape of"
            }
        );
        let out = cmd.output().context("running cpl bench train")?;
        if !out.status.success() {
            bail!(
                "cpl bench train failed for {}: {}",
                describe(c, req.world),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let v: Value =
            serde_json::from_slice(&out.stdout).context("reading cpl bench train's JSON")?;
        let tps = v["tokens_per_sec_median"]
            .as_f64()
            .context("no tokens_per_sec_median")?;
        let rss = v["peak_rss_mib"].as_f64().unwrap_or(f64::NAN);
        // Local ranks are one process: its memory is the sum over the ranks.
        let predicted_mib = p.memory.total * req.world as f64 / (1u64 << 20) as f64;
        let predicted_tps = (req.work.sequences * seq) as f64 / p.time.total;
        rows.push(json!({
            "rank_in_plan": i + 1, "layout": describe(c, req.world),
            "predicted_tokens_per_sec": predicted_tps, "measured_tokens_per_sec": tps,
            "predicted_memory_mib": predicted_mib, "measured_peak_rss_mib": rss,
        }));
    }
    let col = |key: &str| -> Vec<f64> {
        rows.iter()
            .map(|r| r[key].as_f64().unwrap_or(f64::NAN))
            .collect()
    };
    let tau = kendall_tau(
        &col("predicted_tokens_per_sec"),
        &col("measured_tokens_per_sec"),
    );
    Ok(json!({ "kendall_tau": tau, "layouts": rows }))
}

fn print_measured(m: &Value) -> Result<()> {
    println!("\nmeasured here (cpl bench train, 3 steps, the median of the last 2):");
    println!("| plan # | layout | predicted tok/s | measured tok/s | predicted MiB (all ranks) | peak RSS MiB |");
    println!("|---|---|---|---|---|---|");
    for r in m["layouts"].as_array().context("measured layouts")? {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} |",
            r["rank_in_plan"],
            r["layout"].as_str().unwrap_or(""),
            r["predicted_tokens_per_sec"].as_f64().unwrap_or(f64::NAN),
            r["measured_tokens_per_sec"].as_f64().unwrap_or(f64::NAN),
            r["predicted_memory_mib"].as_f64().unwrap_or(f64::NAN),
            r["measured_peak_rss_mib"].as_f64().unwrap_or(f64::NAN),
        );
    }
    match m["kendall_tau"].as_f64() {
        Some(t) => println!("Kendall's tau of predicted and measured tokens/s: {t:.2}"),
        None => println!("Kendall's tau: undefined (ties)"),
    }
    Ok(())
}

/// `cpl plan`'s flags.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    #[command(flatten)]
    pub layout: LayoutArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
    #[command(flatten)]
    pub auto: AutoArgs,
}

/// Prints the mesh and, under a pipeline, every rank's schedule as a timetable with its bubble;
/// with `--auto`, the ranked layouts of [`run`].
pub fn plan(args: &PlanArgs) -> Result<()> {
    if args.auto.auto {
        return run(&args.auto, &args.layout);
    }
    let cfg = args.layout.mesh_config()?;
    let layout = MeshLayout::new(&cfg, args.layout.ranks)?;
    let ep = args.layout.ep;
    let experts = if ep != 1 {
        // The flags' checks first (--ep 0, --ep not dividing the token ranks).
        args.layout.layout()?;
        experts_summary(&layout, ep, args.auto.model.as_deref())?
    } else {
        String::new()
    };
    print!("{}{experts}", layout.describe());
    let pp = &args.pipeline;
    let m = pp.micro_batches.unwrap_or(1);
    let schedule = pp.schedule(args.layout.pp, m)?;
    if let Some(schedule) = &schedule {
        print!("{}", schedule.render()?);
    }
    match (&args.auto.model, &schedule) {
        (Some(model), Some(schedule)) => {
            print!("{}", model_stages(args, model, schedule)?);
        }
        (Some(_), None) if ep != 1 => {}
        (Some(_), None) => bail!(
            "--model without --auto shows a model's pipeline stages (give --pp 2 or more) or \
             where its experts go (give --ep 2 or more)"
        ),
        (None, _) => {
            if args.auto.seq_len.is_some() {
                bail!("--seq-len: give --model (with --pp, or --auto)");
            }
        }
    }
    Ok(())
}

/// `cpl plan --ep N`: the expert-parallel groups and the groups holding the same experts (as
/// [`MeshLayout::expert_groups`] lists them), and with `--model` which experts each position of
/// a group holds. Errors naming `--ep` when the model is dense or `N` does not divide its
/// experts.
fn experts_summary(layout: &MeshLayout, ep: usize, model: Option<&str>) -> Result<String> {
    const SHOWN: usize = 8;
    let (groups, replicas) = layout.expert_groups(ep)?;
    let list = |gs: &[Vec<usize>]| {
        let shown: Vec<String> = gs.iter().take(SHOWN).map(|g| format!("{g:?}")).collect();
        let more = match gs.len().checked_sub(SHOWN) {
            Some(m) if m > 0 => format!(" ... ({m} more)"),
            _ => String::new(),
        };
        format!("{}{more}", shown.join(" "))
    };
    let mut out = format!(
        "ep groups ({} of {ep} ranks, carved from ulysses x ring x dp; tokens travel to their \
         experts inside one): {}\n",
        groups.len(),
        list(&groups)
    );
    out += &format!(
        "same-expert groups ({} of {} ranks; the experts' gradients are summed and ZeRO-sharded \
         over one): {}\n",
        replicas.len(),
        replicas.first().map_or(0, Vec::len),
        list(&replicas)
    );
    if let Some(model) = model {
        let shape = model_shape(model).with_context(|| format!("--model {model}"))?;
        let Some(moe) = shape.moe else {
            bail!("--ep {ep}: {model} is not a mixture of experts");
        };
        if !moe.experts.is_multiple_of(ep) {
            bail!(
                "--ep {ep} does not divide the {} experts of {model}",
                moe.experts
            );
        }
        let per = moe.experts / ep;
        out += &format!(
            "{model}: {} experts per sparse layer (top-{}), {per} per rank: ",
            moe.experts, moe.top_k
        );
        let held: Vec<String> = (0..ep)
            .map(|i| format!("position {i} holds experts {}..{}", i * per, (i + 1) * per))
            .collect();
        out += &held.join(", ");
        out += "\n";
    }
    Ok(out)
}

/// `cpl plan --pp P --model M`: the layers of each virtual stage as --pp-layers cuts them,
/// each stage's training FLOPs over the mean stage's at --seq-len, and the schedule run with
/// those costs (backward twice the forward, communication free) against the unit-cost run and
/// the formula.
fn model_stages(args: &PlanArgs, model: &str, schedule: &PipelineSchedule) -> Result<String> {
    let config = model_config(model).with_context(|| format!("--model {model}"))?;
    let family = models::family::detect(&config).with_context(|| format!("--model {model}"))?;
    let seq_len = args.auto.seq_len.unwrap_or(4096);
    let costs = (family.describe)(&config)?.stage_costs(seq_len, Work::Training);
    let Some(pc) = args.pipeline.stages(args.layout.pp, &costs, &config)? else {
        bail!("--model without --auto shows a model's pipeline stages: give --pp 2 or more");
    };
    let ranges = pc.ranges();
    let stage = costs.of(&ranges);
    let mean = stage.iter().sum::<f64>() / stage.len() as f64;
    let weights: Vec<f64> = stage.iter().map(|c| c / mean).collect();
    let weighted = schedule.validate_weighted(&weights)?;
    let unit = schedule.validate()?;
    let mut out = format!(
        "{} at {seq_len} tokens, --pp-layers {}:\n",
        config.display(),
        args.pipeline.pp_layers.clone().unwrap_or_default()
    );
    for (vs, (r, w)) in ranges.iter().zip(&weights).enumerate() {
        out += &format!(
            "  virtual stage {vs} (rank {}): layers {}..{} ({}), FLOPs {w:.2} x the mean\n",
            vs % args.layout.pp,
            r.start,
            r.end,
            r.len()
        );
    }
    out += &format!(
        "bubble with these stages: {:.1}% (step {:.2} x the equal-stage step; equal stages \
         {:.1}%, formula {:.1}%)\n",
        100.0 * weighted.mean_bubble(),
        weighted.makespan / unit.makespan,
        100.0 * unit.mean_bubble(),
        100.0 * schedule.bubble_formula()
    );
    Ok(out)
}
