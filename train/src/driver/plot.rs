//! The loss chart of a training run (`loss.png`), drawn with `plotters`: the loss of every step,
//! its moving average and the evaluation loss when there is one, against the step, with labelled
//! axes, tick values and a title naming the model and the layout. Text uses DejaVu Sans embedded
//! in the binary (the `dejavu` crate), so the chart does not depend on the machine's fonts.

use std::path::Path;
use std::sync::Once;

use crate::checkpoint::EvalPoint;
use crate::error::{Error, Result};
use crate::trainer::StepStats;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

const SIZE: (u32, u32) = (900, 560);
const FONT: &str = "sans-serif";

/// Registers the embedded font once per process.
fn register_embedded_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).map_err(|_| {
            Error::Invalid("the embedded DejaVu Sans font could not be loaded".into())
        });
    });
    result
}

/// The exponential moving average (0.9) of `xs`.
pub fn moving_average(xs: &[f64]) -> Vec<f64> {
    let mut ema: Vec<f64> = Vec::with_capacity(xs.len());
    for &x in xs {
        ema.push(match ema.last() {
            Some(&prev) => 0.9 * prev + 0.1 * x,
            None => x,
        });
    }
    ema
}

/// Draws `history` (and `evals`) as `path` (PNG), titled `title`.
pub fn loss_curve(
    history: &[StepStats],
    evals: &[EvalPoint],
    title: &str,
    path: &Path,
) -> Result<()> {
    register_embedded_font()?;
    let steps: Vec<(f64, f64)> = history
        .iter()
        .filter(|s| s.loss.is_finite())
        .map(|s| (s.step as f64 + 1.0, s.loss))
        .collect();
    let ema: Vec<(f64, f64)> = steps
        .iter()
        .map(|p| p.0)
        .zip(moving_average(
            &steps.iter().map(|p| p.1).collect::<Vec<_>>(),
        ))
        .collect();
    let evals: Vec<(f64, f64)> = evals
        .iter()
        .filter(|e| e.loss.is_finite())
        .map(|e| (e.step as f64, e.loss))
        .collect();
    let all = || steps.iter().chain(&evals);
    let x_max = all().map(|p| p.0).fold(1.0f64, f64::max);
    let (lo, hi) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 20))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..x_max, (lo - pad)..(hi + pad))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 16))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()?;
        let raw = RGBColor(240, 150, 150);
        chart
            .draw_series(LineSeries::new(steps.iter().copied(), raw.stroke_width(1)))?
            .label("loss")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], raw));
        let avg = RGBColor(20, 40, 160);
        chart
            .draw_series(LineSeries::new(ema.iter().copied(), avg.stroke_width(2)))?
            .label("moving average (0.9)")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], avg.stroke_width(2)));
        if !evals.is_empty() {
            let ev = RGBColor(0, 140, 60);
            chart
                .draw_series(LineSeries::new(evals.iter().copied(), ev.stroke_width(2)))?
                .label("eval loss")
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], ev.stroke_width(2))
                });
            chart.draw_series(evals.iter().map(|&p| Circle::new(p, 3, ev.filled())))?;
        }
        chart
            .configure_series_labels()
            .label_font((FONT, 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| Error::Image {
        path: path.to_path_buf(),
        msg: format!("writing the loss chart: {e}"),
    })
}

/// One curve of [`loss_by_position`]: its label and `(from, to, mean loss)` per position bucket.
pub type PositionCurve = (String, Vec<(usize, usize, f64)>);

