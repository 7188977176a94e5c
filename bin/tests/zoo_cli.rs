//! Every command on every zoo family (Qwen2 with sliding windows, Qwen3, Mistral, Phi-3, Gemma 2
//! with its soft-caps, Gemma 3 with its local and global layers) through
//! the command line, one layout per command: `inspect` names the architecture and its features
//! (the RoPE type, base and context too),
//! `eval` gives transformers' loss (1e-5) on one rank and under a ring, `generate` is the same
//! greedy text under tp2 as on one rank (prompt and reply longer than the window), `train`
//! under pp2 writes a checkpoint (Phi-3's in its fused layout) that `eval` reloads, and
//! `finetune` (LoRA SFT) under pp2 writes a PEFT adapter with PEFT's names and shapes (on
//! Phi-3's fused `qkv_proj` and `gate_up_proj`), which `eval --adapter` reads back under tp2;
//! LoRA DPO under a ring of 2 starts at ln 2 and writes the same layout.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use common::{cpl, fixtures, next_token_loss, stderr, stdout, tmpdir};

/// A copy of zoo fixture `name` with the LLaMA fixtures' tokenizer (vocab 256, as the models').
fn zoo_model(name: &str, dir: &Path) -> PathBuf {
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    let src = fixtures("zoo").join(name);
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), out.join(f)).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures("llama/tokenizer").join(f), out.join(f)).unwrap();
    }
    out
}

