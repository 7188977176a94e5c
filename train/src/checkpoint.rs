//! Training checkpoints: `OUT/step-N/` is a Hugging Face model directory (loadable by
//! transformers and `cpl eval`) plus the training state: `optimizer.safetensors` (AdamW's f32
//! master weights and moments, gathered to whole tensors so that a run can resume under another
//! layout) and `trainer_state.json` (step, data order, settings, metrics so far).
//!
//! A checkpoint is written under a temporary name and renamed into place (see
//! [`models::checkpoint::save_hf`]), so a crash never leaves a half-written `step-N`, and the
//! directories of older checkpoints beyond the last `keep` are removed only after the new one
//! is complete.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_parallel::comm::Comm;
use candle_parallel::nn::Param;
use candle_parallel::pipeline::gather_to_first;
use models::checkpoint::{gather_tp, write_hf_dir, CheckpointReader, SaveOptions};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::trainer::{StepStats, TrainConfig, TrainModel, Trainer};

/// One evaluation of a run: the mean next-token loss on the evaluation data after `step`
/// optimizer steps, over `tokens` labelled tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    pub step: u64,
    pub loss: f64,
    pub tokens: u64,
}

/// What a run has recorded so far (saved with every checkpoint, continued on resume).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    /// Metrics of every step.
    #[serde(rename = "history")]
    pub steps: Vec<StepStats>,
    /// Every evaluation.
    #[serde(default)]
    pub evals: Vec<EvalPoint>,
}

/// `trainer_state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps taken; the run resumes at this step.
    pub step: u64,
    /// Sequences per optimizer step over all data-parallel ranks when saved.
    pub global_batch: usize,
    pub config: TrainConfig,
    #[serde(flatten)]
    pub history: History,
}

/// The `step-N` directory of `out`.
pub fn step_dir(out: &Path, step: u64) -> PathBuf {
    out.join(format!("step-{step}"))
}

/// The complete checkpoints in `out`, by step (temporary directories start with `.`).
pub fn list_checkpoints(out: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            let p = e.path();
            p.join("trainer_state.json").is_file().then_some((n, p))
        })
        .collect();
    v.sort();
    v
}

/// Removes what an interrupted save left in `out`: its temporary directories
/// (`.step-N.tmp-<pid>`, never complete), and puts back a previous checkpoint that was moved
/// aside (`.step-N.old-<pid>`) when no `step-N` replaced it. Returns the paths removed. Run by
/// the driver before it looks for a checkpoint to resume, so a partial save is never picked.
pub fn clean_partial(out: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for e in std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(".step-") else {
            continue;
        };
        let p = e.path();
        if let Some((step, _)) = rest.split_once(".old-") {
            let dir = out.join(format!("step-{step}"));
            if !dir.exists() {
                unless_gone(std::fs::rename(&p, &dir), &p)?;
                continue;
            }
        } else if !rest.contains(".tmp-") {
            continue;
        }
        unless_gone(std::fs::remove_dir_all(&p), &p)?;
        removed.push(p);
    }
    Ok(removed)
}

/// `r`, an operation on `p`, as a [`Result`]: failing because `p` is gone is success (another
/// process of the job did it first).
fn unless_gone(r: std::io::Result<()>, p: &Path) -> Result<()> {
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(p, e)),
        _ => Ok(()),
    }
}

/// Removes all but the last `keep` (at least one) checkpoints of `out`.
fn remove_old(out: &Path, keep: usize) -> Result<()> {
    let all = list_checkpoints(out);
    let old = all.len().saturating_sub(keep.max(1));
    for (_, p) in &all[..old] {
        std::fs::remove_dir_all(p).map_err(|e| Error::io(p, e))?;
    }
    Ok(())
}

/// Collective over the world: saves the trainer's model and state as `out/step-N` (written by
/// world rank 0), then removes all but the last `keep` checkpoints. `extra_files` (config.json,
/// tokenizer files) are copied into the model directory.
pub fn save<M: TrainModel>(
    trainer: &Trainer<M>,
    out: &Path,
    world: &Comm,
    extra_files: &[(String, Vec<u8>)],
    history: &History,
    keep: usize,
) -> Result<PathBuf> {
    let max_shard_bytes = SaveOptions::default().max_shard_bytes;
    save_sharded(
        trainer,
        out,
        world,
        extra_files,
        history,
        keep,
        max_shard_bytes,
    )
}

