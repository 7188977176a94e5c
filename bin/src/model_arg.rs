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
