//! The length curriculum of a run (`cpl train --seq-len-schedule 1024:100,4096:200`, Llama 3's
//! and EasyContext's recipe): `LEN:STEPS` phases, each training `STEPS` optimizer steps on
//! sequences of `LEN` tokens, one after the other; the run has the sum of their steps.
//!
//! The tokens of a step stay those of the first phase ([`SeqLenSchedule::shapes`]): when the
//! length grows k-fold, each data-parallel rank trains on k times fewer sequences, so the
//! learning rate, the optimizer and the data position mean the same in every phase. Because the
//! tokens per step are constant, global sample `step x sequences per step` of a phase's windows
//! starts at token `step x tokens per step` of the stream: without shuffling a phase continues
//! the stream exactly where the previous one stopped, and in every case a phase trains as a run
//! at its length resumed from the previous phase's last checkpoint would
//! (`train::checkpoint::restore` accepts such a resume because it keeps the tokens per step).
//!
//! What the run does with it lives in [`crate::driver::tasks::LengthCurriculum`]; the schedule
//! is part of the run's [`crate::trainer::TrainConfig`] and so of every checkpoint.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What is wrong with a `--seq-len-schedule`; every message names the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error(
        "--seq-len-schedule is empty: expected LEN:STEPS[,LEN:STEPS...], e.g. 1024:100,4096:200"
    )]
    Empty,
    #[error(
        "--seq-len-schedule {schedule}: `{item}` is not LEN:STEPS with whole numbers (e.g. \
         1024:100,4096:200)"
    )]
    Syntax { schedule: String, item: String },
    #[error("--seq-len-schedule {schedule}: length {len} in `{item}` must be at least 2")]
    TooShort {
        schedule: String,
        item: String,
        len: usize,
    },
    #[error("--seq-len-schedule {schedule}: `{item}` has no steps (STEPS must be at least 1)")]
    NoSteps { schedule: String, item: String },
    #[error(
        "--seq-len-schedule {schedule}: phases {first} and {second} both have length {len}; \
         merge them into one phase"
    )]
    Repeated {
        schedule: String,
        first: usize,
        second: usize,
        len: usize,
    },
    #[error(
        "--seq-len-schedule {schedule}: length {len} is above the model's \
         max_position_embeddings {max} (raise it with --max-position-embeddings, or with a \
         --rope-scaling factor)"
    )]
    AboveMaxPosition {
        schedule: String,
        len: usize,
        max: usize,
    },
    #[error(
        "--seq-len-schedule {schedule}: a step of the first phase trains {tokens} tokens per \
         data-parallel rank (--batch x --grad-accum x {first}), not a whole number of sequences \
         of {len} tokens; the tokens of a step are kept constant, so choose lengths that divide \
         them or change --batch / --grad-accum"
    )]
    Tokens {
        schedule: String,
        tokens: usize,
        first: usize,
        len: usize,
    },
    #[error(
        "--seq-len-schedule {now}: the checkpoint being resumed (step {step}) was trained under \
         --seq-len-schedule {saved}, whose phases before step {step} differ; resume with a \
         schedule that agrees with it up to there"
    )]
    Disagrees {
        now: String,
        saved: String,
        step: u64,
    },
}

/// One phase: `steps` optimizer steps on sequences of `seq_len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phase {
    pub seq_len: usize,
    pub steps: u64,
}

/// How a phase's steps are cut, per data-parallel rank: sequences of `seq_len` tokens,
/// `batch` of them per micro-batch (one forward and backward), `grad_accum` micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    pub seq_len: usize,
    pub batch: usize,
    pub grad_accum: usize,
}

impl StepShape {
    /// Sequences per step on one data-parallel rank.
    pub fn sequences(&self) -> usize {
        self.batch * self.grad_accum
    }

    /// Tokens per step on one data-parallel rank.
    pub fn tokens(&self) -> usize {
        self.sequences() * self.seq_len
    }
}

/// A length curriculum: its phases in order, written `LEN:STEPS,LEN:STEPS,...` (also in
/// checkpoints' `trainer_state.json`). Lengths are at least 2, steps at least 1, and two phases
/// in a row never have the same length; lengths may grow or shrink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SeqLenSchedule {
    phases: Vec<Phase>,
}

impl FromStr for SeqLenSchedule {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, ScheduleError> {
        let schedule = s.trim().to_string();
        if schedule.is_empty() {
            return Err(ScheduleError::Empty);
        }
        let mut phases: Vec<Phase> = Vec::new();
        for item in s.trim().split(',').map(str::trim) {
            let item_s = item.to_string();
            let parsed = item
                .split_once(':')
                .and_then(|(l, n)| Some((l.trim().parse().ok()?, n.trim().parse().ok()?)));
            let Some((seq_len, steps)) = parsed else {
                return Err(ScheduleError::Syntax {
                    schedule,
                    item: item_s,
                });
            };
            if seq_len < 2 {
                return Err(ScheduleError::TooShort {
                    schedule,
                    item: item_s,
                    len: seq_len,
                });
            }
            if steps == 0 {
                return Err(ScheduleError::NoSteps {
                    schedule,
                    item: item_s,
                });
            }
            if let Some(prev) = phases.last().filter(|p| p.seq_len == seq_len) {
                return Err(ScheduleError::Repeated {
                    schedule,
                    first: phases.len(),
                    second: phases.len() + 1,
                    len: prev.seq_len,
                });
            }
            phases.push(Phase { seq_len, steps });
        }
        Ok(Self { phases })
    }
}

