//! One pipeline stage for every model: embed → a range of layers → head and loss.
//!
//! A model (with its objective) describes its two ends and its layer stack through
//! [`StagedModel`]; [`Stage`] is the one state machine that runs a rank's chunks of it under a
//! [`PipelineSchedule`] ([`StageModel`] for the executor), and [`run_stage_step`] is a whole
//! step on one rank: the schedule, then the gradients of the parameters both ends hold summed
//! between the first and the last stage ([`finish_step`]), and the loss and its parts summed
//! over the pipeline.
//!
//! Virtual stage `c · p + r` (chunk `c` of pipeline rank `r`) runs the layers
//! `layers[c · p + r]`; the first virtual stage also runs [`StagedModel::embed`] on its
//! micro-batch, the last [`StagedModel::head_loss`]. Activations between stages have the shape
//! [`StagedModel::activation_shape`] gives (the layers' input on this rank) and the step's
//! activation dtype. Which parameters several stages hold is the model's to say
//! ([`StagedModel::shared_params`], from its units), never a rule on parameter names. This
//! file names no model.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};

use super::executor::{finish_step, run_schedule, ExecTimes, StageGrads, StageModel};
use super::schedule::PipelineSchedule;
use crate::comm::{Comm, ReduceOp};
use crate::error::{Error, Result};

/// The summed loss of one micro-batch on this rank and the parts it reports (summed like the
/// loss: e.g. a diffusion loss's MSE and variational-bound terms, DPO's rewards).
#[derive(Debug, Clone)]
pub struct StageLoss {
    /// The scalar to differentiate, before division by the step's global count.
    pub sum: Tensor,
    /// Reported parts, the same number for every micro-batch (may be empty).
    pub parts: Vec<f64>,
}

impl StageLoss {
    /// A loss with no parts.
    pub fn new(sum: Tensor) -> Self {
        Self {
            sum,
            parts: Vec::new(),
        }
    }
}

/// A model as pipeline stages see it (see the [module docs](self)). Every method is
/// collective over the model-parallel ranks of this stage (tp, sequence), never over `pp`.
pub trait StagedModel {
    /// A micro-batch as every stage sees it (inputs, labels, conditioning).
    type Micro;

    /// Shape of the activation entering a layer range for `micro` on this rank (usually
    /// `(batch, tokens of this rank, hidden)`).
    fn activation_shape(&self, micro: &Self::Micro) -> Result<Shape>;

    /// The first virtual stage's input end: `micro`'s input embedded.
    fn embed(&self, micro: &Self::Micro) -> Result<Tensor>;

    /// Layers `layers` (of the whole model's numbering) on `x`.
    fn run_layers(&self, layers: Range<usize>, x: &Tensor, micro: &Self::Micro) -> Result<Tensor>;

    /// The last virtual stage's output end: the summed loss of `micro` on this rank from the
    /// last layer's output `x`, with its parts.
    fn head_loss(&self, x: &Tensor, micro: &Self::Micro) -> Result<StageLoss>;

    /// Gradients of `root` (including those computed inside recomputed layers).
    fn backward(&self, root: &Tensor) -> Result<GradStore>;

    /// Names of the parameters this rank holds that the other end of the pipeline holds too
    /// (the embedding and head units; tied weights), whose gradients are summed between the
    /// first and the last stage. Empty on a stage that holds neither end.
    fn shared_params(&self) -> Vec<String>;

    /// Lengths of the f64 vectors a micro-batch carries from stage to stage besides its
    /// activation (forward) and its gradient (backward): statistics the loss needs from the
    /// layers of every stage, such as a mixture of experts' routing. `(0, 0)`, the default:
    /// none, and the four hooks below are not called.
    fn carry_lens(&self) -> (usize, usize) {
        (0, 0)
    }

    /// Before micro-batch `micro_batch`'s forward on a virtual stage (before
    /// [`StagedModel::embed`] on the first): what the previous virtual stage's
    /// [`StagedModel::forward_carry`] returned (`None` on the first virtual stage).
    fn begin_forward(&self, micro_batch: usize, carried: Option<&[f64]>) -> Result<()> {
        let _ = (micro_batch, carried);
        Ok(())
    }

    /// After [`StagedModel::run_layers`] on a virtual stage that is not the last: the vector
    /// for the next one.
    fn forward_carry(&self, micro_batch: usize) -> Result<Vec<f64>> {
        let _ = micro_batch;
        Ok(Vec::new())
    }

    /// Before micro-batch `micro_batch`'s backward on a virtual stage: what the next virtual
    /// stage's [`StagedModel::backward_carry`] returned (`None` on the last virtual stage).
    fn begin_backward(&self, micro_batch: usize, carried: Option<&[f64]>) -> Result<()> {
        let _ = (micro_batch, carried);
        Ok(())
    }

    /// After the backward on a virtual stage that is not the first: the vector for the
    /// previous one.
    fn backward_carry(&self, micro_batch: usize) -> Result<Vec<f64>> {
        let _ = micro_batch;
        Ok(Vec::new())
    }
}

