//! `cpl eval`, `cpl generate` and `cpl inspect` end to end on the tiny LLaMA fixtures of
//! `tests/fixtures/llama` (made by `scripts/make_llama_fixtures.py` with transformers).
//!
//! What is asserted: eval's loss equals the loss computed from transformers' reference logits
//! (1e-5 relative) and is the same under parallel layouts (1e-5 relative); the dumped logits
//! equal transformers' (1e-4); a model found through a Hub cache directory (HF_HOME, offline)
//! gives the same loss; generation is deterministic and the same under tensor parallelism; bad
//! input fails with exit code 1 and a message naming the file, tensor or flag, never a panic.

use std::path::{Path, PathBuf};

mod common;
use common::{
    assert_clear_errors, copy_dir, cpl, cpl_env, next_token_loss, stderr, stdout, tmpdir, words,
};

use candle_core::{DType, Device, Tensor};

fn fixtures() -> PathBuf {
    common::fixtures("llama")
}

/// The fixture's input ids as a `--tokens` file.
fn tokens_file(dir: &Path) -> (PathBuf, Vec<Vec<i64>>) {
    let t =
        candle_core::safetensors::load(fixtures().join("mha/reference.safetensors"), &Device::Cpu)
            .unwrap();
    let ids = t["input_ids"]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    let path = dir.join("tokens.json");
    std::fs::write(&path, serde_json::to_string(&ids).unwrap()).unwrap();
    (path, ids)
}

/// Mean next-token cross-entropy of transformers' reference logits on the input ids.
fn reference_loss(ids: &[Vec<i64>]) -> f64 {
    let t =
        candle_core::safetensors::load(fixtures().join("mha/reference.safetensors"), &Device::Cpu)
            .unwrap();
    next_token_loss(&t["logits"], ids)
}

fn eval_json(args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut a = vec!["eval"];
    a.extend_from_slice(args);
    a.push("--json");
    let o = cpl_env(&a, env);
    assert!(o.status.success(), "{a:?}: {}", stderr(&o));
    serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{a:?}: {e}: {}", stdout(&o)))
}

/// A text whose last window no layout can split as it is (its length is odd) is padded, not
/// cut: every layout scores the same tokens with the same loss (1e-5 relative) as one rank.
#[test]
fn eval_of_a_text_scores_the_same_tokens_under_every_layout() {
    let dir = tmpdir("eval-text");
    let text = dir.join("text.jsonl");
    let doc = "To be, or not to be, that is the question: whether 'tis nobler in the mind to \
               suffer the slings and arrows of outrageous fortune, or to take arms against a sea \
               of troubles, and by opposing end them.";
    let lines: Vec<String> = (0..3)
        .map(|i| serde_json::json!({ "text": format!("{i} {doc}") }).to_string())
        .collect();
    std::fs::write(&text, lines.join("\n")).unwrap();
    let model = common::default_model();
    let (m, t) = (model.to_str().unwrap(), text.to_str().unwrap());
    let base = [
        "--model",
        m,
        "--data",
        t,
        "--seq-len",
        "64",
        "--dtype",
        "f32",
    ];
    let single = eval_json(&base, &[]);
    let tokens = single["tokens"].as_u64().unwrap();
    let loss = single["loss"].as_f64().unwrap();
    // The text's last window is not a multiple of 8 tokens (zigzag ring 4): it is padded.
    let windows = single["sequences"].as_u64().unwrap();
    assert_ne!(
        (tokens + windows) % 64 % 8,
        0,
        "{single}: the test needs a ragged last window"
    );
    for layout in [
        vec!["--ranks", "4", "--ring", "4"],
        vec!["--ranks", "4", "--ulysses", "2", "--ring", "2"],
        vec!["--ranks", "2", "--ring", "2", "--ring-layout", "contiguous"],
    ] {
        let mut a = base.to_vec();
        a.extend_from_slice(&layout);
        let got = eval_json(&a, &[]);
        assert_eq!(got["tokens"].as_u64(), Some(tokens), "{layout:?}: {got}");
        let l = got["loss"].as_f64().unwrap();
        assert!(
            (l - loss).abs() / loss <= 1e-5,
            "{layout:?}: loss {l} vs one rank {loss}"
        );
    }
    // The padded last window's logits are cut back to its real tokens: those of one rank.
    let logits = |extra: &[&str], name: &str| {
        let out = dir.join(name);
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        a.extend(["--logits-out", out.to_str().unwrap()]);
        eval_json(&a, &[]);
        let mut t = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
        t.remove(&format!("logits.{}", windows - 1)).unwrap()
    };
    let one = logits(&[], "one.safetensors");
    let ring = logits(&["--ranks", "4", "--ring", "4"], "ring.safetensors");
    assert_eq!(one.dim(0).unwrap() as u64, (tokens + windows) % 64);
    testkit::assert_close(&ring, &one, 1e-5, "ring4: the last window's logits");
}

