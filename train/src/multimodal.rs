//! Training LLaVA-style vision-language models on image-text conversations.
//!
//! Data: the sharegpt-with-images JSON-lines format (LLaMA-Factory's `mllm` datasets): a
//! conversation (`messages`, or `conversations`) whose turns hold `<image>` placeholders, and
//! `images`, the image files (paths relative to the data file) in the order of the
//! placeholders. Each conversation is rendered by the chat template and tokenized with its
//! trained-token mask ([`crate::chat`]); every image token of the text is then expanded to the
//! model's tokens per image (untrained), and the images are preprocessed by the model's image
//! processor. One conversation per sequence, padded (or truncated) to `seq_len`.
//!
//! The step is the trainer's ([`Trainer::run_step`] with [`LlavaLoss`]): the summed loss of
//! each micro-batch over the global count of trained tokens, gradients collected and applied
//! by [`Trainer`].

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use candle_parallel::nn::CrossEntropyOptions;
use candle_parallel::pipeline::StageLoss;
use models::llava::preprocess::ImageProcessor;
use models::llava::{Llava, LlavaMicroBatch, LlavaStages};
use models::tokenizer::Tokenizer;

use crate::chat::{ChatTemplate, Conversation, TrainOn};
use crate::data::IGNORE;
use crate::error::{Error, Result};
use crate::objective::{Objective, StepCtx};
use crate::trainer::{StepStats, TrainModel, Trainer};

impl TrainModel for Llava {
    fn end_params(&self) -> Vec<String> {
        models::CausalLm::end_params(&self.llama)
    }

    /// Checkpoints are written in transformers 4's layout (`vision_tower.vision_model.*`),
    /// which transformers 4 and 5 both read.
    fn saved_name(&self, name: &str) -> String {
        models::llava::KeyLayout::V4.stored(name)
    }
}

/// One conversation with its images.
#[derive(Debug, Clone)]
pub struct ImageExample {
    /// Token ids with every image's run of image tokens, padded to the sequence length.
    pub ids: Vec<u32>,
    /// Next-token labels ([`IGNORE`] on image tokens, untrained tokens and padding).
    pub labels: Vec<i64>,
    /// The image files, in the order of the image-token runs (read when the example trains).
    pub images: Vec<PathBuf>,
    /// Where the example comes from (`FILE line N`).
    pub source: String,
}

/// A dataset of image-text conversations (see the [module docs](self)). Images are decoded and
/// preprocessed when their example is drawn, not kept in memory.
pub struct ImageTextDataset {
    pub examples: Vec<ImageExample>,
    pub processor: ImageProcessor,
}

impl ImageTextDataset {
    /// The pixel values `(images, C, H, W)` of example `i` (none for a text-only one). Errors
    /// name the example and the image.
    pub fn pixel_values(&self, i: usize) -> Result<Option<Tensor>> {
        let e = &self.examples[i];
        if e.images.is_empty() {
            return Ok(None);
        }
        let imgs = e
            .images
            .iter()
            .map(|p| {
                self.processor
                    .preprocess_file(p)
                    .map_err(|err| Error::Invalid(format!("{}: {err}", e.source)))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Tensor::stack(&imgs, 0)?))
    }
}

/// What the reader needs of the model.
pub struct ImageTokens {
    pub image_token: u32,
    pub per_image: usize,
}

