//! Image data for diffusion transformers (DiT) and a PNG grid writer for their samples.
//!
//! [`ImageDataset::load`] reads one of two formats, chosen by the path:
//!
//! - **Precomputed latents**: a `.safetensors` file holding `latents`, shape `(N, C, H, W)` in
//!   f32, f16, bf16 or f64, and `labels`, shape `(N)` in any integer dtype (u8, i8, u16, i16,
//!   u32, i32, u64, i64), none negative. `C` must be [`ImageOptions::channels`] (any count:
//!   VAE latents have 4) and `H = W = ` [`ImageOptions::size`]. The values are used as they are
//!   (latents come normalised); the classes are `0..=max(labels)`, named by their numbers.
//! - **Class folders**: a directory with one sub-directory per class, sorted by name into class
//!   indices `0..K` (sub-directories whose name starts with `.` are skipped, and so are plain
//!   files beside them). Each class directory holds `.png`, `.jpg` or `.jpeg` files (the
//!   extension in any case; other files are ignored), read in name order. Every image is
//!   decoded, converted to grayscale (`channels` 1) or RGB (`channels` 3), center-cropped to a
//!   square and resized to `size × size` (bilinear, [`FilterType::Triangle`]) when it is not
//!   already that size, and scaled from `0..=255` to `[-1, 1]` as `x / 127.5 - 1`.
//!
//! Either way the dataset is deterministic: the same files give the same tensor, and every
//! problem (a missing tensor, a wrong shape, a negative label, an unreadable image, a class
//! directory without images) is an error naming the file and what is wrong.
//!
//! Order: epoch `e` visits the images in [`permutation`](crate::data::permutation)`(N, seed + e)` (or in stored order
//! without shuffling), and global sample `k` is image `order_{k / N}[k mod N]`: the order of
//! [`Sampler`] ([`ImageDataset::sampler`]), which trainers deal images with.
//!
//! [`write_grid_png`] tiles a batch of images in `[-1, 1]` into one PNG, written atomically.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use image::imageops::{self, FilterType};
use image::{DynamicImage, ExtendedColorType, ImageEncoder};

use crate::data::Sampler;
use crate::error::{Error, Result};

/// The image extensions a class folder's files are read with (compared case-insensitively).
const IMAGE_EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// Grey level of the separators and empty cells of [`write_grid_png`].
pub const GRID_SEPARATOR: u8 = 64;

/// What the model expects of every image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageOptions {
    /// Channels per image: 1 (grayscale) or 3 (RGB) for image folders; any count for latents.
    pub channels: usize,
    /// Height and width (images are square).
    pub size: usize,
}

/// A labelled image dataset held in memory.
#[derive(Debug, Clone)]
pub struct ImageDataset {
    /// All images, `(N, C, H, W)` f32 on the CPU.
    pub images: Tensor,
    /// The class of every image, each below `num_classes`.
    pub labels: Vec<u32>,
    /// Number of classes (class folders, or the largest label + 1 for latents).
    pub num_classes: usize,
    /// Name of every class: its folder name, or its number for latents.
    pub class_names: Vec<String>,
    /// Where the data came from (the path given to [`ImageDataset::load`]).
    pub source: String,
}

