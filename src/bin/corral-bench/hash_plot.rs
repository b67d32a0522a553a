//! `plot-hash`: one corral build against the client-side hash, cell by cell, from the
//! per-seed figures `scripts/bench-hash.py --json` keeps. Two charts: the build's times as
//! multiples of the hash's, and its follow-ups' warm share less the hash's, each bar the
//! verdict's figure (the build's median against the hash's median), its whisker the seeds'
//! spread (seed by seed), and a dashed line at the bound the issue sets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::plot::Bars;
use crate::report::median;

/// The baseline's name in bench-hash.py's figures.
const HASH: &str = "sticky-hash";
/// Every time at most this multiple of the hash's.
const TIME_BOUND: f64 = 1.1;

/// One line of bench-hash.py's `--json`: a cell and each policy's figures, seed by seed
/// (null where a seed had none, such as follow-up figures without follow-ups).
#[derive(Deserialize)]
struct Cell {
    kind: String,
    load: u32,
    policies: BTreeMap<String, Figures>,
}

#[derive(Deserialize)]
struct Figures {
    warm: Vec<Option<f64>>,
    p50: Vec<Option<f64>>,
    p90: Vec<Option<f64>>,
    mean: Vec<Option<f64>>,
    wall: Vec<Option<f64>>,
}

/// The times judged, in chart order ([`Figures::times`]).
const TIMES: [&str; 4] = [
    "follow-up TTFT p50",
    "follow-up TTFT p90",
    "mean TTFT",
    "wall time",
];

impl Figures {
    fn times(&self) -> [&[Option<f64>]; 4] {
        [&self.p50, &self.p90, &self.mean, &self.wall]
    }
}

/// Where the charts go: `<out>-time.png` and `<out>-warm.png`.
fn charts(out: &Path) -> [PathBuf; 2] {
    let with = |suffix: &str| {
        let mut name = out.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    };
    [with("-time.png"), with("-warm.png")]
}

/// Draws `build` (named `label` on the charts) against the hash from `json` (one cell a
/// line) and returns the figures drawn, as a Markdown table.
pub fn run(
    json: &Path,
    build: &str,
    label: &str,
    title: &str,
    out: &Path,
) -> Result<String, String> {
    let text = std::fs::read_to_string(json)
        .map_err(|e| format!("cannot read {}: {e}", json.display()))?;
    let mut cells = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let cell: Cell = serde_json::from_str(line).map_err(|e| {
            format!(
                "{}:{}: not a bench-hash.py cell: {e}",
                json.display(),
                n + 1
            )
        })?;
        let missing = [build, HASH]
            .into_iter()
            .find(|p| !cell.policies.contains_key(*p));
        if let Some(policy) = missing {
            let known: Vec<&str> = cell.policies.keys().map(String::as_str).collect();
            return Err(format!(
                "{}:{}: no figures for {policy} (it has {})",
                json.display(),
                n + 1,
                known.join(", ")
            ));
        }
        cells.push(cell);
    }
    if cells.is_empty() {
        return Err(format!("{} holds no cell", json.display()));
    }
    let groups: Vec<String> = cells.iter().map(|c| cell_name(&c.kind, c.load)).collect();

    let mut table = format!(
        "| cell | {} | warm share, points |\n| --- | --- | --- | --- | --- | --- |\n",
        TIMES.join(" | ")
    );
    let mut time_series: Vec<(String, Vec<f64>)> = TIMES
        .iter()
        .map(|name| (name.to_string(), Vec::new()))
        .collect();
    let mut time_whiskers = vec![Vec::new(); time_series.len()];
    let (mut warm, mut warm_whiskers, mut warm_bounds) = (Vec::new(), Vec::new(), Vec::new());
    for (cell, group) in cells.iter().zip(&groups) {
        let (mine, hashed) = (&cell.policies[build], &cell.policies[HASH]);
        let mut row = format!("| {group} |");
        for (t, (a, b)) in mine.times().into_iter().zip(hashed.times()).enumerate() {
            let bar = ratio(known_median(a), known_median(b));
            let spread = range(paired(a, b, ratio));
            time_series[t].1.push(bar);
            time_whiskers[t].push(spread);
            row += &format!(" {} |", ratio_text(bar, spread));
        }
        let bar = known_median(&mine.warm) - known_median(&hashed.warm);
        let spread = range(paired(&mine.warm, &hashed.warm, |x, y| x - y));
        warm.push(bar);
        warm_whiskers.push(spread);
        warm_bounds.push(-warm_slack(&cell.kind));
        row += &format!(" {} |\n", points_text(bar, spread));
        table += &row;
    }

    let [time_png, warm_png] = charts(out);
    Bars {
        title: &format!(
            "{title}: {label}'s times as multiples of the hash's (bound {TIME_BOUND}x)"
        ),
        y_label: "corral / hash (median; whisker: per seed)",
        groups: groups.clone(),
        series: time_series,
        log_y: true,
        annotate: false,
        whiskers: time_whiskers,
        bounds: vec![TIME_BOUND; groups.len()],
    }
    .draw(&time_png)?;
    Bars {
        title: &format!("{title}: {label}'s follow-up warm share less the hash's"),
        y_label: "points (median; whisker: per seed)",
        groups,
        series: vec![("warm share".to_string(), warm)],
        log_y: false,
        annotate: true,
        whiskers: vec![warm_whiskers],
        bounds: warm_bounds,
    }
    .draw(&warm_png)?;
    Ok(format!(
        "{table}\nwrote {} and {}\n",
        time_png.display(),
        warm_png.display()
    ))
}