/// One record of the file: the conversation and its image paths.
fn read_records(path: &Path, flag: &str) -> Result<Vec<(Conversation, Vec<PathBuf>)>> {
    let err = |msg: String| Error::Data {
        flag: flag.into(),
        path: path.to_path_buf(),
        msg,
    };
    let convs = crate::chat::read_conversations(path, flag)?;
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?;
    let base = path.parent().unwrap_or(Path::new("."));
    let mut images = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| err(format!("line {}: not valid JSON: {e}", i + 1)))?;
        let list = match &v["images"] {
            serde_json::Value::Null => Vec::new(),
            serde_json::Value::Array(a) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(|s| base.join(s))
                        .ok_or_else(|| err(format!("line {}: images holds {x}, not a path", i + 1)))
                })
                .collect::<Result<Vec<_>>>()?,
            other => {
                return Err(err(format!(
                    "line {}: images is {other}, not a list",
                    i + 1
                )))
            }
        };
        images.push(list);
    }
    if images.len() != convs.len() {
        return Err(err(format!(
            "{} conversations but {} records (only JSON-lines files are read here)",
            convs.len(),
            images.len()
        )));
    }
    Ok(convs.into_iter().zip(images).collect())
}

impl ImageTextDataset {
    /// Reads, renders, tokenizes and preprocesses the file (see the [module docs](self)).
    /// A conversation longer than `seq_len` is truncated. Errors name the file and line: a
    /// number of `<image>` placeholders other than the number of images, a missing or
    /// unreadable image, an image whose tokens would be cut by the window.
    #[allow(clippy::too_many_arguments)]
    pub fn read(
        path: &Path,
        flag: &str,
        tpl: &ChatTemplate,
        tok: &Tokenizer,
        processor: &ImageProcessor,
        image: &ImageTokens,
        seq_len: usize,
        pad_id: u32,
        train_on: TrainOn,
    ) -> Result<Self> {
        let mut examples = Vec::new();
        for (conv, paths) in read_records(path, flag)? {
            let t = crate::chat::tokenize_conversation(tpl, tok, &conv, train_on)?;
            let placeholders = t.ids.iter().filter(|&&x| x == image.image_token).count();
            if placeholders != paths.len() {
                return Err(Error::Data {
                    flag: flag.into(),
                    path: path.to_path_buf(),
                    msg: format!(
                        "{}: {placeholders} <image> placeholder(s) but {} image(s)",
                        conv.source,
                        paths.len()
                    ),
                });
            }
            let (mut ids, mut trained) = (Vec::new(), Vec::new());
            for (&id, &tr) in t.ids.iter().zip(&t.trained) {
                if id == image.image_token {
                    ids.extend(std::iter::repeat_n(id, image.per_image));
                    trained.extend(std::iter::repeat_n(false, image.per_image));
                } else {
                    ids.push(id);
                    trained.push(tr);
                }
            }
            if ids.len() > seq_len {
                // Truncated, as long as every image's tokens stay whole in the window.
                if ids[seq_len..].contains(&image.image_token) {
                    return Err(Error::Data {
                        flag: flag.into(),
                        path: path.to_path_buf(),
                        msg: format!(
                            "{}: {} tokens with its images' tokens, and an image past --seq-len \
                             {seq_len}",
                            conv.source,
                            ids.len()
                        ),
                    });
                }
                ids.truncate(seq_len);
                trained.truncate(seq_len);
            }
            let mut labels: Vec<i64> = (0..ids.len())
                .map(|i| match (ids.get(i + 1), trained.get(i + 1)) {
                    (Some(&t), Some(true)) => t as i64,
                    _ => IGNORE,
                })
                .collect();
            let pad = seq_len - ids.len();
            ids.extend(std::iter::repeat_n(pad_id, pad));
            labels.extend(std::iter::repeat_n(IGNORE, pad));
            if let Some(missing) = paths.iter().find(|p| !p.is_file()) {
                return Err(Error::Data {
                    flag: flag.into(),
                    path: path.to_path_buf(),
                    msg: format!(
                        "{}: image {} does not exist",
                        conv.source,
                        missing.display()
                    ),
                });
            }
            examples.push(ImageExample {
                ids,
                labels,
                images: paths,
                source: conv.source.clone(),
            });
        }
        if examples.is_empty() {
            return Err(Error::Data {
                flag: flag.into(),
                path: path.to_path_buf(),
                msg: "holds no conversation".into(),
            });
        }
        Ok(Self {
            examples,
            processor: processor.clone(),
        })
    }
}

