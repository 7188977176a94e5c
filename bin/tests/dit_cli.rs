//! `cpl train`, `eval`, `generate` and `inspect` on a DiT (the diffusers fixture of
//! `tests/fixtures/dit/tiny` and the bundled digits model), end to end.
//!
//! Asserted: `cpl eval` writes the model output of diffusers' inputs (3e-5 relative, see
//! `tests/dit.rs` for why not 1e-5) and prints the DDPM loss of the float64 reference (1e-5),
//! the same under ring 2 and tp 2; training under a layout equals one rank step by step
//! (1e-5), a resumed run equals the uninterrupted one exactly, checkpoints reload in eval;
//! generation writes a PNG grid of the asked size; training from scratch on image folders;
//! bad input fails with exit code 1 and a message naming the file, tensor or flag.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

mod common;
use common::{assert_clear_errors, cpl, stderr, stdout, tmpdir, words};

use candle_core::{DType, Device, Tensor};

fn tiny() -> PathBuf {
    common::fixtures("dit/tiny")
}

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(tiny().join("reference.safetensors"), &Device::Cpu).unwrap()
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    testkit::rel_err(a, b)
}

/// An `--inputs` file of the fixture's forward batch (and the DDPM batch with `noise`).
fn inputs(dir: &Path) -> (PathBuf, PathBuf) {
    let r = reference();
    let fwd = dir.join("fwd.safetensors");
    candle_core::safetensors::save(
        &HashMap::from([
            ("sample".to_string(), r["fwd.sample"].clone()),
            ("timestep".to_string(), r["fwd.timestep"].clone()),
            ("class_labels".to_string(), r["fwd.class_labels"].clone()),
        ]),
        &fwd,
    )
    .unwrap();
    let ddpm = dir.join("ddpm.safetensors");
    candle_core::safetensors::save(
        &HashMap::from([
            ("sample".to_string(), r["ddpm.x0"].clone()),
            ("timestep".to_string(), r["ddpm.t"].clone()),
            ("class_labels".to_string(), r["ddpm.labels"].clone()),
            ("noise".to_string(), r["ddpm.noise"].clone()),
        ]),
        &ddpm,
    )
    .unwrap();
    (fwd, ddpm)
}

#[test]
fn eval_matches_diffusers_under_layouts() {
    let dir = tmpdir("dit-eval");
    let (fwd, ddpm) = inputs(&dir);
    let r = reference();
    let loss64 = r["ddpm.loss64"].to_scalar::<f32>().unwrap() as f64;
    for layout in ["", "--ranks 2 --ring 2", "--ranks 2 --tp 2"] {
        let out = dir.join("out.safetensors");
        let o = cpl(&words(&format!(
            "eval --model {} --inputs {} --outputs-out {} --json {layout}",
            tiny().display(),
            fwd.display(),
            out.display()
        )));
        assert!(o.status.success(), "{layout}: {}", stderr(&o));
        let y = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
        let e = rel_err(&y["sample"], &r["fwd.output"]);
        assert!(e <= 3e-5, "{layout}: output rel err {e:e}");
        let o = cpl(&words(&format!(
            "eval --model {} --inputs {} --json {layout}",
            tiny().display(),
            ddpm.display()
        )));
        assert!(o.status.success(), "{layout}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        let loss = v["loss"].as_f64().unwrap();
        assert!(
            (loss - loss64).abs() <= 1e-5 * loss64,
            "{layout}: loss {loss} vs float64 {loss64}"
        );
    }
}

/// `key` of every line of `out/metrics.jsonl`.
fn metric(out: &Path, key: &str) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()[key]
                .as_f64()
                .unwrap()
        })
        .collect()
}

fn losses(out: &Path) -> Vec<f64> {
    metric(out, "loss")
}

/// 32 latents of 4x8x8 (the fixture's shape) with labels 0..9.
fn latents(dir: &Path) -> PathBuf {
    let n = 32;
    let v: Vec<f32> = (0..n * 256)
        .map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0)
        .collect();
    let labels: Vec<i64> = (0..n as i64).map(|i| i % 10).collect();
    let path = dir.join("latents.safetensors");
    candle_core::safetensors::save(
        &HashMap::from([
            (
                "latents".to_string(),
                Tensor::from_vec(v, (n, 4, 8, 8), &Device::Cpu).unwrap(),
            ),
            (
                "labels".to_string(),
                Tensor::from_vec(labels, n, &Device::Cpu).unwrap(),
            ),
        ]),
        &path,
    )
    .unwrap();
    path
}

