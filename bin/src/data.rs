//! Input data of `cpl eval` (and later `cpl train`): text, jsonl, or pre-tokenized sequences.

use std::path::Path;

use anyhow::{bail, Context, Result};
use models::tokenizer::Tokenizer;

/// Documents of a text file (`.txt`: the whole file is one document; `.jsonl`: one JSON object
/// per line with a string field `field`).
pub fn read_documents(path: &Path, field: &str) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--data {}: cannot read the file", path.display()))?;
    let is_jsonl = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("jsonl") | Some("ndjson")
    );
    let docs = if is_jsonl {
        let mut docs = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line).with_context(|| {
                format!("--data {} line {}: not valid JSON", path.display(), i + 1)
            })?;
            let t = v.get(field).and_then(|t| t.as_str()).with_context(|| {
                format!(
                    "--data {} line {}: no string field {field:?}",
                    path.display(),
                    i + 1
                )
            })?;
            docs.push(t.to_string());
        }
        docs
    } else {
        vec![text]
    };
    if docs.iter().all(|d| d.trim().is_empty()) {
        bail!("--data {}: the file holds no text", path.display());
    }
    Ok(docs)
}

/// Tokenizes documents and concatenates them, with EOS (when the tokenizer has one) between
/// documents.
pub fn tokenize_documents(tok: &Tokenizer, docs: &[String]) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for d in docs {
        if !ids.is_empty() {
            if let Some(eos) = tok.eos_token_id {
                ids.push(eos);
            }
        }
        ids.extend(tok.encode(d, false)?);
    }
    Ok(ids)
}

/// A JSON array of token-id arrays (`--tokens`).
pub fn read_token_sequences(path: &Path, vocab_size: usize) -> Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--tokens {}: cannot read the file", path.display()))?;
    let seqs: Vec<Vec<i64>> = serde_json::from_str(&text).with_context(|| {
        format!(
            "--tokens {}: expected a JSON array of arrays of token ids",
            path.display()
        )
    })?;
    if seqs.is_empty() {
        bail!("--tokens {}: no sequences", path.display());
    }
    seqs.into_iter()
        .enumerate()
        .map(|(i, s)| {
            if s.len() < 2 {
                bail!(
                    "--tokens {}: sequence {i} has {} tokens; at least 2 are needed for a next-token loss",
                    path.display(),
                    s.len()
                );
            }
            s.into_iter()
                .map(|t| {
                    if t < 0 || t as usize >= vocab_size {
                        bail!(
                            "--tokens {}: sequence {i} holds token id {t}, outside the vocabulary of {vocab_size}",
                            path.display()
                        );
                    }
                    Ok(t as u32)
                })
                .collect()
        })
        .collect()
}
