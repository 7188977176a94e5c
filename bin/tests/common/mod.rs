//! What the `cpl` end-to-end tests share: running the binary, reading its output, scratch
//! directories and the clear-error check.
#![allow(dead_code)] // each test binary uses its own subset

pub mod resume;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Command, Output};

/// The test fixtures folder of the workspace, joined with `rel`.
pub fn fixtures(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

/// A copy of a tiny mixture-of-experts fixture (`moe/<family>`: `qwen3_moe`, `qwen2_moe`,
/// `mixtral`; 8 experts, top-2) in `dir/<family>` with the chat fixtures' tokenizer (256 ids, as
/// the model's vocabulary), so that chat data and passkey prompts can be rendered for it.
pub fn moe_with_tokenizer(dir: &std::path::Path, family: &str) -> PathBuf {
    let m = dir.join(family);
    std::fs::create_dir_all(&m).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures(&format!("moe/{family}")).join(f), m.join(f)).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures("chat/tokenizer").join(f), m.join(f)).unwrap();
    }
    m
}

/// The bundled default model (`assets/default/model`: a 1 M-parameter LLaMA with its tokenizer).
pub fn default_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/default/model")
}

/// Runs `cpl args` with the extra environment `env` and waits for it.
pub fn cpl_env<S: AsRef<OsStr>>(args: &[S], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cpl"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the cpl binary runs")
}

/// Runs `cpl args` and waits for it.
pub fn cpl<S: AsRef<OsStr>>(args: &[S]) -> Output {
    cpl_env(args, &[])
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Copies the files of `src` (a model fixture: flat) into `dst`, created if missing.
pub fn copy_dir(src: &std::path::Path, dst: &std::path::Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

/// A fresh, empty scratch directory unique to this test process and `tag`.
pub fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cpl-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every `(args, needle)` fails with exit code 1 and a message containing `needle`, no panic.
#[track_caller]
pub fn assert_clear_errors<S: AsRef<OsStr> + std::fmt::Debug>(cases: &[(Vec<S>, &str)]) {
    for (args, needle) in cases {
        let o = cpl(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: expected {needle:?} in {err:?}"
        );
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

/// The whitespace-separated words of `line`, as command-line arguments (paths in the tests'
/// temporary directories have no spaces).
pub fn words(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_string).collect()
}

/// Mean next-token cross-entropy (f64) of `logits` `(batch, seq, vocab)` on the ids `ids`
/// (every position but the last scored against the next id): a reference's loss from its
/// logits.
pub fn next_token_loss(logits: &candle_core::Tensor, ids: &[Vec<i64>]) -> f64 {
    use candle_core::{DType, D};
    let logits = logits.to_dtype(DType::F64).unwrap();
    let m = logits.max_keepdim(D::Minus1).unwrap();
    let lse = (logits
        .broadcast_sub(&m)
        .unwrap()
        .exp()
        .unwrap()
        .sum_keepdim(D::Minus1)
        .unwrap()
        .log()
        .unwrap()
        + m)
        .unwrap();
    let logp = logits
        .broadcast_sub(&lse)
        .unwrap()
        .to_vec3::<f64>()
        .unwrap();
    let (mut sum, mut n) = (0.0, 0usize);
    for (b, row) in ids.iter().enumerate() {
        for i in 0..row.len() - 1 {
            sum -= logp[b][i][row[i + 1] as usize];
            n += 1;
        }
    }
    sum / n as f64
}
