//! Finding a model's files: a local directory, or a Hugging Face Hub id through the Hub cache.
//!
//! `--model` is a directory when one exists at that path. Otherwise it is a Hub id
//! (`org/name`, optionally `org/name@revision`) looked up in the Hub cache the way
//! `huggingface_hub` lays it out (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`: `models--org--name/refs/<revision>` names a snapshot under
//! `snapshots/<commit>/`, whose files are symlinks into `blobs/`; a revision that is a commit
//! hash names its snapshot directly). Files missing from the cache are downloaded through `hf-hub` unless
//! `HF_HUB_OFFLINE` is set (to anything but `0`/`false`), in which case a missing file is an error.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The files of one model, all present on disk.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// What the user named (a path or a Hub id), for messages.
    pub source: String,
    pub config: PathBuf,
    /// The safetensors files, in index order (one file for unsharded checkpoints).
    pub weights: Vec<PathBuf>,
    /// `model.safetensors.index.json` for sharded checkpoints.
    pub index: Option<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
    /// `chat_template.jinja`: the chat template, when saved apart from `tokenizer_config.json`
    /// (as transformers does since 4.48).
    pub chat_template: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
}

/// Where the Hub cache lives: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`.
pub fn hub_cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        return PathBuf::from(p).join("hub");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache").join("huggingface").join("hub")
}

fn offline() -> bool {
    match std::env::var("HF_HUB_OFFLINE") {
        Ok(v) => !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "" | "0" | "false" | "no"
        ),
        Err(_) => false,
    }
}

/// Resolves `model` (a directory or a Hub id) to its files.
pub fn resolve(model: &str) -> Result<ModelFiles> {
    let path = Path::new(model);
    if path.is_dir() {
        return from_dir(model, path);
    }
    if path.exists() {
        return Err(Error::NotFound {
            model: model.into(),
            msg: "is a file; pass the model directory (with config.json and *.safetensors)".into(),
        });
    }
    let (id, revision) = match model.split_once('@') {
        Some((id, rev)) => (id, rev),
        None => (model, "main"),
    };
    if id.split('/').count() != 2 || id.starts_with('/') || id.starts_with('.') {
        return Err(Error::NotFound {
            model: model.into(),
            msg: "no such directory, and not a Hub id of the form org/name".into(),
        });
    }
    let fetcher = HubFetcher::new(id, revision);
    let config = fetcher.require(model, "config.json")?;
    let index = fetcher.get(model, "model.safetensors.index.json", false)?;
    let weights = match &index {
        Some(index) => {
            let names = index_files(index)?;
            let mut paths = Vec::with_capacity(names.len());
            for n in names {
                paths.push(fetcher.require(model, &n)?);
            }
            paths
        }
        None => vec![fetcher.require(model, "model.safetensors")?],
    };
    Ok(ModelFiles {
        source: model.into(),
        config,
        weights,
        index,
        tokenizer: fetcher.get(model, "tokenizer.json", false)?,
        tokenizer_config: fetcher.get(model, "tokenizer_config.json", false)?,
        chat_template: fetcher.get(model, "chat_template.jinja", false)?,
        generation_config: fetcher.get(model, "generation_config.json", false)?,
    })
}

/// The files of a local model directory (transformers' `model.safetensors` naming).
pub fn from_dir(source: &str, dir: &Path) -> Result<ModelFiles> {
    from_dir_named(source, dir, "model")
}

/// The files of a local model directory whose weights are `{stem}.safetensors` or
/// `{stem}-0000i-of-0000n.safetensors` with `{stem}.safetensors.index.json` (`model` for
/// transformers, `diffusion_pytorch_model` for diffusers).
pub fn from_dir_named(source: &str, dir: &Path, stem: &str) -> Result<ModelFiles> {
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(Error::NotFound {
            model: source.into(),
            msg: format!("{} does not exist", config.display()),
        });
    }
    let index_path = dir.join(format!("{stem}.safetensors.index.json"));
    let (weights, index) = if index_path.is_file() {
        let files = index_files(&index_path)?
            .into_iter()
            .map(|f| dir.join(f))
            .collect::<Vec<_>>();
        for f in &files {
            if !f.is_file() {
                return Err(Error::NotFound {
                    model: source.into(),
                    msg: format!(
                        "{} names the shard {}, which does not exist",
                        index_path.display(),
                        f.display()
                    ),
                });
            }
        }
        (files, Some(index_path))
    } else {
        let single = dir.join(format!("{stem}.safetensors"));
        if !single.is_file() {
            return Err(Error::NotFound {
                model: source.into(),
                msg: format!(
                    "{} has neither {stem}.safetensors nor {stem}.safetensors.index.json",
                    dir.display()
                ),
            });
        }
        (vec![single], None)
    };
    let opt = |name: &str| {
        let p = dir.join(name);
        p.is_file().then_some(p)
    };
    Ok(ModelFiles {
        source: source.into(),
        config,
        weights,
        index,
        tokenizer: opt("tokenizer.json"),
        tokenizer_config: opt("tokenizer_config.json"),
        chat_template: opt("chat_template.jinja"),
        generation_config: opt("generation_config.json"),
    })
}