fn image_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Image {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

impl ImageDataset {
    /// Loads a `.safetensors` file of latents or a directory of class folders (see the module
    /// documentation for both formats). Errors name the file and what is wrong; a dataset with
    /// no image is an error.
    pub fn load(path: &Path, opts: &ImageOptions) -> Result<Self> {
        if opts.size == 0 || opts.channels == 0 {
            return Err(image_err(
                path,
                format!(
                    "the model expects images of {} channels and size {}; both must be at least 1",
                    opts.channels, opts.size
                ),
            ));
        }
        if path.is_dir() {
            Self::load_folders(path, opts)
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"))
        {
            Self::load_latents(path, opts)
        } else if !path.exists() {
            Err(image_err(path, "no such file or directory"))
        } else {
            Err(image_err(
                path,
                "expected a .safetensors file of `latents` and `labels`, or a directory with one sub-directory of PNG/JPEG images per class",
            ))
        }
    }

    fn load_latents(path: &Path, opts: &ImageOptions) -> Result<Self> {
        use safetensors::{Dtype, SafeTensors};

        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| image_err(path, format!("not a valid safetensors file: {e}")))?;
        let get = |name: &str| {
            st.tensor(name).map_err(|_| {
                let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
                names.sort();
                image_err(
                    path,
                    format!("no tensor `{name}` (tensors: {names:?}); expected `latents` (N, C, H, W) and `labels` (N)"),
                )
            })
        };

        let latents = get("latents")?;
        let shape = latents.shape().to_vec();
        let want = format!("(N, {}, {}, {})", opts.channels, opts.size, opts.size);
        if shape.len() != 4
            || shape[1] != opts.channels
            || shape[2] != opts.size
            || shape[3] != opts.size
        {
            return Err(image_err(
                path,
                format!(
                    "tensor `latents` has shape {shape:?}; the model expects {want} (channels {}, size {})",
                    opts.channels, opts.size
                ),
            ));
        }
        let n = shape[0];
        if n == 0 {
            return Err(image_err(path, "tensor `latents` holds no image"));
        }
        let dtype = match latents.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::F64 => DType::F64,
            other => {
                return Err(image_err(
                    path,
                    format!("tensor `latents` has dtype {other:?}; expected f32, f16, bf16 or f64"),
                ))
            }
        };
        let images = Tensor::from_raw_buffer(latents.data(), dtype, &shape, &Device::Cpu)?
            .to_dtype(DType::F32)?;

        let labels_view = get("labels")?;
        if labels_view.shape() != [n] {
            return Err(image_err(
                path,
                format!(
                    "tensor `labels` has shape {:?}; expected [{n}], one label per image of `latents` {shape:?}",
                    labels_view.shape()
                ),
            ));
        }
        let data = labels_view.data();
        let labels: Vec<i128> = match labels_view.dtype() {
            Dtype::U8 => data.iter().map(|&b| b as i128).collect(),
            Dtype::I8 => data.iter().map(|&b| b as i8 as i128).collect(),
            Dtype::U16 => le_ints::<2>(data, |b| u16::from_le_bytes(b) as i128),
            Dtype::I16 => le_ints::<2>(data, |b| i16::from_le_bytes(b) as i128),
            Dtype::U32 => le_ints::<4>(data, |b| u32::from_le_bytes(b) as i128),
            Dtype::I32 => le_ints::<4>(data, |b| i32::from_le_bytes(b) as i128),
            Dtype::U64 => le_ints::<8>(data, |b| u64::from_le_bytes(b) as i128),
            Dtype::I64 => le_ints::<8>(data, |b| i64::from_le_bytes(b) as i128),
            other => {
                return Err(image_err(
                    path,
                    format!("tensor `labels` has dtype {other:?}; expected an integer dtype"),
                ))
            }
        };
        let labels = labels
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                u32::try_from(l).map_err(|_| {
                    image_err(
                        path,
                        format!("tensor `labels` holds {l} at index {i}; labels must be class indices from 0 to {}", u32::MAX),
                    )
                })
            })
            .collect::<Result<Vec<u32>>>()?;
        let num_classes = labels.iter().max().map_or(0, |&m| m as usize + 1);
        Ok(Self {
            images,
            labels,
            num_classes,
            class_names: (0..num_classes).map(|c| c.to_string()).collect(),
            source: path.display().to_string(),
        })
    }

    fn load_folders(path: &Path, opts: &ImageOptions) -> Result<Self> {
        if opts.channels != 1 && opts.channels != 3 {
            return Err(image_err(
                path,
                format!(
                    "the model expects {} channels; image folders give 1 (grayscale) or 3 (RGB)",
                    opts.channels
                ),
            ));
        }
        let mut classes: Vec<PathBuf> = list_dir(path)?
            .into_iter()
            .filter(|p| {
                p.is_dir()
                    && !p
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            })
            .collect();
        classes.sort();
        if classes.is_empty() {
            return Err(image_err(
                path,
                "holds no class directory; expected one sub-directory of PNG/JPEG images per class",
            ));
        }
        let mut files = Vec::new();
        let mut labels = Vec::new();
        let mut class_names = Vec::with_capacity(classes.len());
        for (c, dir) in classes.iter().enumerate() {
            let mut images: Vec<PathBuf> = list_dir(dir)?
                .into_iter()
                .filter(|p| {
                    p.is_file()
                        && p.extension().and_then(|e| e.to_str()).is_some_and(|e| {
                            IMAGE_EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x))
                        })
                })
                .collect();
            if images.is_empty() {
                return Err(image_err(
                    dir,
                    "class directory holds no .png, .jpg or .jpeg image",
                ));
            }
            images.sort();
            labels.extend(std::iter::repeat_n(c as u32, images.len()));
            files.extend(images);
            class_names.push(
                dir.file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            );
        }

        use rayon::prelude::*;
        let decoded: Vec<Result<Vec<f32>>> =
            files.par_iter().map(|f| decode_image(f, opts)).collect();
        let per = opts.channels * opts.size * opts.size;
        let mut pixels = Vec::with_capacity(per * files.len());
        for d in decoded {
            pixels.extend(d?);
        }
        let images = Tensor::from_vec(
            pixels,
            (files.len(), opts.channels, opts.size, opts.size),
            &Device::Cpu,
        )?;
        Ok(Self {
            images,
            labels,
            num_classes: classes.len(),
            class_names,
            source: path.display().to_string(),
        })
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The images `indices` (rows of [`ImageDataset::images`], `(indices.len(), C, H, W)`) and
    /// their labels. An index at or past [`ImageDataset::len`] is an error.
    pub fn batch(&self, indices: &[usize]) -> Result<(Tensor, Vec<u32>)> {
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len()) {
            return Err(Error::Invalid(format!(
                "image index {bad} is out of range for the {} images of {}",
                self.len(),
                self.source
            )));
        }
        let ids: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
        let ids = Tensor::from_vec(ids, indices.len(), self.images.device())?;
        let images = self.images.index_select(&ids, 0)?;
        let labels = indices.iter().map(|&i| self.labels[i]).collect();
        Ok((images, labels))
    }

    /// The [`Sampler`] of this dataset: which image each global sample is (see the module
    /// docs).
    pub fn sampler(&self, seed: u64, shuffle: bool) -> Sampler {
        Sampler {
            num_windows: self.len(),
            seed,
            shuffle,
        }
    }
}

