//! A lint over the workspace's tests: no NaN-blind maximum outside testkit.
//!
//! candle's `max_all`/`min_all` skip a NaN that is not the first element, and `f64::max`
//! (`fold(0.0, f64::max)`, `m.max(x)`) returns the other operand of a NaN, so an error measured
//! with them is small when the result is full of NaNs. This test reads every Rust file under a
//! `tests` directory of the workspace (testkit's own excepted) and fails, naming file and line,
//! on:
//! - `.max_all(` / `.min_all(`;
//! - the paths `f64::max`, `f32::max`, `f64::min`, `f32::min`;
//! - a `fold(` with a `.max(`/`.min(` on the same line;
//! - a running extremum `x = x.max(..)` / `x = x.min(..)`.
//!
//! Measure with testkit instead (`rel_err`, `assert_close`, `max_abs`, `max_abs_values`,
//! `max_or_nan`), or justify the use with a comment `// nan-ok: <reason>` on the line or in the
//! comment lines directly above it (e.g. a maximum over generated inputs, or one whose every
//! element is also compared with `<=`, which fails on NaN).

use std::path::{Path, PathBuf};

/// The escape marker; a reason must follow it.
const ESCAPE: &str = "nan-ok:";

/// Why `code` (one line, comments included) is NaN-blind, if it is.
fn finding(code: &str) -> Option<&'static str> {
    let line = code.trim_start();
    if line.starts_with("//") {
        return None;
    }
    if line.contains(".max_all(") || line.contains(".min_all(") {
        return Some("candle's max_all/min_all skip NaN");
    }
    for path in ["f64::max", "f32::max", "f64::min", "f32::min"] {
        for (i, _) in line.match_indices(path) {
            let next = line[i + path.len()..].chars().next();
            if !next.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                return Some("f64::max/f32::max return the other operand of a NaN");
            }
        }
    }
    let extremum = line.contains(".max(") || line.contains(".min(");
    if extremum && line.contains("fold(") {
        return Some("a fold with .max/.min skips NaN");
    }
    if extremum && !line.starts_with("let ") {
        if let Some((lhs, rhs)) = line.split_once(" = ") {
            let var = lhs.trim();
            let ident = !var.is_empty() && var.chars().all(|c| c.is_alphanumeric() || c == '_');
            let rhs = rhs.trim_start();
            if ident
                && [".max(", ".min("]
                    .iter()
                    .any(|m| rhs.starts_with(&format!("{var}{m}")))
            {
                return Some("a running maximum with .max/.min skips NaN");
            }
        }
    }
    None
}

/// Whether line `i` of `lines` carries the escape with a reason, itself or in the comment
/// lines directly above it.
fn escaped(lines: &[&str], i: usize) -> bool {
    let has = |l: &str| {
        l.split_once(ESCAPE)
            .is_some_and(|(_, reason)| !reason.trim().is_empty())
    };
    if has(lines[i]) {
        return true;
    }
    lines[..i]
        .iter()
        .rev()
        .take_while(|l| l.trim_start().starts_with("//"))
        .any(|l| has(l))
}

/// `file:line: why: code` for every unescaped finding in `text`.
fn lint(file: &str, text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    (0..lines.len())
        .filter_map(|i| {
            let why = finding(lines[i])?;
            (!escaped(&lines, i)).then(|| format!("{file}:{}: {why}: {}", i + 1, lines[i].trim()))
        })
        .collect()
}

/// Every `.rs` file under a directory named `tests`, below `dir`.
fn test_sources(dir: &Path, in_tests: bool, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            // Build outputs, vendored code, and testkit itself (whose tests use the blind
            // measures on purpose, to show what they miss).
            if name.starts_with('.') || ["target", "third_party", "testkit"].contains(&name) {
                continue;
            }
            test_sources(&p, in_tests || name == "tests", out);
        } else if in_tests && name.ends_with(".rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_nan_blind_maxima_in_the_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let mut files = Vec::new();
    test_sources(root, false, &mut files);
    assert!(
        files.len() > 40,
        "found only {} test sources under {}",
        files.len(),
        root.display()
    );
    let found: Vec<String> = files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{f:?}: {e}"));
            let rel = f.strip_prefix(root).unwrap_or(f).display().to_string();
            lint(&rel, &text)
        })
        .collect();
    assert!(
        found.is_empty(),
        "{} NaN-blind measure(s) in the tests (use testkit's rel_err/assert_close/max_abs/\
         max_abs_values/max_or_nan, or justify with `// {ESCAPE} <reason>`):\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn the_lint_sees_each_pattern_and_honours_the_escape() {
    for blind in [
        "let m = d.abs()?.max_all()?.to_scalar::<f32>()?;",
        "    .max_all()",
        "let n = r.iter().map(|y| y.abs()).fold(0.0, f64::max);",
        "xs.iter().copied().fold(f32::NEG_INFINITY, f32::max)",
        "let m = g.iter().fold(0.0f64, |m, x| m.max(x.abs()));",
        "        worst = worst.max(e);",
        "lo = lo.min(x)",
    ] {
        assert!(finding(blind).is_some(), "missed: {blind}");
        assert_eq!(lint("f.rs", blind).len(), 1, "{blind}");
    }
    for fine in [
        "let tol = 8.0 * U * smax.max(1.0);",
        "let n = n.min(total);",
        "let x = f64::MAX;",
        "let m = testkit::max_abs(&d);",
        "// a comment on .max_all() and f64::max",
        "let k = k.max(1);",
        "let y = f64::max_value();",
    ] {
        assert_eq!(finding(fine), None, "flagged: {fine}");
    }
    // The escape: on the line, or in the comment block right above; a reason is required.
    let on_line = "let m = t.max_all()?; // nan-ok: t is an input built above";
    assert!(lint("f.rs", on_line).is_empty());
    let above =
        "// nan-ok: the maximum of generated inputs\n// (more words)\nworst = worst.max(e);";
    assert!(lint("f.rs", above).is_empty());
    assert_eq!(lint("f.rs", "worst = worst.max(e); // nan-ok:").len(), 1);
    let detached = "// nan-ok: about another line\nlet a = 1;\nworst = worst.max(e);";
    assert_eq!(
        lint("f.rs", detached),
        ["f.rs:3: a running maximum with .max/.min skips NaN: worst = worst.max(e);"]
    );
}
