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
                worst = worst.max(d / tol);
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