impl fmt::Display for SeqLenSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.phases.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}{}:{}", p.seq_len, p.steps)?;
        }
        Ok(())
    }
}

impl TryFrom<String> for SeqLenSchedule {
    type Error = ScheduleError;

    fn try_from(s: String) -> Result<Self, ScheduleError> {
        s.parse()
    }
}

impl From<SeqLenSchedule> for String {
    fn from(s: SeqLenSchedule) -> Self {
        s.to_string()
    }
}

impl SeqLenSchedule {
    /// The phases in order (never empty).
    pub fn phases(&self) -> &[Phase] {
        &self.phases
    }

    /// Optimizer steps of the whole schedule.
    pub fn total_steps(&self) -> u64 {
        self.phases.iter().map(|p| p.steps).sum()
    }

    /// The first phase's length.
    pub fn first_len(&self) -> usize {
        self.phases[0].seq_len
    }

    /// The step (0-based) phase `i` starts at.
    pub fn start_of(&self, i: usize) -> u64 {
        self.phases[..i].iter().map(|p| p.steps).sum()
    }

    /// The phase that optimizer step `step` (0-based) belongs to; steps past the schedule
    /// belong to its last phase.
    pub fn phase_at(&self, step: u64) -> usize {
        let mut end = 0;
        for (i, p) in self.phases.iter().enumerate() {
            end += p.steps;
            if step < end {
                return i;
            }
        }
        self.phases.len() - 1
    }

    /// Errors when a length is above `max_position_embeddings` (`None`: the model states no
    /// limit).
    pub fn check_max_position(&self, max: Option<usize>) -> Result<(), ScheduleError> {
        let Some(max) = max else {
            return Ok(());
        };
        match self.phases.iter().find(|p| p.seq_len > max) {
            Some(p) => Err(ScheduleError::AboveMaxPosition {
                schedule: self.to_string(),
                len: p.seq_len,
                max,
            }),
            None => Ok(()),
        }
    }

    /// Every phase's shape when the first phase has `batch` sequences per micro-batch and
    /// `grad_accum` micro-batches (per data-parallel rank), keeping the tokens of a step: phase
    /// `p` trains `n = batch · grad_accum · first_len / len_p` sequences per rank (an error
    /// when not whole), in micro-batches of the most sequences, dividing `n`, that hold no more
    /// tokens than the first phase's micro-batch (`batch · first_len`; one sequence when a
    /// single one is longer), and the rest as gradient accumulation. Growing lengths thus shrink
    /// `batch` first (the micro-batch's memory stays), then `grad_accum`.
    pub fn shapes(&self, batch: usize, grad_accum: usize) -> Result<Vec<StepShape>, ScheduleError> {
        let first = self.first_len();
        let tokens = batch * grad_accum * first;
        let cap_tokens = batch * first;
        self.phases
            .iter()
            .map(|p| {
                let len = p.seq_len;
                if !tokens.is_multiple_of(len) {
                    return Err(ScheduleError::Tokens {
                        schedule: self.to_string(),
                        tokens,
                        first,
                        len,
                    });
                }
                let n = tokens / len;
                let cap = (cap_tokens / len).max(1);
                let batch = (1..=cap.min(n))
                    .rev()
                    .find(|b| n.is_multiple_of(*b))
                    .unwrap_or(1);
                Ok(StepShape {
                    seq_len: len,
                    batch,
                    grad_accum: n / batch,
                })
            })
            .collect()
    }

    /// The phases of the first `step` steps, as (length, steps) runs.
    fn prefix(&self, step: u64) -> Vec<(usize, u64)> {
        let mut left = step;
        let mut out = Vec::new();
        for p in &self.phases {
            if left == 0 {
                break;
            }
            let n = p.steps.min(left);
            out.push((p.seq_len, n));
            left -= n;
        }
        // Steps past the schedule run at its last length.
        if left > 0 {
            if let Some(last) = out.last_mut() {
                last.1 += left;
            }
        }
        out
    }

