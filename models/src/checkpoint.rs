//! Model parameters from Hugging Face safetensors checkpoints, and saving them back.
//!
//! [`CheckpointReader`] memory-maps the checkpoint's files (single or sharded with
//! `model.safetensors.index.json`) and reads a tensor, or only this rank's slice of it along one
//! dim, straight from the map. It is the [`TensorSource`] model constructors load through (a
//! [`candle_parallel::nn::ParamBuilder`]), so every rank reads only its slices. [`save_hf`]
//! writes a model's parameters back as a Hugging Face model directory, atomically.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::Comm;
use candle_parallel::nn::{Param, Shard, TensorSource};
use safetensors::tensor::{Metadata, SafeTensors, TensorInfo};

use crate::error::{Error, Result};

struct MappedFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
    metadata: Metadata,
}

/// The tensors of a safetensors checkpoint (one or several files), memory-mapped.
pub struct CheckpointReader {
    files: Vec<MappedFile>,
    /// Tensor name -> index into `files`.
    routing: HashMap<String, usize>,
    location: String,
}

/// The shape and dtype of a stored tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub file: PathBuf,
}

impl CheckpointReader {
    /// Maps `paths`. A tensor name present in two files is an error.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut routing = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: the map is read-only; a checkpoint rewritten while mapped is the user's
            // responsibility, as in every safetensors loader (our own writes rename new files
            // into place instead of modifying them).
            let mmap = unsafe { memmap2::MmapOptions::new().map(&file) }
                .map_err(|e| Error::io(path, e))?;
            let (header_len, metadata) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| Error::config(path, format!("not a valid safetensors file: {e}")))?;
            for name in metadata.tensors().keys() {
                if let Some(prev) = routing.insert(name.clone(), i) {
                    return Err(Error::config(
                        path,
                        format!("tensor `{name}` is also in {}", paths[prev].display()),
                    ));
                }
            }
            files.push(MappedFile {
                path: path.clone(),
                mmap,
                data_start: 8 + header_len,
                metadata,
            });
        }
        let location = match paths {
            [one] => one.display().to_string(),
            _ => paths
                .first()
                .and_then(|p| p.parent())
                .map(|d| format!("{} ({} files)", d.display(), paths.len()))
                .unwrap_or_else(|| "(no files)".into()),
        };
        Ok(Self {
            files,
            routing,
            location,
        })
    }

    /// Where the checkpoint is, for messages.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut n: Vec<String> = self.routing.keys().cloned().collect();
        n.sort();
        n
    }

    pub fn contains(&self, name: &str) -> bool {
        self.routing.contains_key(name)
    }

    fn info(&self, name: &str) -> Result<(&MappedFile, &TensorInfo)> {
        let idx = self
            .routing
            .get(name)
            .ok_or_else(|| self.err(name, "missing"))?;
        let file = &self.files[*idx];
        let info = file
            .metadata
            .info(name)
            .ok_or_else(|| self.err(name, "missing from its file's header"))?;
        Ok((file, info))
    }

    fn err(&self, name: &str, msg: impl Into<String>) -> Error {
        Error::Tensor {
            location: self.location.clone(),
            name: name.into(),
            msg: msg.into(),
        }
    }

    /// Shape, dtype and file of `name`.
    pub fn meta(&self, name: &str) -> Result<TensorMeta> {
        let (file, info) = self.info(name)?;
        Ok(TensorMeta {
            shape: info.shape.clone(),
            dtype: DType::try_from(info.dtype)
                .map_err(|e| self.err(name, format!("unsupported dtype: {e}")))?,
            file: file.path.clone(),
        })
    }

    /// How many elements of `name` are NaN or infinite (0 for an integer dtype): what `read`
    /// refuses, counted over the whole tensor (`cpl inspect`).
    pub fn non_finite_count(&self, name: &str) -> Result<usize> {
        let (data, dtype, _) = self.bytes(name)?;
        let el = dtype.size_in_bytes();
        let (mut count, mut at) = (0, 0);
        while let Some((i, _)) = first_non_finite(&data[at * el..], dtype) {
            count += 1;
            at += i + 1;
        }
        Ok(count)
    }

    /// The stored bytes of `name`, its dtype and shape, the length checked against the shape.
    fn bytes(&self, name: &str) -> Result<(&[u8], DType, Vec<usize>)> {
        let (file, info) = self.info(name)?;
        let dtype = DType::try_from(info.dtype)
            .map_err(|e| self.err(name, format!("unsupported dtype: {e}")))?;
        let shape = info.shape.clone();
        let (begin, end) = info.data_offsets;
        let data = file
            .mmap
            .get(file.data_start + begin..file.data_start + end)
            .ok_or_else(|| self.err(name, "data offsets lie outside the file"))?;
        let el = dtype.size_in_bytes();
        let numel: usize = shape.iter().product();
        if data.len() != numel * el {
            return Err(self.err(
                name,
                format!(
                    "holds {} bytes, its shape {shape:?} needs {}",
                    data.len(),
                    numel * el
                ),
            ));
        }
        Ok((data, dtype, shape))
    }

    /// Reads `shard`'s block of `name` (the whole tensor when not split) in the stored dtype.
    /// Only the bytes of the block are read from the map.
    pub fn read(&self, name: &str, shard: Shard, dev: &Device) -> Result<Tensor> {
        let (data, dtype, shape) = self.bytes(name)?;
        let el = dtype.size_in_bytes();
        if !shard.is_split() {
            self.check_finite(name, data, dtype, "")?;
            return Ok(Tensor::from_raw_buffer(data, dtype, &shape, dev)?);
        }
        if shard.dim >= shape.len() || shard.rank >= shard.world {
            return Err(self.err(name, format!("cannot take {shard:?} of shape {shape:?}")));
        }
        let size = shape[shard.dim];
        if !size.is_multiple_of(shard.world) {
            return Err(self.err(
                name,
                format!(
                    "dim {} of shape {shape:?} is not divisible by the tensor-parallel degree {}",
                    shard.dim, shard.world
                ),
            ));
        }
        let block = size / shard.world;
        let outer: usize = shape[..shard.dim].iter().product();
        let inner: usize = shape[shard.dim + 1..].iter().product::<usize>() * el;
        let mut bytes = Vec::with_capacity(outer * block * inner);
        for o in 0..outer {
            let start = (o * size + shard.rank * block) * inner;
            bytes.extend_from_slice(&data[start..start + block * inner]);
        }
        let block_of = format!(
            " of block {} of {} along dim {}",
            shard.rank, shard.world, shard.dim
        );
        self.check_finite(name, &bytes, dtype, &block_of)?;
        let mut local = shape;
        local[shard.dim] = block;
        Ok(Tensor::from_raw_buffer(&bytes, dtype, &local, dev)?)
    }

    /// An error naming `name` when `bytes` (elements of `dtype`; `block` says which part of the
    /// tensor, for the message) hold a NaN or an infinity: a weight that makes every loss NaN
    /// is bad input, refused where it is read rather than met as a NaN loss at the first step.
    fn check_finite(&self, name: &str, bytes: &[u8], dtype: DType, block: &str) -> Result<()> {
        match first_non_finite(bytes, dtype) {
            None => Ok(()),
            Some((i, v)) => Err(self.err(
                name,
                format!(
                    "element {i}{block} is {v}: the checkpoint holds a non-finite value (NaN or \
                     infinity), which would make every loss computed from it NaN"
                ),
            )),
        }
    }
}

