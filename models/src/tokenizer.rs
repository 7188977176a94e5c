//! Tokenizers: `tokenizer.json` through the `tokenizers` crate, special tokens from
//! `tokenizer_config.json` (`bos_token`, `eos_token`, `add_bos_token`, `add_eos_token`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::hub::ModelFiles;

/// Whether special tokens (BOS, EOS, ...) are added when encoding and kept when decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialTokens {
    Keep,
    Drop,
}

/// The byte range `(start, end)` of the text that each token comes from.
pub type Offsets = Vec<(usize, usize)>;

/// A model's tokenizer with its special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
}

impl Tokenizer {
    /// From a model's files (`tokenizer.json` required, `tokenizer_config.json` optional).
    pub fn from_model(files: &ModelFiles) -> Result<Self> {
        let path = files.tokenizer.as_ref().ok_or_else(|| Error::NotFound {
            model: files.source.clone(),
            msg: "has no tokenizer.json".into(),
        })?;
        Self::from_files(path, files.tokenizer_config.as_deref())
    }

    pub fn from_files(tokenizer_json: &Path, tokenizer_config: Option<&Path>) -> Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_file(tokenizer_json).map_err(|e| Error::Tokenizer {
                path: tokenizer_json.into(),
                msg: e.to_string(),
            })?;
        let mut tok = Self {
            inner,
            path: tokenizer_json.into(),
            bos_token_id: None,
            eos_token_id: None,
        };
        if let Some(cfg) = tokenizer_config {
            let text = std::fs::read_to_string(cfg).map_err(|e| Error::io(cfg, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::config(cfg, format!("not valid JSON: {e}")))?;
            let token = |k: &str| -> Option<String> {
                match v.get(k)? {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
                    _ => None,
                }
            };
            tok.bos_token_id = token("bos_token").and_then(|t| tok.inner.token_to_id(&t));
            tok.eos_token_id = token("eos_token").and_then(|t| tok.inner.token_to_id(&t));
        }
        Ok(tok)
    }

    /// Token ids of `text`; [`SpecialTokens::Keep`] applies the tokenizer's post-processor
    /// (e.g. a BOS token), as `tokenizer(text)` does in transformers.
    pub fn encode(&self, text: &str, special: SpecialTokens) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, special == SpecialTokens::Keep)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` with the byte range of `text` each token comes from, without adding
    /// special tokens (no post-processor BOS/EOS): `tokenizer(text, add_special_tokens=False,
    /// return_offsets_mapping=True)` in transformers, but with offsets in bytes rather than
    /// characters. Special tokens written in `text` (e.g. `<|im_end|>`) are still matched.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Offsets)> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// The text of token `id`, if it exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of token `token` (e.g. a special token such as `<|im_end|>`), if in the
    /// vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of `ids`, with or without the special tokens' text.
    pub fn decode(&self, ids: &[u32], special: SpecialTokens) -> Result<String> {
        self.inner
            .decode(ids, special == SpecialTokens::Drop)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
