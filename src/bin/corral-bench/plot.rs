//! PNG charts drawn with plotters. Text uses an embedded font (Noto Sans, from the
//! `ttf-noto-sans` crate), so the charts look the same on every machine and need no system
//! fonts.

use std::ops::Range;
use std::path::Path;
use std::sync::Once;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::FontStyle;

const FONT: &str = "sans-serif";
const SIZE: (u32, u32) = (960, 520);

/// One colour per series, readable on white and distinct in grey scale.
const PALETTE: [RGBColor; 6] = [
    RGBColor(150, 150, 150),
    RGBColor(86, 180, 233),
    RGBColor(230, 159, 0),
    RGBColor(204, 121, 167),
    RGBColor(0, 140, 90),
    RGBColor(0, 90, 170),
];

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if register_font_bytes().is_err() {
            log::warn!("the embedded font did not load: charts will have no text");
        }
    });
}

fn register_font_bytes() -> Result<(), String> {
    plotters::style::register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR)
        .map_err(|_| "invalid font".to_string())
}

/// A grouped bar chart: one group per label on the x axis, one bar per series in each group.
pub struct Bars<'a> {
    pub title: &'a str,
    pub y_label: &'a str,
    pub groups: Vec<String>,
    /// Series name and one value per group (NaN draws no bar).
    pub series: Vec<(String, Vec<f64>)>,
    /// Logarithmic y axis, for values that span orders of magnitude.
    pub log_y: bool,
    /// Draw each bar's value above it.
    pub annotate: bool,
    /// Per series, per group: a whisker from the first value to the second (the spread of
    /// the runs the bar sums up). Empty: none.
    pub whiskers: Vec<Vec<(f64, f64)>>,
    /// Per group: a dashed line across it at this value (a goal's bound; NaN: none).
    /// Empty: none.
    pub bounds: Vec<f64>,
}

fn err(e: impl std::fmt::Display) -> String {
    format!("cannot draw chart: {e}")
}

