//! Running one closure on every rank of a layout: local threads or MPI processes.

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_parallel::comm::Comm;
use candle_parallel::mesh::{DeviceMesh, Dim};
use std::sync::Arc;

use candle_parallel::nn::{Adapters, ParallelCtx, ParamMode, TensorSource, TpActivations};
use models::hub::ModelFiles;
use models::llama::{self, LlamaConfig, LoadedLlama};
use models::peft::Adapter;

use crate::layout::{Backend, LayoutArgs};

/// What a rank works with: its mesh and the parallel context the model is built with.
pub struct Rank {
    pub mesh: DeviceMesh,
    pub ctx: ParallelCtx,
}

impl Rank {
    pub fn world(&self) -> Comm {
        self.mesh.world()
    }

    /// Rank 0 of the world prints and writes.
    pub fn is_main(&self) -> bool {
        self.mesh.rank() == 0
    }
}

/// Runs `f` on every rank of the layout `args` describes and returns world rank 0's result:
/// `Some` in the process that holds rank 0 (the only one with local ranks), `None` in the other
/// processes of an MPI job, which then print and write nothing. Errors of the layout flags are
/// reported before any rank starts.
pub fn launch<T, F>(args: &LayoutArgs, f: F) -> Result<Option<T>>
where
    T: Send,
    F: Fn(&Rank) -> Result<T> + Sync,
{
    if args.pp > 1 {
        bail!(
            "--pp {}: pipeline parallelism is available in `cpl train` only",
            args.pp
        );
    }
    launch_pipelined(args, f)
}

/// [`launch`] for a command that runs pipeline stages (`--pp` above 1 allowed).
pub fn launch_pipelined<T, F>(args: &LayoutArgs, f: F) -> Result<Option<T>>
where
    T: Send,
    F: Fn(&Rank) -> Result<T> + Sync,
{
    let mesh_cfg = args.mesh_config()?;
    let sp_cfg = args.sp_config()?;
    let run_rank = |world: Comm| -> Result<T> {
        let mesh = DeviceMesh::new(&mesh_cfg, world).context("building the device mesh")?;
        let tp = if args.tp_sp {
            TpActivations::SequenceSharded
        } else {
            TpActivations::Replicated
        };
        let ctx = ParallelCtx::new(&mesh, &sp_cfg, tp).context("building the parallel layout")?;
        f(&Rank { mesh, ctx })
    };
    match args.backend {
        Backend::Local => {
            let mut results = candle_parallel::comm::LocalWorld::run(args.ranks, |world| {
                run_rank(world).map_err(|e| format!("{e:#}"))
            })
            .map_err(|e| anyhow::anyhow!("{e}"))?;
            if results.is_empty() {
                bail!("no rank ran");
            }
            Ok(Some(results.swap_remove(0)))
        }
        Backend::Mpi => launch_mpi(args, run_rank),
    }
}

#[cfg(feature = "mpi")]
fn launch_mpi<T, F>(args: &LayoutArgs, run_rank: F) -> Result<Option<T>>
where
    F: Fn(Comm) -> Result<T>,
{
    let world = candle_parallel::comm::mpi::MpiWorld::init()?;
    if world.size() != args.ranks {
        bail!(
            "--ranks {} but mpirun started {} processes",
            args.ranks,
            world.size()
        );
    }
    let main = world.rank() == 0;
    let result = world.launch(|comm| run_rank(comm).map_err(|e| format!("{e:#}")));
    Ok(main.then_some(result))
}

#[cfg(not(feature = "mpi"))]
fn launch_mpi<T, F>(_args: &LayoutArgs, _run_rank: F) -> Result<Option<T>>
where
    F: Fn(Comm) -> Result<T>,
{
    bail!("--backend mpi: this cpl was built without MPI; rebuild with `cargo build -p cpl --features mpi`")
}

/// Loads the LLaMA `files` for `rank`'s layout, with the LoRA `adapter` when given; errors name
/// the layout flags (`--tp 3`) when the layout does not fit the model.
pub fn load_llama(
    files: &ModelFiles,
    rank: &Rank,
    dtype: Option<DType>,
    mode: ParamMode,
    layout: &LayoutArgs,
    adapter: Option<&Adapter>,
) -> Result<LoadedLlama> {
    let all = 0..LlamaConfig::from_file(&files.config)?.num_hidden_layers;
    load_llama_stage(files, rank, dtype, mode, layout, &[all], adapter)
}

/// [`load_llama`] for this rank's pipeline stage: the decoder layers of its virtual stages
/// `layers[c * pp + r]` and, on the first and last pipeline rank, the embedding, norm and head.
pub fn load_llama_stage(
    files: &ModelFiles,
    rank: &Rank,
    dtype: Option<DType>,
    mode: ParamMode,
    layout: &LayoutArgs,
    layers: &[std::ops::Range<usize>],
    adapter: Option<&Adapter>,
) -> Result<LoadedLlama> {
    let (mine, ends) = stage_layers(rank, layers);
    let adapters = adapter
        .map(|a| {
            Adapters::new(
                a.lora.clone(),
                Some(a.source.clone() as Arc<dyn TensorSource>),
            )
        })
        .transpose()?;
    llama::load_stage_adapted(files, &rank.ctx, dtype, mode, &mine, ends, adapters)
        .with_context(|| format!("loading {} with {}", files.source, layout.flags()))
}

/// The PEFT adapter of an `--adapter DIR` flag.
pub fn read_adapter(dir: Option<&std::path::Path>) -> Result<Option<Adapter>> {
    dir.map(|d| models::peft::load(d).with_context(|| format!("--adapter {}", d.display())))
        .transpose()
}

/// This rank's layer ranges among every virtual stage's `layers` (chunk `c` is virtual stage
/// `c · pp + rank`), and whether it holds the first or last stage (the model's two ends).
pub fn stage_layers(
    rank: &Rank,
    layers: &[std::ops::Range<usize>],
) -> (Vec<std::ops::Range<usize>>, bool) {
    let (p, r) = (rank.mesh.size(Dim::Pp), rank.mesh.coord(Dim::Pp));
    let mine = layers.iter().skip(r).step_by(p).cloned().collect();
    (mine, r == 0 || r + 1 == p)
}
