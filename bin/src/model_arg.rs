//! `--model`: a model directory or a Hugging Face Hub id, and the family the registry detects
//! from its `config.json` ([`models::family`]). Every command routes by the family's kind; none
//! names a family.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use models::family::{self, Family};

/// A `--model` resolved to its family.
pub struct ModelArg {
    pub family: &'static Family,
    /// The model directory (a Hub id's snapshot, or the directory given).
    pub dir: PathBuf,
}

/// The family of `model` (a directory with `config.json`, or a Hub id). Errors name the flag;
/// a `config.json` no family claims lists the supported families.
pub fn resolve(model: &str) -> Result<ModelArg> {
    let path = Path::new(model);
    let config = if path.join("config.json").is_file() {
        path.join("config.json")
    } else {
        models::hub::resolve(model)
            .with_context(|| format!("--model {model}"))?
            .config
    };
    let family = family::detect(&config).with_context(|| format!("--model {model}"))?;
    let dir = config
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    Ok(ModelArg { family, dir })
}

/// The files of `family` beside the weights of `files` (its `extra_files` present in the
/// model's directory), as (name, bytes), copied into every checkpoint so that it is a complete
/// model directory. Errors name a file that cannot be read.
pub fn checkpoint_files(
    family: &Family,
    files: &models::hub::ModelFiles,
) -> Result<Vec<(String, Vec<u8>)>> {
    let dir = files.config.parent().unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for name in family.extra_files {
        let p = dir.join(name);
        if p.is_file() {
            let bytes = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
            out.push((name.to_string(), bytes));
        }
    }
    Ok(out)
}

/// A change of the run's `config.json` asked for by flags: the flags (for errors) and the
/// function from the checkpoint's text to the run's.
pub type ConfigChange<'a> = (
    &'static str,
    Box<dyn Fn(&str, &Path) -> models::Result<String> + 'a>,
);

/// The config changes of `cpl train`'s flags: `--rope-*` ([`crate::args::RopeArgs`]),
/// `--router-aux-loss-coef` and `--moe-capacity-factor`.
pub fn train_config_changes(
    rope: &crate::args::RopeArgs,
    router_aux_loss_coef: Option<f64>,
    moe_capacity_factor: Option<f64>,
) -> Result<Vec<ConfigChange<'static>>> {
    let mut changes: Vec<ConfigChange<'static>> = Vec::new();
    if let Some(o) = rope.to_override()? {
        changes.push(("--rope-*", Box::new(move |t, p| o.apply(t, p))));
    }
    if let Some(c) = router_aux_loss_coef {
        changes.push((
            "--router-aux-loss-coef",
            Box::new(move |t, p| models::zoo::moe::set_router_aux_loss_coef(t, c, p)),
        ));
    }
    if let Some(f) = moe_capacity_factor {
        changes.push((
            "--moe-capacity-factor",
            Box::new(move |t, p| models::zoo::moe::set_moe_capacity_factor(t, f, p)),
        ));
    }
    Ok(changes)
}

/// The name of the changed config a run writes into its output directory, and into each
/// checkpoint that holds no `config.json` of its own (a LoRA adapter's).
pub const RUN_CONFIG: &str = "run-config.json";

/// Applies `changes` to the run's model: writes the changed `config.json` to
/// `out/run-config.json` (atomically), points `files.config` at it, and returns its bytes,
/// which replace `config.json` and `run-config.json` in `extra` (the files every checkpoint
/// carries), so that every checkpoint the run saves carries the change. A resumed run must have
/// been saved with the same config (`resumed_config`: the checkpoint's copy of it; a missing
/// file counts as another config): else an error naming the flags, so that a resumed run never
/// silently changes its model. Nothing happens without changes.
pub fn apply_config_changes(
    files: &mut models::hub::ModelFiles,
    changes: &[ConfigChange<'_>],
    out: &Path,
    extra: &mut [(String, Vec<u8>)],
    resumed_config: Option<&Path>,
) -> Result<()> {
    if changes.is_empty() {
        return Ok(());
    }
    let flags = changes
        .iter()
        .map(|(f, _)| *f)
        .collect::<Vec<_>>()
        .join(", ");
    let mut changed = std::fs::read_to_string(&files.config)
        .with_context(|| format!("reading {}", files.config.display()))?;
    for (_, change) in changes {
        changed = change(&changed, &files.config)?;
    }
    if let Some(saved) = resumed_config {
        let was = match std::fs::read_to_string(saved) {
            Ok(was) => Some(was),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("reading {}", saved.display())),
        };
        if was.as_deref() != Some(changed.as_str()) {
            anyhow::bail!(
                "{flags}: the checkpoint being resumed ({}) was saved with another config; \
                 resume with the flags of the run that saved it",
                saved.display()
            );
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("--out {}", out.display()))?;
    let path = out.join(RUN_CONFIG);
    models::checkpoint::write_atomic(&path, changed.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    // The changed config must still load through its family.
    let family = models::family::detect(&path).with_context(|| flags.clone())?;
    (family.describe)(&path).with_context(|| format!("{flags}: the changed config.json"))?;
    files.config = path;
    for (name, bytes) in extra.iter_mut() {
        if name == "config.json" || name == RUN_CONFIG {
            *bytes = changed.clone().into_bytes();
        }
    }
    Ok(())
}