/// The first element of `bytes` (little-endian elements of `dtype`) that is NaN or infinite,
/// with its value; `None` when all are finite or `dtype` is an integer type. Scanned in blocks
/// whose exponent test vectorizes; only a block that holds one is searched element by element.
fn first_non_finite(bytes: &[u8], dtype: DType) -> Option<(usize, f64)> {
    fn scan<const N: usize>(
        bytes: &[u8],
        bad: impl Fn([u8; N]) -> bool,
        value: impl Fn([u8; N]) -> f64,
    ) -> Option<(usize, f64)> {
        const BLOCK: usize = 4096;
        let el = |c: &[u8]| -> [u8; N] { std::array::from_fn(|j| c[j]) };
        for (b, block) in bytes.chunks(BLOCK * N).enumerate() {
            if block.chunks_exact(N).fold(false, |acc, c| acc | bad(el(c))) {
                let (i, c) = block
                    .chunks_exact(N)
                    .enumerate()
                    .find(|(_, c)| bad(el(c)))?;
                return Some((b * BLOCK + i, value(el(c))));
            }
        }
        None
    }
    // Non-finite: every exponent bit set.
    match dtype {
        DType::F32 => scan::<4>(
            bytes,
            |c| u32::from_le_bytes(c) & 0x7f80_0000 == 0x7f80_0000,
            |c| f32::from_le_bytes(c).into(),
        ),
        DType::BF16 => scan::<2>(
            bytes,
            |c| u16::from_le_bytes(c) & 0x7f80 == 0x7f80,
            |c| half::bf16::from_le_bytes(c).to_f64(),
        ),
        DType::F16 => scan::<2>(
            bytes,
            |c| u16::from_le_bytes(c) & 0x7c00 == 0x7c00,
            |c| half::f16::from_le_bytes(c).to_f64(),
        ),
        DType::F64 => scan::<8>(
            bytes,
            |c| u64::from_le_bytes(c) & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000,
            f64::from_le_bytes,
        ),
        _ => None,
    }
}

