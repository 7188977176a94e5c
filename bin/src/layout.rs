//! Parallel layout flags shared by every `cpl` command, and `cpl plan`.

use anyhow::{bail, Context, Result};
use candle_parallel::attention::{SeqLayout, ShardPlan, SpConfig, Strategy};
use candle_parallel::mesh::{Dim, MeshConfig, MeshLayout, Placement};
use candle_parallel::pipeline::{LayerSplit, PipelineSchedule, ScheduleKind, StageCosts};
use std::path::Path;
use train::trainer::PipelineConfig;

#[derive(clap::Args, Debug, Clone)]
pub struct LayoutArgs {
    /// Number of ranks (local threads, or MPI processes).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Head-parallel (Ulysses) degree.
    #[arg(long, default_value_t = 1)]
    pub ulysses: usize,
    /// Context-parallel (ring) degree.
    #[arg(long, default_value_t = 1)]
    pub ring: usize,
    /// Pipeline-parallel degree.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Expert parallelism: ranks over which every mixture-of-experts block divides its experts,
    /// carved from the ranks that hold different tokens (ulysses x ring x dp, innermost first);
    /// tokens travel to their experts and back by all-to-all (each expert still split over
    /// --tp). For a mixture of experts in `cpl train`, `finetune`, `eval`, `generate`, `bench`,
    /// and `cpl plan` (which prints the groups).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Data-parallel degree; inferred from --ranks when omitted.
    #[arg(long)]
    pub dp: Option<usize>,
    /// Rank order, innermost first, e.g. "tp,ulysses,ring,dp,pp" (default) or "tp,ulysses,ring,pp,dp" (Llama 3).
    #[arg(long)]
    pub order: Option<String>,
    /// Placement of the (ulysses, ring) grid (LoongTrain).
    #[arg(long, value_enum, default_value_t = Placement::HeadFirst)]
    pub placement: Placement,
    /// How the sequence is split over the ring ranks. Default: doc-zigzag for a causal model
    /// trained with --doc-mask (zigzag per packed document: it balances every document's causal
    /// triangle), else the model's: zigzag for causal attention (it balances the causal
    /// triangle), contiguous for full attention (DiT).
    #[arg(long, value_enum)]
    pub ring_layout: Option<SeqLayout>,
    /// Sequence-parallel attention. Default: usp when both --ulysses and --ring exceed 1,
    /// ulysses when only --ulysses does, ring otherwise.
    #[arg(long, value_enum)]
    pub cp_impl: Option<Strategy>,
    /// Inner ring size of --cp-impl double-ring (divides --ring).
    #[arg(long, default_value_t = 1)]
    pub inner_ring: usize,
    /// Team size C of --cp-impl startrail (C^2 divides --ring).
    #[arg(long, default_value_t = 1)]
    pub team: usize,
    /// Megatron sequence parallelism inside the tensor-parallel group (norms and residuals
    /// split along the sequence over --tp ranks).
    #[arg(long)]
    pub tp_sp: bool,
    /// How ranks run.
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    pub backend: Backend,
    /// Where parameters and activations live: cpu, cuda (GPU 0) or cuda:N (needs a build with
    /// `--features cuda`; with --backend nccl, rank r uses GPU N + its local rank).
    #[arg(long, default_value = "cpu", value_parser = DeviceArg::parse)]
    pub device: DeviceArg,
}

