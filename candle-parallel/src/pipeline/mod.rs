//! Pipeline parallelism over the mesh's `pp` dimension.
//!
//! [`schedule`]: each rank's ordered list of forwards, backwards, sends and receives for GPipe,
//! 1F1B and interleaved 1F1B, validated before it runs (no tensors involved). Executing a
//! schedule on model stages is not built yet (issue 13).

pub mod schedule;

pub use schedule::{Action, ActionKind, PipelineSchedule, ScheduleKind, ScheduleStats};