/// The entries of directory `dir`.
fn list_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    entries
        .map(|e| e.map(|e| e.path()).map_err(|e| Error::io(dir, e)))
        .collect()
}

/// Little-endian integers of `N` bytes each.
fn le_ints<const N: usize>(data: &[u8], f: impl Fn([u8; N]) -> i128) -> Vec<i128> {
    data.chunks_exact(N)
        .map(|c| {
            let mut b = [0u8; N];
            b.copy_from_slice(c);
            f(b)
        })
        .collect()
}

/// One image file as `(C, size, size)` values in `[-1, 1]`, channel-major.
fn decode_image(path: &Path, opts: &ImageOptions) -> Result<Vec<f32>> {
    let reader = image::ImageReader::open(path)
        .map_err(|e| Error::io(path, e))?
        .with_guessed_format()
        .map_err(|e| Error::io(path, e))?;
    let img = reader
        .decode()
        .map_err(|e| image_err(path, format!("cannot decode the image: {e}")))?;
    let (w, h) = (img.width(), img.height());
    if w == 0 || h == 0 {
        return Err(image_err(path, format!("the image is empty ({w}x{h})")));
    }
    let size = opts.size as u32;
    let img = if w == size && h == size {
        img
    } else {
        let side = w.min(h);
        let square = img.crop_imm((w - side) / 2, (h - side) / 2, side, side);
        if side == size {
            square
        } else {
            match opts.channels {
                1 => DynamicImage::ImageLuma8(imageops::resize(
                    &square.to_luma8(),
                    size,
                    size,
                    FilterType::Triangle,
                )),
                _ => DynamicImage::ImageRgb8(imageops::resize(
                    &square.to_rgb8(),
                    size,
                    size,
                    FilterType::Triangle,
                )),
            }
        }
    };
    let (c, hw) = (opts.channels, opts.size * opts.size);
    let raw: Vec<u8> = if c == 1 {
        img.to_luma8().into_raw()
    } else {
        img.to_rgb8().into_raw()
    };
    // Interleaved HWC bytes to channel-major CHW values.
    let mut out = vec![0f32; c * hw];
    for (p, px) in raw.chunks_exact(c).enumerate() {
        for (ch, &v) in px.iter().enumerate() {
            out[ch * hw + p] = v as f32 / 127.5 - 1.0;
        }
    }
    Ok(out)
}

