//! The DiT side of `cpl train`, `cpl eval`, `cpl generate` and `cpl inspect`: a `--model`
//! directory whose `config.json` names diffusers' `DiTTransformer2DModel` lands here.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::ReduceOp;
use candle_parallel::nn::{ParamBuilder, ParamMode, TensorMap};
use models::checkpoint::CheckpointReader;
use models::diffusion::{flow_sample_euler, DrawStream, GaussianDiffusion, Guidance};
use models::dit::loss::{loss_sum, NoiseLevel, NoisedBatch};
use models::dit::{self, Dit, DitConfig, LoadedDit};
use train::diffusion::{DiffusionConfig, DiffusionTrainer};
use train::images::{write_grid_png, ImageDataset, ImageOptions};
use train::trainer::Trainer;

use crate::args::GenerateArgs;
use crate::args::{interrupt_flag, TrainArgs};
use crate::args::{EvalArgs, SamplerArg};
use crate::launch::{launch, launch_pipelined, stage_layers, Rank};
use train::driver::tasks::DiffusionTask;
use train::driver::{self, Resume};

/// This rank's DiT from `dir`.
fn load(dir: &Path, rank: &Rank, dtype: Option<DType>, mode: ParamMode) -> Result<LoadedDit> {
    let files = dit::files(dir)?;
    Ok(dit::load(&files, &rank.ctx, dtype, mode)?)
}

/// `cpl train` on a DiT.
pub fn train(args: &TrainArgs, dir: &Path) -> Result<()> {
    args.layout
        .require_no_ep("a DiT has no experts: cpl train of a DiT")?;
    args.layout.device.require_cpu("cpl train of a DiT")?;
    // Full attention over the patch tokens: the contiguous ring layout by default.
    let mut args = args.clone();
    args.layout = args.layout.for_attention(false);
    let args = &args;
    if args.template.is_some() || args.freeze_vision_tower || args.freeze_language_model {
        bail!("--template / --freeze-vision-tower / --freeze-language-model are for vision-language models (LLaVA), not DiT");
    }
    let mut cfg = args.train_config()?;
    cfg.seq_len = 0;
    let config_path = dir.join("config.json");
    let model_cfg = DitConfig::from_file(&config_path)?;
    let tokens_per_image = (model_cfg.sample_size / model_cfg.patch_size).pow(2);
    let model_desc = model_cfg.description();
    let ranges = args.pipeline.configure(
        &mut cfg,
        args.layout.pp,
        &model_desc.stage_costs(tokens_per_image, models::family::Work::Training),
        &config_path,
    )?;
    let Some(data_path) = args.data.first() else {
        bail!("--data: a DiT trains on images: a .safetensors file of `latents` and `labels`, or a folder with one sub-folder of PNG/JPEG images per class");
    };
    if args.data.len() > 1 {
        bail!("--data: one image folder or latents file for a DiT");
    }
    let data = ImageDataset::load(
        data_path,
        &ImageOptions {
            channels: model_cfg.in_channels,
            size: model_cfg.sample_size,
        },
    )
    .with_context(|| format!("--data {}", data_path.display()))?;
    if data.num_classes > model_cfg.num_classes() {
        bail!(
            "--data {} has {} classes; the model has {} (num_embeds_ada_norm)",
            data_path.display(),
            data.num_classes,
            model_cfg.num_classes()
        );
    }
    let dcfg = DiffusionConfig {
        objective: args.objective.into(),
        class_dropout: args.class_dropout,
        num_timesteps: 1000,
    };
    let resume = Resume::find(args.resume, &args.out)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("--out {}", args.out.display()))?;
    let config_bytes = std::fs::read(dir.join("config.json"))?;
    let extra = vec![("config.json".to_string(), config_bytes)];
    // From scratch: DiT's initial weights, made in memory by every process alike (no file a
    // multi-process job would race on); otherwise the checkpoint to continue.
    let initial = match (&resume, args.from_scratch) {
        (None, true) => Some(Arc::new(TensorMap::new(
            models::dit::init::initial_weights(&model_cfg, args.seed)?
                .into_iter()
                .collect(),
            "DiT initialisation (--from-scratch)",
        ))),
        _ => None,
    };
    let load_dir = resume
        .as_ref()
        .map(|r| r.dir.clone())
        .unwrap_or_else(|| dir.to_path_buf());
    let interrupted = interrupt_flag()?;
    let flops_per_token =
        model_desc.flops_per_token(tokens_per_image, models::family::Work::Training);
    let dtype = args.dtype.map(DType::from).unwrap_or(DType::F32);
    let banner = format!(
        "cpl train: DiT {} ({:.2} M params, {} patch tokens/image) on {} images of {} classes, {} images/step, {} steps, objective {}, {} rank(s)",
        dir.display(),
        model_cfg.num_parameters() as f64 / 1e6,
        tokens_per_image,
        data.len(),
        data.num_classes,
        args.layout.dp_degree()? * cfg.batch * cfg.grad_accum,
        cfg.steps,
        dcfg.objective,
        args.layout.ranks
    );
    let opts = args.run_options(cfg.steps, extra, flops_per_token, banner)?;
    let _trace = args.start_trace()?;
    let history0 = Resume::history(resume.as_ref());
    let history = launch_pipelined(&args.layout, |rank| {
        let (mine, ends) = stage_layers(rank, &ranges);
        let model = match &initial {
            Some(w) => {
                let (vb, _) =
                    ParamBuilder::new(w.clone(), dtype, &Device::Cpu, ParamMode::Trainable);
                Dit::new_stage(&model_cfg, vb, &rank.ctx, &mine, ends)?
            }
            None => {
                let files = dit::files(&load_dir)?;
                let trainable = ParamMode::Trainable;
                dit::load_stage(&files, &rank.ctx, Some(dtype), trainable, &mine, ends)?.model
            }
        };
        let trainer = Trainer::new(model, &rank.mesh, &rank.ctx, cfg.clone())?;
        let mut t = DiffusionTrainer::new(trainer, dcfg)?;
        if let Some(r) = &resume {
            r.restore(&mut t.trainer)?;
        }
        let mut task = DiffusionTask {
            trainer: t,
            data: &data,
            tokens_per_image,
        };
        let world = rank.world();
        Ok(driver::run(
            &mut task,
            &world,
            &opts,
            history0.clone(),
            &interrupted,
        )?)
    })?;
    if let Some(h) = history {
        let title = format!("DiT: {} ({})", args.layout.flags(), dcfg.objective);
        driver::finish(&h, &opts, &title)?;
    }
    Ok(())
}

