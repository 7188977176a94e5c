//! Pipeline parallelism over the mesh's `pp` dimension.
//!
//! - [`schedule`]: each rank's ordered list of forwards, backwards, sends and receives for
//!   GPipe, 1F1B and interleaved 1F1B, validated before it runs (no tensors involved).
//! - [`stages`]: how a model's layers are cut into (virtual) stages (by cost by default).
//! - [`executor`]: runs one rank's list on its model chunks ([`StageModel`]), sending and
//!   receiving over the `pp` communicator.
//! - [`stage`]: the one stage of every model (embed → layer range → head and loss) over a
//!   model that describes its ends and layers ([`StagedModel`]), and a whole step on one rank
//!   ([`run_stage_step`]).

pub mod executor;
pub mod schedule;
pub mod stage;
pub mod stages;

pub use executor::{finish_step, run_schedule, ExecTimes, StageGrads, StageModel};
pub use schedule::{Action, ActionKind, PipelineSchedule, ScheduleKind, ScheduleStats};
pub use stage::{run_stage_step, Stage, StageLoss, StageOutput, StageStep, StagedModel};
pub use stages::{gather_to_first, split_by_cost, split_layers, LayerSplit, StageCosts};
