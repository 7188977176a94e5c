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