/// A required tensor of an `--inputs` file.
fn input(map: &HashMap<String, Tensor>, path: &Path, name: &str) -> Result<Tensor> {
    map.get(name)
        .cloned()
        .with_context(|| format!("--inputs {}: no tensor `{name}`", path.display()))
}

/// Integer or float values of a 1-D tensor as f64.
fn values(t: &Tensor, path: &Path, name: &str, batch: usize) -> Result<Vec<f64>> {
    if t.dims() != [batch] {
        bail!(
            "--inputs {}: `{name}` must be ({batch}) for a batch of {batch}, got {:?}",
            path.display(),
            t.dims()
        );
    }
    Ok(t.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

/// What `cpl eval --json` prints for a DiT.
#[derive(Debug, serde::Serialize)]
struct DitEvalReport {
    samples: usize,
    /// The diffusion loss (DDPM: mse + vb per sample, mean) when `noise` is given.
    #[serde(skip_serializing_if = "Option::is_none")]
    loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mse: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    vb: Option<f64>,
    seconds: f64,
}

/// `cpl eval` on a DiT: the model output of `--inputs` (`sample`, `timestep`, `class_labels`,
/// optionally `noise`: then `sample` is the clean x0, noised at `timestep` by DDPM, and the loss
/// is printed).
pub fn eval(args: &EvalArgs, dir: &Path) -> Result<()> {
    args.layout.device.require_cpu("cpl eval of a DiT")?;
    let mut args = args.clone();
    args.layout = args.layout.for_attention(false);
    let args = &args;
    let Some(path) = &args.inputs else {
        bail!("--inputs: a DiT evaluates a safetensors file with `sample` (B, C, H, W), `timestep` (B), `class_labels` (B) and optionally `noise`");
    };
    let map = candle_core::safetensors::load(path, &Device::Cpu).with_context(|| {
        format!(
            "--inputs {}: not a readable safetensors file",
            path.display()
        )
    })?;
    let sample = input(&map, path, "sample")?.to_dtype(DType::F32)?;
    let b = sample.dims().first().copied().unwrap_or(0);
    let timestep = values(&input(&map, path, "timestep")?, path, "timestep", b)?;
    let labels = values(&input(&map, path, "class_labels")?, path, "class_labels", b)?;
    if let Some(l) = labels.iter().find(|l| **l < 0.0 || l.fract() != 0.0) {
        bail!(
            "--inputs {}: class label {l} is not a class index",
            path.display()
        );
    }
    let labels: Vec<u32> = labels.iter().map(|&l| l as u32).collect();
    let noise = map
        .get("noise")
        .map(|n| n.to_dtype(DType::F32))
        .transpose()?;
    let dtype = args.dtype.map(DType::from);
    let t0 = Instant::now();
    let out = launch(&args.layout, |rank| {
        let m = load(dir, rank, dtype, ParamMode::Frozen)?;
        let model = &m.model;
        let times: Vec<f32> = timestep.iter().map(|&t| t as f32).collect();
        let output = model
            .forward(&sample, &times, &labels)
            .with_context(|| format!("--inputs {}", path.display()))?;
        let loss = match &noise {
            Some(noise) => {
                if timestep.iter().any(|t| t.fract() != 0.0 || *t < 0.0) {
                    bail!(
                        "--inputs {}: the DDPM loss needs integer timesteps",
                        path.display()
                    );
                }
                let diffusion = GaussianDiffusion::linear(1000)?;
                let batch = NoisedBatch {
                    x0: sample.clone(),
                    noise: noise.clone(),
                    labels: labels.clone(),
                    level: NoiseLevel::Ddpm(timestep.iter().map(|&t| t as u32).collect()),
                };
                let l = loss_sum(model, &diffusion, &batch)?;
                let s = rank.ctx.sequence_group().all_reduce(
                    &Tensor::new(
                        &[l.total.to_scalar::<f32>()? as f64, l.mse, l.vb],
                        &Device::Cpu,
                    )?,
                    ReduceOp::Sum,
                )?;
                Some(s.to_vec1::<f64>()?)
            }
            None => None,
        };
        Ok((output.to_dtype(DType::F32)?, loss))
    })?;
    let Some((output, loss)) = out else {
        return Ok(());
    };
    if let Some(o) = &args.outputs_out {
        candle_core::safetensors::save(&HashMap::from([("sample".to_string(), output)]), o)
            .with_context(|| format!("--outputs-out {}: cannot write", o.display()))?;
    }
    let n = b.max(1) as f64;
    let report = DitEvalReport {
        samples: b,
        loss: loss.as_ref().map(|l| l[0] / n),
        mse: loss.as_ref().map(|l| l[1] / n),
        vb: loss.as_ref().map(|l| l[2] / n),
        seconds: t0.elapsed().as_secs_f64(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        match report.loss {
            Some(l) => println!("loss {l:.6}  samples {b}"),
            None => println!("samples {b} (no `noise` in --inputs: no loss)"),
        }
    }
    Ok(())
}

/// `cpl generate` on a DiT: samples of `--class-labels`, written as a PNG grid.
pub fn generate(args: &GenerateArgs, dir: &Path) -> Result<()> {
    args.layout.device.require_cpu("cpl generate of a DiT")?;
    let mut args = args.clone();
    args.layout = args.layout.for_attention(false);
    let args = &args;
    let labels = parse_labels(&args.class_labels)?;
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let cfg = DitConfig::from_file(&dir.join("config.json"))?;
    if let Some(l) = labels.iter().find(|&&l| l as usize >= cfg.num_classes()) {
        bail!(
            "--class-labels: {l} is not a class of this model (0..{})",
            cfg.num_classes()
        );
    }
    let out_path = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("samples.png"));
    let (c, s) = (cfg.in_channels, cfg.sample_size);
    let mut d = DrawStream::new(args.seed, 0);
    let noise: Vec<f32> = (0..labels.len() * c * s * s)
        .map(|_| d.normal() as f32)
        .collect();
    let noise = Tensor::from_vec(noise, (labels.len(), c, s, s), &Device::Cpu)?;
    let guidance = (args.guidance != 1.0).then_some(Guidance {
        scale: args.guidance as f32,
        null_label: cfg.num_classes() as u32,
    });
    let sampler = args.sampler;
    let dtype = args.dtype.map(DType::from);
    let steps = args.steps;
    let seed = args.seed;
    let images = launch(&args.layout, |rank| {
        let m = load(dir, rank, dtype, ParamMode::Frozen)?;
        let mut model = |x: &Tensor, t: &[f32], y: &[u32]| -> models::Result<Tensor> {
            m.model.forward(x, t, y)
        };
        let out = match sampler {
            SamplerArg::Ddim => GaussianDiffusion::linear(1000)?
                .respaced(steps)?
                .ddim_sample(&mut model, &noise, &labels, guidance)?,
            SamplerArg::Ddpm => {
                let mut stream = DrawStream::new(seed, 1);
                let shape = noise.dims().to_vec();
                let n: usize = shape.iter().product();
                let mut step_noise = |_i: usize| -> models::Result<Tensor> {
                    let v: Vec<f32> = (0..n).map(|_| stream.normal() as f32).collect();
                    Ok(Tensor::from_vec(v, shape.clone(), &Device::Cpu)?)
                };
                GaussianDiffusion::linear(1000)?
                    .respaced(steps)?
                    .ddpm_sample(&mut model, &noise, &labels, guidance, &mut step_noise)?
            }
            SamplerArg::Flow => flow_sample_euler(&mut model, &noise, &labels, guidance, steps)?,
        };
        Ok(out)
    })?;
    let Some(images) = images else { return Ok(()) };
    let cols = match args.cols {
        0 => (labels.len() as f64).sqrt().ceil() as usize,
        c => c,
    };
    write_grid_png(&images, cols.max(1), args.scale, &out_path)?;
    eprintln!(
        "{} samples ({} steps, {:?}, guidance {}) in {}",
        labels.len(),
        steps,
        sampler,
        args.guidance,
        out_path.display()
    );
    Ok(())
}

/// `--class-labels 1,2,3`.
fn parse_labels(text: &Option<String>) -> Result<Vec<u32>> {
    let Some(text) = text else {
        bail!(
            "--class-labels: a DiT generates samples of given classes, e.g. --class-labels 0,1,2"
        );
    };
    let labels = text
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<u32>()
                .with_context(|| format!("--class-labels: `{s}` is not a class index"))
        })
        .collect::<Result<Vec<_>>>()?;
    if labels.is_empty() {
        bail!("--class-labels: no label");
    }
    Ok(labels)
}

