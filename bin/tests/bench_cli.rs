//! `cpl bench` end to end on tiny shapes: every subcommand prints one JSON object with the
//! machine and positive, finite measurements; bad flags give a clear error and exit 1.

mod common;
use common::{assert_clear_errors, cpl, fixtures, stderr, stdout, words};
use serde_json::Value;

/// A tiny random LLaMA, and a small product for the matmul rate.
const TINY: &str =
    "--layers 1 --hidden 32 --heads 4 --intermediate 64 --vocab 96 --matmul-size 256";

/// The rates every `train` and `eval` object has.
const RATES: [&str; 6] = [
    "tokens_per_sec_best",
    "tokens_per_sec_median",
    "peak_gflops",
    "flops_per_token",
    "mfu_best",
    "mfu_median",
];

/// The JSON object of `cpl bench <line> --json`, after checking the machine description.
fn bench_json(line: &str) -> Value {
    let args = words(&format!("bench {line} --json"));
    let o = cpl(&args);
    assert!(o.status.success(), "{line}: {}", stderr(&o));
    let out = stdout(&o);
    let doc: Value = serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("{line}: not one JSON object ({e}): {out}"));
    assert_eq!(doc["bench"], args[1], "{doc}");
    let m = &doc["machine"];
    assert!(m["cpu"].as_str().is_some_and(|c| !c.is_empty()), "{m}");
    for flag in ["avx2", "fma", "avx512f", "avx512_bf16", "amx"] {
        assert!(m[flag].is_boolean(), "machine.{flag}: {m}");
    }
    assert!(m["threads"].as_u64().is_some_and(|t| t >= 1), "{m}");
    assert_eq!(m["cpl_version"], env!("CARGO_PKG_VERSION"), "{m}");
    doc
}

/// Every field of `fields` in `v` is a positive, finite number.
#[track_caller]
fn assert_positive(v: &Value, fields: &[&str]) {
    for f in fields {
        let x = v[f].as_f64();
        assert!(
            x.is_some_and(|x| x.is_finite() && x > 0.0),
            "{f} = {:?} in {v}",
            v[f]
        );
    }
}

#[test]
fn attention_json() {
    let doc = bench_json(
        "attention --seqs 128 --dtypes f32 --masks causal,full --heads 2 --head-dim 32 \
         --repeats 1 --matmul-size 256",
    );
    assert_positive(&doc, &["matmul_f32_gflops"]);
    let rows = doc["results"].as_array().expect("results");
    assert_eq!(rows.len(), 2, "{doc}");
    for r in rows {
        assert_positive(
            r,
            &[
                "fwd_s",
                "fwd_bwd_s",
                "fwd_gflops",
                "fwd_bwd_gflops",
                "fraction_of_matmul",
                "naive_fwd_s",
                "naive_fwd_bwd_s",
            ],
        );
    }
    assert_eq!(rows[0]["key"], "f32_128_causal");
}

#[test]
fn comm_json() {
    let doc = bench_json("comm --ranks 2 --mib 1 --iters 2");
    assert_positive(
        &doc["memcpy"],
        &[
            "touched_best_ms",
            "touched_gbs",
            "fresh_best_ms",
            "fresh_gbs",
        ],
    );
    let rows = doc["results"].as_array().expect("results");
    let ops: Vec<&str> = rows.iter().filter_map(|r| r["op"].as_str()).collect();
    let all = [
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "all-to-all-v",
        "broadcast",
    ];
    assert_eq!(ops, all);
    for r in rows {
        let timed = ["best_ms", "median_ms", "algbw_gbs", "busbw_gbs"];
        assert_positive(r, &timed);
        assert_positive(r, &["busbw_over_memcpy"]);
    }
    // all-gather: 0.5 MiB in, 1 MiB out on each of 2 ranks.
    assert_eq!(rows[1]["input_mib"], 0.5);
    assert_eq!(rows[1]["output_mib"], 1.0);
}

#[test]
fn train_json() {
    let doc = bench_json(&format!("train --seq-len 32 --steps 2 {TINY}"));
    assert_positive(&doc, &RATES);
    assert_positive(&doc, &["peak_rss_mib", "loss_first"]);
    assert_eq!(doc["tokens_per_step"], 32);
    assert_eq!(doc["step_seconds"].as_array().map(Vec::len), Some(2));
    assert_eq!(doc["model"]["layers"], 1);
    assert_eq!(doc["model"]["name"], "random");
    assert_eq!(doc["family"], "llama");
    assert_eq!(doc["model"]["family"], "llama");
}

#[test]
fn train_json_under_a_layout() {
    let doc = bench_json(&format!(
        "train --seq-len 32 --steps 2 --ranks 4 --tp 2 --ring 2 --zero 3 \
         --checkpointing selective {TINY}"
    ));
    assert_positive(&doc, &RATES);
    assert_eq!(doc["layout"], "--ranks 4 --tp 2 --ring 2");
    assert_eq!(doc["zero"], "3");
}