/// The distinct shard file names of a `model.safetensors.index.json`, in first-seen order of
/// the sorted tensor names.
pub fn index_files(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(index, format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::config(index, "has no \"weight_map\" object"))?;
    let mut names: Vec<(&String, &serde_json::Value)> = map.iter().collect();
    names.sort_by(|a, b| a.0.cmp(b.0));
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in names {
        let file = file.as_str().ok_or_else(|| {
            Error::config(
                index,
                format!("weight_map entry `{tensor}` is not a file name"),
            )
        })?;
        if file.contains('/') || file.contains("..") {
            return Err(Error::config(
                index,
                format!("weight_map entry `{tensor}` names `{file}`, not a file of the directory"),
            ));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    if files.is_empty() {
        return Err(Error::config(index, "weight_map is empty"));
    }
    files.sort();
    Ok(files)
}

/// Looks files up in the Hub cache, downloading missing ones unless offline.
struct HubFetcher {
    cache: hf_hub::CacheRepo,
    id: String,
    revision: String,
}

impl HubFetcher {
    fn new(id: &str, revision: &str) -> Self {
        let repo = hf_hub::Repo::with_revision(
            id.to_string(),
            hf_hub::RepoType::Model,
            revision.to_string(),
        );
        let cache = hf_hub::Cache::new(hub_cache_dir()).repo(repo);
        Self {
            cache,
            id: id.into(),
            revision: revision.into(),
        }
    }

    /// `file` in the cache: through `refs/<revision>`, or, when the revision is a commit hash
    /// (`org/name@<40 hex digits>`, which has no ref), straight from `snapshots/<commit>/`, as
    /// `huggingface_hub` resolves it.
    fn cached(&self, file: &str) -> Option<PathBuf> {
        self.cache.get(file).or_else(|| {
            let is_commit =
                self.revision.len() == 40 && self.revision.bytes().all(|b| b.is_ascii_hexdigit());
            let p = hub_cache_dir()
                .join(format!("models--{}", self.id.replace('/', "--")))
                .join("snapshots")
                .join(&self.revision)
                .join(file);
            (is_commit && p.is_file()).then_some(p)
        })
    }

    /// The path of a file the model cannot do without.
    fn require(&self, model: &str, file: &str) -> Result<PathBuf> {
        self.get(model, file, true)?.ok_or_else(|| Error::NotFound {
            model: model.into(),
            msg: format!("{file} is missing"),
        })
    }

    /// The path of `file`; `Ok(None)` when it is optional and absent.
    fn get(&self, model: &str, file: &str, required: bool) -> Result<Option<PathBuf>> {
        if let Some(p) = self.cached(file) {
            return Ok(Some(p));
        }
        if offline() {
            return if required {
                Err(Error::NotFound {
                    model: model.into(),
                    msg: format!(
                        "{file} is not in the Hub cache {} (revision {}) and HF_HUB_OFFLINE is set",
                        hub_cache_dir().display(),
                        self.revision
                    ),
                })
            } else {
                Ok(None)
            };
        }
        let api = hf_hub::api::sync::ApiBuilder::new()
            .with_cache_dir(hub_cache_dir())
            .with_progress(false)
            .build()
            .map_err(|e| Error::NotFound {
                model: model.into(),
                msg: format!("cannot start the Hub client: {e}"),
            })?;
        let repo = api.repo(hf_hub::Repo::with_revision(
            self.id.clone(),
            hf_hub::RepoType::Model,
            self.revision.clone(),
        ));
        match repo.get(file) {
            Ok(p) => Ok(Some(p)),
            Err(e) if required => Err(Error::NotFound {
                model: model.into(),
                msg: format!(
                    "{file} is not in the Hub cache {} and could not be downloaded: {e}",
                    hub_cache_dir().display()
                ),
            }),
            Err(_) => Ok(None),
        }
    }
}
