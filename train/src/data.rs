//! Training and evaluation data: documents from text, JSON-lines or Parquet files (the Hugging
//! Face datasets format), or pre-tokenized sequences, tokenized and packed into fixed-length
//! windows with per-token document ids, shuffled deterministically by seed and dealt to
//! data-parallel ranks.
//!
//! Packing: every document's tokens are followed by EOS (when the tokenizer has one) and the
//! documents are concatenated; the stream is cut into windows of `seq_len + 1` tokens that
//! overlap by one, so that window `w` gives `seq_len` inputs and their `seq_len` next-token
//! labels. Each token carries the index of its document; with document masking a token attends
//! only to earlier tokens of its own document (Llama 3), and the label that would cross from one
//! document into the next is ignored.

use std::path::{Path, PathBuf};

use candle_parallel::attention::AttnMask;
use models::tokenizer::{SpecialTokens, Tokenizer};

use crate::error::{Error, Result};

/// Label value that the loss skips.
pub const IGNORE: i64 = candle_parallel::nn::IGNORE_INDEX;

/// The file kinds [`read_documents`] reads, by extension.
const DATA_EXTENSIONS: [&str; 4] = ["txt", "jsonl", "ndjson", "parquet"];

/// Documents of a text file (`.txt`: the whole file is one document), a JSON-lines file
/// (`.jsonl` / `.ndjson`: one object per line with a string field `field`) or a Parquet file
/// (`.parquet`: the string column `field` of every row, as Hugging Face datasets store text;
/// snappy, zstd, lz4 and gzip compression). Empty documents are skipped. `flag` names the
/// command-line flag in errors.
pub fn read_documents(path: &Path, field: &str, flag: &str) -> Result<Vec<String>> {
    let err = |msg: String| Error::Data {
        flag: flag.into(),
        path: path.to_path_buf(),
        msg,
    };
    let ext = path.extension().and_then(|e| e.to_str());
    let docs = if ext == Some("parquet") {
        read_parquet_column(path, field).map_err(err)?
    } else if matches!(ext, Some("jsonl") | Some("ndjson")) {
        let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?;
        let mut docs = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| err(format!("line {}: not valid JSON: {e}", i + 1)))?;
            let t = v
                .get(field)
                .and_then(|t| t.as_str())
                .ok_or_else(|| err(format!("line {}: no string field {field:?}", i + 1)))?;
            docs.push(t.to_string());
        }
        docs
    } else {
        vec![std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?]
    };
    let docs: Vec<String> = docs.into_iter().filter(|d| !d.trim().is_empty()).collect();
    if docs.is_empty() {
        return Err(err("holds no text".into()));
    }
    Ok(docs)
}

/// The strings of column `field` of a Parquet file, row by row (null values skipped). Errors
/// are messages for [`Error::Data`].
fn read_parquet_column(path: &Path, field: &str) -> std::result::Result<Vec<String>, String> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    use parquet::schema::types::Type;

    let file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let reader =
        SerializedFileReader::new(file).map_err(|e| format!("not a valid Parquet file: {e}"))?;
    let schema = reader.metadata().file_metadata().schema_descr();
    let columns = schema.root_schema().get_fields();
    let column = columns.iter().find(|c| c.name() == field).ok_or_else(|| {
        let names: Vec<&str> = columns.iter().map(|c| c.name()).collect();
        format!("no column {field:?} (columns: {names:?}); choose one with --text-field")
    })?;
    let projection = Type::group_type_builder(schema.root_schema().name())
        .with_fields(vec![column.clone()])
        .build()
        .map_err(|e| format!("column {field:?}: {e}"))?;
    let rows = reader
        .get_row_iter(Some(projection))
        .map_err(|e| format!("column {field:?}: {e}"))?;
    let mut docs = Vec::new();
    for (i, row) in rows.enumerate() {
        let row = row.map_err(|e| format!("row {i}: {e}"))?;
        for (_, value) in row.get_column_iter() {
            match value {
                Field::Str(s) => docs.push(s.clone()),
                Field::Bytes(b) => docs.push(
                    std::str::from_utf8(b.data())
                        .map_err(|_| format!("row {i}: column {field:?} is not UTF-8 text"))?
                        .to_string(),
                ),
                Field::Null => {}
                other => {
                    return Err(format!(
                        "row {i}: column {field:?} holds {other:?}, not text"
                    ))
                }
            }
        }
    }
    Ok(docs)
}

