//! Running one closure on every rank of a layout: local threads or MPI processes.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_parallel::comm::Comm;
use candle_parallel::mesh::{DeviceMesh, Dim};
use std::sync::Arc;

use candle_parallel::nn::{Adapters, ParallelCtx, ParamMode, TensorSource};
use models::hub::ModelFiles;
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
            "--pp {}: this command runs without pipeline stages (--pp is for cpl train, \
             finetune, eval and generate of language models, and LLaVA training and eval)",
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
    let layout = args.layout()?;
    let run_rank = |world: Comm, device: Device| -> Result<T> {
        let (mesh, ctx) = layout
            .context(world)
            .context("building the device mesh and the parallel layout")?;
        let ctx = ctx.with_device(device);
        f(&Rank { mesh, ctx })
    };
    match args.backend {
        Backend::Local => {
            // Local ranks are threads of this process: they share one device.
            let device = args.device.open(0)?;
            let mut results = candle_parallel::comm::LocalWorld::run(args.ranks, |world| {
                run_rank(world, device.clone()).map_err(|e| format!("{e:#}"))
            })
            .map_err(|e| anyhow::anyhow!("{e}"))?;
            if results.is_empty() {
                bail!("no rank ran");
            }
            Ok(Some(results.swap_remove(0)))
        }
        Backend::Mpi => launch_mpi(args, run_rank),
        Backend::Nccl => launch_nccl(args, run_rank),
    }
}

/// A process's place in a multi-process job, from its environment.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessRank {
    pub rank: usize,
    pub size: usize,
    /// Index among the processes of this machine (its GPU offset).
    pub local_rank: usize,
    /// Where rank 0 publishes the NCCL id (None: the caller picks a default).
    pub id_file: Option<std::path::PathBuf>,
}

/// This process's rank from the variables `cpl --backend nccl` gives the processes it spawns
/// (`CPL_NCCL_RANK`, `CPL_NCCL_SIZE`, `CPL_NCCL_ID_FILE`) or that mpirun sets (Open MPI's
/// `OMPI_COMM_WORLD_*`, MPICH/PMI's `PMI_RANK`/`PMI_SIZE`); `None` when none is set (the process
/// that launches the others). The size must equal `--ranks`.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub fn process_rank(
    var: impl Fn(&str) -> Option<String>,
    ranks: usize,
) -> Result<Option<ProcessRank>> {
    let num = |name: &str| -> Result<Option<usize>> {
        var(name)
            .map(|v| {
                v.trim()
                    .parse::<usize>()
                    .with_context(|| format!("environment variable {name}={v:?} is not a number"))
            })
            .transpose()
    };
    let found = [
        ("CPL_NCCL_RANK", "CPL_NCCL_SIZE", "CPL_NCCL_LOCAL_RANK"),
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
        ),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ]
    .into_iter()
    .find(|(r, _, _)| var(r).is_some());
    let Some((r, n, l)) = found else {
        return Ok(None);
    };
    let rank = num(r)?.unwrap_or(0);
    let size = num(n)?.with_context(|| format!("{r} is set but {n} is not"))?;
    if size != ranks {
        bail!("--ranks {ranks} but the job has {size} processes ({n})");
    }
    if rank >= size {
        bail!("{r}={rank} is not below {n}={size}");
    }
    Ok(Some(ProcessRank {
        rank,
        size,
        local_rank: num(l)?.unwrap_or(rank),
        id_file: var("CPL_NCCL_ID_FILE").map(Into::into),
    }))
}

