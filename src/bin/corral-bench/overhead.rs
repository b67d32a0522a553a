//! `corral-bench overhead-report`: reads the measurements scripts/bench-overhead.sh
//! collected (one CSV line per wrk run or probe), prints the tables with the median of the
//! alternating rounds, their spread, corral's ratios to bare Pingora and to nginx, and the
//! goals; and draws the chart.
//!
//! CSV columns: `kind,scenario,target,threads,round,rps,p50_ms,p90_ms,p99_ms,errors`, where
//! kind is `throughput` (many connections), `latency` (one connection) or `chunk-delay` (the
//! streaming probe), scenario is `1k`, `128k` or `stream`, target is `direct`, `nginx`,
//! `pingora` (Pingora's own proxy loop with a fixed peer) or `corral`, and threads is the
//! proxies' worker count.

use std::fmt::Write;
use std::path::Path;

use crate::plot::Bars;
use crate::report::median;

#[derive(Clone, Debug)]
struct Row {
    kind: String,
    scenario: String,
    target: String,
    threads: u32,
    rps: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    errors: u64,
}

const SCENARIOS: [(&str, &str); 3] = [
    ("1k", "1 KiB chat body"),
    ("128k", "128 KiB chat body"),
    ("stream", "streamed reply"),
];
const TARGETS: [&str; 4] = ["direct", "nginx", "pingora", "corral"];
/// Issue 13's goal: corral keeps at least this share of bare Pingora's throughput.
const PINGORA_GOAL: f64 = 0.9;

fn parse(text: &str) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with("kind,") {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 10 {
            return Err(format!("line {}: expected 10 fields: {line}", n + 1));
        }
        let num = |i: usize| -> Result<f64, String> {
            f[i].trim()
                .parse()
                .map_err(|_| format!("line {}: field {} is not a number: {}", n + 1, i + 1, f[i]))
        };
        rows.push(Row {
            kind: f[0].into(),
            scenario: f[1].into(),
            target: f[2].into(),
            threads: num(3)? as u32,
            rps: num(5)?,
            p50: num(6)?,
            p90: num(7)?,
            p99: num(8)?,
            errors: num(9)? as u64,
        });
    }
    Ok(rows)
}

/// One cell over its rounds: the median of each figure and the spread of the main one.
#[derive(Clone, Copy, Debug)]
struct Summary {
    rps: f64,
    rps_min: f64,
    rps_max: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    errors: u64,
    rounds: usize,
}

fn summary(
    rows: &[Row],
    kind: &str,
    scenario: &str,
    target: &str,
    threads: u32,
) -> Option<Summary> {
    let cell: Vec<&Row> = rows
        .iter()
        .filter(|r| {
            r.kind == kind && r.scenario == scenario && r.target == target && r.threads == threads
        })
        .collect();
    if cell.is_empty() {
        return None;
    }
    let of = |f: fn(&Row) -> f64| median(cell.iter().map(|r| f(r)).collect());
    Some(Summary {
        rps: of(|r| r.rps),
        rps_min: cell.iter().map(|r| r.rps).fold(f64::INFINITY, f64::min),
        rps_max: cell.iter().map(|r| r.rps).fold(f64::NEG_INFINITY, f64::max),
        p50: of(|r| r.p50),
        p90: of(|r| r.p90),
        p99: of(|r| r.p99),
        errors: cell.iter().map(|r| r.errors).sum(),
        rounds: cell.len(),
    })
}

fn thread_counts(rows: &[Row]) -> Vec<u32> {
    let mut t: Vec<u32> = rows.iter().map(|r| r.threads).collect();
    t.sort_unstable();
    t.dedup();
    t
}