/// Every row of a Parquet file as a JSON object (column name to value): strings (and UTF-8
/// byte arrays) as JSON strings, numbers and booleans as such, nulls as `null`, lists as arrays
/// and structs and maps as objects, so nested chat columns (a list of `{role, content}`
/// structs, as Hugging Face datasets store them) read like their JSON-lines form. Errors are
/// messages for [`Error::Data`] naming the row (numbered from 0).
pub(crate) fn read_parquet_rows(
    path: &Path,
) -> std::result::Result<Vec<serde_json::Value>, String> {
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let reader =
        SerializedFileReader::new(file).map_err(|e| format!("not a valid Parquet file: {e}"))?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| format!("cannot read rows: {e}"))?;
    let mut out = Vec::new();
    for (i, row) in rows.enumerate() {
        let row = row.map_err(|e| format!("row {i}: {e}"))?;
        let mut obj = serde_json::Map::new();
        for (name, value) in row.get_column_iter() {
            obj.insert(
                name.clone(),
                parquet_json(value).map_err(|e| format!("row {i}: column {name:?}: {e}"))?,
            );
        }
        out.push(serde_json::Value::Object(obj));
    }
    Ok(out)
}

/// One Parquet value as JSON (see [`read_parquet_rows`]).
fn parquet_json(f: &parquet::record::Field) -> std::result::Result<serde_json::Value, String> {
    use parquet::record::Field;
    use serde_json::Value;
    let float = |x: f64| {
        serde_json::Number::from_f64(x)
            .map(Value::Number)
            .unwrap_or(Value::Null)
    };
    Ok(match f {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(n) => Value::from(*n),
        Field::Short(n) => Value::from(*n),
        Field::Int(n) => Value::from(*n),
        Field::Long(n) => Value::from(*n),
        Field::UByte(n) => Value::from(*n),
        Field::UShort(n) => Value::from(*n),
        Field::UInt(n) => Value::from(*n),
        Field::ULong(n) => Value::from(*n),
        Field::Float16(x) => float(f64::from(*x)),
        Field::Float(x) => float(f64::from(*x)),
        Field::Double(x) => float(*x),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => Value::String(
            std::str::from_utf8(b.data())
                .map_err(|_| "binary data that is not UTF-8 text".to_string())?
                .to_string(),
        ),
        Field::Group(row) => {
            let mut obj = serde_json::Map::new();
            for (name, value) in row.get_column_iter() {
                obj.insert(name.clone(), parquet_json(value)?);
            }
            Value::Object(obj)
        }
        Field::ListInternal(list) => Value::Array(
            list.elements()
                .iter()
                .map(parquet_json)
                .collect::<std::result::Result<_, _>>()?,
        ),
        Field::MapInternal(map) => {
            let mut obj = serde_json::Map::new();
            for (k, v) in map.entries() {
                let key = match parquet_json(k)? {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                obj.insert(key, parquet_json(v)?);
            }
            Value::Object(obj)
        }
        other => Value::String(other.to_string()),
    })
}

/// Documents of every file in `paths` (files, or directories whose `.txt`, `.jsonl` and
/// `.parquet` files are read in name order).
pub fn read_corpus(paths: &[PathBuf], field: &str, flag: &str) -> Result<Vec<String>> {
    let mut docs = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| Error::Data {
                    flag: flag.into(),
                    path: p.clone(),
                    msg: format!("cannot list: {e}"),
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| {
                    f.extension()
                        .and_then(|e| e.to_str())
                        .is_some_and(|e| DATA_EXTENSIONS.contains(&e))
                })
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(Error::Data {
                    flag: flag.into(),
                    path: p.clone(),
                    msg: "directory has no .txt, .jsonl or .parquet files".into(),
                });
            }
            for f in files {
                docs.extend(read_documents(&f, field, flag)?);
            }
        } else {
            docs.extend(read_documents(p, field, flag)?);
        }
    }
    Ok(docs)
}

