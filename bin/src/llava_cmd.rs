//! The `cpl` commands on LLaVA-style vision-language models (a `--model` directory whose
//! `config.json` is a `LlavaForConditionalGeneration`): `eval` (token sequences with images),
//! `generate` (a prompt about an image), `train` (image-text conversations) and `inspect`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::ReduceOp;
use candle_parallel::mesh::Dim;
use candle_parallel::nn::{CrossEntropyOptions, ParamMode};
use models::checkpoint::CheckpointReader;
use models::llava::preprocess::ImageProcessor;
use models::llava::{self, Freeze, LlavaConfig};
use models::tokenizer::Tokenizer;
use train::chat::{ChatTemplate, Message, TrainOn};
use train::multimodal::{ImageTextDataset, ImageTokens, LlavaTrainer};
use train::trainer::Trainer;

use crate::args::EvalArgs;
use crate::args::GenerateArgs;
use crate::args::{interrupt_flag, TrainArgs};
use crate::launch::{launch, launch_pipelined, stage_layers, Rank};
use candle_parallel::pipeline::{run_stage_step, PipelineSchedule, StageStep};
use train::driver::tasks::LlavaTask;
use train::driver::{self, Resume};
use train::evaluation::EvalReport;

fn files(dir: &Path) -> Result<models::hub::ModelFiles> {
    Ok(models::hub::from_dir(&dir.display().to_string(), dir)?)
}

/// This rank's pipeline stage of the LLaVA in `f` (the whole model without a pipeline):
/// the language model's layers of its chunks of `ranges`, the vision tower and projector on
/// the first stage.
fn load_rank(
    f: &models::hub::ModelFiles,
    rank: &Rank,
    ranges: &[std::ops::Range<usize>],
    dtype: Option<DType>,
    mode: ParamMode,
    freeze: Freeze,
) -> Result<llava::LoadedLlava> {
    let (layers, ends) = stage_layers(rank, ranges);
    let stage = llava::LlavaStage {
        layers: &layers,
        ends,
        first: rank.mesh.coord(Dim::Pp) == 0,
    };
    Ok(llava::load_stage(
        f,
        &rank.ctx,
        dtype,
        mode,
        freeze,
        Some(stage),
    )?)
}

/// The model's image processor (`preprocessor_config.json`).
fn processor(dir: &Path) -> Result<ImageProcessor> {
    Ok(ImageProcessor::from_dir(dir)?)
}

/// Pixel values `(n, C, H, W)` of `--images` files or a `--pixel-values` safetensors file.
fn pixel_values(dir: &Path, images: &[PathBuf], file: Option<&Path>) -> Result<Option<Tensor>> {
    match (images.is_empty(), file) {
        (true, None) => Ok(None),
        (false, Some(_)) => bail!("give --images or --pixel-values, not both"),
        (true, Some(f)) => {
            let t = candle_core::safetensors::load(f, &Device::Cpu)
                .with_context(|| format!("--pixel-values {}", f.display()))?;
            let pv = t.get("pixel_values").with_context(|| {
                format!("--pixel-values {}: no tensor `pixel_values`", f.display())
            })?;
            if pv.rank() != 4 {
                bail!(
                    "--pixel-values {}: `pixel_values` must be (images, C, H, W), got {:?}",
                    f.display(),
                    pv.dims()
                );
            }
            Ok(Some(pv.to_dtype(DType::F32)?))
        }
        (false, None) => {
            let p = processor(dir)?;
            let imgs = images
                .iter()
                .map(|f| p.preprocess_file(f).context("--images"))
                .collect::<Result<Vec<_>>>()?;
            Ok(Some(Tensor::stack(&imgs, 0)?))
        }
    }
}

/// `ids` with each single image token expanded to `per` of them (sequences that already hold
/// whole runs are left as they are).
fn expand_image_tokens(ids: &[u32], image: u32, per: usize) -> Vec<u32> {
    let count = ids.iter().filter(|&&t| t == image).count();
    if count == 0 || count % per == 0 && count >= per && runs_are_whole(ids, image, per) {
        return ids.to_vec();
    }
    ids.iter()
        .flat_map(|&t| {
            if t == image {
                vec![image; per]
            } else {
                vec![t]
            }
        })
        .collect()
}

fn runs_are_whole(ids: &[u32], image: u32, per: usize) -> bool {
    let mut run = 0;
    for &t in ids.iter().chain(std::iter::once(&u32::MAX)) {
        if t == image {
            run += 1;
        } else {
            if run % per != 0 {
                return false;
            }
            run = 0;
        }
    }
    true
}