/// Draws the loss by token position of one or more models (`cpl eval --by-position`) as `path`
/// (PNG): the mean loss of each bucket at its geometric midpoint, positions on a log scale.
pub fn loss_by_position(curves: &[PositionCurve], title: &str, path: &Path) -> Result<()> {
    register_embedded_font()?;
    let points: Vec<(String, Vec<(f64, f64)>)> = curves
        .iter()
        .map(|(label, b)| {
            let pts = b
                .iter()
                .filter(|(_, _, l)| l.is_finite())
                .map(|&(from, to, l)| (((from.max(1) * to.max(1)) as f64).sqrt(), l))
                .collect();
            (label.clone(), pts)
        })
        .collect();
    let all: Vec<(f64, f64)> = points.iter().flat_map(|(_, p)| p.iter().copied()).collect();
    if all.is_empty() {
        return Err(Error::Invalid(format!(
            "{}: no finite loss to plot",
            path.display()
        )));
    }
    let fold = |f: fn(f64, f64) -> f64, init: f64, g: fn(&(f64, f64)) -> f64| {
        all.iter().map(g).fold(init, f)
    };
    let (x0, x1) = (
        fold(f64::min, f64::INFINITY, |p| p.0),
        fold(f64::max, 0.0, |p| p.0),
    );
    let (y0, y1) = (
        fold(f64::min, f64::INFINITY, |p| p.1),
        fold(f64::max, f64::NEG_INFINITY, |p| p.1),
    );
    let pad = ((y1 - y0) * 0.08).max(1e-3);
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d(
                ((x0 / 1.5).max(0.5)..x1 * 1.5).log_scale(),
                (y0 - pad)..(y1 + pad),
            )?;
        chart
            .configure_mesh()
            .x_desc("token position (log scale; bucket midpoints)")
            .y_desc("mean loss (nats)")
            .label_style((FONT, 14))
            .draw()?;
        for (i, (label, pts)) in points.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
                .label(label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .label_font((FONT, 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| Error::Invalid(format!("{}: cannot draw the chart: {e}", path.display())))
}

/// Draws passkey accuracy `(length, depth, accuracy)` as a heatmap PNG `path`: lengths across,
/// depths down, each cell shaded from red (0) to green (1) with its accuracy written in it.
pub fn passkey_heatmap(cells: &[(usize, f64, f64)], title: &str, path: &Path) -> Result<()> {
    register_embedded_font()?;
    let mut lengths: Vec<usize> = cells.iter().map(|c| c.0).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let mut depths: Vec<f64> = cells.iter().map(|c| c.1).collect();
    depths.sort_by(f64::total_cmp);
    depths.dedup();
    if lengths.is_empty() {
        return Err(Error::Invalid(format!(
            "{}: no passkey cells",
            path.display()
        )));
    }
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let (nx, ny) = (lengths.len(), depths.len());
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 18))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d(
                // A segmented 0..n has n + 1 segments: 0..n - 1 gives the n cells.
                (0..nx.max(2) - 1).into_segmented(),
                (0..ny.max(2) - 1).into_segmented(),
            )?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("prompt length (tokens)")
            .y_desc("key depth")
            .x_labels(nx)
            .y_labels(ny)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => {
                    lengths.get(*i).map(|l| l.to_string()).unwrap_or_default()
                }
                _ => String::new(),
            })
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => depths
                    .get(*i)
                    .map(|d| format!("{d:.2}"))
                    .unwrap_or_default(),
                _ => String::new(),
            })
            .label_style((FONT, 14))
            .draw()?;
        for &(l, d, acc) in cells {
            let (Some(x), Some(y)) = (
                lengths.iter().position(|&v| v == l),
                depths.iter().position(|&v| v == d),
            ) else {
                continue;
            };
            let a = acc.clamp(0.0, 1.0);
            let color = RGBColor((220.0 * (1.0 - a)) as u8, (60.0 + 140.0 * a) as u8, 70);
            chart.draw_series(std::iter::once(Rectangle::new(
                [
                    (SegmentValue::Exact(x), SegmentValue::Exact(y)),
                    (SegmentValue::Exact(x + 1), SegmentValue::Exact(y + 1)),
                ],
                color.filled(),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                format!("{a:.2}"),
                (SegmentValue::CenterOf(x), SegmentValue::CenterOf(y)),
                (FONT, 16).into_font().color(&WHITE),
            )))?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| Error::Invalid(format!("{}: cannot draw the heatmap: {e}", path.display())))
}
