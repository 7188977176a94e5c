//! `models::rope_override` against what transformers saves for the same settings
//! (`tests/fixtures/rope_override/cases.json`, from `scripts/make_rope_override_fixtures.py`):
//! for a v5 flat config, a v4 config and a v5 per-layer-type config, every case's written
//! `config.json` must give transformers' saved `rope_parameters` (the v4 form after
//! transformers' own merge of `rope_scaling` and `rope_theta`) and `max_position_embeddings`
//! exactly, and load through its family; bad overrides are errors naming the flag.

use std::path::{Path, PathBuf};

use models::rope_override::{RopeOverride, RopeScalingArgs};
use serde_json::{json, Map, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn parse_override(v: &Value) -> RopeOverride {
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64);
    let int = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as usize);
    RopeOverride {
        theta: num(v, "theta"),
        max_position_embeddings: int(v, "max_position_embeddings"),
        scaling: v.get("scaling").map(|s| RopeScalingArgs {
            rope_type: s["rope_type"].as_str().expect("rope_type").to_string(),
            factor: num(s, "factor"),
            original_max_position_embeddings: int(s, "original_max_position_embeddings"),
            low_freq_factor: num(s, "low_freq_factor"),
            high_freq_factor: num(s, "high_freq_factor"),
            beta_fast: num(s, "beta_fast"),
            beta_slow: num(s, "beta_slow"),
            attention_factor: num(s, "attention_factor"),
            short_factor: None,
            long_factor: None,
        }),
    }
}

/// The RoPE parameters transformers computes from a config (v4 keys merged as it does).
fn standardized(doc: &Value) -> Value {
    if let Some(rp) = doc.get("rope_parameters") {
        return rp.clone();
    }
    let mut m = match doc.get("rope_scaling") {
        Some(Value::Object(s)) => s.clone(),
        _ => Map::from_iter([("rope_type".to_string(), json!("default"))]),
    };
    if let Some(t) = doc.get("rope_theta") {
        m.insert("rope_theta".into(), t.clone());
    }
    Value::Object(m)
}