/// What a pipeline step needs besides the model and its micro-batches.
#[derive(Debug, Clone, Copy)]
pub struct StageStep<'a> {
    pub schedule: &'a PipelineSchedule,
    /// The layers of every virtual stage, in order.
    pub layers: &'a [Range<usize>],
    /// The pipeline group (its rank `r` is stage `r`).
    pub pp: &'a Comm,
    /// What the step's summed loss is divided by (tokens, samples, pairs of the global batch):
    /// each micro-batch differentiates its share, as on one rank.
    pub global_count: u64,
    /// Dtype of the activations between stages.
    pub dtype: DType,
}

/// What a step returns on every rank of the pipeline.
#[derive(Debug)]
pub struct StageOutput {
    /// Gradients of the step's variables by name (f32, summed over the micro-batches; those
    /// of parameters both ends hold summed between them).
    pub grads: HashMap<String, Tensor>,
    /// The step's summed loss, the same on every pipeline rank.
    pub loss_sum: f64,
    /// The step's summed loss parts, the same on every pipeline rank.
    pub parts: Vec<f64>,
    /// Where this rank's time went.
    pub times: ExecTimes,
}

/// This rank's chunks of a [`StagedModel`] for one step.
pub struct Stage<'a, M: StagedModel> {
    model: &'a M,
    micro: &'a [M::Micro],
    grads: StageGrads,
    rank: usize,
    stages: usize,
    chunks: Vec<Range<usize>>,
    last_virtual: usize,
    global_count: f64,
    dtype: DType,
    loss_sum: f64,
    parts: Vec<f64>,
    carry_lens: (usize, usize),
    /// Carried vectors received and not yet used, and those to send: by (backward,
    /// micro-batch, chunk).
    carried: HashMap<(bool, usize, usize), Vec<f64>>,
    to_send: HashMap<(bool, usize, usize), Vec<f64>>,
    /// The (chunk, micro-batch) whose backward runs next.
    backward_of: Option<(usize, usize)>,
}

impl<'a, M: StagedModel> Stage<'a, M> {
    /// Rank `rank`'s chunks under `step.schedule`; `vars` the variables whose gradients to
    /// accumulate, by parameter name (the model's parameters, or under ZeRO-3 the chunks it
    /// differentiates; none for evaluation).
    pub fn new(
        model: &'a M,
        step: &StageStep<'_>,
        rank: usize,
        micro: &'a [M::Micro],
        vars: Vec<(String, Var)>,
    ) -> Result<Self> {
        let schedule = step.schedule;
        if step.layers.len() != schedule.virtual_stages() {
            return Err(invalid(format!(
                "{} layer ranges for {} virtual stages",
                step.layers.len(),
                schedule.virtual_stages()
            )));
        }
        if micro.len() != schedule.micro_batches {
            return Err(invalid(format!(
                "{} micro-batches for a schedule of {}",
                micro.len(),
                schedule.micro_batches
            )));
        }
        let chunks = (0..schedule.chunks)
            .map(|c| step.layers[schedule.virtual_stage(rank, c)].clone())
            .collect();
        Ok(Self {
            model,
            micro,
            grads: StageGrads::new(vars),
            rank,
            stages: schedule.stages,
            chunks,
            last_virtual: schedule.virtual_stages() - 1,
            global_count: step.global_count.max(1) as f64,
            dtype: step.dtype,
            loss_sum: 0.0,
            parts: Vec::new(),
            carry_lens: model.carry_lens(),
            carried: HashMap::new(),
            to_send: HashMap::new(),
            backward_of: None,
        })
    }

    fn micro(&self, mb: usize) -> Result<&'a M::Micro> {
        self.micro
            .get(mb)
            .ok_or_else(|| invalid(format!("no micro-batch {mb}")))
    }

    /// The accumulated gradients by name (f32), the loss and its parts summed on this rank
    /// (the last stage's; 0 elsewhere), once the schedule has run.
    pub fn into_parts(self) -> (HashMap<String, Tensor>, f64, Vec<f64>) {
        (self.grads.into_grads(), self.loss_sum, self.parts)
    }
}