/// [`save`] with the model's weights split into files of at most `max_shard_bytes`
/// (`model-0000i-of-0000n.safetensors` and an index, as transformers' `max_shard_size`).
#[allow(clippy::too_many_arguments)]
pub fn save_sharded<M: TrainModel>(
    trainer: &Trainer<M>,
    out: &Path,
    world: &Comm,
    extra_files: &[(String, Vec<u8>)],
    history: &History,
    keep: usize,
    max_shard_bytes: usize,
) -> Result<PathBuf> {
    let tp = trainer.tp().clone();
    let write = world.rank() == 0;
    // Optimizer state: whole tensor-parallel slices, gathered like the parameters.
    let mut state = Vec::new();
    for (name, t) in trainer.optimizer_state()? {
        let shard = trainer.entry_shard(&name)?;
        let t = if shard.is_split() {
            tp.all_gather(&t.contiguous()?, shard.dim)?
        } else {
            t
        };
        state.push((name, t));
    }
    let ep = trainer.expert_group();
    if let Some(ep) = ep {
        state = gather_experts(ep, state, |name| trainer.is_expert(name))?;
    }
    let mut params = trainer.whole_params()?;
    let experts: std::collections::HashSet<String> = params
        .iter()
        .filter(|p| p.expert_parallel)
        .map(|p| trainer.model.saved_name(&p.name))
        .collect();
    // Whole tensor-parallel slices, then (under expert parallelism) the experts of every rank.
    let gather = |params: &[Param], keep: bool| -> Result<Vec<(String, candle_core::Tensor)>> {
        let full = gather_tp(params, &tp, keep || ep.is_some(), dtype_of(params))?;
        match ep {
            Some(ep) => gather_experts(ep, full, |n| experts.contains(n)),
            None => Ok(full),
        }
    };
    for p in &mut params {
        p.name = trainer.model.saved_name(&p.name);
    }
    let dtype = dtype_of(&params);
    // Under a pipeline each stage holds its own parameters and their state: the whole model
    // meets on pipeline rank 0 (world rank 0 is one), then is written as on one stage.
    let pp = trainer.pp();
    let pipelined = pp.size() > 1;
    let full = gather(&params, write || pipelined)?;
    let (full, state) = if pipelined {
        (gather_to_first(pp, full)?, gather_to_first(pp, state)?)
    } else {
        (full, state)
    };
    let dir = step_dir(out, trainer.step);
    if write {
        let ts = TrainerState {
            step: trainer.step,
            global_batch: trainer.global_batch(),
            config: trainer.cfg.clone(),
            history: history.clone(),
        };
        let json = serde_json::to_vec_pretty(&ts).map_err(|e| Error::Invalid(e.to_string()))?;
        let mut files = extra_files.to_vec();
        files.push((
            "optimizer.safetensors".into(),
            models::checkpoint::safetensors_bytes(&state)?,
        ));
        files.push(("trainer_state.json".into(), json));
        let opts = SaveOptions {
            dtype,
            extra_files: files,
            weights_name: trainer.model.weights_name().into(),
            max_shard_bytes,
        };
        write_hf_dir(&trainer.model.checkpoint_tensors(full)?, &dir, &opts)?;
        remove_old(out, keep)?;
    }
    // No rank goes on (or reports the checkpoint) before it is complete.
    world.barrier()?;
    Ok(dir)
}

/// The dtype a checkpoint of `params` is written in: the first parameter's (f32 for none).
fn dtype_of(params: &[Param]) -> candle_core::DType {
    params
        .first()
        .map(|p| p.tensor.dtype())
        .unwrap_or(candle_core::DType::F32)
}

/// `named` with the tensors `is_expert` names gathered from every rank of the expert-parallel
/// group `ep` onto its first rank (the others keep only the rest), sorted by name. Collective
/// over `ep`.
fn gather_experts(
    ep: &Comm,
    named: Vec<(String, candle_core::Tensor)>,
    is_expert: impl Fn(&str) -> bool,
) -> Result<Vec<(String, candle_core::Tensor)>> {
    let (experts, mut rest): (Vec<_>, Vec<_>) =
        named.into_iter().partition(|(name, _)| is_expert(name));
    rest.extend(gather_to_first(ep, experts)?);
    rest.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(rest)
}

/// Reads `trainer_state.json` of a checkpoint.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let p = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path: dir.to_path_buf(),
        msg: format!("trainer_state.json is malformed: {e}"),
    })
}

