//! `cpl inspect`: a model's architecture, parameter count, dtypes, checkpoint files, and
//! whether every stored value is finite.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use models::checkpoint::CheckpointReader;

#[derive(clap::Args, Debug, Clone)]
pub struct InspectArgs {
    /// Model directory or Hugging Face Hub id: LlamaForCausalLM, Qwen2ForCausalLM (Qwen2, Qwen2.5), Qwen3ForCausalLM, MistralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, LLaVA, diffusers DiT; the family is detected from config.json.
    #[arg(long)]
    pub model: String,
}

pub fn run(args: &InspectArgs) -> Result<()> {
    let model = crate::model_arg::resolve(&args.model)?;
    match model.family.kind {
        models::Kind::Diffusion => return crate::dit_cmd::inspect(&model.dir),
        models::Kind::VisionLanguage => return crate::llava_cmd::inspect(&model.dir),
        models::Kind::CausalLm => {}
    }
    let files = models::hub::resolve(&args.model)?;
    let desc = (model.family.describe)(&files.config)?;
    let reader = CheckpointReader::open(&files.weights)?;
    println!("model        {}", files.source);
    println!("config       {}", files.config.display());
    // The architecture as config.json names it (validated by the family's loader), not assumed.
    let raw: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&files.config)
            .with_context(|| format!("reading {}", files.config.display()))?,
    )
    .with_context(|| format!("{}: not valid JSON", files.config.display()))?;
    let named: Vec<&str> = raw["architectures"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    let architecture = if named.is_empty() {
        format!(
            "(none in config.json; model_type {}, read as {})",
            raw["model_type"].as_str().unwrap_or("unset"),
            model.family.name
        )
    } else {
        named.join(", ")
    };
    println!("architecture {architecture}: {}", desc.summary);
    println!("family       {}", model.family.name);
    let mut total = 0usize;
    let mut dtypes: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_file: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for name in reader.names() {
        let meta = reader.meta(&name)?;
        let n: usize = meta.shape.iter().product();
        total += n;
        *dtypes.entry(format!("{:?}", meta.dtype)).or_default() += n;
        let e = per_file.entry(meta.file.display().to_string()).or_default();
        e.0 += 1;
        e.1 += n * meta.dtype.size_in_bytes();
    }
    println!(
        "parameters   {total} in the checkpoint ({:.2} M; the config implies {})",
        total as f64 / 1e6,
        desc.params
    );
    let dt: Vec<String> = dtypes.iter().map(|(d, n)| format!("{d}: {n}")).collect();
    println!("dtypes       {}", dt.join(", "));
    println!(
        "shards       {} file(s){}",
        per_file.len(),
        if files.index.is_some() {
            " with model.safetensors.index.json"
        } else {
            ""
        }
    );
    for (f, (count, bytes)) in per_file {
        println!("  {f}: {count} tensors, {:.2} MB", bytes as f64 / 1e6);
    }
    match &files.tokenizer {
        Some(t) => println!("tokenizer    {}", t.display()),
        None => println!("tokenizer    none"),
    }
    print_values(&reader)
}

/// The `values` line of `cpl inspect` (every family): every tensor scanned for NaN and
/// infinity. Loading refuses such a checkpoint at the first one it reads; this lists them all.
pub fn print_values(reader: &CheckpointReader) -> Result<()> {
    let mut bad = Vec::new();
    for name in reader.names() {
        let n = reader.non_finite_count(&name)?;
        if n > 0 {
            let numel: usize = reader.meta(&name)?.shape.iter().product();
            bad.push(format!("`{name}` ({n} of {numel})"));
        }
    }
    if bad.is_empty() {
        println!("values       all finite");
    } else {
        println!(
            "values       {} tensor(s) hold NaN or infinity, which loading refuses: {}",
            bad.len(),
            bad.join(", ")
        );
    }
    Ok(())
}