/// The `--device` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceArg {
    #[default]
    Cpu,
    /// A CUDA GPU by ordinal (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl DeviceArg {
    /// Parses `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("expected cpu, cuda or cuda:N, got {other:?}")),
        }
    }

    /// The candle device of a rank whose GPU is `offset` past this flag's (0 for local ranks,
    /// which share one device). Errors name the flag: a build without CUDA, or a missing GPU.
    pub fn open(&self, offset: usize) -> Result<candle_core::Device> {
        match *self {
            Self::Cpu => Ok(candle_core::Device::Cpu),
            Self::Cuda(n) => {
                if !cfg!(feature = "cuda") {
                    bail!(
                        "--device {self}: this cpl was built without CUDA; rebuild with \
                         `cargo build -p cpl --features cuda` (see docs/gpu.md)"
                    );
                }
                open_cuda(n + offset).with_context(|| {
                    format!(
                        "--device {self}: cannot open CUDA GPU {} (is there one, with its \
                         driver? see docs/gpu.md)",
                        n + offset
                    )
                })
            }
        }
    }

    /// Errors unless this is the CPU: for commands whose data pipeline does not yet put its
    /// inputs on other devices (`what` names the command).
    pub fn require_cpu(&self, what: &str) -> Result<()> {
        if *self != Self::Cpu {
            bail!("--device {self}: {what} runs on the CPU only for now (see docs/gpu.md)");
        }
        Ok(())
    }

    /// [`Self::require_cpu`] with the reason in the error.
    pub fn require_cpu_because(&self, what: &str, why: &str) -> Result<()> {
        if *self != Self::Cpu {
            bail!("--device {self}: {what} runs on the CPU only: {why} (see docs/gpu.md)");
        }
        Ok(())
    }
}

/// GPU `ordinal` with one stream of its own, which every user of the returned device (all local
/// ranks, which are threads) shares: candle's `Device::new_cuda` gives each thread its own
/// per-thread stream, so ranks passing tensors to each other would race.
#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> candle_core::Result<candle_core::Device> {
    Ok(candle_core::Device::Cuda(
        candle_core::cuda::CudaDevice::new_with_stream(ordinal)?,
    ))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> candle_core::Result<candle_core::Device> {
    candle_core::Device::new_cuda(ordinal)
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// How the ranks of a command run.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Threads of this process.
    Local,
    /// One process per rank under mpirun (needs a build with --features mpi).
    Mpi,
    /// One process per GPU with NCCL on CUDA tensors (needs --features nccl and --device cuda):
    /// run as is, `cpl` spawns --ranks local processes; under mpirun, each process is a rank.
    Nccl,
}

impl Default for LayoutArgs {
    fn default() -> Self {
        Self {
            ranks: 1,
            tp: 1,
            ulysses: 1,
            ring: 1,
            pp: 1,
            ep: 1,
            dp: None,
            order: None,
            placement: Placement::HeadFirst,
            ring_layout: None,
            cp_impl: None,
            inner_ring: 1,
            team: 1,
            tp_sp: false,
            backend: Backend::Local,
            device: DeviceArg::Cpu,
        }
    }
}

impl LayoutArgs {
    /// The mesh configuration these flags describe, validated against `--ranks`.
    pub fn mesh_config(&self) -> Result<MeshConfig> {
        if self.ranks == 0 {
            bail!("--ranks must be at least 1");
        }
        let mut cfg = MeshConfig::default()
            .with_tp(self.tp)
            .with_ulysses(self.ulysses)
            .with_ring(self.ring)
            .with_pp(self.pp);
        if let Some(order) = &self.order {
            let dims = Dim::parse_list(order).with_context(|| format!("--order {order:?}"))?;
            cfg = cfg.with_order(&dims);
            cfg.effective_order()
                .with_context(|| format!("--order {order:?}"))?;
        }
        cfg = cfg.with_placement(self.placement);
        let dp = match self.dp {
            Some(dp) => dp,
            None => {
                let others = self.tp * self.ulysses * self.ring * self.pp;
                if others == 0 || !self.ranks.is_multiple_of(others) {
                    bail!(
                        "--ranks {} is not divisible by tp {} x ulysses {} x ring {} x pp {} = {others}; \
                         cannot infer --dp",
                        self.ranks, self.tp, self.ulysses, self.ring, self.pp
                    );
                }
                self.ranks / others
            }
        };
        let cfg = cfg.with_dp(dp);
        cfg.validate(self.ranks).context("parallel layout flags")?;
        Ok(cfg)
    }
}

