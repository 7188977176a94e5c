//! Image preprocessing as a model's `preprocessor_config.json` says (transformers'
//! `CLIPImageProcessor` and `SiglipImageProcessor`): convert to RGB, resize (the shortest edge
//! to `size.shortest_edge`, keeping the aspect ratio, or to `size.height × size.width`),
//! center-crop to `crop_size`, rescale by `rescale_factor` (1/255) and normalise with
//! `image_mean` / `image_std`, giving `(3, H, W)` f32 pixel values.
//!
//! Resampling is written here, not taken from the `image` crate: transformers resizes with
//! Pillow, whose separable convolution (horizontal pass, then vertical) rounds each pass to 8
//! bits with 22-bit fixed-point weights; the `image` crate keeps floats between the passes and
//! treats the borders differently, which moves pixels by up to 10/255. [`pil_resize`]
//! reproduces Pillow's arithmetic, so the pixel values equal transformers' exactly for PNG
//! images; JPEG decoders (libjpeg-turbo in Pillow, the `image` crate's here) may still differ
//! in the last bit of a few pixels.

use std::path::Path;

use candle_core::{Device, Tensor};
use image::RgbImage;
use serde_json::Value;

use crate::error::{Error, Result};

/// How images are resized before the crop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resize {
    /// The shorter side to this length, the other in proportion (truncated, as transformers).
    ShortestEdge(u32),
    /// Exactly `(height, width)`.
    Exact(u32, u32),
}

/// A model's image preprocessing; see the [module docs](self).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessor {
    pub resize: Option<Resize>,
    /// PIL's resample code: 2 bilinear, 3 bicubic.
    pub resample: u32,
    pub crop: Option<(u32, u32)>,
    pub rescale: Option<f32>,
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

fn num(v: &Value) -> Option<u32> {
    v.as_u64()
        .or_else(|| {
            v.as_f64()
                .filter(|x| x.fract() == 0.0 && *x >= 0.0)
                .map(|x| x as u64)
        })
        .map(|x| x as u32)
}

impl ImageProcessor {
    /// The image processor of a model directory: `preprocessor_config.json`, else the
    /// `image_processor` of `processor_config.json` (what transformers 5's `LlavaProcessor`
    /// writes). Errors name the file.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let pre = dir.join("preprocessor_config.json");
        if pre.is_file() {
            return Self::from_file(&pre);
        }
        let proc_ = dir.join("processor_config.json");
        let text = std::fs::read_to_string(&proc_).map_err(|_| Error::NotFound {
            model: dir.display().to_string(),
            msg: "has neither preprocessor_config.json nor processor_config.json (needed to \
                  read images)"
                .into(),
        })?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(&proc_, format!("not valid JSON: {e}")))?;
        match v.get("image_processor") {
            Some(ip) => Self::from_value(ip, &proc_),
            None => Err(Error::config(&proc_, "has no image_processor")),
        }
    }

    /// Reads `preprocessor_config.json`; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(path, format!("not valid JSON: {e}")))?;
        Self::from_value(&v, path)
    }

    fn from_value(v: &Value, path: &Path) -> Result<Self> {
        let bad = |msg: String| Error::config(path, msg);
        let flag = |k: &str, default: bool| v[k].as_bool().unwrap_or(default);
        let resize = if flag("do_resize", true) {
            let s = &v["size"];
            Some(if let Some(e) = num(&s["shortest_edge"]) {
                Resize::ShortestEdge(e)
            } else if let (Some(h), Some(w)) = (num(&s["height"]), num(&s["width"])) {
                Resize::Exact(h, w)
            } else if let Some(e) = num(s) {
                Resize::Exact(e, e)
            } else {
                return Err(bad(format!("size {s} is not understood")));
            })
        } else {
            None
        };
        // CLIPImageProcessor crops by default; SigLIP's has no crop_size.
        let crop = if flag("do_center_crop", !v["crop_size"].is_null()) {
            let c = &v["crop_size"];
            Some(match (num(&c["height"]), num(&c["width"]), num(c)) {
                (Some(h), Some(w), _) => (h, w),
                (_, _, Some(e)) => (e, e),
                _ => return Err(bad(format!("crop_size {c} is not understood"))),
            })
        } else {
            None
        };
        let rescale = flag("do_rescale", true)
            .then(|| v["rescale_factor"].as_f64().unwrap_or(1.0 / 255.0) as f32);
        let triple = |k: &str| -> Result<[f32; 3]> {
            let a = v[k]
                .as_array()
                .filter(|a| a.len() == 3)
                .ok_or_else(|| bad(format!("{k} must be a list of 3 numbers")))?;
            let mut out = [0f32; 3];
            for (o, x) in out.iter_mut().zip(a) {
                *o = x.as_f64().ok_or_else(|| bad(format!("{k} holds {x}")))? as f32;
            }
            Ok(out)
        };
        let normalize = if flag("do_normalize", true) {
            Some((triple("image_mean")?, triple("image_std")?))
        } else {
            None
        };
        let resample = num(&v["resample"]).unwrap_or(3);
        if !(resample == 2 || resample == 3) {
            return Err(bad(format!(
                "resample {resample}: only bilinear (2) and bicubic (3) are supported"
            )));
        }
        Ok(Self {
            resize,
            resample,
            crop,
            rescale,
            normalize,
        })
    }

    /// The pixel values `(3, H, W)` f32 of the image file `path` (PNG or JPEG). Errors name the
    /// file.
    pub fn preprocess_file(&self, path: &Path) -> Result<Tensor> {
        let img = image::ImageReader::open(path)
            .map_err(|e| Error::io(path, e))?
            .with_guessed_format()
            .map_err(|e| Error::io(path, e))?
            .decode()
            .map_err(|e| Error::config(path, format!("not a readable PNG or JPEG image: {e}")))?;
        self.preprocess(&img.to_rgb8())
    }

    /// The pixel values `(3, H, W)` f32 of an RGB image.
    pub fn preprocess(&self, img: &RgbImage) -> Result<Tensor> {
        let filter = if self.resample == 2 {
            Filter::Bilinear
        } else {
            Filter::Bicubic
        };
        let (w, h) = img.dimensions();
        let target = match self.resize {
            Some(Resize::ShortestEdge(e)) => {
                let (short, long) = if w <= h { (w, h) } else { (h, w) };
                let long = (e as u64 * long as u64 / short.max(1) as u64) as u32;
                Some(if w <= h { (e, long) } else { (long, e) })
            }
            Some(Resize::Exact(rh, rw)) => Some((rw, rh)),
            None => None,
        };
        let img = match target {
            Some((tw, th)) if (tw, th) != (w, h) => pil_resize(img, tw, th, filter),
            _ => img.clone(),
        };
        let (w, h) = img.dimensions();
        let (x0, y0, cw, ch) = match self.crop {
            Some((chh, cww)) if chh <= h && cww <= w => ((w - cww) / 2, (h - chh) / 2, cww, chh),
            Some((chh, cww)) => {
                return Err(Error::Invalid(format!(
                    "the image is {w}x{h} after resizing, smaller than the {cww}x{chh} crop"
                )))
            }
            None => (0, 0, w, h),
        };
        let mut out = vec![0f32; 3 * (cw * ch) as usize];
        let plane = (cw * ch) as usize;
        for y in 0..ch {
            for x in 0..cw {
                let p = img.get_pixel(x0 + x, y0 + y);
                for c in 0..3 {
                    // transformers rescales in float64, then works in float32.
                    let mut v = match self.rescale {
                        Some(r) => (p[c] as f64 * r as f64) as f32,
                        None => p[c] as f32,
                    };
                    if let Some((mean, std)) = &self.normalize {
                        v = (v - mean[c]) / std[c];
                    }
                    out[c * plane + (y * cw + x) as usize] = v;
                }
            }
        }
        Ok(Tensor::from_vec(
            out,
            (3, ch as usize, cw as usize),
            &Device::Cpu,
        )?)
    }
}