/// LLaVA's next-token loss on an [`ImageTextDataset`], averaged over the global batch's
/// trained tokens (see the [module docs](self)).
#[derive(Debug, Clone, Copy)]
pub struct LlavaLoss {
    pub opts: CrossEntropyOptions,
}

impl LlavaLoss {
    /// The loss with `--loss-chunk` tokens per chunk of the vocab-parallel loss.
    pub fn new(cfg: &crate::trainer::TrainConfig) -> Self {
        Self {
            opts: CrossEntropyOptions {
                chunk_tokens: cfg.loss_chunk_tokens,
                ..Default::default()
            },
        }
    }

    /// The example indices of `step` for data-parallel rank `d`, in micro-batches.
    fn picked(s: &StepCtx<'_>, data: &ImageTextDataset, step: u64, d: usize) -> Vec<Vec<usize>> {
        let sampler = s.batching.sampler(data.examples.len());
        s.batching
            .micro_samples(&sampler, step, d)
            .into_iter()
            .map(|m| m.into_iter().map(|k| sampler.window_of(k)).collect())
            .collect()
    }
}

impl Objective<Llava> for LlavaLoss {
    type Data = ImageTextDataset;
    type Micro = LlavaMicroBatch;
    type Staged<'a> = LlavaStages<'a>;

    /// Trained tokens of the global batch of `step` (from the labels alone).
    fn global_count(&self, s: &StepCtx<'_>, data: &ImageTextDataset, step: u64) -> Result<u64> {
        let n = (0..s.batching.dp)
            .flat_map(|d| Self::picked(s, data, step, d).concat())
            .map(|i| {
                data.examples[i]
                    .labels
                    .iter()
                    .filter(|&&l| l != IGNORE)
                    .count() as u64
            })
            .sum();
        if n == 0 {
            return Err(Error::Invalid(format!(
                "step {step}: no trained token in the batch"
            )));
        }
        Ok(n)
    }

    /// This rank's micro-batches of `step`, their images read now.
    fn micro_batches(
        &self,
        s: &StepCtx<'_>,
        model: &Llava,
        data: &ImageTextDataset,
        step: u64,
    ) -> Result<Vec<LlavaMicroBatch>> {
        Self::picked(s, data, step, s.dp_rank)
            .iter()
            .map(|m| {
                let ids = m.iter().map(|&i| data.examples[i].ids.clone()).collect();
                let labels = m.iter().map(|&i| data.examples[i].labels.clone()).collect();
                let mut imgs = Vec::new();
                for &i in m {
                    imgs.extend(data.pixel_values(i)?);
                }
                let pv = if imgs.is_empty() {
                    None
                } else {
                    Some(Tensor::cat(&imgs, 0)?)
                };
                Ok(LlavaMicroBatch::new(model, ids, labels, pv)?)
            })
            .collect()
    }

    fn loss(&self, model: &Llava, m: &LlavaMicroBatch) -> Result<StageLoss> {
        let (sum, _) = model.loss_sum(
            &m.ids,
            &m.global_labels,
            m.pixel_values.as_ref(),
            &self.opts,
        )?;
        Ok(StageLoss::new(sum))
    }

    fn staged<'a>(&'a self, model: &'a Llava) -> Result<LlavaStages<'a>> {
        Ok(LlavaStages {
            model,
            opts: self.opts,
        })
    }
}

/// A trainer of a LLaVA model on [`ImageTextDataset`]s.
pub struct LlavaTrainer {
    pub trainer: Trainer<Llava>,
}

impl LlavaTrainer {
    /// Runs optimizer step `self.trainer.step` and advances ([`Trainer::run_step`] with
    /// [`LlavaLoss`]). Collective over the world.
    pub fn step(&mut self, data: &ImageTextDataset) -> Result<StepStats> {
        let obj = LlavaLoss::new(&self.trainer.cfg);
        Ok(self.trainer.run_step(&obj, data)?.stats)
    }
}