#[cfg(feature = "nccl")]
fn launch_nccl<T, F>(args: &LayoutArgs, run_rank: F) -> Result<Option<T>>
where
    F: Fn(Comm, Device) -> Result<T>,
{
    use candle_parallel::comm::nccl::NcclComm;
    use std::time::Duration;

    if !matches!(args.device, crate::layout::DeviceArg::Cuda(_)) {
        bail!("--backend nccl needs --device cuda or cuda:N");
    }
    if args.pp > 1 {
        // The pipeline posts a stage's send before the matching receive exists: NCCL's
        // unbuffered sends would block there.
        bail!(
            "--pp {}: pipeline parallelism does not run over --backend nccl yet",
            args.pp
        );
    }
    let timeout = Duration::from_secs(300);
    let me = process_rank(|k| std::env::var(k).ok(), args.ranks)?;
    if me.is_some() {
        watch_parent();
    }
    let (me, children) = match me {
        Some(me) => (me, Vec::new()),
        None => {
            // The launcher: rank 0 here, ranks 1.. as child processes of the same command.
            let id_file = std::env::temp_dir().join(format!(
                "cpl-nccl-{}-{}.id",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0)
            ));
            let exe = std::env::current_exe().context("--backend nccl: locating cpl")?;
            let mut children = Vec::new();
            for r in 1..args.ranks {
                let spawned = std::process::Command::new(&exe)
                    .args(std::env::args_os().skip(1))
                    .env("CPL_NCCL_RANK", r.to_string())
                    .env("CPL_NCCL_SIZE", args.ranks.to_string())
                    .env("CPL_NCCL_LOCAL_RANK", r.to_string())
                    .env("CPL_NCCL_ID_FILE", &id_file)
                    .env("CPL_NCCL_PARENT", std::process::id().to_string())
                    .spawn();
                match spawned {
                    Ok(child) => children.push((r, child)),
                    Err(e) => {
                        for (_, mut c) in children {
                            let _ = c.kill();
                            let _ = c.wait();
                        }
                        return Err(e)
                            .with_context(|| format!("--backend nccl: starting rank {r}"));
                    }
                }
            }
            let me = ProcessRank {
                rank: 0,
                size: args.ranks,
                local_rank: 0,
                id_file: Some(id_file),
            };
            (me, children)
        }
    };
    // A child that fails stops the job: NCCL's initialisation and collectives would wait for it
    // forever.
    let children = std::sync::Arc::new(std::sync::Mutex::new(children));
    let watcher = {
        let children = children.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            let mut list = children.lock().unwrap_or_else(|p| p.into_inner());
            if list.is_empty() {
                return;
            }
            for (r, child) in list.iter_mut() {
                if let Ok(Some(st)) = child.try_wait() {
                    if !st.success() {
                        eprintln!(
                            "error: --backend nccl: rank {r} exited with {st}; stopping the job"
                        );
                        for (_, c) in list.iter_mut() {
                            let _ = c.kill();
                        }
                        std::process::exit(1);
                    }
                }
            }
        })
    };
    let id_file = match &me.id_file {
        Some(f) => Ok(f.clone()),
        // Under mpirun: one name per job when the launcher gives one (PMIx namespace).
        None => match std::env::var("PMIX_NAMESPACE") {
            Ok(job) => Ok(std::path::PathBuf::from(format!(".cpl-nccl-{job}.id"))),
            Err(_) => Err(anyhow::anyhow!(
                "--backend nccl under this launcher: set CPL_NCCL_ID_FILE to a path unique to \
                 this job, on a filesystem every rank sees"
            )),
        },
    };
    let result = (|| -> Result<T> {
        let id_file = id_file?;
        let device = args.device.open(me.local_rank)?;
        let Device::Cuda(cuda) = &device else {
            bail!("--backend nccl needs a CUDA device");
        };
        let world = NcclComm::from_rendezvous(cuda, me.rank, me.size, &id_file, timeout)
            .context("--backend nccl: creating the NCCL communicator")?;
        let out = run_rank(world, device.clone());
        if me.rank == 0 {
            let _ = std::fs::remove_file(&id_file);
        }
        out
    })();
    // Rank 0 waits for its children (or stops them when it failed itself).
    let mut failed = Vec::new();
    let list = std::mem::take(&mut *children.lock().unwrap_or_else(|p| p.into_inner()));
    for (r, mut child) in list {
        if result.is_err() {
            let _ = child.kill();
        }
        match child.wait() {
            Ok(st) if st.success() => {}
            Ok(st) => failed.push(format!("rank {r} exited with {st}")),
            Err(e) => failed.push(format!("rank {r}: {e}")),
        }
    }
    let _ = watcher.join();
    let value = result.with_context(|| format!("rank {}", me.rank))?;
    if !failed.is_empty() {
        bail!("--backend nccl: {}", failed.join("; "));
    }
    Ok((me.rank == 0).then_some(value))
}

/// In a rank spawned by `cpl --backend nccl`: exit when the launching process is gone (its
/// rank 0 failed or was killed), instead of waiting in NCCL forever.
#[cfg(feature = "nccl")]
fn watch_parent() {
    let Some(parent) = std::env::var("CPL_NCCL_PARENT")
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    std::thread::spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(500));
        // SAFETY: getppid has no preconditions and cannot fail.
        if unsafe { libc::getppid() } != parent {
            eprintln!("error: --backend nccl: the launching process {parent} is gone; stopping");
            std::process::exit(1);
        }
    });
}

#[cfg(not(feature = "nccl"))]
fn launch_nccl<T, F>(_args: &LayoutArgs, _run_rank: F) -> Result<Option<T>>
where
    F: Fn(Comm, Device) -> Result<T>,
{
    bail!("--backend nccl: this cpl was built without NCCL; rebuild with `cargo build -p cpl --features nccl` (see docs/gpu.md)")
}

#[cfg(feature = "mpi")]
fn launch_mpi<T, F>(args: &LayoutArgs, run_rank: F) -> Result<Option<T>>
where
    F: Fn(Comm, Device) -> Result<T>,
{
    // The MPI backend's messages arrive as CPU tensors: GPUs go through --backend nccl.
    args.device
        .require_cpu("--backend mpi (use --backend nccl, under mpirun or not, for GPUs)")?;
    let world = candle_parallel::comm::mpi::MpiWorld::init()?;
    if world.size() != args.ranks {
        bail!(
            "--ranks {} but mpirun started {} processes",
            args.ranks,
            world.size()
        );
    }
    let main = world.rank() == 0;
    let result = world.launch(|comm| run_rank(comm, Device::Cpu).map_err(|e| format!("{e:#}")));
    Ok(main.then_some(result))
}