/// Writes `images` (`(N, C, H, W)`, `C` 1 or 3, any float dtype, on any device, values in
/// `[-1, 1]`) to `path` as one PNG: the images tiled row-major, `min(cols, N)` per row, each
/// pixel drawn as a `scale × scale` block (nearest neighbour), with `scale`-pixel separators of
/// grey [`GRID_SEPARATOR`] between the tiles (none around the grid) and the same grey in
/// the unfilled cells of the last row. The PNG is `cols·W·scale + (cols − 1)·scale` wide and
/// `rows·H·scale + (rows − 1)·scale` high, grayscale for `C = 1`, RGB for `C = 3`. Values are
/// clamped to `[-1, 1]` and mapped to `round((x + 1) · 127.5)` (NaN gives 0). The file is
/// written to a temporary file beside `path` and renamed over it (parent directories are
/// created). Errors name the path.
pub fn write_grid_png(images: &Tensor, cols: usize, scale: usize, path: &Path) -> Result<()> {
    let err = |msg: String| image_err(path, msg);
    let (n, c, h, w) = images.dims4().map_err(|_| {
        err(format!(
            "images of shape {:?}; expected (N, C, H, W)",
            images.dims()
        ))
    })?;
    if c != 1 && c != 3 {
        return Err(err(format!(
            "images of shape {:?} have {c} channels; a PNG grid takes 1 (grayscale) or 3 (RGB)",
            images.dims()
        )));
    }
    if n == 0 || h == 0 || w == 0 {
        return Err(err(format!(
            "no pixels to write: images of shape {:?}",
            images.dims()
        )));
    }
    if !images.dtype().is_float() {
        return Err(err(format!(
            "images of dtype {:?}; expected a float dtype with values in [-1, 1]",
            images.dtype()
        )));
    }
    if cols == 0 || scale == 0 {
        return Err(err(format!(
            "columns ({cols}) and scale ({scale}) must be at least 1"
        )));
    }
    let cols = cols.min(n);
    let rows = n.div_ceil(cols);
    let (tile_w, tile_h) = (w * scale, h * scale);
    let width = cols * tile_w + (cols - 1) * scale;
    let height = rows * tile_h + (rows - 1) * scale;
    let (Ok(width32), Ok(height32)) = (u32::try_from(width), u32::try_from(height)) else {
        return Err(err(format!(
            "a grid of {width}x{height} pixels is too large"
        )));
    };

    let values: Vec<f32> = images
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    let mut buf = vec![GRID_SEPARATOR; width * height * c];
    for (i, img) in values.chunks_exact(c * h * w).enumerate() {
        let (x0, y0) = ((i % cols) * (tile_w + scale), (i / cols) * (tile_h + scale));
        for y in 0..tile_h {
            let row = (y0 + y) * width;
            for x in 0..tile_w {
                let src = (y / scale) * w + x / scale;
                let dst = (row + x0 + x) * c;
                for ch in 0..c {
                    let v = img[ch * h * w + src].clamp(-1.0, 1.0);
                    buf[dst + ch] = ((v + 1.0) * 127.5).round() as u8;
                }
            }
        }
    }

    let mut png = Vec::new();
    let color = if c == 1 {
        ExtendedColorType::L8
    } else {
        ExtendedColorType::Rgb8
    };
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(&buf, width32, height32, color)
        .map_err(|e| err(format!("cannot encode the PNG: {e}")))?;

    if path.file_name().is_none() {
        return Err(err("not a file path".into()));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    models::checkpoint::write_atomic(path, &png)?;
    Ok(())
}
