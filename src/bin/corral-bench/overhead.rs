//! `corral-bench overhead-report`: reads the measurements scripts/bench-overhead.sh
//! collected (one CSV line per wrk run or probe), prints the tables with the corral/nginx
//! ratios and the goals, and draws the chart.
//!
//! CSV columns: `kind,scenario,target,rps,p50_ms,p90_ms,p99_ms,errors`, where kind is
//! `throughput` (many connections), `latency` (one connection) or `chunk-delay` (the
//! streaming probe), scenario is `1k`, `128k` or `stream`, and target is `direct`, `nginx`
//! or `corral`.

use std::fmt::Write;
use std::path::Path;

use crate::plot::Bars;

#[derive(Clone, Debug)]
struct Row {
    kind: String,
    scenario: String,
    target: String,
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
const TARGETS: [&str; 3] = ["direct", "nginx", "corral"];

fn parse(text: &str) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with("kind,") {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 8 {
            return Err(format!("line {}: expected 8 fields: {line}", n + 1));
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
            rps: num(3)?,
            p50: num(4)?,
            p90: num(5)?,
            p99: num(6)?,
            errors: num(7)? as u64,
        });
    }
    Ok(rows)
}

fn find<'a>(rows: &'a [Row], kind: &str, scenario: &str, target: &str) -> Option<&'a Row> {
    rows.iter()
        .find(|r| r.kind == kind && r.scenario == scenario && r.target == target)
}

/// Prints the report as Markdown and draws `plot` (if given).
pub fn report(csv: &Path, plot: Option<&Path>) -> Result<String, String> {
    let text =
        std::fs::read_to_string(csv).map_err(|e| format!("cannot read {}: {e}", csv.display()))?;
    let rows = parse(&text)?;
    let mut md = String::new();
    md.push_str(&throughput_table(&rows));
    md.push_str(&chunk_table(&rows));
    md.push_str(&goals(&rows));
    if let Some(plot) = plot {
        draw(&rows, plot)?;
    }
    Ok(md)
}

fn throughput_table(rows: &[Row]) -> String {
    let mut md = String::from(
        "| scenario | target | req/s (32 conns) | p50 / p90 / p99 ms (32 conns) | \
         p50 / p99 ms (1 conn) | added p50 ms (1 conn) | req/s vs nginx | errors |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for (scenario, label) in SCENARIOS {
        let direct = find(rows, "latency", scenario, "direct").map(|r| r.p50);
        let nginx = find(rows, "throughput", scenario, "nginx").map(|r| r.rps);
        for target in TARGETS {
            let (Some(t), Some(l)) = (
                find(rows, "throughput", scenario, target),
                find(rows, "latency", scenario, target),
            ) else {
                continue;
            };
            let added = direct.map_or("-".into(), |d| format!("{:+.3}", l.p50 - d));
            let ratio = match (target, nginx) {
                ("direct", _) | (_, None) => "-".to_string(),
                (_, Some(n)) => format!("{:.2}", t.rps / n),
            };
            let _ = writeln!(
                md,
                "| {label} | {target} | {:.0} | {:.3} / {:.3} / {:.3} | {:.3} / {:.3} | {added} | {ratio} | {} |",
                t.rps,
                t.p50,
                t.p90,
                t.p99,
                l.p50,
                l.p99,
                t.errors + l.errors
            );
        }
    }
    md
}

fn chunk_table(rows: &[Row]) -> String {
    let mut md = String::from(
        "\n| streamed chunk, backend to client | p50 ms | p90 ms | p99 ms |\n| --- | --- | --- | --- |\n",
    );
    for target in TARGETS {
        if let Some(r) = find(rows, "chunk-delay", "stream", target) {
            let _ = writeln!(
                md,
                "| {target} | {:.3} | {:.3} | {:.3} |",
                r.p50, r.p90, r.p99
            );
        }
    }
    md
}

fn goals(rows: &[Row]) -> String {
    let mut md = String::from("\n");
    for (scenario, label) in &SCENARIOS[..2] {
        let c = find(rows, "throughput", scenario, "corral");
        let n = find(rows, "throughput", scenario, "nginx");
        if let (Some(c), Some(n)) = (c, n) {
            let ratio = c.rps / n.rps;
            let _ = writeln!(
                md,
                "- goal: corral throughput at least nginx's, {label} -- {:.0} vs {:.0} req/s, \
                 ratio {ratio:.2} ({})",
                c.rps,
                n.rps,
                met(ratio >= 1.0)
            );
        }
        let c = find(rows, "latency", scenario, "corral");
        let d = find(rows, "latency", scenario, "direct");
        if let (Some(c), Some(d)) = (c, d) {
            let added = c.p50 - d.p50;
            let _ = writeln!(
                md,
                "- goal: added p50 under 0.2 ms, {label} -- {added:.3} ms ({})",
                met(added < 0.2)
            );
        }
    }
    if let Some(c) = find(rows, "chunk-delay", "stream", "corral") {
        let _ = writeln!(
            md,
            "- goal: streamed chunks forwarded within 1 ms -- p99 {:.3} ms from backend to \
             client through corral ({})",
            c.p99,
            met(c.p99 < 1.0)
        );
    }
    md
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

fn draw(rows: &[Row], path: &Path) -> Result<(), String> {
    let series = TARGETS
        .iter()
        .map(|target| {
            let values = SCENARIOS
                .iter()
                .map(|(s, _)| find(rows, "throughput", s, target).map_or(f64::NAN, |r| r.rps))
                .collect();
            (target.to_string(), values)
        })
        .collect();
    Bars {
        title: "Proxy overhead on loopback: requests per second, 32 connections",
        y_label: "requests/s",
        groups: SCENARIOS.iter().map(|(_, l)| l.to_string()).collect(),
        series,
        log_y: false,
        annotate: true,
    }
    .draw(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_reports_ratios() -> Result<(), String> {
        let csv = "kind,scenario,target,rps,p50_ms,p90_ms,p99_ms,errors\n\
                   throughput,1k,direct,100,1,2,3,0\nlatency,1k,direct,10,0.1,0.2,0.3,0\n\
                   throughput,1k,nginx,50,1,2,3,0\nlatency,1k,nginx,10,0.2,0.2,0.3,0\n\
                   throughput,1k,corral,60,1,2,3,0\nlatency,1k,corral,10,0.25,0.3,0.4,0\n\
                   chunk-delay,stream,corral,0,0.1,0.2,0.5,0\n";
        let rows = parse(csv)?;
        assert_eq!(rows.len(), 7);
        let table = throughput_table(&rows);
        assert!(table.contains("| 1.20 |"), "{table}");
        let g = goals(&rows);
        assert!(g.contains("ratio 1.20 (met)"), "{g}");
        assert!(g.contains("0.150 ms (met)"), "{g}");
        assert!(g.contains("p99 0.500 ms"), "{g}");
        assert!(parse("a,b\n").is_err());
        Ok(())
    }
}