/// `cpl eval` on a LLaVA: each `--tokens` sequence with its images (in order: the images fill
/// the image-token runs of the sequences one after the other).
pub fn eval(args: &EvalArgs, dir: &Path) -> Result<(EvalReport, Vec<Tensor>)> {
    args.layout
        .device
        .require_cpu("cpl eval of a LLaVA model")?;
    let Some(tokens) = &args.tokens else {
        bail!("--tokens: a LLaVA evaluates token sequences (a JSON array of token-id arrays) with --images");
    };
    let f = files(dir)?;
    let cfg = LlavaConfig::from_file(&f.config)?;
    let seqs = train::data::read_token_sequences(tokens, cfg.text().vocab_size, "--tokens")?;
    let pv = pixel_values(dir, &args.images, args.pixel_values.as_deref())?;
    let dtype = args.dtype.map(DType::from);
    let want_logits = args.logits_out.is_some();
    if args.adapter.is_some() {
        bail!(
            "--adapter: LoRA adapters are for language models; {} is a LLaVA",
            dir.display()
        );
    }
    // The text decoder's pieces at the longest sequence (the tower on the first stage is not
    // weighed: its work depends on the images).
    let longest = seqs.iter().map(Vec::len).max().unwrap_or(1);
    let costs = (models::family::LLAVA.describe)(&f.config)?
        .stage_costs(longest, models::family::Work::Forward);
    let pipeline = args.pipeline.stages(args.layout.pp, &costs, &f.config)?;
    if pipeline.is_some() && want_logits {
        bail!("--logits-out is not available with --pp");
    }
    let ranges = match &pipeline {
        Some(pc) => pc.ranges(),
        None => std::iter::once(0..costs.layers.len()).collect(),
    };
    let out = launch_pipelined(&args.layout, |rank: &Rank| {
        let m = load_rank(
            &f,
            rank,
            &ranges,
            dtype,
            ParamMode::Frozen,
            Freeze::default(),
        )
        .with_context(|| format!("loading {} with {}", dir.display(), args.layout.flags()))?;
        let (per, image) = (m.model.tokens_per_image(), cfg.image_token());
        let opts = CrossEntropyOptions::default();
        let (mut sum, mut count, mut next_image) = (0f64, 0u64, 0usize);
        let mut logits = Vec::new();
        // Under a pipeline: this rank's sequences, forward through the stages at the end.
        let mut staged_micro = Vec::new();
        let start = std::time::Instant::now();
        let (dp, dp_rank) = (rank.mesh.size(Dim::Dp), rank.mesh.coord(Dim::Dp));
        for (i, seq) in seqs.iter().enumerate() {
            let ids = expand_image_tokens(seq, image, per);
            let n_img = ids.iter().filter(|&&t| t == image).count() / per;
            let first_image = next_image;
            next_image += n_img;
            // Each data-parallel rank scores its share of the sequences (all of them for
            // --logits-out, which rank 0 writes).
            let mine = i % dp == dp_rank;
            if !mine && !want_logits {
                continue;
            }
            let imgs = match (&pv, n_img) {
                (_, 0) => None,
                (Some(p), n) if first_image + n <= p.dim(0)? => {
                    Some(p.narrow(0, first_image, n)?)
                }
                _ => bail!(
                    "the sequences hold more image-token runs than the {} image(s) given",
                    pv.as_ref().map(|p| p.dim(0).unwrap_or(0)).unwrap_or(0)
                ),
            };
            let labels: Vec<i64> = (0..ids.len())
                .map(|i| match ids.get(i + 1) {
                    Some(&t) if t != image => t as i64,
                    _ => -100,
                })
                .collect();
            if pipeline.is_some() {
                staged_micro.push(llava::LlavaMicroBatch::new(
                    &m.model,
                    vec![ids],
                    vec![labels],
                    imgs,
                )?);
                continue;
            }
            let (s, c) = m.model.loss_sum(
                std::slice::from_ref(&ids),
                std::slice::from_ref(&labels),
                imgs.as_ref(),
                &opts,
            )?;
            if mine {
                sum += s.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                count += c as u64;
            }
            if want_logits {
                let l = m.model.logits(std::slice::from_ref(&ids), imgs.as_ref())?;
                let global = rank.ctx.gather_tokens(&l)?;
                if rank.is_main() {
                    logits.push(global.squeeze(0)?);
                }
            }
        }
        if let Some(p) = &pv {
            if next_image != p.dim(0)? {
                bail!(
                    "{} image(s) given but the sequences hold {next_image} image-token run(s)",
                    p.dim(0)?
                );
            }
        }
        if let (Some(pc), false) = (&pipeline, staged_micro.is_empty()) {
            let pp = rank.mesh.comm(Dim::Pp);
            let schedule =
                PipelineSchedule::forward_only(pp.size(), staged_micro.len(), pc.virtual_stages)?;
            let step = StageStep {
                schedule: &schedule,
                layers: &ranges,
                pp: &pp,
                global_count: 1,
                dtype: m.model.dtype(),
            };
            let staged = llava::LlavaStages {
                model: &m.model,
                opts,
            };
            sum = run_stage_step(&staged, &step, &staged_micro, Vec::new(), 0)?.loss_sum;
            // Labelled tokens of this rank's sequence shards.
            count = staged_micro
                .iter()
                .map(|mb| -> Result<u64> {
                    let l = mb.labels.flatten_all()?.to_vec1::<i64>()?;
                    Ok(l.iter().filter(|&&x| x != -100).count() as u64)
                })
                .sum::<Result<u64>>()?;
        }
        let group = rank.mesh.group(&[Dim::Ulysses, Dim::Ring, Dim::Dp])?;
        let t = group
            .all_reduce(
                &Tensor::new(&[sum, count as f64], &Device::Cpu)?,
                ReduceOp::Sum,
            )?
            .to_vec1::<f64>()?;
        let seconds = rank
            .world()
            .all_reduce(
                &Tensor::new(&[start.elapsed().as_secs_f64()], &Device::Cpu)?,
                ReduceOp::Max,
            )?
            .to_vec1::<f64>()?[0];
        let loss = t[0] / t[1].max(1.0);
        Ok((
            EvalReport {
                loss,
                perplexity: loss.exp(),
                tokens: t[1] as u64,
                sequences: seqs.len(),
                seconds,
                tokens_per_sec: t[1] / seconds.max(1e-12),
                by_position: None,
            },
            logits,
        ))
    })?;
    out.context("no result from rank 0")
}