#[test]
fn eval_json() {
    let doc = bench_json(&format!(
        "eval --seq-len 32 --repeats 2 --ranks 2 --ring 2 {TINY}"
    ));
    assert_positive(&doc, &RATES);
    assert_positive(&doc, &["loss"]);
    // Scored tokens, as `cpl eval` counts them.
    assert_eq!(doc["tokens"], 31);
    // Data parallelism: one sequence per data-parallel rank, all of them counted.
    let doc = bench_json(&format!(
        "eval --seq-len 32 --repeats 1 --ranks 2 --dp 2 {TINY}"
    ));
    assert_positive(&doc, &RATES);
    assert_eq!(doc["tokens"], 62);
}

/// MFU's peak is `cpl train`'s: the run's dtype's matmul rate, or `--peak-tflops`, and the
/// report says which; with a stated peak the MFU is tokens/s x FLOPs per token over it.
#[test]
fn mfu_peak_is_the_one_cpl_train_states() {
    let doc = bench_json(&format!("train --seq-len 32 --steps 2 --dtype bf16 {TINY}"));
    assert_eq!(
        doc["peak_source"],
        "this machine's bf16 matmul rate on cpu (256x256 product, measured at start)",
        "{doc}"
    );
    for line in [
        format!("train --seq-len 32 --steps 2 --peak-tflops 0.5 {TINY}"),
        format!("eval --seq-len 32 --repeats 1 --peak-tflops 0.5 {TINY}"),
    ] {
        let doc = bench_json(&line);
        assert_eq!(doc["peak_source"], "--peak-tflops 0.5", "{doc}");
        assert_eq!(doc["peak_gflops"], 500.0, "{doc}");
        for (mfu, tps) in [
            ("mfu_best", "tokens_per_sec_best"),
            ("mfu_median", "tokens_per_sec_median"),
        ] {
            let want =
                doc[tps].as_f64().unwrap() * doc["flops_per_token"].as_f64().unwrap() / 0.5e12;
            let got = doc[mfu].as_f64().unwrap();
            assert!(
                (got - want).abs() <= 1e-12 * want,
                "{mfu}: {got} vs {want}: {doc}"
            );
        }
    }
}

/// A checkpoint instead of the random model, in its own dtype or another.
#[test]
fn eval_and_train_json_of_a_checkpoint() {
    let model = fixtures("llama/mha").display().to_string();
    let small = "--seq-len 16 --matmul-size 64";
    let doc = bench_json(&format!("eval --model {model} --repeats 1 {small}"));
    assert_positive(&doc, &["tokens_per_sec_best", "loss"]);
    assert_eq!(doc["model"]["name"], model);
    assert_eq!(doc["dtype"], "f32");
    let doc = bench_json(&format!(
        "train --model {model} --steps 2 --dtype bf16 {small}"
    ));
    assert_positive(&doc, &["tokens_per_sec_best", "loss_first"]);
    assert_eq!(doc["dtype"], "bf16");
}

/// Checkpoints of other families, through the registry: the report names the family, its
/// shape and its FLOPs, and the rates are positive.
#[test]
fn eval_and_train_json_of_zoo_families() {
    let small = "--seq-len 16 --matmul-size 64";
    // (fixture, family, layers, heads, kv heads, head_dim)
    for (dir, family, layers, heads, kv_heads, head_dim) in [
        ("zoo/qwen2", "qwen2", 3, 4, 2, 8),
        ("zoo/gemma2", "gemma2", 3, 4, 2, 16),
    ] {
        let model = fixtures(dir).display().to_string();
        let doc = bench_json(&format!("eval --model {model} --repeats 1 {small}"));
        assert_positive(&doc, &RATES);
        assert_positive(&doc, &["loss"]);
        assert_eq!(doc["family"], family, "{doc}");
        let m = &doc["model"];
        assert_eq!(m["family"], family, "{doc}");
        assert_eq!(m["name"], model);
        assert_eq!(
            [&m["layers"], &m["heads"], &m["kv_heads"], &m["head_dim"]],
            [layers, heads, kv_heads, head_dim],
            "{doc}"
        );
        assert_eq!(doc["dtype"], "f32");
        assert_eq!(doc["tokens"], 15);
        let doc = bench_json(&format!("train --model {model} --steps 2 {small}"));
        assert_positive(&doc, &RATES);
        assert_positive(&doc, &["peak_rss_mib", "loss_first"]);
        assert_eq!(doc["family"], family, "{doc}");
        assert_eq!(doc["tokens_per_step"], 16);
        assert_eq!(doc["step_seconds"].as_array().map(Vec::len), Some(2));
    }
}

