//! RoPE against transformers 5.23: every fixture of `scripts/make_rope_fixtures.py`
//! (`tests/fixtures/rope/*.json`: each RoPE type, v4 and v5 config forms, Gemma 3's per-layer-type
//! forms, Phi-3's partial rotation) parsed by [`models::rope`] and compared with the inverse
//! frequencies, attention factor, cos/sin rows (forward and generation with a KV cache) and
//! rotated rows transformers' own rotary modules compute; then the config parsing itself: each
//! form of the same parameters gives the same spec, bad inputs give errors naming the field.
//!
//! Tolerances (transformers and we compute in f32 with the same sequence of roundings, see
//! `candle_parallel::ops::inv_freq`; the only steps that may differ are `pow`, `cos` and `sin`,
//! which torch and Rust's libm each evaluate to within about 1 ulp):
//! - `inv_freq`: 1 ulp (one `pow` rounding apart, then the same exact f32 steps);
//! - cos/sin: `2 ulp(value) + |angle| · 2^-23 · attention_factor`: 2 ulp for the two libraries'
//!   `cos`/`sin` (and the attention-factor product rounded once on each side), and the angle
//!   `pos · inv_freq` (the same f32 product) may differ by 1 ulp of itself when `inv_freq` does,
//!   which moves cos/sin by at most `|angle| · 2^-23`;
//! - attention factor: 1e-15 relative (both f64, the same formula);
//! - rotated rows: `1e-6 · (|q| · |cos| + |rotate_half(q)| · |sin|)` summed, i.e. f32 rounding of
//!   the two products and the sum (transformers' reference is float64 from f32 cos/sin and q).

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use candle_parallel::ops::{RopeScaling, RotaryEmbedding};
use models::llama::LlamaConfig;
use models::rope::{RopeFields, RopeSpec};
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/rope")
}

fn fixtures() -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = std::fs::read_dir(fixture_dir())
        .expect("tests/fixtures/rope (scripts/make_rope_fixtures.py)")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            let v = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            (name, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        out.len() >= 20,
        "expected the RoPE fixtures, found {}",
        out.len()
    );
    out
}

fn usize_of(v: &Value) -> Option<usize> {
    v.as_u64().map(|x| x as usize)
}

/// The spec a family's config gives for `layer_type`, as that family reads its config.json.
fn spec_of(family: &str, cfg: &Value, layer_type: Option<&str>) -> models::Result<RopeSpec> {
    let path = Path::new("config.json");
    match family {
        "llama" => LlamaConfig::from_json(&cfg.to_string(), path)?.rope_spec(path),
        "phi3" | "gemma3" => {
            let head_dim = usize_of(&cfg["head_dim"]).unwrap_or_else(|| {
                usize_of(&cfg["hidden_size"]).unwrap()
                    / usize_of(&cfg["num_attention_heads"]).unwrap()
            });
            let mut f = RopeFields {
                rope_theta: cfg["rope_theta"].as_f64(),
                rope_scaling: cfg.get("rope_scaling"),
                rope_parameters: cfg.get("rope_parameters"),
                partial_rotary_factor: cfg["partial_rotary_factor"].as_f64(),
                ..RopeFields::new(head_dim, usize_of(&cfg["max_position_embeddings"]).unwrap())
            };
            if family == "phi3" {
                // Phi3Config declares `original_max_position_embeddings` (default 4096).
                f.original_max_position_embeddings =
                    Some(usize_of(&cfg["original_max_position_embeddings"]).unwrap_or(4096));
                f.resolve(path)
            } else {
                f.gemma3_layer(layer_type.unwrap(), cfg["rope_local_base_freq"].as_f64())
                    .resolve(path)
            }
        }
        other => panic!("unknown family {other}"),
    }
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn ulp(x: f32) -> f64 {
    let x = x.abs().max(f32::MIN_POSITIVE);
    let next = f32::from_bits(x.to_bits() + 1);
    (next - x) as f64
}

/// Checks cos/sin rows of `rope` at `positions` of a sequence of `seq_len` against the fixture's.
fn check_rows(
    what: &str,
    rope: &RotaryEmbedding,
    positions: &[u32],
    seq_len: usize,
    want_cos: &[Vec<f64>],
    want_sin: &[Vec<f64>],
) -> f64 {
    let (cos, sin) = rope.cos_sin_rows(positions, seq_len);
    let inv = rope.inv_freq_at(seq_len);
    let af = rope.attention_factor();
    let mut worst = 0f64;
    for (r, &p) in positions.iter().enumerate() {
        for (got, want, name) in [
            (&cos[r], &want_cos[r], "cos"),
            (&sin[r], &want_sin[r], "sin"),
        ] {
            assert_eq!(got.len(), want.len(), "{what}: {name} row width at {p}");
            for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
                let angle = (p as f32 * inv[j % inv.len()]).abs() as f64;
                let tol = 2.0 * ulp(w as f32) + angle * 2f64.powi(-23) * af;
                let d = (g as f64 - w).abs();
                worst = worst.max(d / tol); // nan-ok: every d is asserted <= tol just below (NaN fails it)
                assert!(
                    d <= tol,
                    "{what}: {name}[{p}][{j}] = {g}, transformers {w} (diff {d:e}, tol {tol:e})"
                );
            }
        }
    }
    worst
}