/// `cpl inspect` on a DiT.
pub fn inspect(dir: &Path) -> Result<()> {
    let files = dit::files(dir)?;
    let cfg = DitConfig::from_file(&files.config)?;
    let reader = CheckpointReader::open(&files.weights)?;
    let (gh, gw) = cfg.num_patches(cfg.sample_size, cfg.sample_size)?;
    println!("model        {}", dir.display());
    println!("config       {}", files.config.display());
    println!(
        "architecture DiTTransformer2DModel: {} adaLN-Zero blocks, hidden {} ({} heads x {}), MLP {} (GELU tanh), patch {}x{}",
        cfg.num_layers,
        cfg.hidden_size(),
        cfg.num_attention_heads,
        cfg.attention_head_dim,
        cfg.intermediate_size(),
        cfg.patch_size,
        cfg.patch_size
    );
    println!(
        "             input {} x {}x{} -> {} patch tokens ({}x{}), output {} channels{}, {} classes (+ null class for guidance)",
        cfg.in_channels,
        cfg.sample_size,
        cfg.sample_size,
        gh * gw,
        gh,
        gw,
        cfg.out_channels(),
        if cfg.learn_sigma() { " (noise + learned sigma)" } else { "" },
        cfg.num_classes()
    );
    let mut total = 0usize;
    let expected = cfg.parameter_shapes();
    for (name, shape) in &expected {
        let meta = reader.meta(name)?;
        if &meta.shape != shape {
            bail!(
                "{}: `{name}` has shape {:?}, the config implies {shape:?}",
                files.source,
                meta.shape
            );
        }
        total += shape.iter().product::<usize>();
    }
    println!(
        "parameters   {total} ({:.2} M) in {} tensors, {} file(s)",
        total as f64 / 1e6,
        expected.len(),
        files.weights.len()
    );
    crate::inspect::print_values(&reader)
}
