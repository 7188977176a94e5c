//! `cpl data prepare`: tokenize a corpus once and cache it as a `--tokens` file; `cpl data
//! render`: show how chat data is rendered by a chat template and which tokens are trained;
//! `cpl data passkey`: passkey-retrieval prompts as a `--tokens` file.

use std::path::PathBuf;

use anyhow::{Context, Result};
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
    /// Show chat data as fine-tuning sees it: each conversation rendered by the chat template,
    /// its token ids, and which tokens are trained.
    ///
    /// Reads conversations (Alpaca, ShareGPT or OpenAI `messages` records from .jsonl, .json
    /// or .parquet). The human form prints the rendered text with the trained spans wrapped in
    /// ⟦ ⟧, then the ids and a 0/1 line of trained tokens; `--json` prints one object per
    /// line: {"source", "text", "ids", "trained"}.
    Render(RenderArgs),
    /// Write passkey-retrieval prompts as a `--tokens` file, to train a model to retrieve
    /// (`cpl train --tokens OUT --doc-mask`).
    ///
    /// The prompts of `cpl eval --passkey`'s grid (the same template, filler and question, the
    /// answer at the end), one document each, no EOS: a prompt as long as `--seq-len` fills a
    /// window exactly. Choose another `--passkey-seed` than the evaluation's so that its keys
    /// are new to the model.
    Passkey(PasskeyDataArgs),
}

#[derive(clap::Args, Debug)]
pub struct PasskeyDataArgs {
    /// Model directory or Hugging Face Hub id whose tokenizer to use.
    #[arg(long)]
    pub model: String,
    #[command(flatten)]
    pub grid: crate::args::PasskeyGridArgs,
    /// Output file (JSON), written atomically.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(clap::Args, Debug)]
pub struct RenderArgs {
    /// Model directory (only its tokenizer files are read) or Hugging Face Hub id.
    #[arg(long)]
    pub model: String,
    /// Chat data: a .jsonl, .json or .parquet file.
    #[arg(long)]
    pub data: PathBuf,
    /// Chat template: a built-in name (chatml, plain) or a .jinja file; default: the model's
    /// own (chat_template.jinja or tokenizer_config.json).
    #[arg(long)]
    pub template: Option<String>,
    /// Train on the prompt too (every token is trained).
    #[arg(long)]
    pub train_on_prompt: bool,
    /// Train only on the last assistant turn of each conversation.
    #[arg(long)]
    pub mask_history: bool,
    /// Render only the first N conversations.
    #[arg(long)]
    pub limit: Option<usize>,
    /// One JSON object per line instead of the human form.
    #[arg(long)]
    pub json: bool,
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
    match cmd {
        DataCommand::Prepare(a) => prepare(a),
        DataCommand::Render(a) => render(a),
        DataCommand::Passkey(a) => passkey(a),
    }
}

fn passkey(a: &PasskeyDataArgs) -> Result<()> {
    let files = models::hub::resolve(&a.model)?;
    let family = models::family::detect(&files.config)?;
    let desc = (family.describe)(&files.config)?;
    let prompts =
        crate::eval::passkey_prompts(&a.grid, &files, desc.vocab, None, "cpl data passkey")?;
    let seqs: Vec<&[u32]> = prompts.iter().map(|p| p.tokens.as_slice()).collect();
    write_tokens(&a.out, &seqs, "passkey prompts")
}

/// Writes `seqs` as a `--tokens` file at `out` (atomically) and says how many `what` and
/// tokens it holds.
fn write_tokens<S: AsRef<[u32]> + serde::Serialize>(
    out: &std::path::Path,
    seqs: &[S],
    what: &str,
) -> Result<()> {
    let json = serde_json::to_vec(seqs)?;
    models::checkpoint::write_atomic(out, &json)
        .with_context(|| format!("--out {}: cannot write", out.display()))?;
    let tokens: usize = seqs.iter().map(|s| s.as_ref().len()).sum();
    eprintln!(
        "{} {what}, {tokens} tokens -> {}",
        seqs.len(),
        out.display()
    );
    Ok(())
}

fn prepare(a: &PrepareArgs) -> Result<()> {
    let files = models::hub::resolve(&a.model)?;
    let family = models::family::detect(&files.config)?;
    let desc = (family.describe)(&files.config)?;
    let tok = Tokenizer::from_model(&files)?;
    let docs = train::data::read_corpus(&a.data, &a.text_field, "--data")?;
    let seqs = train::data::tokenize_documents(&tok, &docs)?;
    // The same checks `cpl train` applies to the ids.
    train::data::TokenStream::from_sequences(&seqs, desc.vocab)?;
    write_tokens(&a.out, &seqs, "documents")
}

fn render(a: &RenderArgs) -> Result<()> {
    use std::io::Write;
    use train::chat::{self, ChatTemplate, TrainOn};

    // A local directory needs only its tokenizer files; a Hub id is resolved as usual.
    let dir = std::path::Path::new(&a.model);
    let files = if dir.is_dir() {
        chat::tokenizer_files(dir)
    } else {
        models::hub::resolve(&a.model).with_context(|| format!("--model {}", a.model))?
    };
    let tok = Tokenizer::from_model(&files).with_context(|| format!("--model {}", a.model))?;
    let tpl = ChatTemplate::resolve(a.template.as_deref(), &files, &tok, "--template")
        .context("--template")?;
    let convs = chat::read_conversations(&a.data, "--data")?;
    let train_on = TrainOn {
        prompt: a.train_on_prompt,
        mask_history: a.mask_history,
    };
    let limit = a.limit.unwrap_or(usize::MAX);
    let mut out = std::io::stdout().lock();
    for conv in convs.iter().take(limit) {
        let r = chat::render_example(&tpl, &tok, conv, train_on)?;
        if a.json {
            let obj = serde_json::json!({
                "source": r.example.source,
                "text": r.text,
                "ids": r.example.ids,
                "trained": r.example.trained,
            });
            writeln!(out, "{obj}")?;
        } else {
            writeln!(
                out,
                "=== {} ({} tokens, {} trained; template {}) ===",
                r.example.source,
                r.example.ids.len(),
                r.example.num_trained(),
                tpl.name()
            )?;
            writeln!(out, "{}", marked_text(&r))?;
            writeln!(out, "ids: {:?}", r.example.ids)?;
            let bits: String = r
                .example
                .trained
                .iter()
                .map(|&t| if t { '1' } else { '0' })
                .collect();
            writeln!(out, "trained: {bits}\n")?;
        }
    }
    Ok(())
}

/// The rendered text with each run of trained tokens wrapped in ⟦ ⟧.
fn marked_text(r: &train::chat::RenderedExample) -> String {
    let mut out = String::new();
    let mut pos = 0;
    let mut run: Option<(usize, usize)> = None;
    let close = |out: &mut String, pos: &mut usize, (s, e): (usize, usize)| {
        let s = s.max(*pos);
        out.push_str(r.text.get(*pos..s).unwrap_or_default());
        out.push('⟦');
        out.push_str(r.text.get(s..e).unwrap_or_default());
        out.push('⟧');
        *pos = e.max(*pos);
    };
    for (&(s, e), &t) in r.offsets.iter().zip(&r.example.trained) {
        match (t, run) {
            (true, Some((rs, _))) => run = Some((rs, e)),
            (true, None) => run = Some((s, e)),
            (false, Some(span)) => {
                close(&mut out, &mut pos, span);
                run = None;
            }
            (false, None) => {}
        }
    }
    if let Some(span) = run {
        close(&mut out, &mut pos, span);
    }
    out.push_str(r.text.get(pos..).unwrap_or_default());
    out
}
