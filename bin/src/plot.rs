//! A loss-curve PNG without plotting dependencies: a line chart drawn into an RGB buffer and
//! written as an uncompressed (stored-deflate) PNG.

use std::path::Path;

use anyhow::{Context, Result};
use train::trainer::StepStats;

const W: usize = 640;
const H: usize = 400;
const MARGIN: usize = 40;

fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn adler32(bytes: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for &x in bytes {
        a = (a + x as u32) % 65521;
        b = (b + a) % 65521;
    }
    (b << 16) | a
}

fn chunk(out: &mut Vec<u8>, kind: &[u8], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let mut c = kind.to_vec();
    c.extend_from_slice(data);
    out.extend_from_slice(&c);
    out.extend(crc32(&c).to_be_bytes());
}

/// Encodes an RGB image as PNG.
fn encode_png(rgb: &[u8], w: usize, h: usize) -> Vec<u8> {
    let mut raw = Vec::with_capacity((w * 3 + 1) * h);
    for row in rgb.chunks(w * 3) {
        raw.push(0);
        raw.extend_from_slice(row);
    }
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65535).collect();
    for (i, b) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        z.extend((b.len() as u16).to_le_bytes());
        z.extend((!(b.len() as u16)).to_le_bytes());
        z.extend_from_slice(b);
    }
    z.extend(adler32(&raw).to_be_bytes());
    let mut out = vec![0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
    let mut ihdr = Vec::new();
    ihdr.extend((w as u32).to_be_bytes());
    ihdr.extend((h as u32).to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &z);
    chunk(&mut out, b"IEND", &[]);
    out
}

/// Draws the loss of every step and its moving average (x: step, y: loss from min to max)
/// with axes, and writes it.
pub fn loss_curve(history: &[StepStats], path: &Path) -> Result<()> {
    let mut img = vec![255u8; W * H * 3];
    let mut put = |x: usize, y: usize, c: [u8; 3]| {
        if x < W && y < H {
            img[(y * W + x) * 3..(y * W + x) * 3 + 3].copy_from_slice(&c);
        }
    };
    for x in MARGIN..W - MARGIN / 2 {
        put(x, H - MARGIN, [0, 0, 0]);
    }
    for y in MARGIN / 2..H - MARGIN {
        put(MARGIN, y, [0, 0, 0]);
    }
    let losses: Vec<f64> = history
        .iter()
        .map(|s| s.loss)
        .filter(|l| l.is_finite())
        .collect();
    if losses.len() >= 2 {
        let lo = losses.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = losses.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let span = (hi - lo).max(1e-9);
        let pw = (W - MARGIN - MARGIN / 2) as f64;
        let ph = (H - MARGIN - MARGIN / 2) as f64;
        let pt = |i: usize, l: f64| {
            let x = MARGIN as f64 + pw * i as f64 / (losses.len() - 1) as f64;
            let y = (H - MARGIN) as f64 - ph * (l - lo) / span;
            (x, y)
        };
        // Per-step losses in light red, their exponential moving average (0.9) in dark blue.
        let mut ema = Vec::with_capacity(losses.len());
        for (i, &l) in losses.iter().enumerate() {
            ema.push(if i == 0 {
                l
            } else {
                0.9 * ema[i - 1] + 0.1 * l
            });
        }
        for (series, color, width) in [(&losses, [240, 150, 150], 1), (&ema, [20, 40, 160], 2)] {
            for i in 1..series.len() {
                let (x0, y0) = pt(i - 1, series[i - 1]);
                let (x1, y1) = pt(i, series[i]);
                let n = ((x1 - x0).abs().max((y1 - y0).abs()) as usize).max(1);
                for k in 0..=n {
                    let t = k as f64 / n as f64;
                    let (x, y) = (x0 + t * (x1 - x0), y0 + t * (y1 - y0));
                    for dx in 0..width {
                        for dy in 0..width {
                            put(x as usize + dx, y as usize + dy, color);
                        }
                    }
                }
            }
        }
    }
    let png = encode_png(&img, W, H);
    std::fs::write(path, png).with_context(|| format!("writing {}", path.display()))
}