impl Bars<'_> {
    pub fn draw(&self, path: &Path) -> Result<(), String> {
        register_font();
        let values = self.series.iter().flat_map(|(_, v)| v.iter().copied());
        let ends = self.whiskers.iter().flatten().flat_map(|&(a, b)| [a, b]);
        let all = values.chain(ends).chain(self.bounds.iter().copied());
        let finite: Vec<f64> = all.filter(|v| v.is_finite()).collect();
        let max = finite.iter().copied().fold(0.0_f64, f64::max);
        if self.log_y {
            let min = finite
                .iter()
                .copied()
                .filter(|v| *v > 0.0)
                .fold(f64::INFINITY, f64::min);
            let lo = if min.is_finite() { min / 2.0 } else { 0.1 };
            // Headroom above the tallest bar keeps the legend clear of the bars.
            let range = (lo..(max * 8.0).max(lo * 10.0)).log_scale();
            self.draw_with(path, range, lo)
        } else {
            // Bars below zero hang from it; the headroom is for the legend.
            let min = finite.iter().copied().fold(0.0_f64, f64::min);
            let span = (max - min).max(1e-9);
            self.draw_with(path, (min - span * 0.05)..(max + span * 0.45), 0.0)
        }
    }

    fn draw_with<Y>(&self, path: &Path, y: Y, floor: f64) -> Result<(), String>
    where
        Y: AsRangedCoord<Value = f64>,
        Y::CoordDescType: ValueFormatter<f64>,
    {
        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let n = self.groups.len();
        let x_range: Range<f64> = -0.5..(n as f64 - 0.5);
        let mut chart = ChartBuilder::on(&root)
            .caption(self.title, (FONT, 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(x_range, y)
            .map_err(err)?;
        let groups = self.groups.clone();
        let label = move |x: &f64| group_label(&groups, *x);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&label)
            .y_label_formatter(&|v| short(*v))
            .y_desc(self.y_label)
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .draw()
            .map_err(err)?;
        // A log axis has no zero: its bars stand on `floor`; a linear one's hang below zero.
        let top = |v: f64| if self.log_y { v.max(floor) } else { v };
        let width = 0.8 / self.series.len().max(1) as f64;
        for (s, (name, values)) in self.series.iter().enumerate() {
            let color = PALETTE[s % PALETTE.len()];
            let bars = values.iter().enumerate().filter(|(_, v)| v.is_finite());
            let left = |g: usize| g as f64 - 0.4 + s as f64 * width;
            let rects = bars.clone().map(|(g, &v)| {
                Rectangle::new(
                    [(left(g), floor), (left(g) + width * 0.92, top(v))],
                    color.filled(),
                )
            });
            chart
                .draw_series(rects)
                .map_err(err)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())
                });
            if let Some(whiskers) = self.whiskers.get(s) {
                let mid = |g: usize| left(g) + width * 0.46;
                let lines = whiskers
                    .iter()
                    .enumerate()
                    .filter(|(_, (a, b))| a.is_finite() && b.is_finite());
                let lines = lines.map(|(g, &(a, b))| {
                    PathElement::new([(mid(g), top(a)), (mid(g), top(b))], BLACK)
                });
                chart.draw_series(lines).map_err(err)?;
            }
            if self.annotate {
                // Anchored at the bar's top-left corner, lifted above it.
                let texts = bars.map(|(g, &v)| {
                    EmptyElement::at((left(g), top(v).max(floor)))
                        + Text::new(short(v), (0, -15), (FONT, 12).into_font())
                });
                chart.draw_series(texts).map_err(err)?;
            }
        }
        // Over the bars, so that a bar crossing its bound does not hide it.
        for (g, &bound) in self.bounds.iter().enumerate() {
            if bound.is_finite() {
                let line = [(g as f64 - 0.45, bound), (g as f64 + 0.45, bound)];
                let style = BLACK.mix(0.7).stroke_width(2);
                chart
                    .draw_series(DashedLineSeries::new(line, 6, 4, style))
                    .map_err(err)?;
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font((FONT, 14))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)
    }
}

/// The group name at an integer x, nothing between groups.
fn group_label(groups: &[String], x: f64) -> String {
    let i = x.round();
    if (x - i).abs() > 1e-6 || i < 0.0 {
        return String::new();
    }
    groups.get(i as usize).cloned().unwrap_or_default()
}

fn short(v: f64) -> String {
    if v >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Cumulative distributions, one line per series, on a logarithmic x axis.
pub struct Cdf<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    /// Series name and its sorted samples.
    pub series: Vec<(String, Vec<f64>)>,
}

impl Cdf<'_> {
    pub fn draw(&self, path: &Path) -> Result<(), String> {
        register_font();
        let all = self.series.iter().flat_map(|(_, v)| v.iter().copied());
        let positive: Vec<f64> = all.filter(|v| v.is_finite() && *v > 0.0).collect();
        let lo = positive.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = positive.iter().copied().fold(0.0_f64, f64::max);
        let (lo, hi) = if lo.is_finite() {
            (lo / 1.5, (hi * 1.5).max(lo * 10.0))
        } else {
            (1.0, 10.0)
        };
        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(self.title, (FONT, 22))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_labels(8)
            .x_label_formatter(&|v| short(*v))
            .x_desc(self.x_label)
            .y_desc("share of follow-up turns")
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .draw()
            .map_err(err)?;
        for (s, (name, samples)) in self.series.iter().enumerate() {
            let color = PALETTE[s % PALETTE.len()];
            let n = samples.len().max(1) as f64;
            let points = samples
                .iter()
                .enumerate()
                .map(|(i, &v)| (v.max(lo), (i + 1) as f64 / n));
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(3)))
                .map_err(err)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], color.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font((FONT, 14))
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)
    }
}
