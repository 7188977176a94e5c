//! Long-context evaluation from the command line: `cpl eval --by-position` (loss by token
//! position) on one rank and under sequence parallelism, its plot, and its errors.

use std::path::Path;

mod common;
use common::{assert_clear_errors, cpl, stderr, stdout, tmpdir};

fn eval_json(model: &Path, tokens: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        tokens.to_str().unwrap(),
        "--dtype",
        "f32",
        "--json",
        "--by-position",
    ];
    args.extend_from_slice(extra);
    let o = cpl(&args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_str(stdout(&o).trim()).expect("one JSON object")
}

/// The buckets partition every scored token; their token-weighted mean is the overall loss; and
/// ring 4 (zigzag), Ulysses 2 x ring 2 and tp 2 give each bucket's loss of one rank (1e-5: f32,
/// another summation order).
#[test]
fn loss_by_position_is_exact_under_every_layout() {
    let dir = tmpdir("by-position");
    let model = common::fixtures("llama/mha");
    let seqs: Vec<Vec<u32>> = (0..3)
        .map(|b| (0..64).map(|i| ((i * 37 + b * 11) % 256) as u32).collect())
        .collect();
    let tokens = dir.join("ids.json");
    std::fs::write(&tokens, serde_json::to_string(&seqs).unwrap()).unwrap();
    let one = eval_json(&model, &tokens, &[]);
    let buckets = one["by_position"]["buckets"].as_array().unwrap();
    let edges: Vec<(u64, u64)> = buckets
        .iter()
        .map(|b| (b["from"].as_u64().unwrap(), b["to"].as_u64().unwrap()))
        .collect();
    assert_eq!(edges, vec![(1, 16), (16, 32), (32, 64)]);
    let counts: Vec<u64> = buckets
        .iter()
        .map(|b| b["tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(
        counts,
        vec![15 * 3, 16 * 3, 32 * 3],
        "every labelled token once"
    );
    assert_eq!(counts.iter().sum::<u64>(), one["tokens"].as_u64().unwrap());
    let weighted: f64 = buckets
        .iter()
        .map(|b| b["loss"].as_f64().unwrap() * b["tokens"].as_f64().unwrap())
        .sum::<f64>()
        / one["tokens"].as_f64().unwrap();
    let overall = one["loss"].as_f64().unwrap();
    assert!(
        (weighted - overall).abs() <= 1e-6 * overall,
        "{weighted} vs {overall}"
    );
    let losses = |v: &serde_json::Value| -> Vec<f64> {
        v["by_position"]["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["loss"].as_f64().unwrap())
            .collect()
    };
    assert!(
        losses(&one).windows(2).any(|w| (w[0] - w[1]).abs() > 1e-3),
        "the buckets differ: {:?}",
        losses(&one)
    );
    for layout in [
        &["--ranks", "4", "--ring", "4"][..],
        &["--ranks", "4", "--ulysses", "2", "--ring", "2"],
        &["--ranks", "2", "--tp", "2"],
    ] {
        let got = eval_json(&model, &tokens, layout);
        for (g, w) in losses(&got).iter().zip(losses(&one)) {
            assert!((g - w).abs() <= 1e-5 * w.abs(), "{layout:?}: {g} vs {w}");
        }
        assert_eq!(got["by_position"]["buckets"].as_array().unwrap().len(), 3);
    }
    // The plot, with the first run's JSON as a second curve.
    let first = dir.join("first.json");
    std::fs::write(&first, serde_json::to_string(&one).unwrap()).unwrap();
    let png = dir.join("by-position.png");
    let again = eval_json(
        &model,
        &tokens,
        &[
            "--by-position-plot",
            png.to_str().unwrap(),
            "--compare",
            first.to_str().unwrap(),
        ],
    );
    assert_eq!(losses(&again), losses(&one), "same run, same losses");
    let bytes = std::fs::read(&png).expect("the plot is written");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    // Errors name the flag.
    let not_json = dir.join("not.json");
    std::fs::write(&not_json, "{\"loss\": 1.0}").unwrap();
    let base = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "eval",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    assert_clear_errors(&[
        (
            base(&["--by-position", "--ranks", "2", "--pp", "2"]),
            "--by-position is not available with --pp",
        ),
        (
            base(&[
                "--by-position",
                "--by-position-plot",
                png.to_str().unwrap(),
                "--compare",
                not_json.to_str().unwrap(),
            ]),
            "no by_position",
        ),
    ]);
}

fn passkey_json(extra: &[&str]) -> serde_json::Value {
    let model = common::default_model();
    let mut args = vec![
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--passkey",
        "--passkey-lengths",
        "64,128",
        "--passkey-trials",
        "2",
        "--dtype",
        "f32",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = cpl(&args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_str(stdout(&o).trim()).expect("one JSON object")
}

/// `cpl eval --passkey`: the grid (2 lengths x 5 depths x 2 keys) on the bundled model, the same
/// retrievals and answer log-likelihoods (1e-5) under ring 2 (zigzag) and Ulysses 2 as on one
/// rank, the heatmap, and its errors. (The bundled 1 M-parameter model retrieves no key; the
/// scorer itself is tested on hand-made answers in `train::passkey`.)
#[test]
fn passkey_grid_is_the_same_under_every_layout() {
    let one = passkey_json(&[]);
    let cells = one["passkey"]["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 10);
    for c in cells {
        assert_eq!(c["trials"].as_u64(), Some(2));
        let ll = c["answer_loglik"].as_f64().unwrap();
        assert!(ll.is_finite() && ll < 0.0, "{c}");
    }
    let acc = one["passkey"]["accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc));
    for layout in [
        &["--ranks", "2", "--ring", "2"][..],
        &["--ranks", "2", "--ulysses", "2"],
    ] {
        let got = passkey_json(layout);
        for (g, w) in got["passkey"]["cells"]
            .as_array()
            .unwrap()
            .iter()
            .zip(cells)
        {
            assert_eq!(g["retrieved"], w["retrieved"], "{layout:?}");
            let (a, b) = (
                g["answer_loglik"].as_f64().unwrap(),
                w["answer_loglik"].as_f64().unwrap(),
            );
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{layout:?}: {a} vs {b}");
        }
    }
    let dir = tmpdir("passkey");
    let png = dir.join("passkey.png");
    passkey_json(&["--passkey-plot", png.to_str().unwrap()]);
    assert_eq!(&std::fs::read(&png).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
    let model = common::default_model();
    let base = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["eval", "--model", model.to_str().unwrap(), "--passkey"]
            .map(String::from)
            .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    assert_clear_errors(&[
        (
            base(&["--passkey-lengths", "16"]),
            "the needle, question and answer alone take",
        ),
        (
            base(&["--passkey-trials", "0"]),
            "--passkey-trials must be at least 1",
        ),
        (
            base(&["--passkey-lengths", "64", "--ranks", "2", "--pp", "2"]),
            "--passkey is not available with --pp",
        ),
        (
            base(&["--passkey-lengths", "66", "--ranks", "2", "--ring", "2"]),
            "--passkey-lengths 66",
        ),
        (
            base(&["--passkey-depths", "1.5"]),
            "passkey depth 1.5 is not in [0, 1]",
        ),
    ]);
}

/// `--doc-mask` trains with `--ring-layout doc-zigzag` unless `--ring-layout` names another:
/// the same loss as the window's zigzag (1e-5: f32, another summation order), and
/// `metrics.jsonl`'s `attention_work_max_over_mean` shows the balance it buys on a window whose
/// first document fills most of it (ring 4).
#[test]
fn doc_mask_defaults_to_the_per_document_zigzag() {
    let dir = tmpdir("doc-zigzag");
    let model = common::fixtures("llama/mha");
    // Documents much longer than the kernels' 128-row tiles, or the tiles hide the balance.
    let mut docs = testkit::random_docs(3, 1, 3600..3601, 256);
    docs.extend(testkit::random_docs(4, 80, 4..12, 256));
    let tokens = dir.join("docs.json");
    std::fs::write(&tokens, serde_json::to_string(&docs).unwrap()).unwrap();
    let metrics = |tag: &str, extra: &[&str]| -> serde_json::Value {
        let out = dir.join(tag);
        let mut args = vec![
            "train",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
            "--doc-mask",
            "--seq-len",
            "4096",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--grad-accum",
            "1",
            "--ranks",
            "4",
            "--ring",
            "4",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = cpl(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        let line = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        serde_json::from_str(line.lines().next().unwrap()).unwrap()
    };
    let doc = metrics("default", &[]);
    let zigzag = metrics("zigzag", &["--ring-layout", "zigzag"]);
    let explicit = metrics("explicit", &["--ring-layout", "doc-zigzag"]);
    let loss = |v: &serde_json::Value| v["loss"].as_f64().unwrap();
    let balance = |v: &serde_json::Value| v["attention_work_max_over_mean"].as_f64().unwrap();
    testkit::assert_close_scalar(loss(&doc), loss(&zigzag), 1e-5, "loss vs zigzag");
    assert_eq!(
        balance(&doc),
        balance(&explicit),
        "the default is doc-zigzag"
    );
    assert!(
        balance(&doc) < balance(&zigzag) && balance(&doc) <= 1.1,
        "doc-zigzag {} vs zigzag {}",
        balance(&doc),
        balance(&zigzag)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `cpl train --eval-by-position` under ring 2: each evaluation's line in eval.jsonl carries the
/// loss by position bucket, the same as `cpl eval --by-position` gives on the checkpoint saved
/// at that step (1e-5), and TensorBoard gets one scalar per bucket.
#[test]
fn training_evaluates_the_loss_by_position() {
    let dir = tmpdir("train-by-position");
    let model = common::fixtures("llama/mha");
    let seqs: Vec<Vec<u32>> = (0..3)
        .map(|b| (0..64).map(|i| ((i * 29 + b * 7) % 256) as u32).collect())
        .collect();
    let tokens = dir.join("ids.json");
    std::fs::write(&tokens, serde_json::to_string(&seqs).unwrap()).unwrap();
    let out = dir.join("run");
    let t = tokens.to_str().unwrap();
    let args = [
        "train",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        t,
        "--eval-tokens",
        t,
        "--eval-windows",
        "3",
        "--eval-every",
        "2",
        "--eval-by-position",
        "--seq-len",
        "64",
        "--steps",
        "2",
        "--save-every",
        "2",
        "--ranks",
        "2",
        "--ring",
        "2",
        "--tensorboard",
        "--out",
        out.to_str().unwrap(),
    ];
    let o = cpl(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let line: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(out.join("eval.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(line["step"], 2);
    let got = line["by_position"]
        .as_array()
        .expect("by_position in eval.jsonl");
    // The held-out windows: 64 tokens each from the stream of the three sequences (a window's
    // labels reach one token past it, so two windows fit): the first two sequences.
    let windows = dir.join("windows.json");
    std::fs::write(&windows, serde_json::to_string(&seqs[..2]).unwrap()).unwrap();
    let want = eval_json(&out.join("step-2"), &windows, &[]);
    let want = want["by_position"]["buckets"].as_array().unwrap();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert_eq!(
            (&g["from"], &g["to"], &g["tokens"]),
            (&w["from"], &w["to"], &w["tokens"])
        );
        let (a, b) = (g["loss"].as_f64().unwrap(), w["loss"].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{g} vs {w}");
    }
    let tb = std::fs::read_dir(out.join("tb"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let events = train::driver::tensorboard::read_events(&tb).unwrap();
    let tags: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.what {
            Some(train::driver::tensorboard::What::Summary(s)) => Some(s.value[0].tag.clone()),
            _ => None,
        })
        .filter(|t| t.starts_with("eval/loss_by_position/"))
        .collect();
    assert_eq!(tags.len(), want.len(), "{tags:?}");
    // Refused with --pp, and without held-out data.
    assert_clear_errors(&[(
        vec![
            "train",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            t,
            "--eval-by-position",
            "--seq-len",
            "64",
            "--out",
            out.to_str().unwrap(),
        ],
        "--eval-by-position needs held-out data",
    )]);
    std::fs::remove_dir_all(&dir).unwrap();
}
