//! TensorBoard event files (`--tensorboard DIR`): what TensorBoard, torch's `SummaryWriter` and
//! TensorFlow read, written by world rank 0.
//!
//! A file `events.out.tfevents.<secs>.<host>.<pid>` is a sequence of TFRecords (length
//! little-endian u64, its masked CRC32C, the bytes, their masked CRC32C), each a serialized
//! `tensorflow.Event`. The few message types a scalar and a text summary need are declared here
//! with `prost` by their field numbers in TensorFlow's `event.proto`, `summary.proto` and
//! `tensor.proto` (no protoc at build time). Written by hand because the Rust crates that write
//! TensorBoard files are unmaintained (tensorboard-rs, archived; syntaxdot-summary), while the
//! format is small and frozen.
//!
//! A resumed run writes a new file into the same directory and starts it with a `SessionLog`
//! START at the resume step, which tells TensorBoard to drop the earlier files' events from that
//! step on (those of the run that died later).

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use prost::Message;

use crate::error::{Error, Result};

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    pub what: Option<What>,
}

/// `Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `tensorflow.Summary.Value`: a scalar (`simple_value`) or a tensor with its plugin.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `tensorflow.SummaryMetadata` (the plugin that displays a tensor summary).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `tensorflow.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `tensorflow.TensorProto`, as a scalar string (`dtype` DT_STRING, no dimensions).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` with no dimensions (a scalar).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShape {}

/// `tensorflow.SessionLog`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    /// 1: START.
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// `tensorflow.DataType.DT_STRING`.
const DT_STRING: i32 = 7;
/// `tensorflow.SessionLog.SessionStatus.START`.
const START: i32 = 1;

/// An event file being written.
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` and a new event file in it, starting with the file version record.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let name = format!("events.out.tfevents.{secs}.{host}.{}", std::process::id());
        let path = dir.join(name);
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut w = Self {
            file: BufWriter::new(file),
            path,
        };
        w.write(0, What::FileVersion("brain.Event:2".into()))?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A scalar `tag` at `step` (stored as f32, as TensorBoard's scalars are).
    pub fn scalar(&mut self, tag: &str, step: u64, value: f64) -> Result<()> {
        let v = Value {
            tag: tag.into(),
            simple_value: Some(value as f32),
            ..Value::default()
        };
        self.write(step, What::Summary(Summary { value: vec![v] }))
    }

    /// A text summary `tag` at `step` (TensorBoard's Text tab; markdown).
    pub fn text(&mut self, tag: &str, step: u64, text: &str) -> Result<()> {
        let v = Value {
            tag: tag.into(),
            tensor: Some(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape {}),
                string_val: vec![text.as_bytes().to_vec()],
            }),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                    content: Vec::new(),
                }),
            }),
            ..Value::default()
        };
        self.write(step, What::Summary(Summary { value: vec![v] }))
    }

    /// Marks a (re)start at `step`: TensorBoard drops earlier files' events from `step` on.
    pub fn restart(&mut self, step: u64) -> Result<()> {
        self.write(step, What::SessionLog(SessionLog { status: START }))
    }

    /// Writes what is buffered to the file (done after every step by the driver).
    pub fn flush(&mut self) -> Result<()> {
        self.file.flush().map_err(|e| Error::io(&self.path, e))
    }

    fn write(&mut self, step: u64, what: What) -> Result<()> {
        let wall_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let event = Event {
            wall_time,
            step: step as i64,
            what: Some(what),
        };
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend(len);
        rec.extend(masked_crc(&len).to_le_bytes());
        rec.extend(&data);
        rec.extend(masked_crc(&data).to_le_bytes());
        self.file
            .write_all(&rec)
            .map_err(|e| Error::io(&self.path, e))
    }
}

/// TFRecord's checksum: CRC32C, rotated right by 15 bits, plus a constant.
fn masked_crc(bytes: &[u8]) -> u32 {
    let c = crc32c::crc32c(bytes);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// Every event of the file at `path`, checking each record's checksums.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bad = |msg: String| Error::Invalid(format!("{}: {msg}", path.display()));
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| Error::io(path, e))?;
    let (mut at, mut out) = (0, Vec::new());
    let u32_at = |b: &[u8], i: usize| -> Option<u32> {
        Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?))
    };
    while at < bytes.len() {
        let head = bytes
            .get(at..at + 8)
            .ok_or_else(|| bad(format!("record at byte {at}: truncated length")))?;
        let len = u64::from_le_bytes(head.try_into().map_err(|_| bad("length".into()))?) as usize;
        if u32_at(&bytes, at + 8) != Some(masked_crc(head)) {
            return Err(bad(format!("record at byte {at}: bad length checksum")));
        }
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or_else(|| bad(format!("record at byte {at}: truncated data")))?;
        if u32_at(&bytes, at + 12 + len) != Some(masked_crc(data)) {
            return Err(bad(format!("record at byte {at}: bad data checksum")));
        }
        out.push(Event::decode(data).map_err(|e| bad(format!("record at byte {at}: {e}")))?);
        at += 16 + len;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC32C of "123456789" is 0xE3069283 (the standard check value); its mask is
    /// 0xC78AB0E5, as TensorBoard's own `masked_crc32c` computes it.
    #[test]
    fn the_checksum_is_tensorflows_masked_crc32c() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xC78A_B0E5);
    }

    /// Scalars, text and a restart read back as written; a flipped byte is refused.
    #[test]
    fn events_read_back_and_corruption_is_caught() {
        let dir = std::env::temp_dir().join(format!("cpl-tb-{}", std::process::id()));
        let mut w = EventWriter::create(&dir).unwrap();
        w.scalar("train/loss", 3, 2.5).unwrap();
        w.text("run/flags", 0, "cpl train --steps 3").unwrap();
        w.restart(2).unwrap();
        w.flush().unwrap();
        let path = w.path().to_path_buf();
        let events = read_events(&path).unwrap();
        assert_eq!(events.len(), 4);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        let Some(What::Summary(s)) = &events[1].what else {
            panic!("{:?}", events[1])
        };
        assert_eq!((events[1].step, s.value[0].tag.as_str()), (3, "train/loss"));
        assert_eq!(s.value[0].simple_value, Some(2.5));
        let Some(What::Summary(t)) = &events[2].what else {
            panic!("{:?}", events[2])
        };
        let tensor = t.value[0].tensor.as_ref().unwrap();
        assert_eq!(tensor.string_val, [b"cpl train --steps 3".to_vec()]);
        assert_eq!(
            events[3].what,
            Some(What::SessionLog(SessionLog { status: START }))
        );
        assert_eq!(events[3].step, 2);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains("bad data checksum"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
