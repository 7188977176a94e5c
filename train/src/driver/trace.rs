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
    /// Asynchronous transfers (a ring's `exchange`, ended by the next `wait`): their seconds
    /// from posting to arrival, and the seconds this rank was blocked in the `wait`s. The
    /// share of the transfers hidden behind compute is `1 - blocked / in_flight`.
    pub transfers_in_flight: f64,
    pub transfers_blocked: f64,
}

impl TrackSummary {
    /// The share of asynchronous transfer time hidden behind compute (none without transfers).
    pub fn hidden_share(&self) -> Option<f64> {
        (self.transfers_in_flight > 0.0)
            .then(|| 1.0 - self.transfers_blocked / self.transfers_in_flight)
    }
}

/// A span begun and not yet ended on a track: its name, start (µs) and args.
type OpenSpan = (String, f64, serde_json::Value);

/// A `comm` span's operation (`op`), as the trace wrote it.
fn op_of(args: &serde_json::Value) -> &str {
    args["op"].as_str().unwrap_or("")
}

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
        // Per track: the start (µs) of each posted exchange not yet waited for.
        let mut posted: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
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
            if name == "comm" {
                match op_of(&args) {
                    "exchange" => posted.entry(tid).or_default().push(t0),
                    "wait" => {
                        if let Some(start) = posted.entry(tid).or_default().pop() {
                            track.transfers_in_flight += (ts - start) / 1e6;
                            track.transfers_blocked += secs;
                        }
                    }
                    _ => {}
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-made trace: spans nest per track, the step's rank is read, comm bytes add up, and
    /// an exchange posted at 0 µs whose wait blocks from 8 to 10 ms was 80% hidden.
    #[test]
    fn summarize_reads_tracks_bytes_and_the_hidden_share() {
        let ev = |ph: &str, name: &str, ts: f64, args: serde_json::Value| serde_json::json!({"ph": ph, "name": name, "ts": ts, "tid": 3, "pid": 1, "args": args});
        let events = serde_json::json!([
            ev(
                "B",
                "step",
                0.0,
                serde_json::json!({"step": "0", "rank": "1"})
            ),
            ev("B", "comm", 0.0, serde_json::json!({"op": "exchange"})),
            ev(
                "E",
                "comm",
                100.0,
                serde_json::json!({"op": "exchange", "bytes_sent": "64"})
            ),
            ev(
                "B",
                "forward",
                100.0,
                serde_json::json!({"unit": "model.layers.0"})
            ),
            ev("E", "forward", 8_000.0, serde_json::json!({})),
            ev("B", "comm", 8_000.0, serde_json::json!({"op": "wait"})),
            ev("E", "comm", 10_000.0, serde_json::json!({"op": "wait"})),
            ev("E", "step", 10_000.0, serde_json::json!({})),
        ]);
        let dir = std::env::temp_dir().join(format!("cpl-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t.json");
        std::fs::write(&f, events.to_string()).unwrap();
        let t = summarize(std::slice::from_ref(&f)).unwrap().remove(0);
        assert_eq!((t.rank, t.bytes_sent), (Some(1), 64));
        assert!((t.seconds["step"] - 0.01).abs() < 1e-12);
        assert!((t.hidden_share().unwrap() - 0.8).abs() < 1e-9, "{t:?}");
        assert_eq!(t.slowest[0].0, "forward");
        // A span that never ends is an error naming it.
        let cut = serde_json::Value::Array(events.as_array().unwrap()[..7].to_vec());
        std::fs::write(&f, cut.to_string()).unwrap();
        let e = summarize(std::slice::from_ref(&f)).unwrap_err().to_string();
        assert!(e.contains("step never ends"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