impl TensorSource for CheckpointReader {
    fn location(&self) -> String {
        self.location.clone()
    }

    fn contains(&self, name: &str) -> bool {
        CheckpointReader::contains(self, name)
    }

    fn shape(&self, name: &str) -> candle_parallel::Result<Vec<usize>> {
        Ok(self.meta(name).map_err(candle_parallel::Error::from)?.shape)
    }

    fn read(&self, name: &str, shard: Shard, dev: &Device) -> candle_parallel::Result<Tensor> {
        CheckpointReader::read(self, name, shard, dev).map_err(candle_parallel::Error::from)
    }
}

/// Options of [`save_hf`].
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// dtype of the saved tensors.
    pub dtype: DType,
    /// Largest file before the checkpoint is split into `model-0000i-of-0000n.safetensors`
    /// files with an index (Hugging Face's default is 5 GB).
    pub max_shard_bytes: usize,
    /// Files copied verbatim into the directory (config.json, tokenizer files, ...).
    pub extra_files: Vec<(String, Vec<u8>)>,
    /// Stem of the weight files: `model` (transformers: `model.safetensors`,
    /// `model-00001-of-00002.safetensors`, `model.safetensors.index.json`) or
    /// `diffusion_pytorch_model` (diffusers).
    pub weights_name: String,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            max_shard_bytes: 5_000_000_000,
            extra_files: Vec::new(),
            weights_name: "model".into(),
        }
    }
}

/// Collective over `tp`: gathers every split parameter from the tensor-parallel group and, on
/// `tp` rank 0 when `dir` is given, writes the Hugging Face model directory `dir`:
/// `model.safetensors` (or numbered shards plus `model.safetensors.index.json`) and the
/// `extra_files`. The directory is written under a temporary name and renamed into place, so a
/// crash never leaves a half-written `dir`, and an existing `dir` is replaced only once the new
/// one is complete. `params` must be the same list (by name) on every rank.
pub fn save_hf(params: &[Param], tp: &Comm, dir: Option<&Path>, opts: &SaveOptions) -> Result<()> {
    let dir = dir.filter(|_| tp.rank() == 0);
    let full = gather_tp(params, tp, dir.is_some(), opts.dtype)?;
    match dir {
        Some(dir) => write_hf_dir(&full, dir, opts),
        None => Ok(()),
    }
}