/// A JSON array of token-id arrays, each id below `vocab_size`. `flag` names the command-line
/// flag in errors.
pub fn read_token_sequences(path: &Path, vocab_size: usize, flag: &str) -> Result<Vec<Vec<u32>>> {
    let err = |msg: String| Error::Data {
        flag: flag.into(),
        path: path.to_path_buf(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?;
    let seqs: Vec<Vec<i64>> = serde_json::from_str(&text)
        .map_err(|e| err(format!("expected a JSON array of arrays of token ids: {e}")))?;
    if seqs.is_empty() {
        return Err(err("no sequences".into()));
    }
    seqs.into_iter()
        .enumerate()
        .map(|(i, s)| {
            if s.len() < 2 {
                return Err(err(format!(
                    "sequence {i} has {} tokens; at least 2 are needed for a next-token loss",
                    s.len()
                )));
            }
            s.into_iter()
                .map(|t| {
                    if t < 0 || t as usize >= vocab_size {
                        Err(err(format!(
                            "sequence {i} holds token id {t}, outside the vocabulary of {vocab_size}"
                        )))
                    } else {
                        Ok(t as u32)
                    }
                })
                .collect()
        })
        .collect()
}

/// The token ids of every document, tokenized in parallel, in order: no BOS, EOS after each
/// document when the tokenizer has one (what [`TokenStream::from_documents`] packs, and what
/// `cpl data prepare` caches as a `--tokens` file).
pub fn tokenize_documents(tok: &Tokenizer, docs: &[String]) -> Result<Vec<Vec<u32>>> {
    use rayon::prelude::*;
    docs.par_iter()
        .map(|text| {
            let mut ids = tok.encode(text, SpecialTokens::Drop)?;
            if let Some(eos) = tok.eos_token_id {
                ids.push(eos);
            }
            Ok(ids)
        })
        .collect()
}

/// A token stream with the document index of every token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenStream {
    pub ids: Vec<u32>,
    pub doc_ids: Vec<u32>,
}

impl TokenStream {
    /// Tokenizes `docs` in parallel (no BOS; EOS after each document when the tokenizer has
    /// one), keeping their order. Token ids at or above `vocab_size` are an error.
    pub fn from_documents(tok: &Tokenizer, docs: &[String], vocab_size: usize) -> Result<Self> {
        Self::from_sequences(&tokenize_documents(tok, docs)?, vocab_size)
    }

    /// Pre-tokenized documents, one per sequence.
    pub fn from_sequences(seqs: &[Vec<u32>], vocab_size: usize) -> Result<Self> {
        let mut s = TokenStream::default();
        for (d, ids) in seqs.iter().enumerate() {
            s.push_document(d as u32, ids, vocab_size)?;
        }
        Ok(s)
    }

    fn push_document(&mut self, doc: u32, ids: &[u32], vocab_size: usize) -> Result<()> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(Error::Invalid(format!(
                "document {doc} holds token id {bad}, outside the model's vocabulary of {vocab_size}"
            )));
        }
        self.ids.extend_from_slice(ids);
        self.doc_ids.extend(std::iter::repeat_n(doc, ids.len()));
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// One training sequence: `seq_len` inputs, their labels and document ids (renumbered from 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub ids: Vec<u32>,
    pub labels: Vec<i64>,
    pub doc_ids: Vec<u32>,
    /// How many of the last tokens are padding (fine-tuning windows): a mixture of experts'
    /// routing statistics leave them out, as transformers' `attention_mask` does.
    pub padding: usize,
}

/// How packed windows treat the borders between documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// One stream: every token's label is the next token, across documents.
    Continuous,
    /// Documents apart (Llama 3 document masking): the label that would cross into the next
    /// document is ignored.
    Documents,
}