/// Errors when a run of config `now` and `gb` sequences per step (dp x batch x grad-accum)
/// would not continue the data where the checkpoint in `dir` stopped: the
/// samples of step `s` are `s x` the sequences per step (see [`crate::data::Sampler`]), so a
/// run resumed at the same sequence length must keep the sequences per step, and one resumed
/// at another length (a length curriculum's next phase, or a run continued by hand at a new
/// `--seq-len`) the tokens per step, which puts it at the same token of the stream. Under a
/// length curriculum, the phases before the checkpoint's step must be those it was trained
/// under.
fn check_data_position(
    now: &TrainConfig,
    gb: usize,
    dir: &Path,
    state: &TrainerState,
) -> Result<()> {
    let saved = &state.config;
    if let (Some(s), Some(n)) = (&saved.seq_len_schedule, &now.seq_len_schedule) {
        n.check_resumes(s, state.step)?;
    }
    let len = now.seq_len;
    let same = if saved.seq_len == len {
        state.global_batch == gb
    } else {
        state.global_batch * saved.seq_len == gb * len
    };
    if same {
        return Ok(());
    }
    Err(Error::Checkpoint {
        path: dir.to_path_buf(),
        msg: format!(
            "was saved with {} sequences of {} tokens per step (dp x batch x grad-accum); this \
             run has {gb} of {len}: the data order would differ (at another --seq-len, keep the \
             tokens per step: scale --batch or --grad-accum inversely)",
            state.global_batch, saved.seq_len
        ),
    })
}