/// Collective over `tp`: every parameter whole (split ones all-gathered), sorted by name, in
/// `dtype`, checked against its global shape; an empty list unless `keep`.
pub fn gather_tp(
    params: &[Param],
    tp: &Comm,
    keep: bool,
    dtype: DType,
) -> Result<Vec<(String, Tensor)>> {
    let mut sorted: Vec<&Param> = params.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut full = Vec::with_capacity(sorted.len());
    for p in sorted {
        let t = p.tensor.detach();
        let t = if p.shard.is_split() {
            tp.all_gather(&t.contiguous()?, p.shard.dim)?
        } else {
            t
        };
        if t.dims() != p.global_shape.as_slice() {
            return Err(Error::Invalid(format!(
                "saving `{}`: gathered shape {:?}, expected {:?}",
                p.name,
                t.dims(),
                p.global_shape
            )));
        }
        if keep {
            full.push((p.name.clone(), t.to_dtype(dtype)?.contiguous()?));
        }
    }
    Ok(full)
}

/// Writes named tensors as a Hugging Face safetensors model directory (see [`save_hf`]).
pub fn write_hf_dir(tensors: &[(String, Tensor)], dir: &Path, opts: &SaveOptions) -> Result<()> {
    // Split into files of at most max_shard_bytes (a tensor larger than that gets its own file).
    let mut groups: Vec<Vec<&(String, Tensor)>> = vec![Vec::new()];
    let mut size = 0usize;
    for t in tensors {
        let bytes = t.1.elem_count() * t.1.dtype().size_in_bytes();
        if size > 0 && size + bytes > opts.max_shard_bytes {
            groups.push(Vec::new());
            size = 0;
        }
        size += bytes;
        groups.last_mut().expect("non-empty").push(t);
    }
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    let base = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| Error::Invalid(format!("cannot save to {}", dir.display())))?;
    let tmp = parent.join(format!(".{base}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let n = groups.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, group) in groups.iter().enumerate() {
        let stem = &opts.weights_name;
        let file = if n == 1 {
            format!("{stem}.safetensors")
        } else {
            format!("{stem}-{:05}-of-{:05}.safetensors", i + 1, n)
        };
        let map: HashMap<String, Tensor> =
            group.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
        for (k, t) in &map {
            weight_map.insert(k.clone(), serde_json::Value::String(file.clone()));
            total += t.elem_count() * t.dtype().size_in_bytes();
        }
        let path = tmp.join(&file);
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let views: Vec<(String, TensorBytes)> = {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            keys.into_iter()
                .map(|k| Ok((k.clone(), TensorBytes::new(&map[k])?)))
                .collect::<Result<_>>()?
        };
        safetensors::serialize_to_file(views, Some(meta), &path)
            .map_err(|e| Error::Invalid(format!("writing {}: {e}", path.display())))?;
        pause_for_tests(&tmp, &base, i + 1);
    }
    if n > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        write_file(
            &tmp.join(format!("{}.safetensors.index.json", opts.weights_name)),
            serde_json::to_vec_pretty(&index)
                .map_err(|e| Error::Invalid(e.to_string()))?
                .as_slice(),
        )?;
    }
    for (name, bytes) in &opts.extra_files {
        write_file(&tmp.join(name), bytes)?;
    }
    sync_dir(&tmp);
    // Replace atomically: a previous directory is moved aside first and removed last.
    let old = parent.join(format!(".{base}.old-{}", std::process::id()));
    let had_old = dir.exists();
    if had_old {
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
    }
    if let Err(e) = std::fs::rename(&tmp, dir) {
        if had_old {
            let _ = std::fs::rename(&old, dir);
        }
        return Err(Error::io(dir, e));
    }
    sync_dir(parent);
    if had_old {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    }
    Ok(())
}

