//! The proof that `--resume` resumes, shared by every command's tests: a run killed by SIGKILL
//! at a step that is not a save step (reached through the driver's test hook
//! `CPL_TEST_PAUSE_STEP`, never through timing) and resumed equals the uninterrupted run bit for
//! bit, continues from its last checkpoint without recomputing the steps before it, and differs
//! from a run restarted from that checkpoint's weights alone (so the optimizer moments, the
//! schedule and the data position it restores matter).

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{cpl, stderr};

/// Steps of a resume proof; checkpoints every 2 steps, the kill after step 3 (so the run
/// resumes from `step-2` and recomputes step 2).
pub const STEPS: u64 = 5;
const KILL_AFTER: u64 = 3;

/// One command's resume proof.
pub struct ResumeCase<'a> {
    pub name: &'a str,
    /// The command's arguments (any `--out`, `--steps` and `--save-every` in them are
    /// replaced).
    pub args: Vec<String>,
    /// The flag that starts a run from a checkpoint's weights (`--model`, or `--adapter` for
    /// LoRA fine-tuning).
    pub weights_flag: &'a str,
}

/// The metrics.jsonl lines of `out`.
fn lines(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

/// (step, loss, gradient norm) of every metrics line, exactly as written.
fn values(lines: &[String]) -> Vec<(u64, f64, f64)> {
    lines
        .iter()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {l}"));
            (v["step"].as_u64().unwrap(), f("loss"), f("grad_norm"))
        })
        .collect()
}

/// `args` without the flags `drop` (each with its value), then `extra`.
fn with(args: &[String], drop: &[&str], extra: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        if drop.contains(&args[i].as_str()) {
            i += 2;
            continue;
        }
        out.push(args[i].clone());
        i += 1;
    }
    out.extend(extra.iter().map(|s| s.to_string()));
    out
}

/// Runs the proof of `case` in `dir` (see the module docs).
pub fn prove_resume(case: &ResumeCase, dir: &Path) {
    let name = case.name;
    let run = |out: &Path, steps: u64, extra: &[&str]| -> Vec<String> {
        let steps = steps.to_string();
        let o = out.to_str().unwrap();
        let fixed = [
            "--out",
            o,
            "--steps",
            &steps,
            "--save-every",
            "2",
            "--keep",
            "9",
        ];
        let base = [&fixed[..], extra].concat();
        with(
            &case.args,
            &["--out", "--steps", "--save-every", "--keep"],
            &base,
        )
    };
    // The uninterrupted run.
    let full = dir.join(format!("{name}-full"));
    let o = cpl(&run(&full, STEPS, &[]));
    assert!(o.status.success(), "{name}: {}", stderr(&o));
    let want = values(&lines(&full));
    assert_eq!(want.len(), STEPS as usize, "{name}: uninterrupted steps");

    // Killed by SIGKILL once step 3 is done (the last checkpoint: step-2).
    let cut = dir.join(format!("{name}-cut"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_cpl"))
        .args(run(&cut, STEPS, &[]))
        .env("CPL_TEST_PAUSE_STEP", KILL_AFTER.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let marker = cut.join(format!("PAUSED-{KILL_AFTER}"));
    let t0 = Instant::now();
    while !marker.is_file() && t0.elapsed() < Duration::from_secs(300) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{name}: the run ended before step {KILL_AFTER}: {status:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(marker.is_file(), "{name}: never reached step {KILL_AFTER}");
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(9),
        "{name}: killed by SIGKILL: {status:?}"
    );
    assert!(
        cut.join("step-2").is_dir(),
        "{name}: the checkpoint of step 2"
    );
    assert!(!cut.join("step-4").exists(), "{name}: killed before step 4");
    let before = lines(&cut);
    assert_eq!(
        before.len(),
        KILL_AFTER as usize,
        "{name}: steps done before the kill"
    );

    // Resumed: from step-2, the earlier steps kept as written, the uninterrupted run's values.
    let o = cpl(&run(&cut, STEPS, &["--resume"]));
    let err = stderr(&o);
    assert!(o.status.success(), "{name}: {err}");
    let from = "step-2 (step 2)";
    assert!(
        err.contains("resuming from") && err.contains(from),
        "{name}: {err}"
    );
    let after = lines(&cut);
    assert_eq!(
        after[..2],
        before[..2],
        "{name}: steps 0 and 1 are the killed run's lines (their timings too): not recomputed"
    );
    assert_eq!(
        values(&after),
        want,
        "{name}: resumed = uninterrupted, bit for bit"
    );

    // From the checkpoint's weights alone (fresh optimizer, schedule and data position): a
    // different run.
    let ckpt = cut.join("step-2");
    let fresh = dir.join(format!("{name}-weights-only"));
    let args = run(
        &fresh,
        STEPS - 2,
        &[case.weights_flag, ckpt.to_str().unwrap()],
    );
    let args = with(
        &args[..args.len() - 2],
        &[case.weights_flag],
        &args[args.len() - 2..]
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let o = cpl(&args);
    assert!(o.status.success(), "{name}: {}", stderr(&o));
    let restarted: Vec<(f64, f64)> = values(&lines(&fresh)).iter().map(|v| (v.1, v.2)).collect();
    let resumed: Vec<(f64, f64)> = want[2..].iter().map(|v| (v.1, v.2)).collect();
    assert_eq!(restarted.len(), resumed.len(), "{name}");
    assert_ne!(
        restarted, resumed,
        "{name}: weights alone give the resumed run: the restored state would not matter"
    );
}
