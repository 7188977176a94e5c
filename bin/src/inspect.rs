//! `cpl inspect`: a model's architecture, parameter count, dtypes and checkpoint files.

use std::collections::BTreeMap;

use anyhow::Result;
use models::checkpoint::CheckpointReader;
use models::llama::LlamaConfig;

#[derive(clap::Args, Debug, Clone)]
pub struct InspectArgs {
    /// Model directory or Hugging Face Hub id.
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
    let cfg = LlamaConfig::from_file(&files.config)?;
    let reader = CheckpointReader::open(&files.weights)?;
    let (theta, scaling) = cfg.rope(&files.config)?;
    println!("model        {}", files.source);
    println!("config       {}", files.config.display());
    // The architecture as config.json names it (validated by `LlamaConfig`), not assumed.
    let architecture = match cfg.architectures.as_deref() {
        Some(archs) if !archs.is_empty() => archs.join(", "),
        _ => format!(
            "(none in config.json; model_type {}, read as LLaMA)",
            cfg.model_type.as_deref().unwrap_or("unset")
        ),
    };
    println!(
        "architecture {architecture}: {} layers, hidden {}, intermediate {}, {} heads / {} kv heads, head_dim {}, vocab {}",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_kv_heads(),
        cfg.head_dim(),
        cfg.vocab_size
    );
    println!(
        "             rope theta {theta}, scaling {scaling:?}, tied embeddings {}, rms_norm_eps {}",
        cfg.tie_word_embeddings, cfg.rms_norm_eps
    );
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
        cfg.num_parameters()?
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
    Ok(())
}