/// Test hook (never set in normal use): with `CPL_TEST_PAUSE_SAVE=<dir name>:<n>`, the save of
/// the directory named `<dir name>` (e.g. `step-4`) stops for good after writing its `n`-th
/// weight file, leaving a `PAUSED` file in its temporary directory, so a test can kill the
/// process in the middle of a save (`bin/tests/train_cli.rs`).
fn pause_for_tests(tmp: &Path, base: &str, written: usize) {
    let Ok(v) = std::env::var("CPL_TEST_PAUSE_SAVE") else {
        return;
    };
    let Some((name, n)) = v.split_once(':') else {
        return;
    };
    if name == base && n.parse::<usize>().ok() == Some(written) {
        let _ = std::fs::write(tmp.join("PAUSED"), b"");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
}

/// The bytes of a safetensors file holding `tensors` (metadata `{"format": "pt"}`).
pub fn safetensors_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let views = tensors
        .iter()
        .map(|(k, t)| Ok((k.clone(), TensorBytes::new(t)?)))
        .collect::<Result<Vec<_>>>()?;
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize(views, Some(meta))
        .map_err(|e| Error::Invalid(format!("serializing tensors: {e}")))
}

/// Writes `bytes` to `path` atomically: a temporary file beside it (`.<name>.<pid>.tmp`), synced,
/// then renamed over `path`, so `path` is either the old file or the whole new one, never a part.
/// The temporary file is removed on failure. Errors name `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::Invalid(format!("{}: not a file path", path.display())))?
        .to_string_lossy()
        .into_owned();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = write_file(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e)));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(bytes).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))
}

fn sync_dir(dir: &Path) {
    if let Ok(f) = File::open(dir) {
        let _ = f.sync_all();
    }
}