#[test]
fn train_layouts_resume_and_reload() {
    let dir = tmpdir("dit-train");
    let data = latents(&dir);
    let common = format!(
        "train --model {} --data {} --steps 4 --batch 2 --grad-accum 2 --lr 1e-3 --warmup 1 --log-every 1",
        tiny().display(),
        data.display()
    );
    let run = |name: &str, extra: &str| -> PathBuf {
        let out = dir.join(name);
        // The same global batch (4 images: dp x batch x grad-accum) on every layout.
        let line = format!("{common} --out {} {extra}", out.display());
        let line = if extra.contains("--dp 2") {
            line.replace("--grad-accum 2", "--grad-accum 1")
        } else {
            line
        };
        let o = cpl(&words(&line));
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        out
    };
    let single_out = run("single", "");
    let single = losses(&single_out);
    let single_norms = metric(&single_out, "grad_norm");
    assert_eq!(single.len(), 4);
    // Losses and global gradient norms (Adam's update hides a gradient's scale; the norm
    // does not) step by step.
    for (name, extra) in [
        ("ring2", "--ranks 2 --ring 2 --zero 3 --checkpointing full"),
        ("tp2-dp2", "--ranks 4 --tp 2 --dp 2 --objective ddpm"),
        ("pp2-1f1b", "--ranks 2 --pp 2"),
    ] {
        let out = run(name, extra);
        for (key, want) in [("loss", &single), ("grad_norm", &single_norms)] {
            let got = metric(&out, key);
            assert_eq!(got.len(), want.len(), "{name}: {key}");
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs(),
                    "{name}: step {i}: {key} {a} vs {b}"
                );
            }
        }
    }
    // Stopped after 2 steps and resumed: the same losses to the bit.
    let out = dir.join("resumed");
    let o = cpl(&words(
        &format!("{common} --out {} --save-every 2", out.display())
            .replace("--steps 4", "--steps 2"),
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    let o = cpl(&words(&format!(
        "{common} --out {} --resume",
        out.display()
    )));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(&out), single, "resumed run");
    // The checkpoint is a diffusers directory that eval and inspect read.
    let ckpt = out.join("step-4");
    assert!(ckpt.join("diffusion_pytorch_model.safetensors").is_file());
    let (fwd, _) = inputs(&dir);
    let o = cpl(&words(&format!(
        "eval --model {} --inputs {} --json",
        ckpt.display(),
        fwd.display()
    )));
    assert!(o.status.success(), "{}", stderr(&o));
    let o = cpl(&words(&format!("inspect --model {}", ckpt.display())));
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("DiTTransformer2DModel") && text.contains("16 patch tokens"),
        "{text}"
    );
}

/// Writes an 8x8 grayscale PNG per (class folder, index) under `dir`.
fn image_folders(dir: &Path) -> PathBuf {
    let root = dir.join("images");
    for class in ["a", "b"] {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for i in 0..4u8 {
            let img = image::GrayImage::from_fn(8, 8, |x, y| {
                image::Luma([(x as u8 * 30 + y as u8 * 3 + i * 7) % 255])
            });
            img.save(root.join(class).join(format!("{i}.png"))).unwrap();
        }
    }
    root
}

#[test]
fn from_scratch_on_image_folders_then_generate() {
    let dir = tmpdir("dit-scratch");
    let images = image_folders(&dir);
    let out = dir.join("run");
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/digits/dit");
    let o = cpl(&words(&format!(
        "train --model {} --data {} --from-scratch --steps 3 --batch 4 --grad-accum 1 --out {} --objective flow",
        model.display(),
        images.display(),
        out.display()
    )));
    assert!(o.status.success(), "{}", stderr(&o));
    let l = losses(&out);
    assert!(l.iter().all(|x| x.is_finite() && *x > 0.0), "{l:?}");
    for sampler in ["ddim", "ddpm", "flow"] {
        let png = dir.join(format!("{sampler}.png"));
        let o = cpl(&words(&format!(
            "generate --model {} --class-labels 0,1,1 --steps 4 --guidance 2 --sampler {sampler} --scale 2 --out {}",
            out.join("step-3").display(),
            png.display()
        )));
        assert!(o.status.success(), "{sampler}: {}", stderr(&o));
        let img = image::open(&png).unwrap();
        // 2 columns of 8x8 images at scale 2 with a 2-pixel separator.
        assert_eq!(
            (img.width(), img.height()),
            (2 * 16 + 2, 2 * 16 + 2),
            "{sampler}"
        );
    }
}