/// Prints the report as Markdown and draws `plot` (if given).
pub fn report(csv: &Path, plot: Option<&Path>) -> Result<String, String> {
    let text =
        std::fs::read_to_string(csv).map_err(|e| format!("cannot read {}: {e}", csv.display()))?;
    let rows = parse(&text)?;
    let mut md = String::new();
    for threads in thread_counts(&rows) {
        md.push_str(&throughput_table(&rows, threads));
        md.push_str(&chunk_table(&rows, threads));
        md.push_str(&goals(&rows, threads));
    }
    if let Some(plot) = plot {
        draw(&rows, plot)?;
    }
    Ok(md)
}

fn ratio(a: Option<Summary>, b: Option<Summary>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}", a.rps / b.rps),
        _ => "-".into(),
    }
}

fn throughput_table(rows: &[Row], threads: u32) -> String {
    let mut md = format!(
        "\n**Proxies with {threads} thread(s)** (medians of the rounds; req/s spread min-max)\n\n\
         | scenario | target | req/s (many conns) | spread | p50 / p90 / p99 ms | \
         p50 / p99 ms (1 conn) | added p50 ms (1 conn) | vs pingora | vs nginx | rounds | errors |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    );
    for (scenario, label) in SCENARIOS {
        let direct = summary(rows, "latency", scenario, "direct", threads).map(|r| r.p50);
        let pingora = summary(rows, "throughput", scenario, "pingora", threads);
        let nginx = summary(rows, "throughput", scenario, "nginx", threads);
        for target in TARGETS {
            let (Some(t), Some(l)) = (
                summary(rows, "throughput", scenario, target, threads),
                summary(rows, "latency", scenario, target, threads),
            ) else {
                continue;
            };
            let added = direct.map_or("-".into(), |d| format!("{:+.3}", l.p50 - d));
            let (vs_pingora, vs_nginx) = match target {
                "direct" => ("-".into(), "-".into()),
                _ => (ratio(Some(t), pingora), ratio(Some(t), nginx)),
            };
            let _ = writeln!(
                md,
                "| {label} | {target} | {:.0} | {:.0}-{:.0} | {:.3} / {:.3} / {:.3} | {:.3} / {:.3} | \
                 {added} | {vs_pingora} | {vs_nginx} | {} | {} |",
                t.rps,
                t.rps_min,
                t.rps_max,
                t.p50,
                t.p90,
                t.p99,
                l.p50,
                l.p99,
                t.rounds,
                t.errors + l.errors
            );
        }
    }
    md
}

fn chunk_table(rows: &[Row], threads: u32) -> String {
    let mut md = String::from(
        "\n| streamed chunk, backend to client | p50 ms | p90 ms | p99 ms |\n| --- | --- | --- | --- |\n",
    );
    for target in TARGETS {
        if let Some(r) = summary(rows, "chunk-delay", "stream", target, threads) {
            let _ = writeln!(
                md,
                "| {target} | {:.3} | {:.3} | {:.3} |",
                r.p50, r.p90, r.p99
            );
        }
    }
    md
}

fn goals(rows: &[Row], threads: u32) -> String {
    let mut md = String::from("\n");
    for (scenario, label) in SCENARIOS {
        let c = summary(rows, "throughput", scenario, "corral", threads);
        let p = summary(rows, "throughput", scenario, "pingora", threads);
        if let (Some(c), Some(p)) = (c, p) {
            let r = c.rps / p.rps;
            let _ = writeln!(
                md,
                "- goal ({threads} thread(s)): corral at least {PINGORA_GOAL}x bare Pingora's \
                 throughput, {label} -- {:.0} vs {:.0} req/s, ratio {r:.2} ({})",
                c.rps,
                p.rps,
                met(r >= PINGORA_GOAL)
            );
        }
        let c = summary(rows, "latency", scenario, "corral", threads);
        let d = summary(rows, "latency", scenario, "direct", threads);
        if let (Some(c), Some(d), true) = (c, d, scenario != "stream") {
            let added = c.p50 - d.p50;
            let _ = writeln!(
                md,
                "- goal ({threads} thread(s)): added p50 under 0.2 ms, {label} -- {added:.3} ms ({})",
                met(added < 0.2)
            );
        }
    }
    if let Some(c) = summary(rows, "chunk-delay", "stream", "corral", threads) {
        let _ = writeln!(
            md,
            "- goal ({threads} thread(s)): streamed chunks forwarded within 1 ms -- p99 {:.3} ms \
             from backend to client through corral ({})",
            c.p99,
            met(c.p99 < 1.0)
        );
    }
    md
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

/// Median throughput of every target, one group per scenario and thread count.
fn draw(rows: &[Row], path: &Path) -> Result<(), String> {
    let threads = thread_counts(rows);
    let groups: Vec<(&str, &str, u32)> = threads
        .iter()
        .flat_map(|&t| SCENARIOS.iter().map(move |&(s, l)| (s, l, t)))
        .collect();
    let series = TARGETS
        .iter()
        .map(|target| {
            let values = groups
                .iter()
                .map(|&(s, _, t)| {
                    summary(rows, "throughput", s, target, t).map_or(f64::NAN, |r| r.rps)
                })
                .collect();
            (target.to_string(), values)
        })
        .collect();
    Bars {
        title: "Proxy overhead on loopback: requests per second (median of rounds)",
        y_label: "requests/s",
        groups: groups
            .iter()
            .map(|(_, l, t)| format!("{l}, {t} thr"))
            .collect(),
        series,
        log_y: false,
        annotate: true,
        whiskers: Vec::new(),
        bounds: Vec::new(),
    }
    .draw(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_spreads_and_ratios_per_thread_count() -> Result<(), String> {
        let csv = "kind,scenario,target,threads,round,rps,p50_ms,p90_ms,p99_ms,errors\n\
                   throughput,1k,direct,1,1,100,1,2,3,0\nlatency,1k,direct,1,1,10,0.1,0.2,0.3,0\n\
                   throughput,1k,nginx,1,1,50,1,2,3,0\nlatency,1k,nginx,1,1,10,0.2,0.2,0.3,0\n\
                   throughput,1k,pingora,1,1,40,1,2,3,0\nthroughput,1k,pingora,1,2,44,1,2,3,0\n\
                   latency,1k,pingora,1,1,10,0.2,0.2,0.3,0\n\
                   throughput,1k,corral,1,1,30,1,2,3,0\nthroughput,1k,corral,1,2,39,1,2,3,0\n\
                   throughput,1k,corral,1,3,36,1,2,3,1\nlatency,1k,corral,1,1,10,0.25,0.3,0.4,0\n\
                   throughput,1k,corral,2,1,80,1,2,3,0\n\
                   chunk-delay,stream,corral,1,1,0,0.1,0.2,0.5,0\n";
        let rows = parse(csv)?;
        assert_eq!(rows.len(), 13);
        assert_eq!(thread_counts(&rows), [1, 2]);
        let c = summary(&rows, "throughput", "1k", "corral", 1).ok_or("no cell")?;
        assert_eq!(
            (c.rps, c.rps_min, c.rps_max, c.rounds, c.errors),
            (36.0, 30.0, 39.0, 3, 1)
        );
        let p = summary(&rows, "throughput", "1k", "pingora", 1).ok_or("no cell")?;
        assert_eq!(
            p.rps, 42.0,
            "the median of an even count is the mean of the middle two"
        );
        let table = throughput_table(&rows, 1);
        // corral: 36 / 42 of pingora, 36 / 50 of nginx.
        assert!(table.contains("| 0.86 | 0.72 | 3 | 1 |"), "{table}");
        let g = goals(&rows, 1);
        assert!(g.contains("ratio 0.86 (MISSED)"), "{g}");
        assert!(g.contains("0.150 ms (met)"), "{g}");
        assert!(g.contains("p99 0.500 ms"), "{g}");
        assert!(parse("a,b\n").is_err());
        Ok(())
    }
}
