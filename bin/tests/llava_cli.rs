//! `cpl` on LLaVA models end to end: inspect, eval with image files or pixel values, training
//! on image-text conversations under a layout against one rank (its checkpoint evaluates
//! again), generation, and bad input.

mod common;

use std::path::{Path, PathBuf};

use common::{assert_clear_errors, cpl, fixtures, stderr, stdout, tmpdir};

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn model(name: &str) -> String {
    s(&fixtures(&format!("llava/{name}")))
}

fn image(name: &str) -> PathBuf {
    fixtures(&format!("llava/images/{name}"))
}

fn run_ok(args: &[String]) -> String {
    let o = cpl(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|x| x.to_string()).collect()
}

/// The reference batch's token ids (one image in sequence 0, two in sequence 1) as a --tokens
/// file, and its pixel values as a --pixel-values file.
fn inputs(dir: &Path) -> (PathBuf, PathBuf) {
    let r = candle_core::safetensors::load(
        fixtures("llava/clip/reference.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let ids = r["input_ids"].to_vec2::<i64>().unwrap();
    let tokens = dir.join("ids.json");
    std::fs::write(&tokens, serde_json::to_string(&ids).unwrap()).unwrap();
    let pv = dir.join("pv.safetensors");
    let map =
        std::collections::HashMap::from([("pixel_values".to_string(), r["pixel_values"].clone())]);
    candle_core::safetensors::save(&map, &pv).unwrap();
    (tokens, pv)
}

fn loss(out: &str) -> f64 {
    let v: serde_json::Value = serde_json::from_str(out).unwrap();
    v["loss"].as_f64().unwrap()
}

#[test]
fn inspect_and_eval_with_images_or_pixel_values() {
    let out = run_ok(&args(&["inspect", "--model", &model("clip")]));
    assert!(
        out.contains("vision tower clip_vision_model")
            && out.contains("projector")
            && out.contains("16 image tokens"),
        "{out}"
    );
    let d = tmpdir("llava-eval");
    let (tokens, pv) = inputs(&d);
    let imgs = format!(
        "{},{},{}",
        s(&image("a.png")),
        s(&image("b.png")),
        s(&image("c.jpg"))
    );
    let with_files = loss(&run_ok(&args(&[
        "eval",
        "--model",
        &model("clip"),
        "--tokens",
        &s(&tokens),
        "--images",
        &imgs,
        "--json",
    ])));
    let with_pv = loss(&run_ok(&args(&[
        "eval",
        "--model",
        &model("clip"),
        "--tokens",
        &s(&tokens),
        "--pixel-values",
        &s(&pv),
        "--json",
    ])));
    let ring = loss(&run_ok(&args(&[
        "eval",
        "--model",
        &model("clip"),
        "--tokens",
        &s(&tokens),
        "--pixel-values",
        &s(&pv),
        "--json",
        "--ranks",
        "4",
        "--ring",
        "2",
        "--tp",
        "2",
    ])));
    // The JPEG's decoders differ in a few pixels' last bit (see tests/llava.rs).
    assert!(
        (with_files - with_pv).abs() / with_pv < 1e-3,
        "{with_files} vs {with_pv}"
    );
    assert!(
        (ring - with_pv).abs() / with_pv < 1e-5,
        "{ring} vs {with_pv}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

fn conversations(dir: &Path) -> PathBuf {
    let f = dir.join("mm.jsonl");
    let line = |content: &str, reply: &str, imgs: &[&str]| {
        let images: Vec<String> = imgs.iter().map(|i| s(&image(i))).collect();
        serde_json::json!({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": reply}], "images": images}).to_string()
    };
    let text = [
        line(
            "<image>what is the miller doing?",
            "the miller grinds the corn.",
            &["a.png"],
        ),
        line(
            "compare <image> and <image>",
            "the first is brighter.",
            &["b.png", "c.jpg"],
        ),
        line("a question without image", "an answer.", &[]),
        line("<image>and this one?", "a darker one.", &["c.jpg"]),
    ]
    .join("\n");
    std::fs::write(&f, text + "\n").unwrap();
    f
}

fn metrics(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// MFU by hand for LLaVA (the `clip` fixture, 96 tokens a sequence, on average one image a
/// sequence): with `--peak-tflops 1`, `mfu x 1e12 / tokens_per_sec` in metrics.jsonl is the
/// model FLOPs per token, `want`. Text (PaLM's convention, as for a dense LM): N = 2 x (2 x 32 x
/// 64 + 2 x 32 x 16 + 3 x 32 x 64 + 2 x 32) + 32 + 260 x 32 = 31,008 multiplying parameters,
/// attention width 2 x 8 x 8 = 128: forward 2N + 4 x 128 x 96 / 2 = 86,592 a token; training
/// three times that, 259,776; with the language model frozen 4N + 3 x 24,576 = 197,760. The
/// image (CLIP, 16 patches of 8 x 8 x 3 and a class token, hidden 32, MLP 64, the layers up to
/// feature layer -2: one): patch embedding 2 x 32 x 192 x 16 = 196,608, the layer
/// 2 x (4 x 32² + 2 x 32 x 64) x 17 + 4 x 32 x 17² = 315,520, the projector
/// 2 x (32 x 32 + 32 x 32) x 16 = 65,536; trained, three times all (1,732,992, that is 18,052 a token); with the tower frozen
/// its forward once and the projector three times (708,736).
fn assert_mfu_flops(out: &Path, want: f64) {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let flops = v["mfu"].as_f64().unwrap() * 1e12 / v["tokens_per_sec"].as_f64().unwrap();
        assert!(
            (flops - want).abs() <= 1e-9 * want,
            "{flops} vs {want} in {line}"
        );
    }
}

#[test]
fn training_on_conversations_matches_one_rank_and_saves_a_llava() {
    let d = tmpdir("llava-train");
    let data = conversations(&d);
    let base = |out: &Path, extra: &[&str]| -> Vec<String> {
        let mut a = args(&[
            "train",
            "--model",
            &model("clip"),
            "--data",
            &s(&data),
            "--seq-len",
            "96",
            "--batch",
            "1",
            "--grad-accum",
            "2",
            "--lr",
            "1e-3",
            "--warmup",
            "0",
            "--out",
            &s(out),
        ]);
        if !extra.contains(&"--steps") {
            a.extend(["--steps".to_string(), "3".to_string()]);
        }
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    let one = d.join("one");
    run_ok(&base(&one, &["--peak-tflops", "1"]));
    assert_mfu_flops(&one, 277_828.0);
    let want = metrics(&one);
    assert_eq!(want.len(), 3);
    assert!(want[2] < want[0], "{want:?}");
    for (tag, flags) in [
        ("usp", vec!["--ranks", "4", "--ulysses", "2", "--ring", "2"]),
        (
            "tp-sp-zero3",
            vec![
                "--ranks",
                "4",
                "--tp",
                "2",
                "--ring",
                "2",
                "--tp-sp",
                "--zero",
                "3",
                "--checkpointing",
                "full",
            ],
        ),
        // Pipeline stages: the tower and projector on the first.
        ("pp2", vec!["--ranks", "2", "--pp", "2"]),
        ("pp2-tp2", vec!["--ranks", "4", "--pp", "2", "--tp", "2"]),
    ] {
        let out = d.join(tag);
        run_ok(&base(&out, &flags));
        assert_eq!(metrics(&out).len(), want.len(), "{tag}: steps");
        for (a, b) in metrics(&out).iter().zip(&want) {
            assert!((a - b).abs() / b < 1e-5, "{tag}: {a} vs {b}");
        }
    }
    // Projector-only pretraining: the tower and the language model are saved unchanged.
    let frozen = d.join("frozen");
    run_ok(&base(
        &frozen,
        &[
            "--freeze-vision-tower",
            "--freeze-language-model",
            "--peak-tflops",
            "1",
        ],
    ));
    assert_mfu_flops(&frozen, 197_760.0 + 708_736.0 / 96.0);
    let before = candle_core::safetensors::load(
        fixtures("llava/clip/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let after = candle_core::safetensors::load(
        frozen.join("step-3/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert_eq!(before.len(), after.len());
    for (k, w) in &before {
        // Saved in transformers 4's layout: the tower under `vision_tower.vision_model.`.
        let saved = match k.strip_prefix("vision_tower.") {
            Some(rest) => format!("vision_tower.vision_model.{rest}"),
            None => k.clone(),
        };
        testkit::assert_finite(&after[&saved], k);
        let same = testkit::max_abs(&(&after[&saved] - w).unwrap()) == 0.0;
        assert_eq!(same, !k.starts_with("multi_modal_projector"), "{k}");
    }
    // Resuming continues the run exactly.
    let part = d.join("part");
    run_ok(&base(&part, &["--steps", "2", "--decay", "constant"]));
    run_ok(&base(&part, &["--decay", "constant", "--resume"]));
    let whole = d.join("whole");
    run_ok(&base(&whole, &["--decay", "constant"]));
    assert_eq!(metrics(&part), metrics(&whole), "resumed losses");
    // The checkpoint is a LLaVA directory again; evaluated through pipeline stages it gives
    // the loss of one rank.
    let (tokens, pv) = inputs(&d);
    let eval = |extra: &[&str]| -> f64 {
        let mut a = args(&[
            "eval",
            "--model",
            &s(&one.join("step-3")),
            "--tokens",
            &s(&tokens),
            "--pixel-values",
            &s(&pv),
            "--json",
        ]);
        a.extend(extra.iter().map(|x| x.to_string()));
        loss(&run_ok(&a))
    };
    let eval_one = eval(&[]);
    for flags in [
        &["--ranks", "2", "--pp", "2"][..],
        &["--ranks", "4", "--pp", "2", "--tp", "2"][..],
    ] {
        let got = eval(flags);
        assert!(
            (got - eval_one).abs() <= 1e-5 * eval_one.abs() && got.is_finite(),
            "eval {flags:?}: {got} vs {eval_one}"
        );
    }
    // Generation runs on it (the tiny model may well answer with its end-of-sequence token).
    run_ok(&args(&[
        "generate",
        "--model",
        &s(&one.join("step-3")),
        "--image",
        &s(&image("a.png")),
        "--prompt",
        "what is this?",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
    ]));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_multimodal_input_fails_with_a_clear_error() {
    let d = tmpdir("llava-bad");
    let (tokens, _) = inputs(&d);
    let corrupt = d.join("corrupt.png");
    std::fs::write(&corrupt, b"\x89PNG\r\n\x1a\n not an image").unwrap();
    let mismatch = d.join("mismatch.jsonl");
    std::fs::write(
        &mismatch,
        serde_json::json!({"messages": [{"role": "user", "content": "<image><image> two?"}, {"role": "assistant", "content": "one"}], "images": [s(&image("a.png"))]}).to_string() + "\n",
    )
    .unwrap();
    let bad_tower = d.join("badtower");
    std::fs::create_dir_all(&bad_tower).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
    ] {
        std::fs::copy(fixtures("llava/clip").join(f), bad_tower.join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(bad_tower.join("config.json")).unwrap();
    std::fs::write(
        bad_tower.join("config.json"),
        cfg.replace("clip_vision_model", "dino_vision_model"),
    )
    .unwrap();
    let (t, c, m, b) = (s(&tokens), s(&corrupt), s(&mismatch), s(&bad_tower));
    let a = s(&image("a.png"));
    let out = s(&d.join("out"));
    assert_clear_errors(&[
        (
            args(&[
                "eval",
                "--model",
                &model("clip"),
                "--tokens",
                &t,
                "--images",
                &a,
            ]),
            "image",
        ),
        (
            args(&[
                "eval",
                "--model",
                &model("clip"),
                "--tokens",
                &t,
                "--images",
                "/nonexistent/x.png",
            ]),
            "/nonexistent/x.png",
        ),
        (
            args(&[
                "eval",
                "--model",
                &model("clip"),
                "--tokens",
                &t,
                "--images",
                &c,
            ]),
            "corrupt.png",
        ),
        (
            args(&["eval", "--model", &b, "--tokens", &t, "--images", &a]),
            "dino_vision_model",
        ),
        (
            args(&[
                "train",
                "--model",
                &model("clip"),
                "--data",
                &m,
                "--seq-len",
                "96",
                "--steps",
                "1",
                "--out",
                &out,
            ]),
            "2 <image> placeholder(s) but 1 image(s)",
        ),
        (
            args(&[
                "eval",
                "--model",
                &model("..").replace("llava/..", "llama/mha"),
                "--tokens",
                &t,
                "--images",
                &a,
            ]),
            "not one",
        ),
        (
            args(&[
                "train",
                "--model",
                &model("clip"),
                "--data",
                &m,
                "--template",
                "nosuch",
                "--out",
                &out,
            ]),
            "--template",
        ),
        (
            args(&[
                "train",
                "--model",
                &model("clip"),
                "--tokens",
                &t,
                "--out",
                &out,
            ]),
            "--tokens",
        ),
    ]);
    let _ = std::fs::remove_dir_all(&d);
}

/// `--resume` is proven (see `common::resume`) for LLaVA training under tp 2: killed by SIGKILL
/// after step 3, resumed from step-2, equal to the uninterrupted run bit for bit, the earlier
/// steps not recomputed, and unlike a run from the checkpoint's weights alone.
#[test]
fn resume_is_proven_for_llava_training() {
    let d = tmpdir("llava-resume-proof");
    let data = conversations(&d);
    let case = common::resume::ResumeCase {
        name: "llava-tp2",
        args: args(&[
            "train",
            "--model",
            &model("clip"),
            "--data",
            &s(&data),
            "--seq-len",
            "96",
            "--grad-accum",
            "2",
            "--lr",
            "1e-3",
            "--warmup",
            "1",
            "--ranks",
            "2",
            "--tp",
            "2",
        ]),
        weights_flag: "--model",
    };
    common::resume::prove_resume(&case, &d);
    let _ = std::fs::remove_dir_all(&d);
}