#[test]
fn eval_matches_transformers_and_every_layout() {
    let dir = tmpdir("eval");
    let (tokens, ids) = tokens_file(&dir);
    let model = fixtures().join("mha");
    let (m, t) = (model.to_str().unwrap(), tokens.to_str().unwrap());
    let want = reference_loss(&ids);
    let single = eval_json(&["--model", m, "--tokens", t], &[]);
    let loss = single["loss"].as_f64().unwrap();
    assert!(
        (loss - want).abs() / want <= 1e-5,
        "loss {loss} vs transformers {want}"
    );
    assert_eq!(single["tokens"].as_u64(), Some(2 * 31));
    assert!((single["perplexity"].as_f64().unwrap() - loss.exp()).abs() <= 1e-9 * loss.exp());
    for layout in [
        vec!["--ranks", "2", "--tp", "2"],
        vec!["--ranks", "4", "--ring", "4"],
        vec!["--ranks", "4", "--ulysses", "2", "--ring", "2"],
        vec!["--ranks", "4", "--ring", "4", "--cp-impl", "allgather"],
        vec![
            "--ranks",
            "4",
            "--ring",
            "4",
            "--cp-impl",
            "double-ring",
            "--inner-ring",
            "2",
        ],
        vec![
            "--ranks",
            "4",
            "--tp",
            "2",
            "--ring",
            "2",
            "--ring-layout",
            "contiguous",
        ],
        vec!["--ranks", "2", "--dp", "2"],
    ] {
        let mut a = vec!["--model", m, "--tokens", t];
        a.extend_from_slice(&layout);
        let got = eval_json(&a, &[])["loss"].as_f64().unwrap();
        assert!(
            (got - loss).abs() / loss <= 1e-5,
            "{layout:?}: loss {got} vs single rank {loss}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_writes_transformers_logits() {
    let dir = tmpdir("logits");
    let (tokens, _) = tokens_file(&dir);
    let out = dir.join("logits.safetensors");
    let model = fixtures().join("mha");
    eval_json(
        &[
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
            "--ranks",
            "2",
            "--ring",
            "2",
            "--logits-out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    let got = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    let reference =
        candle_core::safetensors::load(fixtures().join("mha/reference.safetensors"), &Device::Cpu)
            .unwrap();
    let want = &reference["logits"];
    for b in 0..2 {
        let g = &got[&format!("logits.{b}")];
        let w = want.get(b).unwrap();
        testkit::assert_close(
            g,
            &w,
            1e-5,
            &format!("sequence {b}: logits vs transformers"),
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_text_and_jsonl() {
    let dir = tmpdir("text");
    let model = fixtures().join("mha");
    let m = model.to_str().unwrap();
    let txt = dir.join("a.txt");
    // 27 repeats tokenize (with the EOS that ends the document) to 11 windows of exactly 64
    // tokens, which every layout below can split: each layout then scores the same tokens.
    std::fs::write(
        &txt,
        "The quick brown fox jumps over the lazy dog. ".repeat(27),
    )
    .unwrap();
    let t = txt.to_str().unwrap();
    let r = eval_json(&["--model", m, "--data", t, "--seq-len", "64"], &[]);
    let (loss, tokens) = (r["loss"].as_f64().unwrap(), r["tokens"].as_u64().unwrap());
    assert_eq!(
        (tokens, r["sequences"].as_u64()),
        (11 * 63, Some(11)),
        "the text no longer fills whole windows (tokenizer changed?)"
    );
    for layout in [
        vec!["--ranks", "2", "--ring", "2"],
        vec!["--ranks", "4", "--ulysses", "2", "--ring", "2"],
        vec!["--ranks", "2", "--tp", "2"],
    ] {
        let mut a = vec!["--model", m, "--data", t, "--seq-len", "64"];
        a.extend_from_slice(&layout);
        let par = eval_json(&a, &[]);
        assert_eq!(par["tokens"].as_u64(), Some(tokens), "{layout:?}");
        let got = par["loss"].as_f64().unwrap();
        testkit::assert_close_scalar(got, loss, 1e-5, &format!("{layout:?}: loss vs one rank"));
    }
    let jsonl = dir.join("a.jsonl");
    std::fs::write(
        &jsonl,
        "{\"text\": \"hello world, hello again\"}\n{\"text\": \"a second document\"}\n",
    )
    .unwrap();
    let r = eval_json(
        &[
            "--model",
            m,
            "--data",
            jsonl.to_str().unwrap(),
            "--seq-len",
            "8",
        ],
        &[],
    );
    assert!(r["tokens"].as_u64().unwrap() > 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Lays out `src`'s files as `huggingface_hub` stores a repository in a cache: the file
/// contents in `blobs/<hash>`, and `snapshots/<commit>/<name>` a relative symlink to its blob;
/// `refs/main` names the commit.
fn hub_repo(cache: &Path, id: &str, commit: &str, src: &Path) {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let (blobs, snap) = (repo.join("blobs"), repo.join("snapshots").join(commit));
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for (i, e) in std::fs::read_dir(src).unwrap().enumerate() {
        let e = e.unwrap();
        // Blob names are content hashes; any unique name shows the indirection.
        let blob = format!("{:040x}", 0xb10b_0000 + i);
        std::fs::copy(e.path(), blobs.join(&blob)).unwrap();
        std::os::unix::fs::symlink(
            Path::new("../../blobs").join(&blob),
            snap.join(e.file_name()),
        )
        .unwrap();
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
}

/// A Hub id resolves through the cache as `huggingface_hub` lays it out (blobs and symlinked
/// snapshots), offline; `HF_HUB_CACHE` takes precedence over `HF_HOME` (whose cache holds
/// another model under the same id); a missing model names the id and offline mode.
#[test]
fn models_load_from_a_hub_cache() {
    let home = tmpdir("hub");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let id = "tiny-org/tiny-llama";
    // The model under $HF_HUB_CACHE, and a decoy (another fixture) under $HF_HOME/hub.
    let cache = home.join("elsewhere");
    hub_repo(&cache, id, commit, &fixtures().join("mha"));
    hub_repo(&home.join("hub"), id, commit, &fixtures().join("tied"));
    let snapshot_config = cache
        .join("models--tiny-org--tiny-llama/snapshots")
        .join(commit)
        .join("config.json");
    assert!(std::fs::symlink_metadata(&snapshot_config)
        .unwrap()
        .file_type()
        .is_symlink());
    let (tokens, _) = tokens_file(&home);
    let t = tokens.to_str().unwrap();
    let local = |fixture: &str| {
        eval_json(
            &[
                "--model",
                fixtures().join(fixture).to_str().unwrap(),
                "--tokens",
                t,
            ],
            &[],
        )
    };
    let (home_s, cache_s) = (home.to_str().unwrap(), cache.to_str().unwrap());
    let offline = ("HF_HUB_OFFLINE", "1");
    let both = [("HF_HOME", home_s), ("HF_HUB_CACHE", cache_s), offline];
    let hub = eval_json(&["--model", id, "--tokens", t], &both);
    assert_eq!(
        hub["loss"],
        local("mha")["loss"],
        "HF_HUB_CACHE must win over HF_HOME"
    );
    let pinned = format!("{id}@{commit}");
    let hub = eval_json(&["--model", &pinned, "--tokens", t], &both);
    assert_eq!(
        hub["loss"],
        local("mha")["loss"],
        "a revision naming the commit"
    );
    let home_only = [("HF_HOME", home_s), offline];
    let hub = eval_json(&["--model", id, "--tokens", t], &home_only);
    assert_eq!(
        hub["loss"],
        local("tied")["loss"],
        "$HF_HOME/hub without HF_HUB_CACHE"
    );
    let o = cpl_env(&["inspect", "--model", "tiny-org/missing"], &both);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("tiny-org/missing") && stderr(&o).contains("HF_HUB_OFFLINE"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&home).unwrap();
}

/// The number of parameters a LLaMA `config.json` implies, written out from its fields:
/// embeddings `V·H`; per layer q `Hq·hd·H`, k and v `Hkv·hd·H` each, o `H·Hq·hd`, gate and up
/// `I·H` each, down `H·I`, two RMSNorm weights `H` each; the final norm `H`; the LM head `V·H`
/// unless tied to the embeddings.
fn llama_parameters_from_config(cfg: &serde_json::Value) -> usize {
    let get = |k: &str| cfg[k].as_u64().unwrap_or_else(|| panic!("config: {k}")) as usize;
    let (h, i, l, v) = (
        get("hidden_size"),
        get("intermediate_size"),
        get("num_hidden_layers"),
        get("vocab_size"),
    );
    let (hq, hkv, hd) = (
        get("num_attention_heads"),
        get("num_key_value_heads"),
        get("head_dim"),
    );
    let attn = hq * hd * h + 2 * hkv * hd * h + h * hq * hd;
    let mlp = 3 * i * h;
    let tied = cfg["tie_word_embeddings"].as_bool().unwrap();
    v * h + l * (attn + mlp + 2 * h) + h + if tied { 0 } else { v * h }
}

/// `(tensors, elements)` of one safetensors file, read with candle.
fn safetensors_counts(path: &Path) -> (usize, usize) {
    let t = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    for (name, x) in &t {
        assert_eq!(x.dtype(), DType::F32, "{name}: the fixtures are f32");
    }
    (t.len(), t.values().map(|x| x.elem_count()).sum())
}

/// The line of `out` that starts with `prefix` (exactly one).
fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
    let hits: Vec<&str> = out.lines().filter(|l| l.starts_with(prefix)).collect();
    assert_eq!(
        hits.len(),
        1,
        "one line starting with {prefix:?} in:\n{out}"
    );
    hits[0]
}

/// `cpl inspect --model DIR`'s standard output (the run must succeed).
fn inspect(dir: &Path) -> String {
    let o = cpl(&["inspect", "--model", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
}

/// inspect's lines for a checkpoint of `n` f32 parameters (`implied` by its config) and for one
/// of its files holding `tensors` tensors of `elems` elements.
fn parameters_line(n: usize, implied: usize) -> String {
    format!(
        "parameters   {n} in the checkpoint ({:.2} M; the config implies {implied})",
        n as f64 / 1e6
    )
}

fn file_line(path: &Path, tensors: usize, elems: usize) -> String {
    format!(
        "  {}: {tensors} tensors, {:.2} MB",
        path.display(),
        (elems * 4) as f64 / 1e6
    )
}

/// `cpl inspect` on the single-file mha fixture reports the architecture named by config.json,
/// the exact parameter count (checked against the config's shapes and the safetensors file's),
/// the dtype, and the file with its tensor count and size; on the sharded fixture, every shard.
#[test]
fn inspect_reports_the_model() {
    let dir = fixtures().join("mha");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let from_config = llama_parameters_from_config(&cfg);
    let weights = dir.join("model.safetensors");
    let (tensors, from_file) = safetensors_counts(&weights);
    // hidden 32, intermediate 64, 2 layers, 4 heads / 4 kv heads of 8, vocab 256, untied:
    // 256·32 + 2·(4·32·32 + 3·64·32 + 2·32) + 32 + 256·32 = 37024, in 1 + 2·9 + 1 + 1 tensors.
    assert_eq!(from_config, 37024);
    assert_eq!(
        from_file, from_config,
        "the fixture's file and its config agree"
    );
    assert_eq!(tensors, 21);

    let out = inspect(&dir);
    let arch = cfg["architectures"][0].as_str().unwrap();
    assert_eq!(arch, "LlamaForCausalLM");
    assert!(
        line(&out, "architecture ").starts_with(&format!(
            "architecture {arch}: 2 layers, hidden 32, intermediate 64, 4 heads / 4 kv heads, \
             head_dim 8, vocab 256"
        )),
        "{out}"
    );
    assert_eq!(
        line(&out, "parameters "),
        parameters_line(from_file, from_config),
        "{out}"
    );
    assert_eq!(
        line(&out, "dtypes "),
        format!("dtypes       F32: {from_file}")
    );
    assert_eq!(line(&out, "shards "), "shards       1 file(s)");
    assert_eq!(
        line(&out, &format!("  {}", weights.display())),
        file_line(&weights, tensors, from_file)
    );

    // The architecture comes from config.json: without the field, inspect does not claim one.
    let no_arch = tmpdir("inspect-no-arch");
    copy_dir(&dir, &no_arch);
    let mut cfg2 = cfg.clone();
    cfg2.as_object_mut().unwrap().remove("architectures");
    std::fs::write(
        no_arch.join("config.json"),
        serde_json::to_string_pretty(&cfg2).unwrap(),
    )
    .unwrap();
    let out = inspect(&no_arch);
    let a = line(&out, "architecture ");
    assert!(
        !a.contains("LlamaForCausalLM") && a.contains("none in config.json"),
        "{out}"
    );
    std::fs::remove_dir_all(&no_arch).unwrap();

    // The sharded fixture: the same parameters over three files listed by the index.
    let dir = fixtures().join("sharded");
    let out = inspect(&dir);
    assert!(
        line(&out, "architecture ").starts_with("architecture LlamaForCausalLM: "),
        "{out}"
    );
    assert_eq!(
        line(&out, "shards "),
        "shards       3 file(s) with model.safetensors.index.json"
    );
    let mut total = 0;
    for k in 1..=3 {
        let f = dir.join(format!("model-0000{k}-of-00003.safetensors"));
        let (tensors, elems) = safetensors_counts(&f);
        total += elems;
        let want = file_line(&f, tensors, elems);
        assert!(out.lines().any(|l| l == want), "{want:?} in:\n{out}");
    }
    assert_eq!(total, from_config);
    assert_eq!(line(&out, "parameters "), parameters_line(total, total));
    assert_eq!(line(&out, "dtypes "), format!("dtypes       F32: {total}"));
}

#[test]
fn generate_is_deterministic_and_the_same_under_tp_and_pp() {
    let m = fixtures().join("mha");
    let args = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "Hello world",
            "--max-new-tokens",
            "12",
        ];
        a.extend_from_slice(extra);
        let o = cpl(&a);
        assert!(o.status.success(), "{a:?}: {}", stderr(&o));
        stdout(&o)
    };
    let one = args(&["--temperature", "0"]);
    assert!(one.starts_with("Hello world"), "{one}");
    assert_eq!(one, args(&["--temperature", "0"]));
    assert_eq!(
        one,
        args(&["--temperature", "0", "--ranks", "2", "--tp", "2"])
    );
    // Pipeline stages: hidden states forward through the stages, the last stage's logits
    // broadcast back; the greedy text is the one of one rank.
    assert_eq!(
        one,
        args(&["--temperature", "0", "--ranks", "2", "--pp", "2"])
    );
    assert_eq!(
        one,
        args(&[
            "--temperature",
            "0",
            "--ranks",
            "4",
            "--pp",
            "2",
            "--tp",
            "2"
        ])
    );
    let sampled = args(&["--temperature", "1.0", "--top-p", "0.9", "--seed", "7"]);
    assert_eq!(
        sampled,
        args(&["--temperature", "1.0", "--top-p", "0.9", "--seed", "7"])
    );
}

/// A copy of the mha fixture whose checkpoint is rewritten by `edit`.
fn broken_model(
    tag: &str,
    edit: impl FnOnce(&mut std::collections::HashMap<String, Tensor>),
) -> PathBuf {
    let dir = tmpdir(tag);
    copy_dir(&fixtures().join("mha"), &dir);
    let path = dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    edit(&mut t);
    candle_core::safetensors::save(&t, &path).unwrap();
    dir
}

#[test]
fn bad_input_fails_with_a_clear_error() {
    let base = tmpdir("bad");
    let (tokens, _) = tokens_file(&base);
    let t = tokens.to_str().unwrap().to_string();
    let good = fixtures().join("mha").to_str().unwrap().to_string();

    let no_config = base.join("no-config");
    copy_dir(&fixtures().join("mha"), &no_config);
    std::fs::remove_file(no_config.join("config.json")).unwrap();

    let bad_json = base.join("bad-json");
    copy_dir(&fixtures().join("mha"), &bad_json);
    std::fs::write(bad_json.join("config.json"), "{ \"hidden_size\": 64, ").unwrap();

    let bad_arch = base.join("bad-arch");
    copy_dir(&fixtures().join("mha"), &bad_arch);
    let cfg = std::fs::read_to_string(bad_arch.join("config.json")).unwrap();
    std::fs::write(
        bad_arch.join("config.json"),
        cfg.replace("LlamaForCausalLM", "GPT2LMHeadModel"),
    )
    .unwrap();

    let missing = broken_model("missing-tensor", |t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
    });
    let wrong_shape = broken_model("wrong-shape", |t| {
        let w = t["model.layers.0.self_attn.q_proj.weight"]
            .narrow(0, 0, 8)
            .unwrap();
        t.insert("model.layers.0.self_attn.q_proj.weight".into(), w);
    });
    let empty = base.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let bad_tokens = base.join("bad-tokens.json");
    std::fs::write(&bad_tokens, "[[1, 2, 99999]]").unwrap();
    let not_json = base.join("not.json");
    std::fs::write(&not_json, "hello").unwrap();

    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            words(&format!(
                "eval --model {} --tokens {t}",
                no_config.display()
            )),
            "config.json",
        ),
        (
            words(&format!("eval --model {} --tokens {t}", bad_json.display())),
            "config.json",
        ),
        (
            words(&format!("inspect --model {}", bad_arch.display())),
            "GPT2LMHeadModel",
        ),
        (
            words(&format!("eval --model {} --tokens {t}", missing.display())),
            "model.layers.1.mlp.up_proj.weight",
        ),
        (
            words(&format!(
                "eval --model {} --tokens {t}",
                wrong_shape.display()
            )),
            "model.layers.0.self_attn.q_proj.weight",
        ),
        (
            words(&format!(
                "eval --model {good} --tokens {t} --ranks 3 --tp 3"
            )),
            "--tp 3",
        ),
        (
            words(&format!(
                "eval --model {good} --tokens {t} --ranks 8 --ulysses 8"
            )),
            "--ulysses 8",
        ),
        (
            words(&format!("eval --model {good} --data {}", empty.display())),
            "--data",
        ),
        (
            words(&format!(
                "eval --model {good} --tokens {}",
                bad_tokens.display()
            )),
            "99999",
        ),
        (
            words(&format!(
                "eval --model {good} --tokens {}",
                not_json.display()
            )),
            "--tokens",
        ),
        (
            words(&format!(
                "eval --model {good} --tokens {t} --ranks 4 --ring 4 --cp-impl startrail --team 3"
            )),
            "team",
        ),
        (
            words(&format!(
                "eval --model {} --tokens {t}",
                base.join("nowhere").display()
            )),
            "nowhere",
        ),
        (
            words(&format!("eval --model {good} --tokens {t} --dtype f8")),
            "--dtype",
        ),
        (
            words(&format!(
                "eval --model {good} --tokens {t} --ranks 2 --ep 2"
            )),
            "--ep 2: ",
        ),
        (
            words(&format!(
                "generate --model {good} --prompt hi --max-new-tokens 2 --ranks 2 --ep 2"
            )),
            "is not a mixture of experts",
        ),
    ];
    assert_clear_errors(&cases);
    for d in [base, missing, wrong_shape] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