impl Packing {
    /// [`Packing::Documents`] with document masking (`doc_mask` of a config).
    pub fn with_doc_mask(doc_mask: bool) -> Self {
        if doc_mask {
            Self::Documents
        } else {
            Self::Continuous
        }
    }
}

/// The stream cut into windows of `seq_len` inputs (windows of `seq_len + 1` tokens overlapping
/// by one), packed as [`Packing`] says.
#[derive(Debug, Clone)]
pub struct PackedDataset {
    stream: std::sync::Arc<TokenStream>,
    seq_len: usize,
    doc_mask: bool,
}

impl PackedDataset {
    /// Errors when the stream is shorter than one window.
    pub fn new(stream: TokenStream, seq_len: usize, packing: Packing) -> Result<Self> {
        Self::windows_of(std::sync::Arc::new(stream), seq_len, packing)
    }

    /// The same stream and packing in windows of `seq_len` (the stream is shared, not
    /// copied): a length curriculum's phases. Errors as [`PackedDataset::new`].
    pub fn with_seq_len(&self, seq_len: usize) -> Result<Self> {
        let packing = Packing::with_doc_mask(self.doc_mask);
        Self::windows_of(self.stream.clone(), seq_len, packing)
    }

    fn windows_of(
        stream: std::sync::Arc<TokenStream>,
        seq_len: usize,
        packing: Packing,
    ) -> Result<Self> {
        if seq_len == 0 {
            return Err(Error::Invalid(
                "the sequence length must be at least 1".into(),
            ));
        }
        if stream.len() < seq_len + 1 {
            return Err(Error::Invalid(format!(
                "the data has {} tokens, fewer than one window of sequence length {seq_len} + 1",
                stream.len()
            )));
        }
        Ok(Self {
            stream,
            seq_len,
            doc_mask: packing == Packing::Documents,
        })
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn num_windows(&self) -> usize {
        (self.stream.len() - 1) / self.seq_len
    }

    pub fn num_tokens(&self) -> usize {
        self.stream.len()
    }

    /// Window `i` (in stream order).
    pub fn window(&self, i: usize) -> Window {
        let start = i * self.seq_len;
        let ids = self.stream.ids[start..start + self.seq_len].to_vec();
        let docs = &self.stream.doc_ids[start..start + self.seq_len + 1];
        let labels = (0..self.seq_len)
            .map(|j| {
                if self.doc_mask && docs[j + 1] != docs[j] {
                    IGNORE
                } else {
                    self.stream.ids[start + j + 1] as i64
                }
            })
            .collect();
        let first = docs[0];
        let doc_ids = docs[..self.seq_len].iter().map(|d| d - first).collect();
        Window {
            ids,
            labels,
            doc_ids,
            padding: 0,
        }
    }
}

/// Training sequences that [`Batching`] deals out: packed pretraining windows
/// ([`PackedDataset`]) or fine-tuning examples ([`crate::finetune::SftDataset`]).
pub trait Windows {
    fn num_windows(&self) -> usize;
    /// Window `i`, `0 <= i < num_windows()`.
    fn window(&self, i: usize) -> Window;
}

impl Windows for PackedDataset {
    fn num_windows(&self) -> usize {
        PackedDataset::num_windows(self)
    }

    fn window(&self, i: usize) -> Window {
        PackedDataset::window(self, i)
    }
}

/// A deterministic permutation of `0..n` from `seed` (splitmix64 + Fisher-Yates).
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// Which window each (optimizer step, data-parallel rank, micro-batch) trains on: the windows
/// of epoch `e` in the order `permutation(num_windows, seed + e)`, dealt out `dp · micro`
/// at a time; global sample `k` is window `order_e[k mod n]` with `e = k / n`. Independent of
/// the layout except through `dp`, so a run resumes under another layout with the same data
/// when the global batch is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampler {
    pub num_windows: usize,
    pub seed: u64,
    pub shuffle: bool,
}