/// `cpl generate --image FILE --prompt TEXT` on a LLaVA: the prompt as a user turn after the
/// image, rendered by the model's chat template (else the built-in `plain`), continued greedily
/// or by sampling. Each new token runs the whole sequence again (no KV cache for images yet).
pub fn generate(args: &GenerateArgs, dir: &Path) -> Result<()> {
    args.layout
        .device
        .require_cpu("cpl generate of a LLaVA model")?;
    let Some(prompt) = &args.prompt else {
        bail!("--prompt: the question about the image is required");
    };
    if args.adapter.is_some() {
        bail!(
            "--adapter: LoRA adapters are for language models; {} is a LLaVA",
            dir.display()
        );
    }
    if args.layout.tp_sp || args.layout.ulysses > 1 || args.layout.ring > 1 {
        bail!(
            "cpl generate on a LLaVA runs without sequence parallelism or --tp-sp (--tp is fine)"
        );
    }
    let f = files(dir)?;
    let cfg = LlavaConfig::from_file(&f.config)?;
    let tok = Tokenizer::from_model(&f)?;
    let tpl = match ChatTemplate::from_model(&f)? {
        Some(t) => t,
        None => ChatTemplate::builtin_for("plain", &tok)?,
    };
    let image_text = tok.id_to_token(cfg.image_token()).with_context(|| {
        format!(
            "the tokenizer has no token for image_token_id {}",
            cfg.image_token()
        )
    })?;
    let content = if args.image.is_empty() {
        prompt.clone()
    } else {
        format!("{}\n{prompt}", image_text.repeat(args.image.len()))
    };
    let conv = [Message::new("user", &content)];
    let text = tpl.render(&conv, true)?;
    let (ids, _) = tok.encode_with_offsets(&text)?;
    let pv = pixel_values(dir, &args.image, None)?;
    let dtype = args.dtype.map(DType::from);
    let out = launch(&args.layout, |rank: &Rank| {
        if rank.ctx.sequence_group().size() > 1 {
            bail!("cpl generate on a LLaVA runs without sequence parallelism (tp is fine)");
        }
        let m = llava::load(&f, &rank.ctx, dtype, ParamMode::Frozen, Freeze::default())?;
        let mut ids = expand_image_tokens(&ids, cfg.image_token(), m.model.tokens_per_image());
        let start = ids.len();
        let mut rng = train::generation::Rng(args.seed);
        for _ in 0..args.max_new_tokens {
            let logits = m.model.logits(std::slice::from_ref(&ids), pv.as_ref())?;
            let logits = rank.ctx.gather_tokens(&logits)?;
            let last = logits.squeeze(0)?.get(ids.len() - 1)?.to_vec1::<f32>()?;
            let next = train::generation::sample(&last, args.temperature, args.top_p, &mut rng);
            ids.push(next);
            if Some(next) == tok.eos_token_id {
                break;
            }
        }
        Ok(ids[start..].to_vec())
    })?;
    if let Some(new) = out {
        println!(
            "{}",
            tok.decode(&new, models::tokenizer::SpecialTokens::Drop)?
        );
    }
    Ok(())
}

