//! Per-rank timelines (`--trace FILE`): the `tracing` spans of a run written as a Chrome /
//! Perfetto trace (`tracing-chrome`), one track per thread, so one per local rank (threads) or
//! one file per process under MPI. The spans: `step` (fields `step`, `rank`), `data`,
//! `micro_batch`, `forward` of every layer unit (`unit`), `backward`, `pipeline`, `optimizer`,
//! `comm` for every communication call (`op`, `bytes_sent`, `bytes_recv`: the communicator's
//! traffic counts), `eval` and `checkpoint`. `--trace-steps a..b` records those steps only.
//! Without `--trace` no subscriber is installed and every span costs one disabled-callsite
//! check. [`summarize`] reads the files back (`cpl trace summarize`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;

use crate::error::{Error, Result};

static RECORDING: AtomicBool = AtomicBool::new(true);
static FROM: AtomicU64 = AtomicU64::new(0);
static TO: AtomicU64 = AtomicU64::new(u64::MAX);

/// Keeps the trace file open; dropping it writes the end of the file.
pub struct TraceGuard {
    _flush: tracing_chrome::FlushGuard,
    path: PathBuf,
}

impl TraceGuard {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Installs the process's trace writer to `path`, recording the steps in `steps` (all without).
/// Once per process.
pub fn start(path: &Path, steps: Option<Range<u64>>) -> Result<TraceGuard> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    // Fail early on an unwritable path (the writer thread would only panic).
    std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    if let Some(r) = &steps {
        FROM.store(r.start, Ordering::Relaxed);
        TO.store(r.end, Ordering::Relaxed);
        RECORDING.store(r.contains(&0), Ordering::Relaxed);
    }
    let (layer, flush) = tracing_chrome::ChromeLayerBuilder::new()
        .file(path)
        .include_args(true)
        .build();
    let filter = tracing_subscriber::filter::filter_fn(|_| RECORDING.load(Ordering::Relaxed));
    let subscriber = tracing_subscriber::registry().with(layer.with_filter(filter));
    tracing::subscriber::set_global_default(subscriber)
        .map_err(|e| Error::Invalid(format!("--trace: {e}")))?;
    Ok(TraceGuard {
        _flush: flush,
        path: path.to_path_buf(),
    })
}

/// The driver's call before step `step`: records it when it is in the `--trace-steps` window.
pub fn at_step(step: u64) {
    let on = (FROM.load(Ordering::Relaxed)..TO.load(Ordering::Relaxed)).contains(&step);
    if RECORDING.swap(on, Ordering::Relaxed) != on {
        tracing::callsite::rebuild_interest_cache();
    }
}

/// One track's totals in a trace file.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TrackSummary {
    pub file: String,
    pub tid: u64,
    /// The world rank of the track's `step` spans (none: a track without steps).
    pub rank: Option<u64>,
    /// Seconds in each span name (nested spans counted in their own name too).
    pub seconds: BTreeMap<String, f64>,
    /// Bytes sent by the track's `comm` spans.
    pub bytes_sent: u64,
    /// Its three longest spans: (name, detail, seconds).
    pub slowest: Vec<(String, String, f64)>,
}

/// A span begun and not yet ended on a track: its name, start (µs) and args.
type OpenSpan = (String, f64, serde_json::Value);

/// Reads trace files written by `--trace` (one per process) into one summary per track;
/// checks that every span that begins ends, in order, on its track.
pub fn summarize(files: &[PathBuf]) -> Result<Vec<TrackSummary>> {
    let mut out = Vec::new();
    for f in files {
        let bad = |msg: String| Error::Invalid(format!("trace {}: {msg}", f.display()));
        let text = std::fs::read_to_string(f).map_err(|e| Error::io(f, e))?;
        let events: Vec<serde_json::Value> = serde_json::from_str(&text)
            .map_err(|e| bad(format!("not a Chrome trace (a JSON array of events): {e}")))?;
        let mut tracks: BTreeMap<u64, (TrackSummary, Vec<OpenSpan>)> = BTreeMap::new();
        for e in &events {
            let ph = e["ph"].as_str().unwrap_or("");
            if ph != "B" && ph != "E" {
                continue;
            }
            let tid = e["tid"]
                .as_u64()
                .ok_or_else(|| bad(format!("no tid: {e}")))?;
            let ts = e["ts"].as_f64().ok_or_else(|| bad(format!("no ts: {e}")))?;
            let name = e["name"].as_str().unwrap_or("").to_string();
            let (track, stack) = tracks.entry(tid).or_insert_with(|| {
                let t = TrackSummary {
                    file: f.display().to_string(),
                    tid,
                    ..TrackSummary::default()
                };
                (t, Vec::new())
            });
            if ph == "B" {
                if name == "step" {
                    track.rank = number(&e["args"]["rank"]).or(track.rank);
                }
                stack.push((name, ts, e["args"].clone()));
                continue;
            }
            let (open, t0, args) = stack
                .pop()
                .ok_or_else(|| bad(format!("track {tid}: {name} ends without beginning")))?;
            if open != name {
                return Err(bad(format!(
                    "track {tid}: {open} is closed by the end of {name}"
                )));
            }
            let secs = (ts - t0) / 1e6;
            *track.seconds.entry(name.clone()).or_default() += secs;
            let args = if e["args"].is_object() {
                &e["args"]
            } else {
                &args
            };
            if name == "comm" {
                track.bytes_sent += number(&args["bytes_sent"]).unwrap_or(0);
            }
            let detail = ["unit", "op", "step", "i"]
                .iter()
                .find_map(|k| {
                    let v = args.get(*k)?;
                    Some(format!(
                        "{k} {}",
                        v.as_str().map_or(v.to_string(), String::from)
                    ))
                })
                .unwrap_or_default();
            if name != "step" {
                track.slowest.push((name, detail, secs));
                track.slowest.sort_by(|a, b| b.2.total_cmp(&a.2));
                track.slowest.truncate(3);
            }
        }
        for (tid, (track, stack)) in tracks {
            if let Some((name, _, _)) = stack.last() {
                return Err(bad(format!("track {tid}: {name} never ends")));
            }
            out.push(track);
        }
    }
    Ok(out)
}

/// A number of a trace's args, which `tracing-chrome` writes as JSON numbers or as strings.
fn number(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| v.as_str()?.parse().ok())
}
