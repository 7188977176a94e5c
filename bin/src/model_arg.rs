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

/// Applies `--rope-*` (see [`crate::args::RopeArgs`]) to the run's model: writes the changed
/// `config.json` to `out/rope-config.json` (atomically), points `files.config` at it, and
/// returns its bytes, which replace `config.json` in `extra` (the files every checkpoint
/// carries). A run resumed from `resume_dir` must have been saved with the same config: else an
/// error, so that a resumed run never silently changes its RoPE. Nothing happens without flags.
pub fn apply_rope(
    files: &mut models::hub::ModelFiles,
    rope: &crate::args::RopeArgs,
    out: &Path,
    extra: &mut [(String, Vec<u8>)],
    resume_dir: Option<&Path>,
) -> Result<()> {
    let Some(o) = rope.to_override()? else {
        return Ok(());
    };
    let text = std::fs::read_to_string(&files.config)
        .with_context(|| format!("reading {}", files.config.display()))?;
    let changed = o.apply(&text, &files.config)?;
    if let Some(dir) = resume_dir {
        let saved = dir.join("config.json");
        let was = std::fs::read_to_string(&saved)
            .with_context(|| format!("reading {}", saved.display()))?;
        if was != changed {
            anyhow::bail!(
                "--rope-*: the checkpoint being resumed ({}) was saved with another RoPE config; \
                 resume with the flags of the run that saved it",
                saved.display()
            );
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("--out {}", out.display()))?;
    let path = out.join("rope-config.json");
    models::checkpoint::write_atomic(&path, changed.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    // The changed config must still load through its family.
    let family = models::family::detect(&path).context("--rope-*")?;
    (family.describe)(&path).context("--rope-*: the changed config.json")?;
    files.config = path;
    for (name, bytes) in extra.iter_mut() {
        if name == "config.json" {
            *bytes = changed.clone().into_bytes();
        }
    }
    Ok(())
}