#[test]
fn bad_inputs_fail_clearly() {
    let dir = tmpdir("dit-bad");
    let t = tiny().display().to_string();
    let (fwd, _) = inputs(&dir);
    // A 3-channel sample for a 4-channel model, and a file without class labels.
    let bad = dir.join("bad.safetensors");
    candle_core::safetensors::save(
        &HashMap::from([
            (
                "sample".to_string(),
                Tensor::zeros((1, 3, 8, 8), DType::F32, &Device::Cpu).unwrap(),
            ),
            (
                "timestep".to_string(),
                Tensor::new(&[1i64], &Device::Cpu).unwrap(),
            ),
            (
                "class_labels".to_string(),
                Tensor::new(&[1i64], &Device::Cpu).unwrap(),
            ),
        ]),
        &bad,
    )
    .unwrap();
    let nolabels = dir.join("nolabels.safetensors");
    candle_core::safetensors::save(
        &HashMap::from([
            (
                "sample".to_string(),
                Tensor::zeros((1, 4, 8, 8), DType::F32, &Device::Cpu).unwrap(),
            ),
            (
                "timestep".to_string(),
                Tensor::new(&[1i64], &Device::Cpu).unwrap(),
            ),
        ]),
        &nolabels,
    )
    .unwrap();
    let corrupt = dir.join("imgs/a");
    std::fs::create_dir_all(&corrupt).unwrap();
    std::fs::write(corrupt.join("x.png"), b"not a png").unwrap();
    let digits = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/digits");
    let latents4 = latents(&dir);
    let s = |x: &str| words(x);
    assert_clear_errors(&[
        (
            s(&format!("eval --model {t} --inputs {}", bad.display())),
            "in_channels 4",
        ),
        (
            s(&format!("eval --model {t} --inputs {}", nolabels.display())),
            "class_labels",
        ),
        (s(&format!("eval --model {t}")), "--inputs"),
        (
            s(&format!(
                "eval --model {t} --inputs {} --ranks 3 --ring 3",
                fwd.display()
            )),
            "16 patch tokens",
        ),
        (
            s(&format!("generate --model {t} --steps 4")),
            "--class-labels",
        ),
        (
            s(&format!("generate --model {t} --class-labels 3,x")),
            "`x`",
        ),
        (
            s(&format!("generate --model {t} --class-labels 10")),
            "not a class",
        ),
        (
            s(&format!(
                "train --model {}/dit --data {} --from-scratch --steps 1 --out {}",
                digits.display(),
                dir.join("imgs").display(),
                dir.join("o").display()
            )),
            "x.png",
        ),
        (
            s(&format!(
                "train --model {}/dit --data {} --steps 1 --from-scratch --out {}",
                digits.display(),
                latents4.display(),
                dir.join("o2").display()
            )),
            "latents",
        ),
        (
            s(&format!(
                "train --model {t} --steps 1 --out {}",
                dir.join("o3").display()
            )),
            "--data",
        ),
    ]);
}

/// A DiT whose patch count is not a multiple of 2 x ring (12x12 images in 2x2 patches: 36
/// tokens on ring 4) trains with the default ring layout, contiguous for full attention (zigzag
/// would need a multiple of 8), with the losses of one rank; an explicit --ring-layout zigzag
/// is still honoured, and refused with a clear error.
#[test]
fn full_attention_defaults_to_the_contiguous_ring_layout() {
    let dir = tmpdir("dit-36");
    let root = dir.join("images");
    for class in ["a", "b"] {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for i in 0..2u8 {
            let img = image::GrayImage::from_fn(12, 12, |x, y| {
                image::Luma([((x * 20 + y * 5) as u8).wrapping_add(i * 9)])
            });
            img.save(root.join(class).join(format!("{i}.png"))).unwrap();
        }
    }
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let digits = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/digits/dit/config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(digits).unwrap()).unwrap();
    cfg["sample_size"] = 12.into();
    cfg["num_embeds_ada_norm"] = 2.into();
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    let run = |tag: &str, extra: &str| {
        let out = dir.join(tag);
        let o = cpl(&words(&format!(
            "train --model {} --data {} --from-scratch --steps 2 --batch 2 --grad-accum 1 --out {} {extra}",
            model.display(),
            root.display(),
            out.display()
        )));
        (o, out)
    };
    let (o, one) = run("one", "");
    assert!(o.status.success(), "{}", stderr(&o));
    let (o, ring) = run("ring4", "--ranks 4 --ring 4");
    assert!(o.status.success(), "{}", stderr(&o));
    let (want, got) = (losses(&one), losses(&ring));
    assert_eq!(want.len(), 2);
    assert_eq!(got.len(), want.len(), "ring4 steps");
    for (a, b) in got.iter().zip(&want) {
        testkit::assert_close_scalar(*a, *b, 1e-5, "ring4 (contiguous) vs one rank");
    }
    let (o, _) = run("zigzag", "--ranks 4 --ring 4 --ring-layout zigzag");
    assert!(
        !o.status.success(),
        "zigzag over 36 tokens on ring 4 must be refused"
    );
    assert!(stderr(&o).contains("36 patch tokens"), "{}", stderr(&o));
}

/// `--resume` is proven (see `common::resume`) for DiT training under ring 2: killed by SIGKILL
/// after step 3, resumed from step-2, equal to the uninterrupted run bit for bit, the earlier
/// steps not recomputed, and unlike a run from the checkpoint's weights alone.
#[test]
fn resume_is_proven_for_dit_training() {
    let dir = tmpdir("dit-resume-proof");
    let data = latents(&dir);
    let line = format!(
        "train --model {} --data {} --batch 2 --grad-accum 2 --lr 1e-3 --warmup 1 --ranks 2 --ring 2",
        tiny().display(),
        data.display()
    );
    let case = common::resume::ResumeCase {
        name: "dit-ring2",
        args: words(&line),
        weights_flag: "--model",
    };
    common::resume::prove_resume(&case, &dir);
    std::fs::remove_dir_all(&dir).unwrap();
}
