//! The `cpl` binary end to end: good runs succeed, bad flags give a clear error and exit 1.

mod common;
use common::{assert_clear_errors, cpl, stderr};

#[test]
fn demo_agrees_with_single_rank() {
    let o = cpl(&["demo", "--ranks", "3", "--elems", "12"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("all ranks agree with the single-rank computation"),
        "{out}"
    );
    // all_gather of 12 f32 on 3 ranks: each rank sends its 48 bytes to 2 peers.
    assert!(
        out.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["1", "all_gather", "96", "96"]),
        "{out}"
    );
}

#[test]
fn plan_prints_groups() {
    let o = cpl(&[
        "plan",
        "--ranks",
        "8",
        "--tp",
        "2",
        "--ring",
        "2",
        "--placement",
        "context-first",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("ring groups (4 of 2 ranks): [0, 2]"), "{out}");
    assert!(out.contains("dp groups (4 of 2 ranks): [0, 4]"), "{out}");
}

/// `cpl plan --ep` prints the expert-parallel groups and the groups holding the same experts
/// (the communicators' ranks: `candle-parallel/tests/moe_block.rs`), and with `--model` which
/// experts each position of a group holds; a dense model, an ep that does not divide the
/// experts or the token ranks, and `--auto` with `--ep` are errors naming the flag.
#[test]
fn plan_prints_the_expert_groups() {
    let mixtral = common::fixtures("moe/mixtral");
    let m = mixtral.to_str().unwrap();
    let o = cpl(&[
        "plan", "--ranks", "8", "--ring", "2", "--ep", "4", "--model", m,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in [
        "ring groups (4 of 2 ranks): [0, 1]",
        "ep groups (2 of 4 ranks, carved from ulysses x ring x dp; tokens travel to their experts \
         inside one): [0, 1, 2, 3] [4, 5, 6, 7]",
        "same-expert groups (4 of 2 ranks; the experts' gradients are summed and ZeRO-sharded \
         over one): [0, 4] [1, 5] [2, 6] [3, 7]",
        "8 experts per sparse layer (top-2), 2 per rank: position 0 holds experts 0..2, position \
         1 holds experts 2..4, position 2 holds experts 4..6, position 3 holds experts 6..8",
    ] {
        assert!(out.contains(want), "{want}\n{out}");
    }
    let gqa = common::fixtures("llama/gqa");
    assert_clear_errors(&[
        (
            vec![
                "plan",
                "--ranks",
                "4",
                "--ep",
                "2",
                "--model",
                gqa.to_str().unwrap(),
            ],
            "is not a mixture of experts",
        ),
        (
            vec!["plan", "--ranks", "6", "--ep", "3", "--model", m],
            "--ep 3 does not divide the 8 experts",
        ),
        (
            vec!["plan", "--ranks", "4", "--ep", "3"],
            "--ep 3 does not divide the 4 ranks",
        ),
        (
            vec![
                "plan",
                "--auto",
                "--ep",
                "2",
                "--model",
                m,
                "--seq-len",
                "64",
                "--world",
                "4",
                "--hardware",
                "h100-cluster",
            ],
            "leave out --ranks 1 --ep 2",
        ),
    ]);
}

/// `cpl plan` with a pipeline prints every rank's timetable and the bubble next to the formula
/// (issue 13's example command), for a micro-batch count that is not a multiple of the stages.
#[test]
fn plan_prints_the_pipeline_timetable() {
    let o = cpl(&[
        "plan",
        "--ranks",
        "4",
        "--pp",
        "4",
        "--micro-batches",
        "6",
        "--pp-schedule",
        "interleaved",
        "--virtual-stages",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("interleaved schedule: 4 stages x 6 micro-batches x 2 chunk(s)"),
        "{out}"
    );
    for r in 0..4 {
        assert!(out.contains(&format!("rank {r}: ")), "{out}");
    }
    assert!(out.contains("formula (p-1)/(v*m+p-1) = 20.0%"), "{out}");
    let o = cpl(&[
        "plan",
        "--ranks",
        "2",
        "--pp",
        "2",
        "--micro-batches",
        "3",
        "--pp-schedule",
        "gpipe",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("rank 1: .  F0 F1 F2 B0 -  B1 -  B2 -"),
        "{out}"
    );
}

#[test]
fn bad_pipeline_flags_fail_with_a_clear_error() {
    assert_clear_errors(&[
        (
            vec![
                "plan",
                "--ranks",
                "4",
                "--pp",
                "4",
                "--micro-batches",
                "8",
                "--virtual-stages",
                "2",
            ],
            "need the interleaved schedule",
        ),
        (
            vec![
                "plan",
                "--ranks",
                "2",
                "--pp",
                "2",
                "--pp-schedule",
                "interleaved",
            ],
            "at least 2 model chunks",
        ),
        (
            vec!["plan", "--ranks", "2", "--pp", "2", "--micro-batches", "0"],
            "at least one micro-batch",
        ),
        (
            vec!["plan", "--ranks", "2", "--micro-batches", "4"],
            "give --pp 2 or more",
        ),
        (
            vec![
                "plan",
                "--ranks",
                "2",
                "--pp",
                "2",
                "--pp-schedule",
                "zigzag",
            ],
            "--pp-schedule",
        ),
    ]);
}

#[test]
fn bad_layouts_fail_with_a_clear_error() {
    assert_clear_errors(&[
        (
            vec!["plan", "--ranks", "16", "--tp", "3"],
            "cannot infer --dp",
        ),
        (
            vec!["plan", "--ranks", "8", "--ring", "0", "--dp", "8"],
            "ring degree is 0",
        ),
        (
            vec!["plan", "--ranks", "8", "--tp", "2", "--dp", "2"],
            "but the world has 8 ranks",
        ),
        (
            vec!["plan", "--ranks", "8", "--placement", "sideways"],
            "--placement",
        ),
        (
            vec!["plan", "--ranks", "8", "--order", "tp,ring"],
            "--order",
        ),
        (vec!["demo", "--ranks", "0"], "--ranks"),
        (vec!["demo", "--ranks", "3", "--elems", "10"], "divisible"),
    ]);
}

/// `--device` and `--backend nccl` in a build without the `cuda`/`nccl` features: clear errors
/// naming the flag and the rebuild, never a silent run on the CPU.
#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_flags_without_gpu_features_fail_clearly() {
    let model = common::fixtures("llama/mha");
    let tokens = common::fixtures("llama/tokens.json");
    let (model, tokens) = (model.to_string_lossy(), tokens.to_string_lossy());
    let eval = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["eval", "--model", &model, "--tokens", &tokens]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    assert_clear_errors(&[
        (
            eval(&["--device", "cuda"]),
            "--device cuda:0: this cpl was built without CUDA",
        ),
        (eval(&["--device", "cuda:1"]), "--features cuda"),
        (eval(&["--device", "gpu"]), "expected cpu, cuda or cuda:N"),
        (
            eval(&["--backend", "nccl"]),
            "--backend nccl: this cpl was built without NCCL",
        ),
        (
            ["bench", "attention", "--device", "cuda", "--seqs", "16"]
                .map(String::from)
                .to_vec(),
            "--device cuda:0: this cpl was built without CUDA",
        ),
    ]);
    // The CPU stays the default and `--device cpu` is accepted.
    let o = cpl(&eval(&["--device", "cpu"]));
    assert!(o.status.success(), "{}", stderr(&o));
}
