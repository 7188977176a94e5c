//! `cpl plan --auto` and `cpl bench calibrate` end to end: the ranking is sorted and fits the
//! memory, the printed command is the winner's, a calibrated file plans, `--measure` runs the
//! layouts it names, and impossible requests fail with errors naming the cause.

mod common;
use common::{assert_clear_errors, cpl, stderr, stdout, tmpdir, words};
use serde_json::Value;

/// A LLaMA config of the benchmark shape family (8 heads, 4 kv heads), written once per test.
fn config(tag: &str, layers: usize, hidden: usize, vocab: usize) -> String {
    let dir = tmpdir(tag);
    let path = dir.join("config.json");
    let cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": vocab,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false
    });
    std::fs::write(&path, cfg.to_string()).unwrap();
    path.display().to_string()
}

fn plan_json(line: &str) -> Value {
    let o = cpl(&words(&format!("plan --auto {line} --json")));
    assert!(o.status.success(), "{line}: {}", stderr(&o));
    serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{line}: {e}"))
}

#[test]
fn ranking_is_sorted_fits_memory_and_covers_the_world() {
    let model = config("plan-7b", 32, 4096, 32000);
    let doc = plan_json(&format!(
        "--model {model} --seq-len 32768 --world 8 --hardware h100-node --dtype bf16"
    ));
    let budget = doc["memory_per_rank_bytes"].as_f64().unwrap();
    let ranked = doc["ranked"].as_array().unwrap();
    assert!(ranked.len() > 20, "{} layouts", ranked.len());
    let mut last = 0.0;
    for c in ranked {
        let t = c["prediction"]["time"]["total"].as_f64().unwrap();
        assert!(t.is_finite() && t >= last, "not sorted: {c}");
        last = t;
        assert!(c["prediction"]["memory"]["total"].as_f64().unwrap() <= budget);
        let world: u64 = ["tp", "ulysses", "ring", "pp", "dp"]
            .iter()
            .map(|k| c[k].as_u64().unwrap())
            .product();
        assert_eq!(world, 8, "{c}");
        assert!(c["flags"].as_str().unwrap().starts_with("--ranks 8"), "{c}");
        assert_eq!(c["ep"], 1, "a dense model has no experts to divide: {c}");
    }
    // Sequence parallelism and pipelines are among the candidates; every strategy appears.
    for s in ["ring", "ulysses", "usp", "double-ring", "all-gather"] {
        assert!(ranked.iter().any(|c| c["strategy"] == s), "no {s}");
    }
    assert!(ranked.iter().any(|c| c["pp"].as_u64() > Some(1)));
    for c in doc["too_big"].as_array().unwrap() {
        assert!(c["prediction"]["memory"]["total"].as_f64().unwrap() > budget);
    }
}

#[test]
fn table_prints_the_winner_as_cpl_train_flags() {
    let model = config("plan-table", 4, 512, 32000);
    let o = cpl(&words(&format!(
        "plan --auto --model {model} --seq-len 8192 --world 4 --hardware cpu-2core --top 3"
    )));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("| 1 |") && out.contains("| 3 |") && !out.contains("| 4 |"),
        "{out}"
    );
    let cmd = out
        .lines()
        .find(|l| l.starts_with("cpl train "))
        .unwrap_or_else(|| panic!("no command: {out}"));
    assert!(
        cmd.contains("--seq-len 8192") && cmd.contains("--ranks 4"),
        "{cmd}"
    );
}