/// The fixture's input ids as a `--tokens` file, and transformers' mean next-token loss on them
/// (every position counted) from its reference logits.
fn tokens_and_loss(name: &str, dir: &Path) -> (PathBuf, f64) {
    let t = candle_core::safetensors::load(
        fixtures("zoo").join(name).join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let ids = t["input_ids"]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    let path = dir.join(format!("{name}-tokens.json"));
    std::fs::write(&path, serde_json::to_string(&ids).unwrap()).unwrap();
    (path, next_token_loss(&t["logits"], &ids))
}

fn run_ok(args: &[&str]) -> String {
    let o = cpl(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
}

fn eval_loss(model: &Path, tokens: &Path, layout: &[&str]) -> f64 {
    let mut a = vec![
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        tokens.to_str().unwrap(),
        "--json",
    ];
    a.extend_from_slice(layout);
    let out = run_ok(&a);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["loss"].as_f64().unwrap()
}

/// `cpl finetune` of `model` (LoRA, the plain template, 2 steps of 8 examples of 64 tokens, no
/// warm-up) into `out`, with `extra` flags.
fn finetune(model: &str, out: &Path, extra: &[&str]) {
    let mut a = vec![
        "finetune",
        "--model",
        model,
        "--template",
        "plain",
        "--seq-len",
        "64",
        "--steps",
        "2",
        "--max-examples",
        "8",
        "--warmup",
        "0",
        "--out",
        out.to_str().unwrap(),
    ];
    a.extend_from_slice(extra);
    run_ok(&a);
}

fn generate(model: &Path, layout: &[&str]) -> String {
    let mut a = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Hello world! The miller",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    ];
    a.extend_from_slice(layout);
    run_ok(&a)
}

#[test]
fn every_command_runs_every_zoo_family() {
    let dir = tmpdir("zoo-cli");
    for (name, arch, feature) in [
        ("qwen2", "Qwen2ForCausalLM", "q/k/v biases"),
        ("qwen3", "Qwen3ForCausalLM", "q/k norms"),
        (
            "mistral",
            "MistralForCausalLM",
            "sliding window 8 on 2 of 2 layers",
        ),
        ("phi3", "Phi3ForCausalLM", "fused qkv / gate-up projections"),
        (
            "gemma2",
            "Gemma2ForCausalLM",
            "attention logit soft-cap, final logit soft-cap",
        ),
        (
            "gemma3",
            "Gemma3ForCausalLM",
            "sliding window 8 on 2 of 3 layers, RoPE linear θ 1000000, factor 2 on global \
             layers, default θ 10000 on windowed layers",
        ),
    ] {
        let model = zoo_model(name, &dir);
        let m = model.to_str().unwrap();

        let out = run_ok(&["inspect", "--model", m]);
        let line = out
            .lines()
            .find(|l| l.starts_with("architecture "))
            .unwrap_or_else(|| panic!("{name}: {out}"));
        assert!(line.starts_with(&format!("architecture {arch}: ")), "{out}");
        assert!(line.contains(feature), "{name}: {feature} in {line}");
        assert!(
            out.lines().any(|l| l == format!("family       {name}")),
            "{out}"
        );

        let (tokens, want) = tokens_and_loss(name, &dir);
        let one = eval_loss(&model, &tokens, &[]);
        assert!(
            (one - want).abs() / want <= 1e-5,
            "{name}: eval {one} vs transformers {want}"
        );
        let ring = eval_loss(&model, &tokens, &["--ranks", "2", "--ring", "2"]);
        assert!(
            (ring - one).abs() / one <= 1e-5,
            "{name}: ring2 {ring} vs {one}"
        );

        let text = generate(&model, &[]);
        assert!(
            text.starts_with("Hello world! The miller"),
            "{name}: {text}"
        );
        assert_eq!(
            text,
            generate(&model, &["--ranks", "2", "--tp", "2"]),
            "{name}: tp2"
        );

        let out = dir.join(format!("{name}-train"));
        run_ok(&[
            "train",
            "--model",
            m,
            "--tokens",
            tokens.to_str().unwrap(),
            "--seq-len",
            "16",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--save-every",
            "2",
            "--ranks",
            "2",
            "--pp",
            "2",
            "--out",
            out.to_str().unwrap(),
        ]);
        let saved = out.join("step-2");
        let family = models::family::detect(&saved.join("config.json")).unwrap();
        assert_eq!(family.name, name, "the checkpoint keeps its family");
        let after = eval_loss(&saved, &tokens, &[]);
        assert!(
            after.is_finite() && after != one,
            "{name}: trained eval {after} vs {one}"
        );

        let ft = dir.join(format!("{name}-lora"));
        finetune(m, &ft, &["--ranks", "2", "--pp", "2"]);
        let adapter: serde_json::Value =
            serde_json::from_slice(&std::fs::read(ft.join("step-2/adapter_config.json")).unwrap())
                .unwrap();
        assert_eq!(adapter["peft_type"], "LORA", "{name}: {adapter}");
        let step = ft.join("step-2");
        assert_peft_layout(&step, &model, 8);
        let tuned = |layout: &[&str]| -> String {
            let mut a = vec![
                "eval",
                "--model",
                m,
                "--adapter",
                step.to_str().unwrap(),
                "--tokens",
                tokens.to_str().unwrap(),
                "--json",
            ];
            a.extend_from_slice(layout);
            run_ok(&a)
        };
        let v: serde_json::Value = serde_json::from_str(tuned(&[]).trim()).unwrap();
        let w: serde_json::Value =
            serde_json::from_str(tuned(&["--ranks", "2", "--tp", "2"]).trim()).unwrap();
        let (a, b) = (v["loss"].as_f64().unwrap(), w["loss"].as_f64().unwrap());
        assert!(
            (a - b).abs() / a <= 1e-5 && a != one,
            "{name}: adapter eval {a} (tp2 {b}, base {one})"
        );

        // LoRA DPO under a ring of 2: the first step's loss is ln 2 (the policy is its
        // reference, the base with the adapters off), the second has moved.
        let dpo = dir.join(format!("{name}-dpo"));
        let pairs =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/chat/dialogue-dpo.jsonl");
        let pairs = pairs.to_str().unwrap();
        finetune(
            m,
            &dpo,
            &[
                "--stage",
                "dpo",
                "--data",
                pairs,
                "--lr",
                "1e-2",
                "--log-every",
                "1",
                "--ranks",
                "2",
                "--ring",
                "2",
            ],
        );
        let losses: Vec<f64> = std::fs::read_to_string(dpo.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["loss"].as_f64())
            .collect();
        assert_eq!(losses.len(), 2, "{name}: DPO losses {losses:?}");
        assert!(
            (losses[0] - std::f64::consts::LN_2).abs() <= 1e-6,
            "{name}: first DPO loss {}",
            losses[0]
        );
        assert!(
            losses[1].is_finite() && (losses[1] - losses[0]).abs() > 1e-6,
            "{name}: DPO step 2 {losses:?}"
        );
        assert_peft_layout(&dpo.join("step-2"), &model, 8);
    }
    // The RoPE of a partially rotated LongRoPE model, and of a Llama 3 one.
    for (name, rope) in [
        (
            "zoo/phi3_longrope",
            ", RoPE longrope θ 10000, long factors beyond 16 tokens, rotary 4 of 8 dims",
        ),
        (
            "llama/llama3_rope",
            ", RoPE llama3 θ 500000, factor 8 of 64 tokens",
        ),
    ] {
        let out = run_ok(&["inspect", "--model", fixtures(name).to_str().unwrap()]);
        assert!(
            out.lines()
                .any(|l| l.starts_with("architecture ") && l.ends_with(rope)),
            "{name}: {out}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The adapter in `dir` has exactly PEFT's tensors for rank `r` on every linear layer of
/// `model` (PEFT's modules: Phi-3's fused `qkv_proj` and `gate_up_proj`, the others' q, k, v,
/// gate and up): `base_model.model.model.layers.N.<module>.lora_A.weight` (r, in) and
/// `.lora_B.weight` (out, r).
fn assert_peft_layout(dir: &Path, model: &Path, r: usize) {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    let get = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (h, i, heads) = (
        get("hidden_size"),
        get("intermediate_size"),
        get("num_attention_heads"),
    );
    let d = cfg["head_dim"].as_u64().map_or(h / heads, |d| d as usize);
    let (q, kv) = (heads * d, get("num_key_value_heads") * d);
    let modules: Vec<(&str, usize, usize)> = if cfg["model_type"] == "phi3" {
        vec![
            ("self_attn.qkv_proj", q + 2 * kv, h),
            ("self_attn.o_proj", h, q),
            ("mlp.gate_up_proj", 2 * i, h),
            ("mlp.down_proj", h, i),
        ]
    } else {
        vec![
            ("self_attn.q_proj", q, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, q),
            ("mlp.gate_proj", i, h),
            ("mlp.up_proj", i, h),
            ("mlp.down_proj", h, i),
        ]
    };
    let mut want: Vec<(String, Vec<usize>)> = Vec::new();
    for l in 0..get("num_hidden_layers") {
        for &(m, out, inp) in &modules {
            let p = format!("base_model.model.model.layers.{l}.{m}");
            want.push((format!("{p}.lora_A.weight"), vec![r, inp]));
            want.push((format!("{p}.lora_B.weight"), vec![out, r]));
        }
    }
    want.sort();
    let t = candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)
        .unwrap();
    let mut got: Vec<(String, Vec<usize>)> = t
        .iter()
        .map(|(n, v)| (n.clone(), v.dims().to_vec()))
        .collect();
    got.sort();
    assert_eq!(got, want, "{}", dir.display());
}

/// `metrics.jsonl` counts each step's attention work (`attention_scores`, the busiest rank's
/// query-key scores): Mistral's window of 8 at 1024 tokens under ring 2 costs less than a third
/// of the same model without a window (the kernels round each row's columns up to 32-key
/// panels, so a window of 8 costs about 40 columns a row against 512 on average), and both are
/// positive.
#[test]
fn metrics_count_the_attention_work_a_window_saves() {
    let dir = tmpdir("zoo-work");
    let windowed = zoo_model("mistral", &dir);
    let global = dir.join("global");
    std::fs::create_dir_all(&global).unwrap();
    for e in std::fs::read_dir(&windowed).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), global.join(e.file_name())).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(global.join("config.json")).unwrap()).unwrap();
    cfg["sliding_window"] = serde_json::Value::Null;
    std::fs::write(global.join("config.json"), cfg.to_string()).unwrap();
    let docs = testkit::random_docs(5, 24, 200..300, 256);
    let tokens = dir.join("docs.json");
    std::fs::write(&tokens, serde_json::to_string(&docs).unwrap()).unwrap();
    let scores = |model: &Path, tag: &str| -> u64 {
        let out = dir.join(tag);
        run_ok(&[
            "train",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
            "--seq-len",
            "1024",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--ranks",
            "2",
            "--ring",
            "2",
            "--out",
            out.to_str().unwrap(),
        ]);
        let line = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let v: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
        v["attention_scores"].as_u64().unwrap()
    };
    let (w, g) = (scores(&windowed, "w"), scores(&global, "g"));
    assert!(w > 0 && g > 0, "window {w}, global {g}");
    assert!(3 * w < g, "window 8: {w} scores vs global {g}");
    std::fs::remove_dir_all(&dir).unwrap();
}