/// The warm share a build may keep below the hash's, in points: more on Ollama's old runner,
/// whose slots alone keep anything warm.
fn warm_slack(kind: &str) -> f64 {
    if kind == "ollama-legacy" { 5.0 } else { 2.0 }
}

/// A cell's name on the chart: the node kind as people call it, and the live conversations
/// per slot.
fn cell_name(kind: &str, load: u32) -> String {
    let kind = match kind {
        "ollama" => "Ollama",
        "ollama-legacy" => "old runner",
        "llama-cpp" => "llama.cpp",
        "openai" => "OpenAI-compat.",
        other => other,
    };
    format!("{kind} {load}x")
}

/// The median of the seeds that have a figure; NaN where none has.
fn known_median(values: &[Option<f64>]) -> f64 {
    median(values.iter().flatten().copied().collect())
}

/// `f` of each seed's pair, where both have a figure.
fn paired(a: &[Option<f64>], b: &[Option<f64>], f: impl Fn(f64, f64) -> f64) -> Vec<f64> {
    let pairs = a.iter().zip(b).filter_map(|(x, y)| Some(f((*x)?, (*y)?)));
    pairs.filter(|v| v.is_finite()).collect()
}

/// `a` over `b`; NaN where `b` is not a positive figure.
fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

/// The least and the greatest, NaN where there is none.
fn range(values: Vec<f64>) -> (f64, f64) {
    let least = values.iter().copied().reduce(f64::min);
    let most = values.iter().copied().reduce(f64::max);
    least.zip(most).unwrap_or((f64::NAN, f64::NAN))
}

fn ratio_text(bar: f64, (least, most): (f64, f64)) -> String {
    if bar.is_nan() {
        return "-".into();
    }
    format!("{bar:.2}x [{least:.2}-{most:.2}]")
}

fn points_text(bar: f64, (least, most): (f64, f64)) -> String {
    if bar.is_nan() {
        return "-".into();
    }
    format!("{bar:+.1} [{least:+.1} to {most:+.1}]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_is_the_verdicts_figure_and_the_whisker_the_seeds_spread() {
        let build = [Some(10.0), Some(30.0), None, Some(20.0)];
        let hash = [Some(20.0), Some(20.0), Some(5.0), Some(20.0)];
        // The verdict compares medians: 20 against 20.
        assert_eq!(ratio(known_median(&build), known_median(&hash)), 1.0);
        // Seed by seed: 0.5, 1.5 and 1.0; the seed without a figure is left out.
        let spread = range(paired(&build, &hash, ratio));
        assert_eq!(spread, (0.5, 1.5));
        assert!(known_median(&[None, None]).is_nan());
        assert!(ratio(known_median(&[None]), 1.0).is_nan());
        assert!(ratio(1.0, 0.0).is_nan());
        assert!(range(Vec::new()).0.is_nan());
    }
}