impl LayoutArgs {
    /// These flags for a model whose attention is `causal` or full: without an explicit
    /// `--ring-layout`, zigzag for causal attention, contiguous for full attention (zigzag only
    /// balances a causal mask, and needs sequences of a multiple of 2 x ring).
    pub fn for_attention(mut self, causal: bool) -> Self {
        if self.ring_layout.is_none() {
            self.ring_layout = Some(if causal {
                SeqLayout::Zigzag
            } else {
                SeqLayout::Contiguous
            });
        }
        self
    }

    /// The parallel layout these flags describe (mesh, sequence-parallel attention, TP-sp):
    /// what every rank builds its mesh and context from.
    pub fn layout(&self) -> Result<candle_parallel::plan::Layout> {
        let tp = if self.tp_sp {
            candle_parallel::nn::TpActivations::SequenceSharded
        } else {
            candle_parallel::nn::TpActivations::Replicated
        };
        let mesh = self.mesh_config()?;
        let tokens = mesh.degree(Dim::Ulysses) * mesh.degree(Dim::Ring) * mesh.degree(Dim::Dp);
        if self.ep == 0 {
            bail!("--ep must be at least 1");
        }
        if !tokens.is_multiple_of(self.ep) {
            bail!(
                "--ep {} does not divide the {tokens} ranks that hold different tokens (ulysses x \
                 ring x dp), from which expert parallelism is carved",
                self.ep
            );
        }
        Ok(
            candle_parallel::plan::Layout::new(mesh, self.sp_config()?, tp)
                .with_expert_parallel(self.ep),
        )
    }

    /// Errors naming `--ep` unless it is 1: for commands (`what`) that run no expert
    /// parallelism.
    pub fn require_no_ep(&self, what: &str) -> Result<()> {
        if self.ep != 1 {
            bail!(
                "--ep {}: {what} runs no expert parallelism (cpl train and cpl bench train do)",
                self.ep
            );
        }
        Ok(())
    }

    /// The data-parallel degree of these flags (checked).
    pub fn dp_degree(&self) -> Result<usize> {
        let mesh = self.mesh_config()?;
        Ok(MeshLayout::new(&mesh, self.ranks)?.group_size(&[Dim::Dp]))
    }

    /// These flags for a causal model trained with document masks (`doc_mask`): without an
    /// explicit `--ring-layout`, doc-zigzag (each packed document zigzagged over the ring
    /// ranks). Precedence: `--ring-layout`, then this, then [`LayoutArgs::for_attention`].
    pub fn for_documents(mut self, doc_mask: bool) -> Self {
        if doc_mask && self.ring_layout.is_none() {
            self.ring_layout = Some(SeqLayout::DocZigzag);
        }
        self
    }

    /// The layout flags that differ from their defaults, as typed (`--ranks 4 --tp 2 --ring 2`).
    pub fn flags(&self) -> String {
        let d = Self::default();
        let mut f = vec![format!("--ranks {}", self.ranks)];
        for (flag, v, default) in [
            ("--tp", self.tp, d.tp),
            ("--ulysses", self.ulysses, d.ulysses),
            ("--ring", self.ring, d.ring),
            ("--pp", self.pp, d.pp),
            ("--ep", self.ep, d.ep),
            ("--inner-ring", self.inner_ring, d.inner_ring),
            ("--team", self.team, d.team),
        ] {
            if v != default {
                f.push(format!("{flag} {v}"));
            }
        }
        if let Some(dp) = self.dp {
            f.push(format!("--dp {dp}"));
        }
        if let Some(c) = self.cp_impl {
            f.push(format!("--cp-impl {c}"));
        }
        if self.placement != d.placement {
            f.push(format!("--placement {}", self.placement));
        }
        if let Some(l) = self
            .ring_layout
            .filter(|_| self.ring_layout != d.ring_layout)
        {
            f.push(format!("--ring-layout {l}"));
        }
        if self.tp_sp {
            f.push("--tp-sp".into());
        }
        if self.device != d.device {
            f.push(format!("--device {}", self.device));
        }
        f.join(" ")
    }