#[test]
fn overrides_write_what_transformers_saves() {
    let root = root();
    let text = std::fs::read_to_string(root.join("tests/fixtures/rope_override/cases.json"))
        .expect("cases.json (scripts/make_rope_override_fixtures.py)");
    let fixture: Value = serde_json::from_str(&text).expect("json");
    let cases = fixture["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 21, "3 inputs x 7 cases");
    let tmp = std::env::temp_dir().join(format!("cpl-rope-override-{}", std::process::id()));
    for case in cases {
        let input = case["input"].as_str().expect("input");
        let name = case["name"].as_str().expect("name");
        let dir = root.join(fixture["inputs"][input].as_str().expect("input path"));
        let config = dir.join("config.json");
        let text = std::fs::read_to_string(&config).expect("input config");
        let ov = parse_override(&case["override"]);
        let out = ov.apply(&text, &config).expect("apply");
        let doc: Value = serde_json::from_str(&out).expect("output json");
        let what = format!("{input} {name}");
        assert_eq!(
            standardized(&doc),
            case["saved"]["rope_parameters"],
            "{what}: rope parameters"
        );
        assert_eq!(
            doc["max_position_embeddings"], case["saved"]["max_position_embeddings"],
            "{what}: max_position_embeddings"
        );
        // The form is kept: v4 stays v4.
        assert_eq!(
            doc.get("rope_parameters").is_some(),
            input != "v4",
            "{what}: form"
        );
        // Every other key is untouched.
        let before: Value = serde_json::from_str(&text).expect("json");
        for (k, v) in before.as_object().expect("object") {
            if !k.starts_with("rope") && k != "max_position_embeddings" {
                assert_eq!(&doc[k], v, "{what}: {k} changed");
            }
        }
        // It loads through its family.
        let d = tmp.join(format!("{input}-{name}"));
        std::fs::create_dir_all(&d).expect("tmp");
        std::fs::write(d.join("config.json"), &out).expect("write");
        let family = models::family::detect(&d.join("config.json")).expect("family");
        (family.describe)(&d.join("config.json"))
            .unwrap_or_else(|e| panic!("{what}: written config does not load: {e}"));
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn applying_twice_changes_nothing() {
    let config = root().join("assets/default/model/config.json");
    let text = std::fs::read_to_string(&config).expect("config");
    let ov = RopeOverride {
        theta: Some(50000.0),
        scaling: Some(RopeScalingArgs {
            rope_type: "yarn".into(),
            factor: Some(16.0),
            ..Default::default()
        }),
        max_position_embeddings: None,
    };
    let once = ov.apply(&text, &config).expect("once");
    // A second application (a resumed run) reads original = 2048 now: the caller compares
    // configs, so the explicit original keeps it stable.
    let explicit = RopeOverride {
        scaling: Some(RopeScalingArgs {
            original_max_position_embeddings: Some(128),
            ..ov.scaling.clone().expect("scaling")
        }),
        ..ov.clone()
    };
    assert_eq!(explicit.apply(&once, &config).expect("twice"), once);
    assert!(!ov.is_empty() && RopeOverride::default().is_empty());
}

#[test]
fn bad_overrides_name_the_flag() {
    let config = root().join("assets/default/model/config.json");
    let text = std::fs::read_to_string(&config).expect("config");
    let scaling = |t: &str| RopeScalingArgs {
        rope_type: t.into(),
        ..Default::default()
    };
    let with = |s: RopeScalingArgs| RopeOverride {
        scaling: Some(s),
        ..Default::default()
    };
    let cases: Vec<(RopeOverride, &str)> = vec![
        (
            with(RopeScalingArgs {
                factor: Some(1.0),
                ..scaling("yarn")
            }),
            "--rope-factor 1: must be > 1",
        ),
        (
            with(RopeScalingArgs {
                factor: Some(0.5),
                ..scaling("linear")
            }),
            "--rope-factor 0.5",
        ),
        (
            with(scaling("yarn")),
            "--rope-scaling yarn needs --rope-factor",
        ),
        (
            with(RopeScalingArgs {
                factor: Some(4.0),
                beta_fast: Some(32.0),
                ..scaling("linear")
            }),
            "--rope-beta-fast: --rope-scaling linear does not take it",
        ),
        (
            with(RopeScalingArgs {
                factor: Some(4.0),
                ..scaling("ntk")
            }),
            "--rope-scaling ntk: not a RoPE type",
        ),
        (
            with(RopeScalingArgs {
                factor: Some(8.0),
                low_freq_factor: Some(4.0),
                high_freq_factor: Some(1.0),
                ..scaling("llama3")
            }),
            "--rope-high-freq-factor 1 must be above",
        ),
        (
            with(RopeScalingArgs {
                factor: Some(4.0),
                ..scaling("default")
            }),
            "--rope-factor: --rope-scaling default does not take it",
        ),
        (
            with(RopeScalingArgs {
                short_factor: Some(vec![1.0]),
                long_factor: Some(vec![]),
                ..scaling("longrope")
            }),
            "--rope-long-factor: a list of positive factors",
        ),
        (
            RopeOverride {
                theta: Some(-1.0),
                ..Default::default()
            },
            "--rope-theta -1",
        ),
        (
            RopeOverride {
                max_position_embeddings: Some(0),
                ..Default::default()
            },
            "--max-position-embeddings must be >= 1",
        ),
    ];
    for (ov, needle) in cases {
        let e = ov.apply(&text, &config).expect_err(needle).to_string();
        assert!(e.contains(needle), "{e:?} should contain {needle:?}");
        assert!(e.contains("config.json"), "{e:?} names the file");
    }
    // A per-layer-type config without a full_attention entry is ambiguous.
    let nested = r#"{"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1.0}, "chunked": {"rope_type": "default"}}}"#;
    let e = RopeOverride {
        theta: Some(2.0),
        ..Default::default()
    }
    .apply(nested, &config)
    .expect_err("ambiguous")
    .to_string();
    assert!(e.contains("full_attention"), "{e}");
    assert!(RopeOverride::default()
        .apply("[1]", &config)
        .expect_err("not an object")
        .to_string()
        .contains("not a JSON object"));
}