impl Sampler {
    /// The stream index of global sample `k`.
    pub fn window_of(&self, k: u64) -> usize {
        let n = self.num_windows as u64;
        let (epoch, i) = (k / n, (k % n) as usize);
        if self.shuffle {
            permutation(self.num_windows, self.seed.wrapping_add(epoch))[i]
        } else {
            i
        }
    }

    /// The global sample indices of `step` for data-parallel rank `dp_rank` of `dp`, with
    /// `micro` sequences per rank and step.
    pub fn samples(&self, step: u64, dp: usize, dp_rank: usize, micro: usize) -> Vec<u64> {
        let per_step = (dp * micro) as u64;
        let base = step * per_step + (dp_rank * micro) as u64;
        (0..micro as u64).map(|j| base + j).collect()
    }
}

/// How each optimizer step's global batch is dealt: `dp` data-parallel replicas, each training
/// on `grad_accum` micro-batches of `batch` windows (with document masks, one forward per
/// window, each with its own mask). The windows come from the [`Sampler`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    pub dp: usize,
    pub batch: usize,
    pub grad_accum: usize,
    pub doc_mask: bool,
    pub seed: u64,
    pub shuffle: bool,
}

/// The sequences of one forward and backward pass, in global (unsharded) form.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    pub ids: Vec<Vec<u32>>,
    pub labels: Vec<Vec<i64>>,
    pub mask: AttnMask,
    /// Per sequence, its trailing padding tokens ([`Window::padding`]).
    pub padding: Vec<usize>,
}

impl Batching {
    /// Sequences per optimizer step over all data-parallel ranks.
    pub fn global_batch(&self) -> usize {
        self.dp * self.batch * self.grad_accum
    }

    /// The sampler over a dataset of `n` windows (samples, pairs) with this run's seed and
    /// shuffling.
    pub fn sampler(&self, n: usize) -> Sampler {
        Sampler {
            num_windows: n,
            seed: self.seed,
            shuffle: self.shuffle,
        }
    }

    /// Data-parallel rank `d`'s global sample indices of `step` (see [`Sampler::samples`]) in
    /// micro-batches of `batch`: what every dataset (windows, images, conversations, pairs)
    /// deals a step by.
    pub fn micro_samples(&self, sampler: &Sampler, step: u64, d: usize) -> Vec<Vec<u64>> {
        sampler
            .samples(step, self.dp, d, self.batch * self.grad_accum)
            .chunks(self.batch)
            .map(|k| k.to_vec())
            .collect()
    }

    /// The windows data-parallel rank `d` trains on in `step`.
    pub fn windows(&self, data: &(impl Windows + ?Sized), step: u64, d: usize) -> Vec<Window> {
        let s = self.sampler(data.num_windows());
        self.micro_samples(&s, step, d)
            .into_iter()
            .flatten()
            .map(|k| data.window(s.window_of(k)))
            .collect()
    }

    /// Labelled tokens in the global batch of `step` (known to every rank without
    /// communication).
    pub fn global_tokens(&self, data: &(impl Windows + ?Sized), step: u64) -> u64 {
        (0..self.dp)
            .flat_map(|d| self.windows(data, step, d))
            .map(|w| w.labels.iter().filter(|&&l| l != IGNORE).count() as u64)
            .sum()
    }