fn rows(v: &Value) -> Vec<Vec<f64>> {
    v.as_array().unwrap().iter().map(floats).collect()
}

#[test]
fn every_fixture_matches_transformers() {
    for (name, fx) in fixtures() {
        let family = fx["family"].as_str().unwrap();
        let cfg = &fx["config"];
        for layer in fx["layers"].as_array().unwrap() {
            let layer_type = layer["layer_type"].as_str();
            let what = format!("{name}/{}", layer_type.unwrap_or("-"));
            let spec = spec_of(family, cfg, layer_type).unwrap_or_else(|e| panic!("{what}: {e}"));
            let rope = spec.embedding().unwrap();
            for case in layer["cases"].as_array().unwrap() {
                let seq_len = usize_of(&case["seq_len"]).unwrap();
                let what = format!("{what} at seq_len {seq_len}");
                // The frequencies and attention factor the module used.
                let want = floats(&case["inv_freq"]);
                let got = rope.inv_freq_at(seq_len);
                assert_eq!(got.len(), want.len(), "{what}: number of frequencies");
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let d = (g as f64 - w).abs();
                    assert!(
                        d <= ulp(w as f32),
                        "{what}: inv_freq[{i}] = {g:e}, transformers {w:e}"
                    );
                }
                let af = case["attention_scaling"].as_f64().unwrap();
                assert!(
                    (rope.attention_factor() - af).abs() <= 1e-15 * af.abs(),
                    "{what}: attention factor {} vs {af}",
                    rope.attention_factor()
                );
                let positions: Vec<u32> = case["positions"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p.as_u64().unwrap() as u32)
                    .collect();
                check_rows(
                    &what,
                    &rope,
                    &positions,
                    seq_len,
                    &rows(&case["cos"]),
                    &rows(&case["sin"]),
                );
                if let Some(q) = case.get("q") {
                    let q = rows(q);
                    let want = rows(&case["rotated"]);
                    let d = spec.head_dim;
                    let flat: Vec<f32> = q.iter().flatten().map(|&v| v as f32).collect();
                    let x =
                        Tensor::from_vec(flat, (1, positions.len(), 1, d), &Device::Cpu).unwrap();
                    // The positions of a sequence of seq_len tokens, as one rank holding a shard.
                    let got = rope.apply_seq(&x, &positions, seq_len).unwrap();
                    let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
                    let (cos, sin) = rope.cos_sin_rows(&positions, seq_len);
                    let h = rope.rotated_dims() / 2;
                    for (r, wrow) in want.iter().enumerate() {
                        for (j, &w) in wrow.iter().enumerate() {
                            let g = got[r * d + j] as f64;
                            let tol = if j < 2 * h {
                                let partner = if j < h { q[r][j + h] } else { q[r][j - h] };
                                1e-6 * (q[r][j].abs() * cos[r][j].abs() as f64
                                    + partner.abs() * sin[r][j].abs() as f64)
                            } else {
                                // Passed through unchanged (up to serde_json's parsing of
                                // the f64 text, not always correctly rounded).
                                4.0 * f64::EPSILON * w.abs()
                            };
                            assert!(
                                (g - w).abs() <= tol,
                                "{what}: rotated row {r} dim {j}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
            // Generation with a KV cache: each call's last position rotated with the
            // frequencies of the sequence so far (`max(position_ids) + 1`).
            if let Some(generation) = layer.get("generation") {
                for (step, call) in generation.as_array().unwrap().iter().enumerate() {
                    let positions: Vec<u32> = call["positions"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|p| p.as_u64().unwrap() as u32)
                        .collect();
                    let last = *positions.last().unwrap();
                    let seq_len = *positions.iter().max().unwrap() as usize + 1;
                    check_rows(
                        &format!("{what}: generation step {step}"),
                        &rope,
                        &[last],
                        seq_len,
                        &[floats(&call["cos"])],
                        &[floats(&call["sin"])],
                    );
                }
            }
        }
    }
}

/// A LLaMA config.json with the given RoPE keys (head_dim 16, max_position_embeddings 128).
fn llama_json(rope_keys: &str) -> String {
    let sep = if rope_keys.is_empty() { "" } else { "," };
    format!(
        r#"{{"hidden_size": 32, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "head_dim": 16, "vocab_size": 16,
            "max_position_embeddings": 128{sep} {rope_keys}}}"#
    )
}

fn llama_spec(rope_keys: &str) -> models::Result<RopeSpec> {
    let path = Path::new("config.json");
    LlamaConfig::from_json(&llama_json(rope_keys), path)?.rope_spec(path)
}

/// Each config form of the same parameters parses to the same spec: v4 `rope_theta` +
/// `rope_scaling` with `type` or `rope_type`, v5 `rope_parameters` (theta inside, or the
/// top-level one as fallback), for every type.
#[test]
fn every_config_form_gives_the_same_spec() {
    let params = [
        r#""factor": 4.0"#,
        r#""factor": 2.0"#,
        r#""factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16, "mscale": 0.7, "mscale_all_dim": 1.0, "truncate": false"#,
        r#""short_factor": [1,1,1,1,2,2,2,2], "long_factor": [1,2,3,4,5,6,7,8], "original_max_position_embeddings": 32"#,
        r#""factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32"#,
    ];
    for (kind, p) in ["linear", "dynamic", "yarn", "longrope", "llama3"]
        .iter()
        .zip(params)
    {
        let forms = [
            format!(r#""rope_theta": 50000.0, "rope_scaling": {{"type": "{kind}", {p}}}"#),
            format!(r#""rope_theta": 50000.0, "rope_scaling": {{"rope_type": "{kind}", {p}}}"#),
            format!(r#""rope_parameters": {{"rope_type": "{kind}", "rope_theta": 50000, {p}}}"#),
            format!(r#""rope_theta": 50000.0, "rope_parameters": {{"rope_type": "{kind}", {p}}}"#),
            // transformers: a non-empty rope_scaling wins over rope_parameters.
            format!(
                r#""rope_theta": 50000.0, "rope_scaling": {{"type": "{kind}", {p}}},
                   "rope_parameters": {{"rope_type": "default", "rope_theta": 7.0}}"#
            ),
        ];
        let specs: Vec<RopeSpec> = forms
            .iter()
            .map(|f| llama_spec(f).unwrap_or_else(|e| panic!("{kind}: {f}: {e}")))
            .collect();
        assert_eq!(specs[0].scaling.name(), *kind);
        assert_eq!(specs[0].theta, 50000.0);
        for (f, s) in forms.iter().zip(&specs) {
            assert_eq!(s, &specs[0], "{kind}: {f}");
        }
        // The embedding of every form rotates identically (same frequencies at every length).
        let a = specs[0].embedding().unwrap();
        let b = specs[2].embedding().unwrap();
        for len in [8, 32, 33, 128, 300] {
            assert_eq!(a.inv_freq_at(len), b.inv_freq_at(len), "{kind} at {len}");
        }
    }
    // No keys, an empty rope_scaling, and explicit defaults: base 10000, default type.
    for form in [
        "",
        r#""rope_scaling": {}"#,
        r#""rope_scaling": null, "rope_theta": 10000"#,
        r#""rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}"#,
    ] {
        let s = llama_spec(form).unwrap();
        assert_eq!(
            (s.theta, &s.scaling, s.dim),
            (10000.0, &RopeScaling::Default, 16),
            "{form}"
        );
    }
}

/// Defaults as transformers applies them: `original_max_position_embeddings` from
/// `max_position_embeddings` (overridden by a top-level key), yarn's attention factor from
/// `factor`/`mscale`, betas 32/1 (also for 0), longrope's from `max_position_embeddings /
/// original`.
#[test]
fn defaults_follow_transformers() {
    let s = llama_spec(r#""rope_scaling": {"type": "yarn", "factor": 4.0}"#).unwrap();
    let RopeScaling::Yarn {
        original_max_position_embeddings,
        beta_fast,
        beta_slow,
        truncate,
        attention_factor,
        ..
    } = s.scaling
    else {
        panic!("{s:?}")
    };
    assert_eq!(original_max_position_embeddings, 128);
    assert_eq!((beta_fast, beta_slow, truncate), (32.0, 1.0, true));
    assert_eq!(attention_factor, 0.1 * 4f64.ln() + 1.0);
    let s = llama_spec(
        r#""original_max_position_embeddings": 64,
           "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                            "beta_fast": 0, "beta_slow": null}"#,
    )
    .unwrap();
    let RopeScaling::Yarn {
        original_max_position_embeddings,
        beta_fast,
        beta_slow,
        ..
    } = s.scaling
    else {
        panic!("{s:?}")
    };
    assert_eq!(original_max_position_embeddings, 64, "top-level key wins");
    assert_eq!((beta_fast, beta_slow), (32.0, 1.0));
    let s = llama_spec(
        r#""rope_scaling": {"type": "longrope", "original_max_position_embeddings": 32,
                            "short_factor": [1,1,1,1,1,1,1,1], "long_factor": [2,2,2,2,2,2,2,2]}"#,
    )
    .unwrap();
    let want = (1.0 + 4f64.ln() / 32f64.ln()).sqrt();
    assert_eq!(s.scaling.attention_factor(), want);
}

/// Bad inputs are errors naming the field (and, for an unknown type, the supported ones).
#[test]
fn bad_rope_keys_name_the_field() {
    let cases: [(&str, &[&str]); 14] = [
        (
            r#""rope_scaling": {"type": "su", "factor": 2}"#,
            &[
                "rope_scaling.type",
                "`su`",
                "default, linear, dynamic, yarn, longrope, llama3",
            ],
        ),
        (
            r#""rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}"#,
            &["rope_parameters.rope_type", "`proportional`", "longrope"],
        ),
        (
            r#""rope_scaling": {"type": "linear"}"#,
            &["rope_scaling.factor", "linear"],
        ),
        (
            r#""rope_parameters": {"rope_type": "dynamic"}"#,
            &["rope_parameters.factor", "dynamic"],
        ),
        (
            r#""rope_scaling": {"type": "yarn", "original_max_position_embeddings": 32}"#,
            &["rope_scaling.factor", "yarn"],
        ),
        (
            r#""rope_scaling": {"type": "linear", "factor": -2.0}"#,
            &["rope_scaling.factor", "-2"],
        ),
        (
            r#""rope_scaling": {"type": "dynamic", "factor": 0}"#,
            &["rope_scaling.factor", "positive"],
        ),
        (
            r#""rope_scaling": {"type": "linear", "factor": "4"}"#,
            &["rope_scaling.factor", "number"],
        ),
        (
            r#""rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}"#,
            &[
                "rope_scaling.high_freq_factor",
                "rope_scaling.low_freq_factor",
            ],
        ),
        (
            r#""rope_scaling": {"type": "llama3", "factor": 8, "high_freq_factor": 4}"#,
            &["rope_scaling.low_freq_factor"],
        ),
        (
            r#""rope_scaling": {"type": "longrope", "short_factor": [1,1,1], "long_factor": [1,1,1,1,1,1,1,1]}"#,
            &["rope_scaling.short_factor", "3 values", "8 frequencies"],
        ),
        (
            r#""rope_scaling": {"type": "longrope", "short_factor": [1,1,1,1,1,1,1,1]}"#,
            &["rope_scaling.long_factor", "8 numbers"],
        ),
        (
            r#""rope_parameters": {"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 0}"#,
            &["rope_parameters.original_max_position_embeddings"],
        ),
        (
            r#""rope_parameters": {"rope_type": "default", "rope_theta": -1}"#,
            &["rope_parameters.rope_theta"],
        ),
    ];
    for (keys, needles) in cases {
        let e = llama_spec(keys).expect_err(keys).to_string();
        for n in needles {
            assert!(e.contains(n), "{keys}: error `{e}` does not mention `{n}`");
        }
    }
    // Per-layer-type parameters in a model without layer types; partial rotation in LLaMA.
    let e = llama_spec(r#""rope_parameters": {"full_attention": {"rope_type": "default"}}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("per layer type") && e.contains("full_attention"),
        "{e}"
    );
    let e = llama_spec(r#""partial_rotary_factor": 0.5"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("partial_rotary_factor"), "{e}");
    let mut f = RopeFields::new(16, 128);
    f.partial_rotary_factor = Some(1.5);
    let e = f.resolve(Path::new("c.json")).unwrap_err().to_string();
    assert!(
        e.contains("partial_rotary_factor") && e.contains("1.5"),
        "{e}"
    );
}

/// Gemma 3's per-layer-type forms: v5 nested `rope_parameters`, v4 `rope_theta` +
/// `rope_local_base_freq` + `rope_scaling` on global layers, and the defaults (1e6 global, 1e4
/// local) give the same specs; partial rotation (Phi-3) halves the rotated dims.
#[test]
fn per_layer_type_forms_agree() {
    let v5: Value = serde_json::from_str(
        r#"{"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}"#,
    )
    .unwrap();
    let v4_scaling: Value =
        serde_json::from_str(r#"{"rope_type": "linear", "factor": 8.0}"#).unwrap();
    let path = Path::new("config.json");
    for layer in ["sliding_attention", "full_attention"] {
        let nested = RopeFields {
            rope_parameters: Some(&v5),
            ..RopeFields::new(16, 128)
        }
        .gemma3_layer(layer, None)
        .resolve(path)
        .unwrap();
        let v4 = RopeFields {
            rope_theta: Some(1e6),
            rope_scaling: Some(&v4_scaling),
            ..RopeFields::new(16, 128)
        }
        .gemma3_layer(layer, Some(1e4))
        .resolve(path)
        .unwrap();
        let defaults = RopeFields {
            rope_scaling: Some(&v4_scaling),
            ..RopeFields::new(16, 128)
        }
        .gemma3_layer(layer, None)
        .resolve(path)
        .unwrap();
        assert_eq!(nested, v4, "{layer}");
        assert_eq!(nested, defaults, "{layer}");
        let linear = layer == "full_attention";
        assert_eq!(matches!(nested.scaling, RopeScaling::Linear { .. }), linear);
    }
    // A missing layer-type entry is the default type with the layer type's default base.
    let only_full: Value =
        serde_json::from_str(r#"{"full_attention": {"rope_type": "linear", "factor": 2}}"#)
            .unwrap();
    let s = RopeFields {
        rope_parameters: Some(&only_full),
        ..RopeFields::new(16, 128)
    }
    .gemma3_layer("sliding_attention", None)
    .resolve(path)
    .unwrap();
    assert_eq!((s.theta, &s.scaling), (10_000.0, &RopeScaling::Default));
    let s = RopeFields {
        partial_rotary_factor: Some(0.75),
        ..RopeFields::new(16, 128)
    }
    .resolve(path)
    .unwrap();
    assert_eq!((s.dim, s.embedding().unwrap().rotated_dims()), (12, 12));
}