    /// The sequence-parallel attention these flags describe.
    pub fn sp_config(&self) -> Result<SpConfig> {
        let strategy = match self.cp_impl {
            Some(s) => s,
            None if self.ulysses > 1 && self.ring > 1 => Strategy::Usp,
            None if self.ulysses > 1 => Strategy::Ulysses,
            None => Strategy::Ring,
        };
        let cfg = SpConfig::new(strategy, self.ulysses, self.ring)
            .with_layout(self.ring_layout.unwrap_or(SeqLayout::Zigzag))
            .with_inner_ring(self.inner_ring)
            .with_team(self.team)
            .with_placement(self.placement);
        cfg.validate().with_context(|| {
            format!(
                "--cp-impl {} with --ulysses {} --ring {} --inner-ring {} --team {}",
                strategy.name(),
                self.ulysses,
                self.ring,
                self.inner_ring,
                self.team
            )
        })?;
        Ok(cfg)
    }

    /// Errors naming the flags when sequences of `seq_len` tokens cannot be split over the
    /// sequence-parallel ranks.
    pub fn check_seq_len(&self, seq_len: usize) -> Result<()> {
        let sp = self.sp_config()?;
        ShardPlan::new(seq_len, sp.layout, sp.ring, sp.ulysses).with_context(|| {
            format!(
                "--seq-len {seq_len} cannot be split by --ring {} --ulysses {} --ring-layout {}",
                sp.ring, sp.ulysses, sp.layout
            )
        })?;
        Ok(())
    }
}

/// `cpl plan`: prints the mesh, its rank order and groups.
/// Pipeline schedule flags (`cpl plan` and `cpl train`; with `--pp` above 1).
#[derive(clap::Args, Debug, Clone)]
pub struct PipelineArgs {
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value_t = ScheduleKind::OneFOneB)]
    pub pp_schedule: ScheduleKind,
    /// Micro-batches per optimizer step (any number: also not a multiple of --pp, or below
    /// it). `cpl train`: replaces --grad-accum under a pipeline (default: --grad-accum).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// Model chunks per pipeline rank (--pp-schedule interleaved: 2 or more).
    #[arg(long, default_value_t = 1)]
    pub virtual_stages: usize,
    /// Decoder layers of each virtual stage: `auto` (the default: the stages balanced by the
    /// model's FLOPs per piece, the first stage's embedding and the last stage's head and loss
    /// included), `even` (Llama 3's rule: one layer less on the first and the last stage) or
    /// the counts, e.g. 3,5,5,3.
    #[arg(long)]
    pub pp_layers: Option<LayerSplit>,
}

impl PipelineArgs {
    /// Sets `cfg`'s pipeline from these flags under `--pp pp` for a model whose pieces cost
    /// `costs` (its config at `config_path`): a step's micro-batches are --micro-batches
    /// (default --grad-accum), the stages' layers as --pp-layers says. Returns the layers of
    /// every virtual stage (the whole model, one range, without a pipeline).
    pub fn configure(
        &self,
        cfg: &mut train::trainer::TrainConfig,
        pp: usize,
        costs: &StageCosts,
        config_path: &Path,
    ) -> Result<Vec<std::ops::Range<usize>>> {
        if pp > 1 {
            cfg.grad_accum = self.micro_batches.unwrap_or(cfg.grad_accum);
        }
        if self.schedule(pp, cfg.grad_accum)?.is_some() {
            cfg.pipeline = self.stages(pp, costs, config_path)?;
        }
        Ok(match &cfg.pipeline {
            Some(pc) => pc.ranges(),
            None => std::iter::once(0..costs.layers.len()).collect(),
        })
    }