    /// Errors unless this schedule trains the first `step` steps as `saved` did (a run resumed
    /// at `step` from a checkpoint of a run under `saved`): the phases after may differ.
    pub fn check_resumes(&self, saved: &SeqLenSchedule, step: u64) -> Result<(), ScheduleError> {
        if self.prefix(step) == saved.prefix(step) {
            return Ok(());
        }
        Err(ScheduleError::Disagrees {
            now: self.to_string(),
            saved: saved.to_string(),
            step,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(text: &str) -> SeqLenSchedule {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn parses_and_prints_schedules() {
        let a = s("1024:100,4096:200");
        assert_eq!(
            a.phases(),
            [
                Phase {
                    seq_len: 1024,
                    steps: 100
                },
                Phase {
                    seq_len: 4096,
                    steps: 200
                }
            ]
        );
        assert_eq!(a.to_string(), "1024:100,4096:200");
        assert_eq!(a.total_steps(), 300);
        assert_eq!(s(" 512:3 , 128:2 ").to_string(), "512:3,128:2");
        assert_eq!(s("64:7").total_steps(), 7);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, "\"1024:100,4096:200\"");
        assert_eq!(serde_json::from_str::<SeqLenSchedule>(&json).unwrap(), a);
        assert!(serde_json::from_str::<SeqLenSchedule>("\"1024\"").is_err());
    }

    #[test]
    fn malformed_schedules_are_errors_naming_the_flag() {
        for (text, needle) in [
            ("", "is empty"),
            ("1024", "`1024` is not LEN:STEPS"),
            ("a:b", "`a:b` is not LEN:STEPS"),
            ("1024:10,", "`` is not LEN:STEPS"),
            ("1024:-1", "`1024:-1` is not LEN:STEPS"),
            ("1024:1.5", "is not LEN:STEPS"),
            ("0:10", "length 0 in `0:10` must be at least 2"),
            ("1:10", "must be at least 2"),
            ("1024:0", "`1024:0` has no steps"),
            ("1024:5,1024:5", "phases 1 and 2 both have length 1024"),
        ] {
            let e = text.parse::<SeqLenSchedule>().unwrap_err().to_string();
            assert!(e.starts_with("--seq-len-schedule"), "{text}: {e}");
            assert!(e.contains(needle), "{text}: {e}");
        }
        let e = s("128:1,256:1")
            .check_max_position(Some(128))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--seq-len-schedule")
                && e.contains("length 256 is above")
                && e.contains("max_position_embeddings 128"),
            "{e}"
        );
        assert!(s("128:1,256:1").check_max_position(Some(256)).is_ok());
        assert!(s("128:1,256:1").check_max_position(None).is_ok());
    }

    #[test]
    fn phases_of_steps() {
        let a = s("16:2,32:3,8:1");
        let at: Vec<usize> = (0..8).map(|t| a.phase_at(t)).collect();
        assert_eq!(at, [0, 0, 1, 1, 1, 2, 2, 2]);
        assert_eq!((a.start_of(0), a.start_of(1), a.start_of(2)), (0, 2, 5));
    }

    #[test]
    fn shapes_keep_the_tokens_of_a_step() {
        let shape = |seq_len, batch, grad_accum| StepShape {
            seq_len,
            batch,
            grad_accum,
        };
        // Growing: the micro-batch shrinks first, then the accumulation.
        let got = s("1024:1,4096:1,8192:1").shapes(4, 2).unwrap();
        assert_eq!(
            got,
            [shape(1024, 4, 2), shape(4096, 1, 2), shape(8192, 1, 1)]
        );
        assert!(got.iter().all(|g| g.tokens() == 8192));
        // Not a multiple of the micro-batch: the largest divisor that fits its tokens.
        assert_eq!(
            s("1024:1,1536:1").shapes(3, 2).unwrap(),
            [shape(1024, 3, 2), shape(1536, 2, 2)]
        );
        // Shrinking: the micro-batch grows up to the first one's tokens.
        assert_eq!(
            s("4096:1,1024:1").shapes(1, 2).unwrap(),
            [shape(4096, 1, 2), shape(1024, 4, 2)]
        );
        // Tokens that make no whole number of sequences.
        for (text, batch, accum) in [("1024:1,16384:1", 4, 2), ("1024:1,3000:1", 1, 4)] {
            let e = s(text).shapes(batch, accum).unwrap_err().to_string();
            assert!(
                e.starts_with("--seq-len-schedule") && e.contains("not a whole number"),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn a_resumed_schedule_agrees_before_the_step() {
        let saved = s("16:2,32:3");
        for (now, step, ok) in [
            ("16:2,32:3", 3, true),
            ("16:2,32:5", 3, true),      // the last phase extended
            ("16:2,32:1,64:4", 3, true), // changed after the step
            ("16:2,64:3", 2, true),      // changed at the boundary
            ("16:2,64:3", 3, false),     // step 2 ran at 32
            ("16:1,32:4", 2, false),
            ("16:2,32:3", 9, true), // past the end: the last length
        ] {
            let r = s(now).check_resumes(&saved, step);
            assert_eq!(r.is_ok(), ok, "{now} at {step}: {r:?}");
            if let Err(e) = r {
                assert!(e.to_string().starts_with("--seq-len-schedule"), "{e}");
            }
        }
    }
}