impl<M: StagedModel> StageModel for Stage<'_, M> {
    fn activation_spec(&self, _chunk: usize, micro_batch: usize) -> Result<(Shape, DType)> {
        let m = self.micro(micro_batch)?;
        Ok((self.model.activation_shape(m)?, self.dtype))
    }

    fn forward(
        &mut self,
        chunk: usize,
        micro_batch: usize,
        input: Option<&Tensor>,
    ) -> Result<Tensor> {
        let vs = chunk * self.stages + self.rank;
        let m = self.micro(micro_batch)?;
        if self.carry_lens.0 > 0 {
            let carried = self.carried.remove(&(false, micro_batch, chunk));
            if carried.is_none() && vs > 0 {
                return Err(invalid(format!(
                    "virtual stage {vs} got no carried vector with micro-batch {micro_batch}"
                )));
            }
            self.model.begin_forward(micro_batch, carried.as_deref())?;
        }
        let x = match input {
            Some(x) => x.clone(),
            None if vs == 0 => self.model.embed(m)?,
            None => return Err(invalid(format!("virtual stage {vs} got no input"))),
        };
        let layers = self
            .chunks
            .get(chunk)
            .cloned()
            .ok_or_else(|| invalid(format!("no chunk {chunk}")))?;
        let x = self.model.run_layers(layers, &x, m)?;
        if vs != self.last_virtual {
            if self.carry_lens.0 > 0 {
                let c = self.model.forward_carry(micro_batch)?;
                self.to_send.insert((false, micro_batch, chunk), c);
            }
            return Ok(x);
        }
        let loss = self.model.head_loss(&x, m)?;
        self.loss_sum += loss.sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        if self.parts.len() < loss.parts.len() {
            self.parts.resize(loss.parts.len(), 0.0);
        }
        for (acc, p) in self.parts.iter_mut().zip(&loss.parts) {
            *acc += p;
        }
        Ok((loss.sum / self.global_count)?)
    }

    fn backward(&mut self, root: &Tensor) -> Result<GradStore> {
        let store = self.model.backward(root)?;
        self.grads.add(&store)?;
        if let (Some((chunk, mb)), true) = (self.backward_of.take(), self.carry_lens.1 > 0) {
            if chunk * self.stages + self.rank > 0 {
                let c = self.model.backward_carry(mb)?;
                self.to_send.insert((true, mb, chunk), c);
            }
        }
        Ok(store)
    }

    fn carry_lens(&self) -> (usize, usize) {
        self.carry_lens
    }

    fn receive_carry(
        &mut self,
        backward: bool,
        chunk: usize,
        micro_batch: usize,
        carry: Vec<f64>,
    ) -> Result<()> {
        self.carried.insert((backward, micro_batch, chunk), carry);
        Ok(())
    }

    fn send_carry(&mut self, backward: bool, chunk: usize, micro_batch: usize) -> Result<Vec<f64>> {
        let want = if backward {
            self.carry_lens.1
        } else {
            self.carry_lens.0
        };
        match self.to_send.remove(&(backward, micro_batch, chunk)) {
            Some(c) if c.len() == want => Ok(c),
            Some(c) => Err(invalid(format!(
                "a carried vector of {} values where the model said {want}",
                c.len()
            ))),
            None => Err(invalid(format!(
                "no carried vector of micro-batch {micro_batch} out of chunk {chunk}"
            ))),
        }
    }

    fn begin_backward(&mut self, chunk: usize, micro_batch: usize) -> Result<()> {
        if self.carry_lens.1 > 0 {
            let vs = chunk * self.stages + self.rank;
            let carried = self.carried.remove(&(true, micro_batch, chunk));
            if carried.is_none() && vs != self.last_virtual {
                return Err(invalid(format!(
                    "virtual stage {vs} got no carried vector with micro-batch {micro_batch}'s gradient"
                )));
            }
            self.model.begin_backward(micro_batch, carried.as_deref())?;
            self.backward_of = Some((chunk, micro_batch));
        }
        Ok(())
    }
}

/// One step of `micro` through this rank's stage of `model` (see the [module docs](self)):
/// runs the schedule, sums the shared parameters' gradients between the two ends and the loss
/// and its `num_parts` parts over the pipeline. Collective over `step.pp`: every rank of it
/// calls this with the same schedule and part count.
pub fn run_stage_step<M: StagedModel>(
    model: &M,
    step: &StageStep<'_>,
    micro: &[M::Micro],
    vars: Vec<(String, Var)>,
    num_parts: usize,
) -> Result<StageOutput> {
    let shared: Vec<(String, Var)> = {
        let names: std::collections::HashSet<String> = model.shared_params().into_iter().collect();
        let mut s: Vec<(String, Var)> = vars
            .iter()
            .filter(|(n, _)| names.contains(n))
            .cloned()
            .collect();
        s.sort_by(|a, b| a.0.cmp(&b.0));
        s
    };
    let mut stage = Stage::new(model, step, step.pp.rank(), micro, vars)?;
    let times = run_schedule(step.schedule, step.pp, &mut stage)?;
    let (grads, loss_sum, mut parts) = stage.into_parts();
    let (grads, loss_sum) = finish_step(step.pp, grads, &shared, loss_sum)?;
    parts.resize(num_parts, 0.0);
    if num_parts > 0 {
        parts = step
            .pp
            .all_reduce(&Tensor::new(parts.as_slice(), &Device::Cpu)?, ReduceOp::Sum)?
            .to_vec1::<f64>()?;
    }
    Ok(StageOutput {
        grads,
        loss_sum,
        parts,
        times,
    })
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::invalid("pipeline stage", msg)
}