    /// Data-parallel rank `d`'s micro-batches of `step`.
    pub fn micro_batches(
        &self,
        data: &(impl Windows + ?Sized),
        step: u64,
        d: usize,
    ) -> Vec<MicroBatch> {
        let windows = self.windows(data, step, d);
        let mut out = Vec::new();
        for micro in windows.chunks(self.batch) {
            let groups: Vec<&[Window]> = if self.doc_mask {
                micro.chunks(1).collect()
            } else {
                vec![micro]
            };
            for g in groups {
                out.push(MicroBatch {
                    ids: g.iter().map(|w| w.ids.clone()).collect(),
                    labels: g.iter().map(|w| w.labels.clone()).collect(),
                    padding: g.iter().map(|w| w.padding).collect(),
                    mask: if self.doc_mask {
                        AttnMask::documents(g[0].doc_ids.clone())
                    } else {
                        AttnMask::Causal
                    },
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_overlap_by_one_and_mask_document_borders() {
        let s =
            TokenStream::from_sequences(&[vec![5, 6, 7], vec![8, 9], vec![10, 11, 12, 13]], 100)
                .unwrap();
        let d = PackedDataset::new(s.clone(), 4, Packing::Documents).unwrap();
        assert_eq!(d.num_windows(), 2);
        let w = d.window(0);
        assert_eq!(w.ids, vec![5, 6, 7, 8]);
        assert_eq!(w.labels, vec![6, 7, IGNORE, 9]);
        assert_eq!(w.doc_ids, vec![0, 0, 0, 1]);
        let w = d.window(1);
        assert_eq!(w.ids, vec![9, 10, 11, 12]);
        assert_eq!(w.labels, vec![IGNORE, 11, 12, 13]);
        assert_eq!(w.doc_ids, vec![0, 1, 1, 1]);
        let plain = PackedDataset::new(s, 4, Packing::Continuous).unwrap();
        assert_eq!(plain.window(0).labels, vec![6, 7, 8, 9]);
    }

    #[test]
    fn permutation_is_a_deterministic_shuffle() {
        let p = permutation(100, 7);
        assert_eq!(p, permutation(100, 7));
        assert_ne!(p, permutation(100, 8));
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn sampler_deals_disjoint_samples() {
        let s = Sampler {
            num_windows: 10,
            seed: 1,
            shuffle: true,
        };
        let a = s.samples(3, 2, 0, 2);
        let b = s.samples(3, 2, 1, 2);
        assert_eq!(a, vec![12, 13]);
        assert_eq!(b, vec![14, 15]);
        assert!(s.window_of(12) < 10);
    }

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/data")
            .join(name)
    }

    /// Parquet files written by pyarrow (`scripts/make_data_fixtures.py`: snappy with two row
    /// groups, zstd with `large_string`, gzip; one null row) hold the documents of the JSON-lines
    /// file.
    #[test]
    fn parquet_gives_the_documents_of_jsonl() {
        let want = read_documents(&fixture("docs.jsonl"), "text", "--data").unwrap();
        assert_eq!(want.len(), 6);
        for f in [
            "docs-snappy.parquet",
            "docs-zstd.parquet",
            "docs-gzip.parquet",
        ] {
            let got = read_documents(&fixture(f), "text", "--data").unwrap();
            assert_eq!(got, want, "{f}");
        }
    }

    #[test]
    fn bad_parquet_is_a_clear_error() {
        let msg =
            |p: &Path, field: &str| read_documents(p, field, "--data").unwrap_err().to_string();
        let m = msg(&fixture("not-text.parquet"), "text");
        assert!(
            m.contains("not-text.parquet") && m.contains("not text"),
            "{m}"
        );
        let m = msg(&fixture("docs-snappy.parquet"), "content");
        assert!(
            m.contains("no column \"content\"") && m.contains("--text-field"),
            "{m}"
        );
        let dir = std::env::temp_dir().join(format!("cpl-parquet-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let broken = dir.join("broken.parquet");
        std::fs::write(&broken, b"PAR1 this is not parquet").unwrap();
        let m = msg(&broken, "text");
        assert!(
            m.contains("broken.parquet") && m.contains("not a valid Parquet file"),
            "{m}"
        );
        // A directory of data files reads the Parquet ones too, in name order.
        std::fs::copy(fixture("docs-zstd.parquet"), dir.join("a.parquet")).unwrap();
        std::fs::remove_file(&broken).unwrap();
        let docs = read_corpus(std::slice::from_ref(&dir), "text", "--data").unwrap();
        assert_eq!(docs.len(), 6);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_data_is_an_error() {
        assert!(TokenStream::from_sequences(&[vec![1, 300]], 256).is_err());
        let s = TokenStream::from_sequences(&[vec![1, 2, 3]], 256).unwrap();
        assert!(PackedDataset::new(s, 8, Packing::Continuous).is_err());
    }
}