#[test]
fn calibrated_hardware_plans_and_measure_runs_the_layouts() {
    let dir = tmpdir("plan-calibrate");
    let hw = dir.join("hw.toml");
    // `cpl bench --calibrate` is `cpl bench calibrate`.
    let o = cpl(&words(&format!(
        "bench --calibrate --out {} --ranks 2 --attention-seq 128 --matmul-size 256",
        hw.display()
    )));
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&hw).unwrap();
    for field in [
        "matmul_flops",
        "attention_flops",
        "memory_bandwidth",
        "memory_bytes",
    ] {
        assert!(text.contains(field), "{field}: {text}");
    }
    assert!(text.contains("devices_per_node = 2") && text.contains("shared_node = true"));
    let model = config("plan-measure", 1, 64, 256);
    // 5 layouts: Kendall's tau over 2 is always +-1 and checks nothing.
    let doc = plan_json(&format!(
        "--model {model} --seq-len 128 --world 2 --hardware {} --measure 5",
        hw.display()
    ));
    let m = &doc["measured"];
    let rows = m["layouts"].as_array().unwrap();
    assert_eq!(rows.len(), 5, "{m}");
    for r in rows {
        for k in [
            "predicted_tokens_per_sec",
            "measured_tokens_per_sec",
            "predicted_memory_mib",
        ] {
            assert!(r[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {r}");
        }
    }
    // Spread over the ranking from its first, in plan order (so predicted tokens/s fall).
    assert_eq!(rows[0]["rank_in_plan"], 1, "{m}");
    let col = |k: &str| -> Vec<f64> { rows.iter().map(|r| r[k].as_f64().unwrap()).collect() };
    let plan_rank = col("rank_in_plan");
    let (pred, meas) = (
        col("predicted_tokens_per_sec"),
        col("measured_tokens_per_sec"),
    );
    for i in 1..rows.len() {
        assert!(plan_rank[i] > plan_rank[i - 1], "{m}");
        assert!(pred[i] <= pred[i - 1], "{m}");
    }
    // The reported tau is Kendall's tau-b of these rows.
    let sign = |x: f64| (x > 0.0) as i32 - (x < 0.0) as i32;
    let (mut s, mut untied_pred, mut untied_meas) = (0, 0, 0);
    for i in 0..rows.len() {
        for j in i + 1..rows.len() {
            let (a, b) = (sign(pred[i] - pred[j]), sign(meas[i] - meas[j]));
            s += a * b;
            untied_pred += a.abs();
            untied_meas += b.abs();
        }
    }
    let want = s as f64 / ((untied_pred * untied_meas) as f64).sqrt();
    let tau = m["kendall_tau"].as_f64().unwrap_or(f64::NAN);
    assert!(
        (tau - want).abs() < 1e-12,
        "tau {tau}, from the rows {want}: {m}"
    );
}

#[test]
fn impossible_requests_are_clear_errors() {
    let model = config("plan-errors", 4, 512, 32000);
    let bad_hw = tmpdir("plan-errors-hw").join("hw.toml");
    std::fs::write(&bad_hw, "name = \"x\"\nnodes = 0\n").unwrap();
    let line = |rest: &str| words(&format!("plan --auto --model {model} {rest}"));
    assert_clear_errors(&[
        // No layout of 7 ranks: 7 divides neither the heads nor the sequence, and one
        // sequence per step leaves no data parallelism.
        (
            line("--seq-len 4096 --world 7 --hardware h100-node --global-batch-tokens 4096"),
            "no layout of 7 ranks divides",
        ),
        (
            line("--seq-len 4194304 --world 4 --hardware cpu-2core"),
            "no layout of 4 ranks fits a sequence of 4194304 tokens in memory",
        ),
        (
            line("--seq-len 4096 --world 16 --hardware h100-node"),
            "does not fit",
        ),
        (
            line("--seq-len 4096 --world 4 --hardware h100-node --global-batch-tokens 5000"),
            "--global-batch-tokens 5000",
        ),
        (line("--seq-len 4096 --world 4"), "--auto needs --hardware"),
        (
            line(&format!("--seq-len 4096 --world 4 --hardware {}", bad_hw.display())),
            "hw.toml",
        ),
        (
            line("--seq-len 4096 --world 4 --hardware h100-node --tp 2"),
            "--auto chooses the layout",
        ),
        (
            words("plan --auto --seq-len 4096 --world 4 --hardware h100-node"),
            "--auto needs --model",
        ),
        (
            words("plan --auto --model /nonexistent/config.json --seq-len 64 --world 2 --hardware h100-node"),
            "/nonexistent/config.json",
        ),
    ]);
}

/// A Mixtral-8x7B-shaped model (8 experts, top-2) at 32K tokens on 16 H100s: every candidate's
/// expert parallelism divides the experts and the token ranks, both ep 1 and ep > 1 are
/// searched, dividing the experts lowers a layout's predicted memory, the winner is printed
/// with its `--ep`, and `--measure` runs the fixture's checkpoint (a config file alone is refused).
#[test]
fn mixture_of_experts_plans_with_expert_parallelism() {
    let dir = tmpdir("plan-mixtral");
    let path = dir.join("config.json");
    let cfg = serde_json::json!({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 32000, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "sliding_window": null, "tie_word_embeddings": false
    });
    std::fs::write(&path, cfg.to_string()).unwrap();
    let model = path.display().to_string();
    let line =
        format!("--model {model} --seq-len 32768 --world 16 --hardware h100-cluster --dtype bf16");
    let doc = plan_json(&line);
    let ranked = doc["ranked"].as_array().unwrap();
    let all: Vec<&Value> = ranked
        .iter()
        .chain(doc["too_big"].as_array().unwrap())
        .collect();
    let u = |c: &Value, k: &str| c[k].as_u64().unwrap();
    for c in &all {
        let ep = u(c, "ep");
        assert!(8 % ep == 0, "{c}");
        assert!(
            (u(c, "ulysses") * u(c, "ring") * u(c, "dp")) % ep == 0,
            "{c}"
        );
    }
    for ep in [1, 2, 4, 8] {
        assert!(
            all.iter().any(|c| u(c, "ep") == ep),
            "ep {ep} never searched"
        );
    }
    // The same layout with the experts divided needs less memory per rank.
    let key = |c: &Value| {
        [
            "tp",
            "ulysses",
            "ring",
            "pp",
            "dp",
            "strategy",
            "zero",
            "checkpointing",
            "tp_sp",
        ]
        .map(|k| c[k].to_string())
        .join(" ")
    };
    let mem = |c: &Value| c["prediction"]["memory"]["total"].as_f64().unwrap();
    let undivided: std::collections::HashMap<String, f64> = all
        .iter()
        .filter(|c| u(c, "ep") == 1)
        .map(|c| (key(c), mem(c)))
        .collect();
    let mut pairs = 0;
    for b in all.iter().filter(|c| u(c, "ep") > 1) {
        if let Some(&m1) = undivided.get(&key(b)) {
            assert!(mem(b) < m1, "{b} needs {} bytes, {m1} with ep 1", mem(b));
            pairs += 1;
        }
    }
    assert!(pairs > 10, "{pairs} pairs");
    let best = &ranked[0];
    assert!(
        u(best, "ep") > 1,
        "the 47B-parameter model fits with its experts divided: {best}"
    );
    let flags = best["flags"].as_str().unwrap();
    assert!(
        flags.contains(&format!("--ep {}", u(best, "ep"))),
        "{flags}"
    );
    let o = cpl(&words(&format!("plan --auto {line} --top 2")));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let cmd = out
        .lines()
        .find(|l| l.starts_with("cpl train "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(cmd.contains(" --ep "), "{cmd}");
    // `--measure` runs a mixture of experts on its own checkpoint: a config file alone is a
    // clear error; the fixture's directory runs 3 layouts (each measured, at some throughput).
    assert_clear_errors(&[(
        words(&format!(
            "plan --auto --model {model} --seq-len 4096 --world 2 --hardware cpu-2core --measure 2"
        )),
        "is a config file",
    )]);
    let moe = common::fixtures("moe").join("qwen3_moe");
    let doc = plan_json(&format!(
        "--model {} --seq-len 64 --world 2 --hardware cpu-2core --measure 3",
        moe.display()
    ));
    let rows = doc["measured"]["layouts"]
        .as_array()
        .unwrap_or_else(|| panic!("no measured layouts: {}", doc["measured"]));
    assert_eq!(rows.len(), 3, "{rows:?}");
    for r in rows {
        let tps = r["measured_tokens_per_sec"].as_f64().unwrap_or(f64::NAN);
        assert!(tps.is_finite() && tps > 0.0, "{r}");
    }
}

/// A Mistral-7B config at 128K tokens on 16 H100s: with `sliding_window: 4096` every layer is
/// costed by its window (the planner's shape carries it), so the best layout and every layout
/// of both rankings predict less time than with `sliding_window: null` (global attention);
/// `--measure` runs a windowed model on its checkpoint, so a config file alone is refused.
#[test]
fn sliding_window_models_are_planned_by_their_window() {
    let mistral = |tag: &str, window: Value| {
        let path = tmpdir(tag).join("config.json");
        let cfg = serde_json::json!({
            "architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
            "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": window,
            "tie_word_embeddings": false
        });
        std::fs::write(&path, cfg.to_string()).unwrap();
        path.display().to_string()
    };
    let windowed = mistral("plan-mistral-window", serde_json::json!(4096));
    let global = mistral("plan-mistral-global", Value::Null);
    let line = |model: &str| {
        format!("--model {model} --seq-len 131072 --world 16 --hardware h100-cluster --dtype bf16")
    };
    let (w, g) = (plan_json(&line(&windowed)), plan_json(&line(&global)));
    assert_eq!(w["model"]["window"]["window"], 4096, "{}", w["model"]);
    assert_eq!(
        w["model"]["window"]["windowed_layers"], 32,
        "{}",
        w["model"]
    );
    assert!(g["model"]["window"].is_null(), "{}", g["model"]);
    let total = |c: &Value| c["prediction"]["time"]["total"].as_f64().unwrap();
    let (wr, gr) = (
        w["ranked"].as_array().unwrap(),
        g["ranked"].as_array().unwrap(),
    );
    let (wb, gb) = (total(&wr[0]), total(&gr[0]));
    assert!(wb < gb, "best: {wb} s with the window, {gb} s without");
    // The same layout, with and without the window.
    let key = |c: &Value| c["flags"].as_str().unwrap().to_string();
    let global_time: std::collections::HashMap<String, f64> =
        gr.iter().map(|c| (key(c), total(c))).collect();
    let mut worst = 0.0;
    let mut pairs = 0;
    for c in wr {
        if let Some(&t) = global_time.get(&key(c)) {
            worst = testkit::max_or_nan(worst, total(c) / t);
            pairs += 1;
        }
    }
    assert!(pairs > 100, "{pairs} layouts in both rankings");
    assert!(
        worst < 1.0,
        "a layout is no faster with the window: {worst}"
    );
    // Every ring is planned contiguous too. Without the window contiguous gives the last rank
    // the latest queries: each such layout computes more than its zigzag twin. Under the 4K
    // window (8K tokens a rank on a ring of 16) it is balanced and sends fewer ring steps: no
    // more compute than zigzag's, fewer bytes, and the best layout is contiguous.
    let twins = |ranked: &[Value]| -> Vec<(Value, Value)> {
        let by_flags: std::collections::HashMap<String, &Value> =
            ranked.iter().map(|c| (key(c), c)).collect();
        ranked
            .iter()
            .filter_map(|c| {
                let k = key(c);
                let zig = k.replace(" --ring-layout contiguous", "");
                (zig != k)
                    .then(|| by_flags.get(&zig).map(|z| (c.clone(), (*z).clone())))
                    .flatten()
            })
            .collect()
    };
    let compute = |c: &Value| c["prediction"]["time"]["compute"].as_f64().unwrap();
    let bytes = |c: &Value| c["prediction"]["bytes_sent"].as_f64().unwrap();
    let (gt, wt) = (twins(gr), twins(wr));
    assert!(
        gt.len() > 50 && wt.len() > 50,
        "{} and {} twins",
        gt.len(),
        wt.len()
    );
    for (contiguous, zigzag) in &gt {
        assert!(
            compute(contiguous) > compute(zigzag) * 1.01,
            "global: {} computes {} s, its zigzag twin {} s",
            key(contiguous),
            compute(contiguous),
            compute(zigzag)
        );
    }
    let mut fewer = 0;
    for (contiguous, zigzag) in &wt {
        assert!(
            compute(contiguous) <= compute(zigzag) * 1.001,
            "windowed: {} computes {} s, its zigzag twin {} s",
            key(contiguous),
            compute(contiguous),
            compute(zigzag)
        );
        assert!(bytes(contiguous) <= bytes(zigzag), "{}", key(contiguous));
        fewer += usize::from(bytes(contiguous) < bytes(zigzag));
    }
    assert!(
        fewer > 10,
        "{fewer} contiguous rings send less under the window"
    );
    assert!(
        key(&wr[0]).contains("--ring-layout contiguous"),
        "best: {}",
        key(&wr[0])
    );
    assert_clear_errors(&[(
        words(&format!(
            "plan --auto --model {windowed} --seq-len 4096 --world 2 --hardware cpu-2core \
             --measure 2"
        )),
        "sliding-window layers on its own",
    )]);
}

/// `cpl plan --pp 2 --model M` without --auto: the split `--pp-layers auto` makes (a 32-layer
/// model whose head, at hidden 1024 and a 32k vocabulary, costs about 2 layers at 4096 tokens:
/// 17 + 15 layers), each stage's FLOPs, and the bubble of the schedule run with those costs,
/// larger than the equal-stage bubble; `--pp-layers even` splits 16 + 16, a slower step. Bad
/// combinations are clear errors.
#[test]
fn plan_shows_a_models_pipeline_stages() {
    let model = config("plan-stages", 32, 1024, 32_000);
    let run = |extra: &str| {
        let o = cpl(&words(&format!(
            "plan --ranks 2 --pp 2 --micro-batches 8 --model {model} --seq-len 4096 {extra}"
        )));
        assert!(o.status.success(), "{extra}: {}", stderr(&o));
        stdout(&o)
    };
    let step = |out: &str| -> f64 {
        let at = out.find("(step ").unwrap_or_else(|| panic!("{out}")) + 6;
        out[at..].split(' ').next().unwrap().parse().unwrap()
    };
    let auto = run("");
    assert!(auto.contains("--pp-layers auto:"), "{auto}");
    assert!(
        auto.contains("virtual stage 0 (rank 0): layers 0..17 (17)"),
        "{auto}"
    );
    assert!(
        auto.contains("virtual stage 1 (rank 1): layers 17..32 (15)"),
        "{auto}"
    );
    let even = run("--pp-layers even");
    assert!(
        even.contains("virtual stage 0 (rank 0): layers 0..16 (16)"),
        "{even}"
    );
    assert!(step(&auto) < step(&even), "{auto}\n{even}");
    assert!(step(&auto) >= 1.0, "{auto}");
    assert_clear_errors(&[
        (
            words(&format!("plan --ranks 2 --model {model}")),
            "--model without --auto shows a model's pipeline stages (give --pp 2 or more)",
        ),
        (
            words("plan --ranks 2 --pp 2 --seq-len 64"),
            "--seq-len: give --model",
        ),
    ]);
}
