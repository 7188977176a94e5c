//! What a fine-tuning run reads and writes besides the model: chat files become SFT windows or
//! DPO pairs ([`FinetuneData::read`]), and a checkpoint carries the files that make it
//! loadable on its own ([`checkpoint_files`]).

use std::path::{Path, PathBuf};

use candle_parallel::nn::LoraConfig;
use models::tokenizer::Tokenizer;

use crate::chat::{self, ChatTemplate, TokenizedExample, TrainOn};
use crate::data::Windows;
use crate::error::{Error, Result};
use crate::finetune::{Example, PackStats, PairDataset, SftDataset, SftOptions};

/// The training data of a fine-tuning run.
pub enum FinetuneData {
    /// Conversations packed (or padded) into windows for SFT.
    Sft(SftDataset),
    /// Preference pairs for DPO.
    Dpo(PairDataset),
}

/// How conversations become tokens: the template, the tokenizer, which turns are trained, and
/// the windows (`opts`) of a model of `vocab` tokens.
pub struct ChatTokenizing<'a> {
    pub template: &'a ChatTemplate,
    pub tokenizer: &'a Tokenizer,
    pub train_on: TrainOn,
    /// Read at most this many records (over all files).
    pub max_examples: Option<usize>,
    pub opts: &'a SftOptions,
    pub vocab: usize,
}

impl FinetuneData {
    /// Reads and tokenizes `paths` (chat records for SFT, preference pairs with `dpo`); errors
    /// name `flag` and the file.
    pub fn read(
        paths: &[PathBuf],
        flag: &str,
        dpo: bool,
        how: &ChatTokenizing,
    ) -> Result<(Self, PackStats)> {
        let take = |n: usize| how.max_examples.unwrap_or(n).min(n);
        let windows =
            |e: String| Error::Invalid(format!("{flag} with --seq-len {}: {e}", how.opts.seq_len));
        if dpo {
            let mut pairs = Vec::new();
            for p in paths {
                pairs.extend(chat::read_preference_pairs(p, flag)?);
            }
            pairs.truncate(take(pairs.len()));
            let pairs = pairs
                .iter()
                .map(|p| {
                    let (c, r) = chat::tokenize_pair(how.template, how.tokenizer, p)?;
                    Ok((example(c), example(r)))
                })
                .collect::<Result<Vec<_>>>()?;
            let (d, s) = PairDataset::new(&pairs, how.opts, how.vocab)
                .map_err(|e| windows(e.to_string()))?;
            return Ok((Self::Dpo(d), s));
        }
        let mut convs = Vec::new();
        for p in paths {
            convs.extend(chat::read_conversations(p, flag)?);
        }
        convs.truncate(take(convs.len()));
        let examples = convs
            .iter()
            .map(|c| {
                let t = chat::tokenize_conversation(how.template, how.tokenizer, c, how.train_on)?;
                Ok(example(t))
            })
            .collect::<Result<Vec<_>>>()?;
        let (d, s) =
            SftDataset::new(&examples, how.opts, how.vocab).map_err(|e| windows(e.to_string()))?;
        Ok((Self::Sft(d), s))
    }

    /// Windows (SFT) or pairs (DPO).
    pub fn len(&self) -> usize {
        match self {
            Self::Sft(d) => d.num_windows(),
            Self::Dpo(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn example(t: TokenizedExample) -> Example {
    Example {
        ids: t.ids,
        trained: t.trained,
    }
}

/// Files written into every checkpoint of a fine-tuning run of `files`: under LoRA PEFT's
/// `adapter_config.json` (`target_modules` as given: `"all-linear"` or the layer names, which
/// PEFT expands or suffix-matches; `base_model_name_or_path` = `model_id`) and the tokenizer
/// files; for full fine-tuning the model's config, generation config and tokenizer files.
pub fn checkpoint_files(
    files: &models::hub::ModelFiles,
    lora: Option<&LoraConfig>,
    model_id: &str,
) -> Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    let mut copy: Vec<&Path> = [
        files.tokenizer.as_deref(),
        files.tokenizer_config.as_deref(),
        files.chat_template.as_deref(),
    ]
    .into_iter()
    .flatten()
    .collect();
    match lora {
        Some(cfg) => {
            let json = models::peft::AdapterConfig::from_lora(cfg, model_id).to_json()?;
            out.push((models::peft::CONFIG_NAME.to_string(), json));
        }
        None => {
            copy.push(&files.config);
            copy.extend(files.generation_config.as_deref());
        }
    }
    for p in copy {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.push((name, std::fs::read(p).map_err(|e| Error::io(p, e))?));
    }
    Ok(out)
}
