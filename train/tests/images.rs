//! Image datasets (safetensors latents and class folders), their sampling order, and the PNG
//! grid writer.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use image::{GrayImage, Luma, Rgb, RgbImage};
use train::data::Sampler;
use train::images::{write_grid_png, ImageDataset, ImageOptions, GRID_SEPARATOR};

/// A fresh directory `name` under the test target's temporary directory (`target/tmp`).
fn fresh_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("images-{name}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn save(path: &Path, tensors: Vec<(&str, Tensor)>) {
    let map: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    candle_core::safetensors::save(&map, path).unwrap();
}

fn latents(n: usize, c: usize, s: usize) -> Tensor {
    let v: Vec<f32> = (0..n * c * s * s)
        .map(|i| (i as f32 * 0.37).sin() * 1.5)
        .collect();
    Tensor::from_vec(v, (n, c, s, s), &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn load_err(path: &Path, channels: usize, size: usize) -> String {
    ImageDataset::load(path, &ImageOptions { channels, size })
        .unwrap_err()
        .to_string()
}

#[test]
fn safetensors_latents_round_trip() {
    let dir = fresh_dir("roundtrip");
    let x = latents(5, 4, 8);
    let opts = ImageOptions {
        channels: 4,
        size: 8,
    };

    let p = dir.join("i64.safetensors");
    save(
        &p,
        vec![
            ("latents", x.clone()),
            (
                "labels",
                Tensor::new(&[0i64, 3, 1, 3, 2], &Device::Cpu).unwrap(),
            ),
        ],
    );
    let d = ImageDataset::load(&p, &opts).unwrap();
    assert_eq!(d.len(), 5);
    assert!(!d.is_empty());
    assert_eq!(d.images.dims(), &[5, 4, 8, 8]);
    assert_eq!(d.images.dtype(), DType::F32);
    assert_eq!(flat(&d.images), flat(&x));
    assert_eq!(d.labels, vec![0, 3, 1, 3, 2]);
    assert_eq!(d.num_classes, 4);
    assert_eq!(d.class_names, vec!["0", "1", "2", "3"]);
    assert_eq!(d.source, p.display().to_string());

    // u8 labels, f16 latents (converted to f32 exactly, as they are representable).
    let p = dir.join("u8.safetensors");
    let half = x.to_dtype(DType::F16).unwrap();
    save(
        &p,
        vec![
            ("latents", half.clone()),
            (
                "labels",
                Tensor::new(&[1u8, 0, 0, 1, 1], &Device::Cpu).unwrap(),
            ),
        ],
    );
    let d = ImageDataset::load(&p, &opts).unwrap();
    assert_eq!(d.labels, vec![1, 0, 0, 1, 1]);
    assert_eq!(d.num_classes, 2);
    assert_eq!(flat(&d.images), flat(&half.to_dtype(DType::F32).unwrap()));

    // bf16 latents and u32 labels.
    let p = dir.join("bf16.safetensors");
    let bf = x.to_dtype(DType::BF16).unwrap();
    save(
        &p,
        vec![
            ("latents", bf.clone()),
            (
                "labels",
                Tensor::new(&[4u32, 0, 0, 1, 1], &Device::Cpu).unwrap(),
            ),
        ],
    );
    let d = ImageDataset::load(&p, &opts).unwrap();
    assert_eq!(d.labels, vec![4, 0, 0, 1, 1]);
    assert_eq!(flat(&d.images), flat(&bf.to_dtype(DType::F32).unwrap()));

    // batch selects rows and their labels.
    let (b, l) = d.batch(&[3, 0, 3]).unwrap();
    assert_eq!(b.dims(), &[3, 4, 8, 8]);
    assert_eq!(l, vec![1, 4, 1]);
    let want = Tensor::cat(
        &[
            d.images.get(3).unwrap().unsqueeze(0).unwrap(),
            d.images.get(0).unwrap().unsqueeze(0).unwrap(),
            d.images.get(3).unwrap().unsqueeze(0).unwrap(),
        ],
        0,
    )
    .unwrap();
    assert_eq!(flat(&b), flat(&want));
    let m = d.batch(&[0, 5]).unwrap_err().to_string();
    assert!(m.contains("index 5") && m.contains("5 images"), "{m}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_latents_are_clear_errors() {
    let dir = fresh_dir("bad-latents");
    let labels = || Tensor::new(&[0i64, 1, 2], &Device::Cpu).unwrap();

    let p = dir.join("channels.safetensors");
    save(
        &p,
        vec![("latents", latents(3, 3, 8)), ("labels", labels())],
    );
    let m = load_err(&p, 4, 8);
    assert!(
        m.contains("channels.safetensors")
            && m.contains("`latents`")
            && m.contains("[3, 3, 8, 8]")
            && m.contains("(N, 4, 8, 8)"),
        "{m}"
    );

    let p = dir.join("size.safetensors");
    save(
        &p,
        vec![("latents", latents(3, 4, 16)), ("labels", labels())],
    );
    let m = load_err(&p, 4, 8);
    assert!(
        m.contains("size.safetensors")
            && m.contains("`latents`")
            && m.contains("[3, 4, 16, 16]")
            && m.contains("(N, 4, 8, 8)"),
        "{m}"
    );

    let p = dir.join("no-labels.safetensors");
    save(&p, vec![("latents", latents(3, 4, 8))]);
    let m = load_err(&p, 4, 8);
    assert!(
        m.contains("no-labels.safetensors") && m.contains("no tensor `labels`"),
        "{m}"
    );

    let p = dir.join("no-latents.safetensors");
    save(&p, vec![("labels", labels())]);
    let m = load_err(&p, 4, 8);
    assert!(
        m.contains("no-latents.safetensors") && m.contains("no tensor `latents`"),
        "{m}"
    );

    let p = dir.join("negative.safetensors");
    save(
        &p,
        vec![
            ("latents", latents(3, 4, 8)),
            ("labels", Tensor::new(&[0i64, -1, 2], &Device::Cpu).unwrap()),
        ],
    );
    let m = load_err(&p, 4, 8);
    assert!(
        m.contains("negative.safetensors") && m.contains("`labels`") && m.contains("-1"),
        "{m}"
    );

    let p = dir.join("count.safetensors");
    save(
        &p,
        vec![
            ("latents", latents(3, 4, 8)),
            ("labels", Tensor::new(&[0i64, 1], &Device::Cpu).unwrap()),
        ],
    );
    let m = load_err(&p, 4, 8);
    assert!(
        m.contains("count.safetensors") && m.contains("`labels`") && m.contains("[2]"),
        "{m}"
    );

    let p = dir.join("float-labels.safetensors");
    save(
        &p,
        vec![
            ("latents", latents(3, 4, 8)),
            (
                "labels",
                Tensor::new(&[0f32, 1., 2.], &Device::Cpu).unwrap(),
            ),
        ],
    );
    let m = load_err(&p, 4, 8);
    assert!(
        m.contains("float-labels.safetensors") && m.contains("integer"),
        "{m}"
    );

    let p = dir.join("garbage.safetensors");
    std::fs::write(&p, b"not a safetensors file").unwrap();
    let m = load_err(&p, 4, 8);
    assert!(m.contains("garbage.safetensors"), "{m}");

    let m = load_err(&dir.join("missing.safetensors"), 4, 8);
    assert!(m.contains("missing.safetensors"), "{m}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two classes, `cats` (index 0) and `dogs` (index 1), with grayscale and RGB PNGs, a JPEG, a
/// non-square image, and files that are not images.
fn write_folder(dir: &Path) {
    let cats = dir.join("cats");
    let dogs = dir.join("dogs");
    std::fs::create_dir_all(&cats).unwrap();
    std::fs::create_dir_all(&dogs).unwrap();
    // cats/a.png: 4x4 grayscale, no resize: pixel (y, x) = 0 at (0, 0), 255 at (0, 1), else 51·y.
    let a = GrayImage::from_fn(4, 4, |x, y| {
        Luma([match (x, y) {
            (0, 0) => 0,
            (1, 0) => 255,
            _ => 51 * y as u8,
        }])
    });
    a.save(cats.join("a.png")).unwrap();
    // cats/B.PNG: 8x8 RGB, resized to 4x4; a uniform colour survives the resize exactly.
    RgbImage::from_pixel(8, 8, Rgb([255, 0, 51]))
        .save_with_format(cats.join("B.PNG"), image::ImageFormat::Png)
        .unwrap();
    std::fs::write(cats.join("notes.txt"), b"not an image").unwrap();
    // dogs/c.jpg: a uniform grey JPEG, 6x6.
    RgbImage::from_pixel(6, 6, Rgb([128, 128, 128]))
        .save(dogs.join("c.jpg"))
        .unwrap();
    // dogs/d.png: non-square 6x4 grayscale: the center 4x4 is kept (columns 1..5), with no
    // resize; the cropped columns are black.
    GrayImage::from_fn(6, 4, |x, _| Luma([if x == 0 || x == 5 { 0 } else { 255 }]))
        .save(dogs.join("d.png"))
        .unwrap();
    // A plain file beside the class folders is not a class.
    std::fs::write(dir.join("README"), b"two classes").unwrap();
}

#[test]
fn folder_dataset_reads_classes_in_order() {
    let dir = fresh_dir("folder");
    write_folder(&dir);

    let d = ImageDataset::load(
        &dir,
        &ImageOptions {
            channels: 1,
            size: 4,
        },
    )
    .unwrap();
    assert_eq!(d.len(), 4);
    assert_eq!(d.images.dims(), &[4, 1, 4, 4]);
    assert_eq!(d.num_classes, 2);
    assert_eq!(d.class_names, vec!["cats", "dogs"]);
    // Sorted by file name: "B.PNG" < "a.png" (byte order), then c.jpg, d.png.
    assert_eq!(d.labels, vec![0, 0, 1, 1]);
    let a = flat(&d.images.get(1).unwrap());
    assert_eq!(a[0], -1.0);
    assert_eq!(a[1], 1.0);
    for y in 1..4 {
        for x in 0..4 {
            assert_eq!(a[y * 4 + x], 51.0 * y as f32 / 127.5 - 1.0, "({y}, {x})");
        }
    }
    // The non-square image is center-cropped: all white.
    assert!(flat(&d.images.get(3).unwrap()).iter().all(|&v| v == 1.0));
    // The JPEG is close to its grey (lossy).
    assert!(flat(&d.images.get(2).unwrap())
        .iter()
        .all(|&v| (v - (128.0 / 127.5 - 1.0)).abs() < 0.05));
    // The RGB image resized and converted to grayscale is uniform.
    let b = flat(&d.images.get(0).unwrap());
    assert!(b.iter().all(|&v| v == b[0]), "{b:?}");

    let rgb = ImageDataset::load(
        &dir,
        &ImageOptions {
            channels: 3,
            size: 4,
        },
    )
    .unwrap();
    assert_eq!(rgb.images.dims(), &[4, 3, 4, 4]);
    // B.PNG resized from 8x8 keeps its uniform colour, channel-major.
    let b = flat(&rgb.images.get(0).unwrap());
    let want = [1.0, -1.0, 51.0 / 127.5 - 1.0];
    for (c, w) in want.iter().enumerate() {
        assert!(b[c * 16..(c + 1) * 16].iter().all(|v| v == w), "{c}: {b:?}");
    }
    // A grayscale source in RGB repeats its value in every channel.
    let a = flat(&rgb.images.get(1).unwrap());
    assert_eq!(&a[..16], &a[16..32]);
    assert_eq!(&a[..16], &a[32..]);
    assert_eq!((a[0], a[1]), (-1.0, 1.0));

    // Loading twice gives the same tensor.
    let again = ImageDataset::load(
        &dir,
        &ImageOptions {
            channels: 3,
            size: 4,
        },
    )
    .unwrap();
    assert_eq!(flat(&again.images), flat(&rgb.images));

    // Image folders give 1 or 3 channels.
    let m = load_err(&dir, 4, 4);
    assert!(m.contains("4 channels"), "{m}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_folders_are_clear_errors() {
    let dir = fresh_dir("bad-folder");
    write_folder(&dir);
    let corrupt = dir.join("dogs").join("e.png");
    let bytes: Vec<u8> = (0..200u32).map(|i| (i * 7919 % 251) as u8).collect();
    std::fs::write(&corrupt, bytes).unwrap();
    let m = load_err(&dir, 1, 4);
    assert!(m.contains("e.png"), "{m}");
    std::fs::remove_file(&corrupt).unwrap();

    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(empty.join("readme.txt"), b"no image here").unwrap();
    let m = load_err(&dir, 1, 4);
    assert!(m.contains("empty") && m.contains("no .png"), "{m}");

    let none = fresh_dir("no-classes");
    let m = load_err(&none, 1, 4);
    assert!(
        m.contains("images-no-classes") && m.contains("no class directory"),
        "{m}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&none).unwrap();
}

fn dataset(n: usize) -> ImageDataset {
    ImageDataset {
        images: latents(n, 1, 2),
        labels: vec![0; n],
        num_classes: 1,
        class_names: vec!["0".into()],
        source: "test".into(),
    }
}

/// Epoch `e`'s order of the images under [`ImageDataset::sampler`].
fn epoch_order(d: &ImageDataset, seed: u64, epoch: u64, shuffle: bool) -> Vec<usize> {
    let s = d.sampler(seed, shuffle);
    let n = d.len() as u64;
    (epoch * n..(epoch + 1) * n)
        .map(|k| s.window_of(k))
        .collect()
}

#[test]
fn epoch_orders_are_deterministic_permutations() {
    let d = dataset(20);
    let o = epoch_order(&d, 7, 0, true);
    let mut sorted = o.clone();
    sorted.sort();
    assert_eq!(sorted, (0..20).collect::<Vec<_>>());
    assert_eq!(o, epoch_order(&d, 7, 0, true));
    assert_ne!(o, epoch_order(&d, 8, 0, true));
    assert_ne!(o, epoch_order(&d, 7, 1, true));
    assert_eq!(epoch_order(&d, 7, 3, false), (0..20).collect::<Vec<_>>());
}

#[test]
fn samples_walk_the_epochs() {
    let d = dataset(10);
    let s: Sampler = d.sampler(3, true);
    let (e0, e1) = (epoch_order(&d, 3, 0, true), epoch_order(&d, 3, 1, true));
    // Batch 4: step 2 takes samples 8..12, the last two of epoch 0 and the first two of epoch 1.
    let step = |step: u64, batch: u64, s: &Sampler| -> Vec<usize> {
        (step * batch..(step + 1) * batch)
            .map(|k| s.window_of(k))
            .collect()
    };
    assert_eq!(step(0, 4, &s), e0[..4].to_vec());
    assert_eq!(step(2, 4, &s), vec![e0[8], e0[9], e1[0], e1[1]]);
    // A batch longer than the dataset spans several epochs.
    let want: Vec<usize> = (25..50u64)
        .map(|k| epoch_order(&d, 3, k / 10, true)[(k % 10) as usize])
        .collect();
    assert_eq!(step(1, 25, &s), want);
    assert_eq!(step(3, 4, &d.sampler(3, false)), vec![2, 3, 4, 5]);
}

#[test]
fn grid_png_has_the_right_size_and_pixels() {
    let dir = fresh_dir("grid");
    // 5 RGB images of 3x2 (H=3, W=2), image i filled with value -1 + 0.5·i in channel 0,
    // 1 in channel 1, -1 in channel 2 (bf16: the writer takes any float dtype).
    let (n, h, w, scale, cols) = (5usize, 3usize, 2usize, 2usize, 3usize);
    let mut v = Vec::new();
    for i in 0..n {
        v.extend(std::iter::repeat_n(-1.0 + 0.5 * i as f32, h * w));
        v.extend(std::iter::repeat_n(1.0f32, h * w));
        v.extend(std::iter::repeat_n(-1.0f32, h * w));
    }
    let t = Tensor::from_vec(v, (n, 3, h, w), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let path = dir.join("sub").join("grid.png");
    write_grid_png(&t, cols, scale, &path).unwrap();
    let img = image::open(&path).unwrap().to_rgb8();
    let (gw, gh) = (cols * w * scale + (cols - 1) * scale, 2 * h * scale + scale);
    assert_eq!((img.width() as usize, img.height() as usize), (gw, gh));
    // Image 4 (row 1, column 1) starts at x = 1·(4 + 2), y = 1·(6 + 2); value 1.0 → 255.
    let (x0, y0) = (w * scale + scale, h * scale + scale);
    for (dx, dy) in [(0, 0), (3, 5)] {
        assert_eq!(
            img.get_pixel((x0 + dx) as u32, (y0 + dy) as u32).0,
            [255, 255, 0]
        );
    }
    // Image 2 (row 0, column 2): -1 + 1.0 = 0.0 → 128.
    assert_eq!(img.get_pixel((2 * x0) as u32, 0).0, [128, 255, 0]);
    // Separator column right of image 0, and the empty last cell.
    let sep = [GRID_SEPARATOR; 3];
    assert_eq!(img.get_pixel((w * scale) as u32, 0).0, sep);
    assert_eq!(img.get_pixel((gw - 1) as u32, (gh - 1) as u32).0, sep);
    // No temporary file is left behind.
    let left: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("grid.png")]);

    // Grayscale, clamped values.
    let g = Tensor::from_vec(vec![-3.0f32, 3.0, 0.5, -0.5], (1, 1, 2, 2), &Device::Cpu).unwrap();
    let gp = dir.join("gray.png");
    write_grid_png(&g, 4, 1, &gp).unwrap();
    let img = image::open(&gp).unwrap();
    assert_eq!(img.color(), image::ColorType::L8);
    let img = img.to_luma8();
    assert_eq!((img.width(), img.height()), (2, 2));
    assert_eq!(img.as_raw(), &vec![0, 255, 191, 64]);

    // Bad inputs name the path.
    let m = write_grid_png(&latents(2, 4, 2), 2, 1, &gp)
        .unwrap_err()
        .to_string();
    assert!(m.contains("gray.png") && m.contains("4 channels"), "{m}");
    let m = write_grid_png(&g, 0, 1, &gp).unwrap_err().to_string();
    assert!(m.contains("gray.png"), "{m}");
    std::fs::remove_dir_all(&dir).unwrap();
}