#[cfg(not(feature = "mpi"))]
fn launch_mpi<T, F>(_args: &LayoutArgs, _run_rank: F) -> Result<Option<T>>
where
    F: Fn(Comm, Device) -> Result<T>,
{
    bail!("--backend mpi: this cpl was built without MPI; rebuild with `cargo build -p cpl --features mpi`")
}

/// The causal LM of `files` (the registry's family of its `config.json`) for `rank`'s
/// layout: the decoder layers of its chunks of `ranges` (every virtual stage's layers) and the
/// two ends on the first and last stage, with the LoRA `adapter` when given. Errors name the
/// model, the family and the layout flags; `--ep` above 1 on a model without sparse blocks is
/// one (every command that builds a causal LM loads it here).
pub fn load_causal_lm(
    files: &ModelFiles,
    rank: &Rank,
    ranges: &[std::ops::Range<usize>],
    dtype: Option<DType>,
    mode: ParamMode,
    layout: &LayoutArgs,
    adapter: Option<&Adapter>,
) -> Result<models::family::LoadedCausalLm> {
    let adapters = adapters_of(adapter)?;
    load_causal_lm_adapted(files, rank, ranges, dtype, mode, layout, adapters)
}

/// [`load_causal_lm`] with LoRA `adapters` already built (fresh ones for fine-tuning, or a
/// PEFT adapter's).
pub fn load_causal_lm_adapted(
    files: &ModelFiles,
    rank: &Rank,
    ranges: &[std::ops::Range<usize>],
    dtype: Option<DType>,
    mode: ParamMode,
    layout: &LayoutArgs,
    adapters: Option<Arc<Adapters>>,
) -> Result<models::family::LoadedCausalLm> {
    let family = models::family::detect(&files.config)?;
    let load = family.load_causal_lm.with_context(|| {
        format!(
            "{}: the {} family does not load as a causal language model",
            files.source, family.name
        )
    })?;
    let (layers, ends) = stage_layers(rank, ranges);
    let spec = models::family::LoadSpec {
        ctx: &rank.ctx,
        dtype,
        mode,
        layers: &layers,
        ends,
        adapters,
    };
    let loaded = load(files, &spec)
        .with_context(|| format!("loading {} with {}", files.source, layout.flags()))?;
    if layout.ep > 1 && !loaded.model.has_routers() {
        bail!(
            "--ep {}: {} is not a mixture of experts (expert parallelism divides the experts of \
             its sparse blocks)",
            layout.ep,
            files.source
        );
    }
    Ok(loaded)
}

/// The adapters of a PEFT `adapter` for building a model with them.
fn adapters_of(adapter: Option<&Adapter>) -> Result<Option<Arc<Adapters>>> {
    Ok(adapter
        .map(|a| {
            Adapters::new(
                a.lora.clone(),
                Some(a.source.clone() as Arc<dyn TensorSource>),
            )
        })
        .transpose()?)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn process_rank_from_each_launcher() {
        assert_eq!(process_rank(env(&[]), 4).unwrap(), None);
        let spawned = env(&[
            ("CPL_NCCL_RANK", "2"),
            ("CPL_NCCL_SIZE", "4"),
            ("CPL_NCCL_LOCAL_RANK", "2"),
            ("CPL_NCCL_ID_FILE", "/tmp/x.id"),
        ]);
        let p = process_rank(spawned, 4).unwrap().unwrap();
        assert_eq!((p.rank, p.size, p.local_rank), (2, 4, 2));
        assert_eq!(
            p.id_file.as_deref(),
            Some(std::path::Path::new("/tmp/x.id"))
        );
        let ompi = env(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ]);
        let p = process_rank(ompi, 8).unwrap().unwrap();
        assert_eq!((p.rank, p.size, p.local_rank, p.id_file), (5, 8, 1, None));
        let pmi = env(&[("PMI_RANK", "3"), ("PMI_SIZE", "4")]);
        let p = process_rank(pmi, 4).unwrap().unwrap();
        assert_eq!(
            (p.rank, p.local_rank),
            (3, 3),
            "local rank defaults to the rank"
        );
    }

    #[test]
    fn process_rank_errors_name_the_variable() {
        let msg = |pairs: &[(&str, &str)], ranks| {
            format!("{:#}", process_rank(env(pairs), ranks).unwrap_err())
        };
        let m = msg(
            &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")],
            4,
        );
        assert!(m.contains("--ranks 4") && m.contains("2 processes"), "{m}");
        let m = msg(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")], 2);
        assert!(m.contains("PMI_RANK"), "{m}");
        let m = msg(&[("CPL_NCCL_RANK", "1")], 2);
        assert!(m.contains("CPL_NCCL_SIZE"), "{m}");
        let m = msg(&[("CPL_NCCL_RANK", "2"), ("CPL_NCCL_SIZE", "2")], 2);
        assert!(m.contains("not below"), "{m}");
    }
}