/// Restores the optimizer state and step of `trainer` (whose model was loaded from the same
/// checkpoint) from `dir`, reading only this rank's slices.
pub fn restore<M: TrainModel>(
    trainer: &mut Trainer<M>,
    dir: &Path,
    state: &TrainerState,
) -> Result<()> {
    check_data_position(&trainer.cfg, trainer.global_batch(), dir, state)?;
    let reader = CheckpointReader::open(&[dir.join("optimizer.safetensors")])?;
    let mut tensors = HashMap::new();
    // A pipeline stage, or an expert-parallel rank, reads the state of its own parameters only.
    let partial = trainer.pp().size() > 1 || trainer.expert_group().is_some();
    for name in reader.names() {
        let shard = match trainer.entry_shard(&name) {
            Ok(s) => s,
            Err(_) if partial => continue,
            Err(_) => {
                return Err(Error::Checkpoint {
                    path: dir.to_path_buf(),
                    msg: format!("optimizer state `{name}` names no parameter of the model"),
                })
            }
        };
        tensors.insert(name.clone(), reader.read(&name, shard, &Device::Cpu)?);
    }
    trainer
        .load_optimizer_state(tensors, state.step)
        .map_err(|e| Error::Checkpoint {
            path: dir.to_path_buf(),
            msg: format!("optimizer.safetensors: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_parallel::plan::MemoryPlan;

    /// An empty directory of its own under the system's temporary directory.
    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cpl-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn state(step: u64, global_batch: usize, seq_len: usize) -> TrainerState {
        TrainerState {
            step,
            global_batch,
            config: TrainConfig::constant_lr(seq_len, 10, 1e-3, 16, MemoryPlan::default()),
            history: History::default(),
        }
    }

    /// A complete checkpoint `step-N` (as far as listing goes: its `trainer_state.json`).
    fn complete(out: &Path, step: u64) -> PathBuf {
        let dir = step_dir(out, step);
        std::fs::create_dir_all(&dir).unwrap();
        let json = serde_json::to_vec(&state(step, 2, 32)).unwrap();
        std::fs::write(dir.join("trainer_state.json"), json).unwrap();
        dir
    }

    fn steps(out: &Path) -> Vec<u64> {
        list_checkpoints(out).into_iter().map(|(s, _)| s).collect()
    }

    #[test]
    fn checkpoints_are_listed_by_step_and_only_complete_ones() {
        let out = tmp("list");
        assert_eq!(step_dir(&out, 7), out.join("step-7"));
        assert!(list_checkpoints(&out).is_empty());
        assert!(list_checkpoints(&out.join("missing")).is_empty());
        for s in [10, 2, 0] {
            complete(&out, s);
        }
        // Not checkpoints: no state file, not a step number, a temporary directory.
        std::fs::create_dir_all(out.join("step-5")).unwrap();
        std::fs::create_dir_all(out.join("step-x")).unwrap();
        let partial = out.join(".step-11.tmp-1");
        std::fs::create_dir_all(&partial).unwrap();
        std::fs::write(partial.join("trainer_state.json"), b"{}").unwrap();
        // By number, not by name (step-10 after step-2).
        assert_eq!(
            list_checkpoints(&out),
            [0, 2, 10].map(|s| (s, step_dir(&out, s)))
        );
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn clean_partial_removes_temporaries_and_puts_back_moved_checkpoints() {
        let out = tmp("clean");
        complete(&out, 1);
        let tmp1 = out.join(".step-2.tmp-17");
        std::fs::create_dir_all(&tmp1).unwrap();
        // step-3 was moved aside and its replacement never came: it comes back.
        let moved = complete(&out, 3);
        std::fs::rename(&moved, out.join(".step-3.old-17")).unwrap();
        // step-4 was moved aside and replaced: the old copy goes.
        complete(&out, 4);
        let old4 = out.join(".step-4.old-17");
        std::fs::create_dir_all(&old4).unwrap();
        // Not a save's: left alone.
        let other = out.join(".step-5.other");
        std::fs::create_dir_all(&other).unwrap();
        let mut removed = clean_partial(&out).unwrap();
        removed.sort();
        assert_eq!(removed, [tmp1, old4]);
        assert!(other.is_dir());
        assert_eq!(steps(&out), [1, 3, 4]);
        assert!(clean_partial(&out).unwrap().is_empty());
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn a_path_already_gone_is_no_error() {
        let p = Path::new("/nowhere");
        assert!(unless_gone(Ok(()), p).is_ok());
        let gone = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert!(unless_gone(Err(gone), p).is_ok());
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        let err = unless_gone(Err(denied), p).unwrap_err().to_string();
        assert!(err.contains("/nowhere"), "{err}");
    }

    #[test]
    fn old_checkpoints_beyond_keep_are_removed() {
        let out = tmp("keep");
        for s in 1..=3 {
            complete(&out, s);
            remove_old(&out, 2).unwrap();
        }
        assert_eq!(steps(&out), [2, 3]);
        // Keeping 0 keeps the last one.
        for keep in [1, 0] {
            complete(&out, 4);
            remove_old(&out, keep).unwrap();
            assert_eq!(steps(&out), [4], "keep {keep}");
        }
        remove_old(&out, 5).unwrap();
        assert_eq!(steps(&out), [4]);
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn trainer_state_round_trips_and_a_malformed_one_is_a_clear_error() {
        let out = tmp("state");
        let dir = complete(&out, 6);
        let read = read_state(&dir).unwrap();
        assert_eq!(read.step, 6);
        assert_eq!(read.global_batch, 2);
        assert_eq!(read.config, state(6, 2, 32).config);
        std::fs::write(dir.join("trainer_state.json"), b"{\"step\": 6}").unwrap();
        let err = read_state(&dir).unwrap_err().to_string();
        assert!(err.contains("trainer_state.json is malformed"), "{err}");
        assert!(read_state(&out.join("step-9")).is_err());
        std::fs::remove_dir_all(&out).unwrap();
    }

    /// Resuming keeps the sequences per step at the same length, the tokens per step at
    /// another, and the phases of a length curriculum before the checkpoint.
    #[test]
    fn resuming_must_continue_the_data_where_it_stopped() {
        let dir = Path::new("/out/step-3");
        let now = |seq_len| state(0, 0, seq_len).config;
        // (saved sequences, saved length, now sequences, now length, resumes)
        for (sgb, slen, gb, len, ok) in [
            (4, 32, 4, 32, true),
            (4, 32, 2, 32, false),
            (4, 32, 8, 32, false),
            // Same tokens per step at another length (these numbers also tell `*` from `/`).
            (64, 2, 32, 4, true),
            (64, 2, 16, 4, false),
            (64, 2, 64, 4, false),
        ] {
            let r = check_data_position(&now(len), gb, dir, &state(3, sgb, slen));
            assert_eq!(
                r.is_ok(),
                ok,
                "saved {sgb} x {slen}, now {gb} x {len}: {r:?}"
            );
            if let Err(e) = r {
                let e = e.to_string();
                assert!(e.contains("/out/step-3") && e.contains("data order"), "{e}");
            }
        }
        // A length curriculum must agree with the saved one up to the checkpoint's step.
        let curriculum = |text: &str| {
            let mut c = now(16);
            c.seq_len_schedule = Some(text.parse().unwrap());
            c
        };
        let saved = TrainerState {
            config: curriculum("16:5,32:5"),
            ..state(3, 4, 16)
        };
        assert!(check_data_position(&curriculum("16:4,64:6"), 4, dir, &saved).is_ok());
        assert!(check_data_position(&curriculum("16:2,32:8"), 4, dir, &saved).is_err());
    }
}