/// `cpl train` on a LLaVA: image-text conversations (`--data FILE.jsonl`, see
/// [`train::multimodal`]), every layout and memory flag; `--freeze-vision-tower`,
/// `--freeze-language-model` (projector-only pretraining: both).
pub fn train(args: &TrainArgs, dir: &Path) -> Result<()> {
    args.layout
        .require_no_ep("a LLaVA model has no experts: cpl train of a LLaVA model")?;
    args.layout
        .device
        .require_cpu("cpl train of a LLaVA model")?;
    // Flags of text or diffusion training that mean nothing here are errors, not ignored.
    if args.tokens.is_some() || !args.eval_data.is_empty() || args.eval_tokens.is_some() {
        bail!(
            "--tokens, --eval-data and --eval-tokens are for text models; a LLaVA trains on \
             --data conversations with images"
        );
    }
    if args.doc_mask || args.from_scratch {
        bail!(
            "--doc-mask and --from-scratch do not apply to a LLaVA (one conversation per \
             sequence, weights from --model)"
        );
    }
    let mut cfg = args.train_config()?;
    // --resume: the model (and optimizer) of the last checkpoint in --out.
    let resume = Resume::find(args.resume, &args.out)?;
    let model_dir = resume
        .as_ref()
        .map(|r| r.dir.clone())
        .unwrap_or_else(|| dir.to_path_buf());
    let f = files(&model_dir)?;
    let lcfg = LlavaConfig::from_file(&f.config)?;
    let tok = Tokenizer::from_model(&f)?;
    let tpl = match &args.template {
        Some(spec) => ChatTemplate::resolve(Some(spec), &f, &tok, "--template")
            .with_context(|| format!("--template {spec}"))?,
        None => match ChatTemplate::from_model(&f)? {
            Some(t) => t,
            None => ChatTemplate::builtin_for("plain", &tok)?,
        },
    };
    let proc_ = processor(&model_dir)?;
    if args.data.is_empty() {
        bail!("--data: JSON-lines files of conversations with images (messages + images)");
    }
    let freeze = Freeze {
        vision_tower: args.freeze_vision_tower,
        language_model: args.freeze_language_model,
    };
    // Tokens per image: from the config, without loading the model.
    let per = lcfg.tokens_per_image()?;
    let mut data: Option<ImageTextDataset> = None;
    for data_path in &args.data {
        let more = ImageTextDataset::read(
            data_path,
            "--data",
            &tpl,
            &tok,
            &proc_,
            &ImageTokens {
                image_token: lcfg.image_token(),
                per_image: per,
            },
            cfg.seq_len,
            tok.eos_token_id.unwrap_or(0),
            TrainOn::default(),
        )?;
        match &mut data {
            Some(d) => d.examples.extend(more.examples),
            None => data = Some(more),
        }
    }
    let data = data.context("no data")?;
    let text_work = if freeze.language_model {
        models::family::Work::FrozenTraining
    } else {
        models::family::Work::Training
    };
    let images_per_sequence = data.examples.iter().map(|e| e.images.len()).sum::<usize>() as f64
        / data.examples.len().max(1) as f64;
    // Per token: each sequence's images through the tower and the projector, spread over its
    // tokens.
    let vision_per_token = images_per_sequence
        * lcfg.vision_training_flops_per_image(!freeze.vision_tower)?
        / cfg.seq_len.max(1) as f64;
    let text_desc = (models::family::LLAVA.describe)(&f.config)?;
    // Pipeline: the language model's decoder layers cut into stages; the tower and
    // projector on the first.
    let mut costs = text_desc.stage_costs(cfg.seq_len, text_work);
    costs.first += vision_per_token;
    let ranges = args
        .pipeline
        .configure(&mut cfg, args.layout.pp, &costs, &f.config)?;
    std::fs::create_dir_all(&args.out)?;
    let extra = crate::model_arg::checkpoint_files(&models::family::LLAVA, &f)?;
    let interrupted = interrupt_flag()?;
    let dtype = args.dtype.map(DType::from);
    let global = args.layout.dp_degree()? * cfg.batch * cfg.grad_accum;
    // Text tokens (frozen-weight work when the language model is frozen) plus the images.
    let flops_per_token = text_desc.flops_per_token(cfg.seq_len, text_work) + vision_per_token;
    let banner = format!(
        "cpl train: LLaVA {} on {} conversations, seq {} x {global} sequences/step, {} steps, {} rank(s)",
        dir.display(),
        data.examples.len(),
        cfg.seq_len,
        cfg.steps,
        args.layout.ranks
    );
    let opts = args.run_options(cfg.steps, extra, flops_per_token, banner)?;
    let _trace = args.start_trace()?;
    let history0 = Resume::history(resume.as_ref());
    let history = launch_pipelined(&args.layout, |rank: &Rank| {
        let m = load_rank(&f, rank, &ranges, dtype, ParamMode::Trainable, freeze)?;
        let mut t = LlavaTrainer {
            trainer: Trainer::new(m.model, &rank.mesh, &rank.ctx, cfg.clone())?,
        };
        if let Some(r) = &resume {
            r.restore(&mut t.trainer)?;
        }
        let mut task = LlavaTask {
            trainer: t,
            data: &data,
            processed_tokens: (global * cfg.seq_len) as f64,
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
        let title = format!("LLaVA {}: {}", dir.display(), args.layout.flags());
        driver::finish(&h, &opts, &title)?;
    }
    Ok(())
}

/// `cpl inspect` of a LLaVA: the tower, the projector and the language model.
pub fn inspect(dir: &Path) -> Result<()> {
    let f = files(dir)?;
    let cfg = LlavaConfig::from_file(&f.config)?;
    let reader = CheckpointReader::open(&f.weights)?;
    let layout = llava::KeyLayout::detect(&reader.names(), reader.location())?;
    let v = &cfg.vision_config;
    let t = cfg.text();
    let count = |prefix: &str| -> usize {
        reader
            .names()
            .iter()
            .filter(|n| n.starts_with(prefix))
            .filter_map(|n| reader.meta(n).ok())
            .map(|m| m.shape.iter().product::<usize>())
            .sum()
    };
    let (vp, pp, lp) = match layout {
        llava::KeyLayout::StateDict => (
            "model.vision_tower.",
            "model.multi_modal_projector.",
            "model.language_model.",
        ),
        llava::KeyLayout::Saved | llava::KeyLayout::V4 => {
            ("vision_tower.", "multi_modal_projector.", "language_model.")
        }
    };
    println!("model        {}", dir.display());
    println!("architecture LlavaForConditionalGeneration ({layout:?} key layout)");
    println!(
        "vision tower {}: image {}x{}, patch {}, {} layers, hidden {}, {} heads, intermediate {}; {} params",
        v.model_type, v.image_size, v.image_size, v.patch_size, v.num_hidden_layers, v.hidden_size,
        v.num_attention_heads, v.intermediate_size, count(vp)
    );
    println!(
        "             features: hidden state {}, strategy {}, {} image tokens per image (id {})",
        match &cfg.vision_feature_layer {
            llava::FeatureLayer::One(l) => l.to_string(),
            llava::FeatureLayer::Many(v) => format!("{v:?}"),
        },
        cfg.vision_feature_select_strategy,
        v.num_patches() + usize::from(v.model_type.starts_with("clip"))
            - usize::from(cfg.vision_feature_select_strategy == "default"),
        cfg.image_token()
    );
    println!(
        "projector    linear_1 -> {} -> linear_2 ({} -> {}), bias {}; {} params",
        cfg.projector_hidden_act,
        v.hidden_size,
        t.hidden_size,
        cfg.multimodal_projector_bias,
        count(pp)
    );
    println!(
        "language     LLaMA: {} layers, hidden {}, {} heads / {} kv heads, vocab {}; {} params",
        t.num_hidden_layers,
        t.hidden_size,
        t.num_attention_heads,
        t.num_kv_heads(),
        t.vocab_size,
        count(lp) + count("lm_head.")
    );
    crate::inspect::print_values(&reader)
}
