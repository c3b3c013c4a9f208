//! The bench's pictures, drawn with `plotters` (SVG backend only).
//!
//! - `timeline.svg`: a window of steady decode steps, blocking above
//!   pipelined, each with a device lane (forward, sampling) and a scheduler
//!   lane (busy, blocked on the device): the bubble made visible.
//! - `throughput.svg`: tokens/s per workload and configuration.

use std::path::Path;

use anyhow::{anyhow, Context as _};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;

use super::harness::{Kind, RunData};
use super::stats::ConfigResult;
use super::workload::{EngineConfig, Mix};
use super::Options;

const FORWARD: RGBColor = RGBColor(52, 101, 164);
const SAMPLING: RGBColor = RGBColor(245, 121, 0);
const BUSY: RGBColor = RGBColor(78, 154, 6);
const WAIT: RGBColor = RGBColor(211, 215, 207);
const CONFIG_COLORS: [RGBColor; 3] = [
    RGBColor(136, 138, 133),
    RGBColor(114, 159, 207),
    RGBColor(52, 101, 164),
];

/// Steps in the timeline window.
const WINDOW_STEPS: usize = 6;

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing: {e:?}")
}

/// Start of `n` consecutive decode steps near the middle of a run, each
/// with a full batch; falls back to the longest decode stretch.
fn window(run: &RunData, streams: usize) -> Option<(usize, usize)> {
    let steps = &run.steps;
    let ok = |s: &super::harness::StepRecord| s.kind == Kind::Decode && s.rows >= streams;
    let n = WINDOW_STEPS.min(steps.len());
    let mid = steps.len() / 2;
    let candidates = (mid..steps.len()).chain((0..mid).rev());
    for start in candidates {
        if start + n <= steps.len() && steps[start..start + n].iter().all(ok) {
            return Some((start, start + n));
        }
    }
    None
}

struct Lane {
    /// (start, end, color) in ms from the window start.
    device: Vec<(f64, f64, RGBColor)>,
    sched: Vec<(f64, f64, RGBColor)>,
    len_ms: f64,
}

fn lane(run: &RunData, (a, b): (usize, usize)) -> Lane {
    let t0 = run.steps[a].forward.0;
    let t1 = run.steps[b - 1].sample.1;
    let ms = |t: f64| (t - t0) * 1e3;
    let mut device = Vec::new();
    for s in &run.steps[a..b] {
        device.push((ms(s.forward.0), ms(s.forward.1), FORWARD));
        device.push((ms(s.sample.0), ms(s.sample.1), SAMPLING));
    }
    let clip = |x: f64| x.clamp(t0, t1);
    let mut sched = Vec::new();
    for &(ta, tb) in run.ticks.iter().filter(|t| t.1 > t0 && t.0 < t1) {
        let mut cursor = ta;
        for &(wa, wb) in run.waits.iter().filter(|w| w.0 >= ta && w.1 <= tb) {
            if wa > cursor {
                sched.push((ms(clip(cursor)), ms(clip(wa)), BUSY));
            }
            sched.push((ms(clip(wa)), ms(clip(wb)), WAIT));
            cursor = wb;
        }
        if tb > cursor {
            sched.push((ms(clip(cursor)), ms(clip(tb)), BUSY));
        }
    }
    sched.retain(|s| s.1 > s.0);
    Lane {
        device,
        sched,
        len_ms: ms(t1),
    }
}

