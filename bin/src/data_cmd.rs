//! `cpl data prepare`: tokenize a corpus once and cache it as a `--tokens` file.

use std::path::PathBuf;

use anyhow::{Context, Result};
use models::llama::LlamaConfig;
use models::tokenizer::Tokenizer;

#[derive(clap::Subcommand, Debug)]
pub enum DataCommand {
    /// Tokenize a corpus once into a `--tokens` file for `cpl train` and `cpl eval`.
    ///
    /// Reads text, jsonl or Parquet files (in parallel) and writes a JSON array of token-id
    /// arrays, one per document with EOS appended (when the tokenizer has one):
    /// `cpl train --tokens OUT` then trains exactly as `cpl train --data FILES`, without
    /// tokenizing again.
    Prepare(PrepareArgs),
}

#[derive(clap::Args, Debug)]
pub struct PrepareArgs {
    /// Model directory or Hugging Face Hub id whose tokenizer to use.
    #[arg(long)]
    pub model: String,
    /// Text: .txt, .jsonl or .parquet files, or directories of them.
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// The text field of .jsonl records and the text column of .parquet files.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Output file (JSON), written atomically.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(cmd: &DataCommand) -> Result<()> {
    let DataCommand::Prepare(a) = cmd;
    let files = models::hub::resolve(&a.model)?;
    let cfg = LlamaConfig::from_file(&files.config)?;
    let tok = Tokenizer::from_model(&files)?;
    let docs = train::data::read_corpus(&a.data, &a.text_field, "--data")?;
    let seqs = train::data::tokenize_documents(&tok, &docs)?;
    // The same checks `cpl train` applies to the ids.
    train::data::TokenStream::from_sequences(&seqs, cfg.vocab_size)?;
    let json = serde_json::to_vec(&seqs)?;
    let tmp = a.out.with_extension("json.tmp");
    std::fs::write(&tmp, &json)
        .and_then(|()| std::fs::rename(&tmp, &a.out))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
        .with_context(|| format!("--out {}: cannot write", a.out.display()))?;
    let tokens: usize = seqs.iter().map(|s| s.len()).sum();
    eprintln!(
        "{} documents, {tokens} tokens -> {}",
        seqs.len(),
        a.out.display()
    );
    Ok(())
}