/// The text table names the family and its shape.
#[test]
fn eval_table_of_a_zoo_family() {
    let model = fixtures("zoo/gemma2").display().to_string();
    let o = cpl(&words(&format!(
        "bench eval --model {model} --seq-len 16 --repeats 1 --matmul-size 64"
    )));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("machine: "), "{out}");
    assert!(
        out.contains(&format!("model: {model} (gemma2: 3 layers, hidden 32")),
        "{out}"
    );
}

/// A text table by default, with the machine line.
#[test]
fn comm_table() {
    let o = cpl(&words(
        "bench comm --ranks 2 --mib 1 --iters 1 --ops broadcast",
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("machine: "), "{out}");
    assert!(out.contains("| broadcast | 1 MiB → 1 MiB |"), "{out}");
}

#[test]
fn bad_flags_are_clear_errors() {
    let dit_model = format!(
        "train --model {} --seq-len 16",
        fixtures("dit/tiny").display()
    );
    let cases = [
        ("comm --ranks 0", "--ranks must be at least 1"),
        ("comm --iters 0", "--iters must be at least 1"),
        (
            "comm --ranks 3 --mib 1",
            "does not split evenly over --ranks 3",
        ),
        ("comm --ops all-sum", "--ops"),
        ("attention --dtypes f64", "--dtypes"),
        ("attention --masks sliding", "--masks"),
        ("attention --heads 0", "--heads must be at least 1"),
        ("attention --seqs 0", "--seqs 0"),
        (
            "attention --matmul-size 0",
            "--matmul-size must be at least 1",
        ),
        (
            "attention --torch /nonexistent/torch.json",
            "--torch /nonexistent/torch.json",
        ),
        ("train --dtype f64", "--dtype"),
        ("train --steps 1", "--steps 1 must be at least 2"),
        (
            "train --seq-len 30 --ranks 4 --ring 4",
            "--seq-len 30 cannot be split by --ring 4",
        ),
        ("train --ranks 3 --tp 2", "--ranks 3 is not divisible"),
        (
            "train --pp 2 --ranks 2",
            "--pp 2: cpl bench runs no pipeline",
        ),
        (
            "train --steps 2 --seq-len 16 --ranks 2 --tp 2 --layers 1 --hidden 32 --heads 4 \
             --intermediate 64 --vocab 97 --matmul-size 64",
            "--ranks 2 --tp 2",
        ),
        ("eval --hidden 30 --heads 4", "--hidden 30 --heads 4"),
        ("eval --model x --layers 2", "--layers"),
        (
            "eval --model /nonexistent/model --seq-len 16",
            "--model /nonexistent/model",
        ),
        (
            dit_model.as_str(),
            "the dit family does not load as a causal language model",
        ),
        ("eval --repeats 0", "--repeats must be at least 1"),
        (
            "eval --peak-tflops 0",
            "--peak-tflops 0 must be a positive number",
        ),
        (
            "train --peak-tflops nan",
            "--peak-tflops NaN must be a positive number",
        ),
        ("train --matmul-size 0", "--matmul-size must be at least 1"),
        ("matmul --isa neon", "--isa"),
        ("matmul --gemm blas", "--gemm"),
    ];
    let cases: Vec<(Vec<String>, &str)> = cases
        .iter()
        .map(|(line, needle)| (words(&format!("bench {line}")), *needle))
        .collect();
    assert_clear_errors(&cases);
}

/// The products' library that cannot be used is an error naming the flag and the variable (MKL
/// asked for where its file does not open; a `FLASH_RING_GEMM` or `FLASH_RING_BF16` value it
/// does not know), before anything is timed.
#[test]
fn an_unusable_products_library_is_a_clear_error() {
    let missing = "/nonexistent/libmkl_rt.so.3";
    let cases = [
        (
            vec![("FLASH_RING_MKL", missing)],
            "--gemm mkl",
            format!("FLASH_RING_MKL={missing}"),
        ),
        (
            vec![("FLASH_RING_GEMM", "blis")],
            "--gemm auto",
            "FLASH_RING_GEMM=\"blis\": expected auto, native or mkl".to_string(),
        ),
        (
            vec![("FLASH_RING_BF16", "fast")],
            "--bf16 auto",
            "FLASH_RING_BF16=\"fast\": expected auto, dot or widen".to_string(),
        ),
    ];
    for (env, flag, needle) in cases {
        let line = format!("bench matmul {flag} --repeats 1");
        let o = common::cpl_env(&words(&line), &env);
        let err = common::stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{line} {env:?}: {err}");
        assert!(
            err.contains(flag) && err.contains(&needle),
            "{line} {env:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{line} {env:?}: {err}");
        assert!(
            common::stdout(&o).is_empty(),
            "nothing timed: {}",
            common::stdout(&o)
        );
    }
}