/// Pillow's resampling filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Bilinear,
    Bicubic,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bilinear => (1.0 - x).max(0.0),
            Filter::Bicubic => {
                let a = -0.5;
                if x < 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * a
                } else {
                    0.0
                }
            }
        }
    }
}

/// Fixed-point bits of Pillow's 8-bit resampling weights.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// For each of `out_size` outputs: the first input index and the fixed-point weights, as
/// Pillow's `precompute_coeffs` and `normalize_coeffs_8bpc` compute them.
fn coefficients(in_size: u32, out_size: u32, filter: Filter) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            let ss = 1.0 / filterscale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let mut k: Vec<f64> = (xmin..xmax)
                .map(|x| filter.weight((x as f64 - center + 0.5) * ss))
                .collect();
            let total: f64 = k.iter().sum();
            if total != 0.0 {
                k.iter_mut().for_each(|w| *w /= total);
            }
            let fixed = k
                .iter()
                .map(|&w| {
                    let v = w * (1u64 << PRECISION_BITS) as f64;
                    (if v < 0.0 { v - 0.5 } else { v + 0.5 }) as i32
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

fn clip8(v: i64) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// One pass of Pillow's 8-bit resampling along x (`horizontal`) or y.
fn resample_pass(img: &RgbImage, size: u32, filter: Filter, horizontal: bool) -> RgbImage {
    let (w, h) = img.dimensions();
    let in_size = if horizontal { w } else { h };
    let coeffs = coefficients(in_size, size, filter);
    let (ow, oh) = if horizontal { (size, h) } else { (w, size) };
    let mut out = RgbImage::new(ow, oh);
    let half = 1i64 << (PRECISION_BITS - 1);
    for y in 0..oh {
        for x in 0..ow {
            let (start, k) = &coeffs[if horizontal { x } else { y } as usize];
            let mut acc = [half; 3];
            for (i, &kk) in k.iter().enumerate() {
                let p = if horizontal {
                    img.get_pixel(*start as u32 + i as u32, y)
                } else {
                    img.get_pixel(x, *start as u32 + i as u32)
                };
                for c in 0..3 {
                    acc[c] += p[c] as i64 * kk as i64;
                }
            }
            out.put_pixel(
                x,
                y,
                image::Rgb([clip8(acc[0]), clip8(acc[1]), clip8(acc[2])]),
            );
        }
    }
    out
}

/// `img` resized to `w × h` as Pillow's `Image.resize` does for 8-bit RGB images: a horizontal
/// pass (when the width changes), then a vertical one (when the height does), each rounded to
/// 8 bits.
pub fn pil_resize(img: &RgbImage, w: u32, h: u32, filter: Filter) -> RgbImage {
    let (iw, ih) = img.dimensions();
    let img = if w != iw {
        resample_pass(img, w, filter, true)
    } else {
        img.clone()
    };
    if h != ih {
        resample_pass(&img, h, filter, false)
    } else {
        img
    }
}