    /// The layers of every virtual stage for `pp` ranks of a model whose pieces cost `costs`
    /// (its config at `config_path`), as --pp-layers says (default `auto`), printed on rank 0's
    /// log with each stage's share of the cost. `None` without a pipeline.
    pub fn stages(
        &self,
        pp: usize,
        costs: &StageCosts,
        config_path: &Path,
    ) -> Result<Option<PipelineConfig>> {
        if pp <= 1 {
            return Ok(None);
        }
        let n = costs.layers.len();
        let how = self.pp_layers.clone().unwrap_or_default();
        let ranges = how
            .split(costs, pp * self.virtual_stages)
            .with_context(|| {
                format!(
                    "--pp-layers {how} for the {n} layers of {}",
                    config_path.display()
                )
            })?;
        let stage_costs = costs.of(&ranges);
        let mean = stage_costs.iter().sum::<f64>() / stage_costs.len() as f64;
        let shares: Vec<String> = stage_costs
            .iter()
            .map(|c| format!("{:.2}", c / mean))
            .collect();
        let counts: Vec<String> = ranges.iter().map(|r| r.len().to_string()).collect();
        eprintln!(
            "pipeline layers per virtual stage (--pp-layers {how}): {}; FLOPs over the mean \
             stage: {}",
            counts.join(","),
            shares.join(", ")
        );
        Ok(Some(PipelineConfig {
            schedule: self.pp_schedule,
            virtual_stages: self.virtual_stages,
            layers: ranges.iter().map(|r| r.len()).collect(),
        }))
    }

    /// The schedule for `pp` ranks and `micro_batches`, with errors naming the flags; `None`
    /// without a pipeline (when the pipeline flags are then an error).
    pub fn schedule(&self, pp: usize, micro_batches: usize) -> Result<Option<PipelineSchedule>> {
        if pp <= 1 {
            if self.micro_batches.is_some() || self.virtual_stages != 1 || self.pp_layers.is_some()
            {
                bail!(
                    "--micro-batches, --virtual-stages and --pp-layers describe a pipeline: give \
                     --pp 2 or more"
                );
            }
            return Ok(None);
        }
        let s = PipelineSchedule::new(self.pp_schedule, pp, micro_batches, self.virtual_stages)
            .with_context(|| {
                format!(
                    "--pp {pp} --pp-schedule {} --micro-batches {micro_batches} \
                     --virtual-stages {}",
                    self.pp_schedule, self.virtual_stages
                )
            })?;
        if let Some(LayerSplit::Counts(c)) = &self.pp_layers {
            if c.len() != pp * self.virtual_stages {
                bail!(
                    "--pp-layers gives {} counts; --pp {pp} x --virtual-stages {} needs {}",
                    c.len(),
                    self.virtual_stages,
                    pp * self.virtual_stages
                );
            }
        }
        Ok(Some(s))
    }
}

#[cfg(test)]
mod device_tests {
    use super::DeviceArg;

    #[test]
    fn device_flag_parses_and_prints() {
        assert_eq!(DeviceArg::parse("cpu"), Ok(DeviceArg::Cpu));
        assert_eq!(DeviceArg::parse("cuda"), Ok(DeviceArg::Cuda(0)));
        assert_eq!(DeviceArg::parse("cuda:3"), Ok(DeviceArg::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", "metal"] {
            let e = DeviceArg::parse(bad).unwrap_err();
            assert!(e.contains("cpu, cuda or cuda:N"), "{bad}: {e}");
        }
        assert_eq!(DeviceArg::Cuda(2).to_string(), "cuda:2");
        assert!(DeviceArg::Cpu.open(0).unwrap().is_cpu());
        assert!(DeviceArg::Cpu.require_cpu("x").is_ok());
        let e = DeviceArg::Cuda(0)
            .require_cpu("cpl train of a DiT")
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("--device cuda:0: cpl train of a DiT"),
            "{e}"
        );
        assert!(DeviceArg::Cpu.require_cpu_because("x", "y").is_ok());
        let e = DeviceArg::Cuda(1)
            .require_cpu_because("cpl bench train", "its timings do not synchronise a GPU")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--device cuda:1: cpl bench train runs on the CPU only: its timings"),
            "{e}"
        );
    }

    /// Without the `cuda` feature, asking for a GPU is an error naming the flag and the rebuild.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error() {
        let e = format!("{:#}", DeviceArg::Cuda(1).open(0).unwrap_err());
        assert!(
            e.contains("--device cuda:1") && e.contains("--features cuda"),
            "{e}"
        );
    }
}