/// A tensor's bytes in the safetensors serializer's view.
struct TensorBytes {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl TensorBytes {
    fn new(t: &Tensor) -> Result<Self> {
        use candle_core::DType as D;
        let dtype = match t.dtype() {
            D::F32 => safetensors::Dtype::F32,
            D::BF16 => safetensors::Dtype::BF16,
            D::F16 => safetensors::Dtype::F16,
            D::F64 => safetensors::Dtype::F64,
            D::U32 => safetensors::Dtype::U32,
            D::I64 => safetensors::Dtype::I64,
            D::U8 => safetensors::Dtype::U8,
            other => return Err(Error::Invalid(format!("cannot save dtype {other:?}"))),
        };
        let shape = t.dims().to_vec();
        let t = t.flatten_all()?;
        // Little-endian element bytes, as safetensors stores them.
        macro_rules! le_bytes {
            ($ty:ty) => {
                t.to_vec1::<$ty>()?
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect()
            };
        }
        let data: Vec<u8> = match t.dtype() {
            D::F32 => le_bytes!(f32),
            D::BF16 => le_bytes!(half::bf16),
            D::F16 => le_bytes!(half::f16),
            D::F64 => le_bytes!(f64),
            D::U32 => le_bytes!(u32),
            D::I64 => le_bytes!(i64),
            _ => t.to_vec1::<u8>()?,
        };
        Ok(Self { dtype, shape, data })
    }
}

impl safetensors::View for TensorBytes {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every float dtype: NaN, +inf and -inf found at their index with their value, also past
    /// the first scan block; finite values (large ones, a subnormal, -0) and integers pass.
    #[test]
    fn non_finite_elements_are_found_in_every_float_dtype() {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let n = 10_000;
            let mut v: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin() * 1e3).collect();
            v[1] = -0.0;
            v[2] = 1e-40; // subnormal in f32, flushed in the half types' rounding: still finite
            v[3] = 6.0e4; // near f16's largest (65504)
            let t = |v: &[f64]| Tensor::new(v, &Device::Cpu).and_then(|t| t.to_dtype(dtype));
            let bytes = |t: &Tensor| -> Vec<u8> { TensorBytes::new(t).expect("bytes").data };
            let clean = t(&v).expect("tensor");
            assert_eq!(first_non_finite(&bytes(&clean), dtype), None, "{dtype:?}");
            for (at, bad) in [
                (0, f64::NAN),
                (4095, f64::INFINITY),
                (9_999, f64::NEG_INFINITY),
            ] {
                let mut w = v.clone();
                w[at] = bad;
                let found = first_non_finite(&bytes(&t(&w).expect("tensor")), dtype);
                let (i, x) = found.unwrap_or_else(|| panic!("{dtype:?}: {bad} at {at} missed"));
                assert_eq!(i, at, "{dtype:?}");
                assert!(
                    x.is_nan() == bad.is_nan() && (bad.is_nan() || x == bad),
                    "{dtype:?}"
                );
            }
        }
        assert_eq!(first_non_finite(&[0xff; 64], DType::U8), None);
    }

    /// `non_finite_count` over whole tensors (f32, bf16) with dozens of NaNs and infinities at
    /// scattered positions, runs of them included, against a plain count of their values.
    #[test]
    fn non_finite_count_matches_a_plain_count() {
        let dir = std::env::temp_dir().join(format!("cpl-nonfinite-count-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("model.safetensors");
        let n = 9_000;
        let mut v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut seed = 7u64;
        for k in 0..60 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let at = (seed >> 33) as usize % n;
            v[at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][k % 3];
        }
        v[100..104].fill(f32::NAN); // a run
        let want = v.iter().filter(|x| !x.is_finite()).count();
        let t = Tensor::from_vec(v, n, &Device::Cpu).expect("t");
        let tensors = vec![
            ("f32".to_string(), t.clone()),
            ("bf16".to_string(), t.to_dtype(DType::BF16).expect("bf16")),
        ];
        write_atomic(&path, &safetensors_bytes(&tensors).expect("bytes")).expect("write");
        let reader = CheckpointReader::open(std::slice::from_ref(&path)).expect("open");
        for name in ["f32", "bf16"] {
            assert_eq!(
                reader.non_finite_count(name).expect("count"),
                want,
                "{name}"
            );
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Reading a tensor with a NaN, whole or one rank's block, fails naming the tensor, the
    /// checkpoint and the element; the clean tensors of the same file still read, and a block
    /// without the NaN reads too.
    #[test]
    fn a_non_finite_weight_is_refused_naming_the_tensor() {
        let dir = std::env::temp_dir().join(format!("cpl-nonfinite-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("model.safetensors");
        let mut w = vec![0.5f32; 4 * 6];
        w[3 * 6 + 2] = f32::NAN; // row 3, column 2
        w[3 * 6 + 5] = f32::INFINITY; // row 3, column 5: counted, never the first reported
        let tensors = vec![
            (
                "bad.weight".to_string(),
                Tensor::from_vec(w, (4, 6), &Device::Cpu).expect("t"),
            ),
            (
                "good.weight".to_string(),
                Tensor::ones((4, 6), DType::F32, &Device::Cpu).expect("t"),
            ),
        ];
        write_atomic(&path, &safetensors_bytes(&tensors).expect("bytes")).expect("write");
        let reader = CheckpointReader::open(std::slice::from_ref(&path)).expect("open");
        let dev = Device::Cpu;
        let err = reader
            .read("bad.weight", Shard::replicated(), &dev)
            .expect_err("a NaN weight must be refused")
            .to_string();
        assert!(
            err.contains("`bad.weight`") && err.contains("element 20 is NaN"),
            "{err}"
        );
        assert!(err.contains(&dir.display().to_string()), "{err}");
        assert!(reader
            .read("good.weight", Shard::replicated(), &dev)
            .is_ok());
        // Rows split in two: the NaN is in rank 1's block (row 3 = its row 1), element 8.
        let err = reader
            .read("bad.weight", Shard::new(0, 1, 2), &dev)
            .expect_err("the block holding the NaN")
            .to_string();
        assert!(
            err.contains("element 8 of block 1 of 2 along dim 0 is NaN"),
            "{err}"
        );
        assert!(reader.read("bad.weight", Shard::new(0, 0, 2), &dev).is_ok());
        assert_eq!(reader.non_finite_count("bad.weight").expect("count"), 2);
        assert_eq!(reader.non_finite_count("good.weight").expect("count"), 0);
        std::fs::remove_dir_all(&dir).ok();
    }
}