/// Draw the timeline; returns the caption for the Markdown report, or
/// `None` when no workload had a long enough steady window.
pub fn timeline(
    opts: &Options,
    runs: &[Vec<Vec<RunData>>],
    path: &Path,
) -> anyhow::Result<Option<String>> {
    // The text workload with the most streams up to 8 (bubbles are visible
    // where steps are short).
    let Some((wi, w)) = opts
        .workloads
        .iter()
        .enumerate()
        .filter(|(_, w)| w.mix == Mix::Text && w.streams <= 8)
        .max_by_key(|(_, w)| w.streams)
    else {
        return Ok(None);
    };
    let ci_block = 0;
    let ci_pipe = EngineConfig::ALL
        .iter()
        .position(|&c| c == EngineConfig::PipelinedRideAlong)
        .unwrap_or(1);
    let (Some(block), Some(pipe)) = (runs[wi][ci_block].first(), runs[wi][ci_pipe].first()) else {
        return Ok(None);
    };
    let (Some(wb), Some(wp)) = (window(block, w.streams), window(pipe, w.streams)) else {
        return Ok(None);
    };
    let lanes = [lane(block, wb), lane(pipe, wp)];
    let xmax = lanes[0].len_ms.max(lanes[1].len_ms) * 1.02;
    let root = SVGBackend::new(path, (1100, 380)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let title = format!(
        "{} decode steps, {}: blocking {:.1} ms vs pipelined {:.1} ms",
        b_len(wb),
        w.label(),
        lanes[0].len_ms,
        lanes[1].len_ms
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(&title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(170)
        .build_cartesian_2d(0f64..xmax, 0f64..5f64)
        .map_err(plot_err)?;
    let names = [
        "pipelined: scheduler",
        "pipelined: device",
        "blocking: scheduler",
        "blocking: device",
    ];
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(11)
        .y_label_formatter(&|y| {
            let i = (y - 0.5).round();
            if (y - 0.5 - i).abs() < 1e-6 && (0.0..4.0).contains(&i) {
                names[i as usize].to_string()
            } else {
                String::new()
            }
        })
        .x_desc("ms from the window's first forward")
        .draw()
        .map_err(plot_err)?;
    let rects = |segs: &[(f64, f64, RGBColor)], y: f64| -> Vec<Rectangle<(f64, f64)>> {
        segs.iter()
            .map(|&(a, b, c)| Rectangle::new([(a, y - 0.32), (b, y + 0.32)], c.filled()))
            .collect()
    };
    for (i, l) in lanes.iter().enumerate() {
        let base = if i == 0 { 2.0 } else { 0.0 };
        chart
            .draw_series(rects(&l.sched, base + 0.5))
            .map_err(plot_err)?;
        chart
            .draw_series(rects(&l.device, base + 1.5))
            .map_err(plot_err)?;
    }
    for (label, color) in [
        ("forward", FORWARD),
        ("sampling", SAMPLING),
        ("scheduler busy", BUSY),
        ("scheduler waits for device", WAIT),
    ] {
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0, 0.0), (0.0, 0.0)],
                color.filled(),
            )))
            .map_err(plot_err)?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    let idle = |l: &Lane| l.len_ms - l.device.iter().map(|d| d.1 - d.0).sum::<f64>();
    Ok(Some(format!(
        "{} consecutive steady decode steps of the {} workload (first repetition), blocking vs \
         pipelined with prefill riding along. Gaps in a device lane are the bubble; in the \
         pipelined lanes the scheduler works while the next forward runs. Device idle in these \
         windows: blocking {:.3} ms of {:.1} ms, pipelined {:.3} ms of {:.1} ms.",
        b_len(wb),
        w.label(),
        idle(&lanes[0]),
        lanes[0].len_ms,
        idle(&lanes[1]),
        lanes[1].len_ms,
    )))
}

fn b_len((a, b): (usize, usize)) -> usize {
    b - a
}

/// Bar chart of tokens/s per workload and configuration.
pub fn throughput(results: &[ConfigResult], path: &Path) -> anyhow::Result<()> {
    let mut workloads: Vec<&str> = Vec::new();
    for r in results {
        if !workloads.contains(&r.workload.as_str()) {
            workloads.push(&r.workload);
        }
    }
    let per = EngineConfig::ALL.len() as u32 + 1;
    let slots = workloads.len() as u32 * per;
    let ymax = results.iter().map(|r| r.tokens_per_s).fold(0.0, f64::max) * 1.15;
    let root = SVGBackend::new(path, (1100, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Throughput (generated tokens/s, end to end)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((0u32..slots).into_segmented(), 0f64..ymax.max(1.0))
        .map_err(plot_err)?;
    let names = workloads.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(slots as usize)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) if i % per == 1 => names
                .get((i / per) as usize)
                .map_or(String::new(), |s| s.to_string()),
            _ => String::new(),
        })
        .y_desc("tokens/s")
        .draw()
        .map_err(plot_err)?;
    for (ci, &config) in EngineConfig::ALL.iter().enumerate() {
        let color = CONFIG_COLORS[ci];
        let bars: Vec<(u32, f64)> = results
            .iter()
            .filter(|r| r.config == config)
            .filter_map(|r| {
                let wi = workloads.iter().position(|w| *w == r.workload)?;
                Some((wi as u32 * per + ci as u32, r.tokens_per_s))
            })
            .collect();
        chart
            .draw_series(bars.iter().map(|&(x, y)| {
                Rectangle::new(
                    [
                        (SegmentValue::Exact(x), 0.0),
                        (SegmentValue::Exact(x + 1), y),
                    ],
                    color.filled(),
                )
            }))
            .map_err(plot_err)?
            .label(config.label())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        chart
            .draw_series(bars.iter().map(|&(x, y)| {
                Text::new(
                    format!("{y:.0}"),
                    (SegmentValue::Exact(x), y + ymax * 0.01),
                    ("sans-serif", 11),
                )
            }))
            .map_err(plot_err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
