//! The report: a text table, or one JSON object (`--json`).

use serde_json::{json, Value};

use crate::args::{Args, Limit, Mode};
use crate::figures::{pair, ratios, RouteFigures};
use crate::plan::Route;
use crate::stats::{FAILURES, SAMPLES_PRINTED};

/// `items` separated by commas, or `none`.
fn joined_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(", ")
    }
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

pub(crate) fn print_text(args: &Args, run_id: &str, figures: &[RouteFigures<'_>], runtime: &str) {
    let phase = match args.limit() {
        Limit::Requests(n) => format!("{n} requests"),
        Limit::Duration(d) => format!("{} s", d.as_secs_f64()),
    };
    let connections = match args.mode() {
        Mode::Closed => format!("{} connections per route", args.connections),
        Mode::Open { rate } => format!(
            "open loop at {rate} req/s over up to {} connections per route",
            args.connections
        ),
    };
    println!(
        "run {run_id}: {}, {connections}, {} rounds x {phase} per route \
         (+{} s warmup), duplicates {:.2}, conflicts {:.2}, {} accounts, producer {}, \
         client runtime {runtime}",
        args.url,
        args.rounds,
        args.warmup.as_secs_f64(),
        args.duplicates,
        args.conflicts,
        args.accounts,
        args.producer,
    );
    println!();
    println!(
        "{:<9} {:<9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10} {:>6}",
        "route",
        "kind",
        "requests",
        "req/s",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "max ms",
        "mismatches",
        "errors"
    );
    for route in figures {
        let rows = std::iter::once(("all", &route.all))
            .chain(route.kinds.iter().map(|(k, f)| (k.name(), f)));
        for (kind, f) in rows {
            println!(
                "{:<9} {:<9} {:>9} {:>9.1} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10} {:>6}",
                route.report.route.name(),
                kind,
                f.stats.requests(),
                f.per_second,
                ms(f.p50_us),
                ms(f.p99_us),
                ms(f.p999_us),
                ms(f.stats.latency.max()),
                f.stats.mismatches,
                f.stats.errors(),
            );
        }
    }
    println!();
    for route in figures {
        let rates: Vec<String> = route
            .phase_rates()
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect();
        let statuses: Vec<String> = route
            .all
            .stats
            .statuses
            .iter()
            .map(|(s, n)| format!("{s} x{n}"))
            .collect();
        let errors: Vec<String> = FAILURES
            .iter()
            .filter(|f| route.all.stats.errors[**f as usize] > 0)
            .map(|f| format!("{} x{}", f.name(), route.all.stats.errors[*f as usize]))
            .collect();
        println!(
            "{:<9} phases req/s: {}; statuses: {}; replayed: {}; transport errors: {}",
            route.report.route.name(),
            rates.join(" "),
            joined_or_none(&statuses),
            route.all.stats.replayed,
            joined_or_none(&errors),
        );
    }
    print_open_loop(args, figures);
    if let Some(r) = ratios(figures) {
        let by_kind: Vec<String> = r
            .p99_by_kind
            .iter()
            .map(|(k, v)| format!("{} {v:.2}x", k.name()))
            .collect();
        println!();
        println!(
            "layered / baseline: throughput {:.2}x, p50 {:.2}x, p99 {:.2}x (p99 by layered kind: {})",
            r.throughput,
            r.p50,
            r.p99,
            by_kind.join(", ")
        );
        let rounds: Vec<String> = r.by_round.iter().map(|v| format!("{v:.2}")).collect();
        print!(
            "layered / baseline throughput by round: {}",
            rounds.join(" ")
        );
        if let Some((first, last)) = r.first_and_last() {
            print!(
                "; mean of the first fifth of the rounds {first:.2}x, of the last fifth {last:.2}x"
            );
            if first > 0.0 {
                print!(" (last / first {:.2})", last / first);
            }
        }
        println!();
    }
    for (name, over, under) in CEILING_PAIRS {
        if let Some(p) = pair(figures, over, under) {
            println!(
                "{} / {}: throughput {:.3}x, p99 {:.3}x ({name})",
                over.name(),
                under.name(),
                p.throughput,
                p.p99
            );
        }
    }
    println!();
    for route in figures {
        for (whose, cpu) in [
            ("server", route.report.server_cpu()),
            ("PostgreSQL", route.report.postgres_cpu()),
        ] {
            if let Some(us) = route.per_request_us(cpu) {
                println!(
                    "{whose} CPU on {}: {us:.1} us per request",
                    route.report.route.name()
                );
            }
        }
        if let Some((per_request_us, share)) = route.client_cpu() {
            println!(
                "client CPU on {}: {per_request_us:.1} us per request, {:.0}% of one core{}",
                route.report.route.name(),
                share * 100.0,
                if share > 0.9 * f64::from(args.threads) {
                    " (the load generator itself may be the bottleneck)"
                } else {
                    ""
                }
            );
        }
    }
    for route in figures {
        let warm = &route.report.warmup;
        if warm.requests() > 0 {
            println!(
                "warmup on {}: {} requests, {} mismatches, {} transport errors (not in the figures)",
                route.report.route.name(),
                warm.requests(),
                warm.mismatches(),
                warm.errors()
            );
        }
    }
    let samples: Vec<&str> = figures
        .iter()
        .flat_map(|f| f.report.samples())
        .take(SAMPLES_PRINTED)
        .collect();
    if !samples.is_empty() {
        println!();
        println!("first mismatches and errors:");
        for sample in samples {
            println!("  {sample}");
        }
    }
}

/// In open loop, each route's schedule: one line each.
fn print_open_loop(args: &Args, figures: &[RouteFigures<'_>]) {
    for route in figures {
        if let Some(open) = &route.open {
            let phases: Vec<String> = route
                .phase_achieved()
                .iter()
                .map(|r| format!("{r:.0}"))
                .collect();
            println!(
                "{:<9} open loop: target {} req/s, achieved {:.1} req/s (phases: {}); late {} of \
                 {} ({:.1}%); send delay p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; at most {} of \
                 {} connections busy",
                route.report.route.name(),
                open.rate,
                open.achieved(),
                phases.join(" "),
                open.late,
                open.sent,
                open.late as f64 * 100.0 / open.sent.max(1) as f64,
                ms(open.delay.value_at_quantile(0.5)),
                ms(open.delay.value_at_quantile(0.99)),
                ms(open.delay.max()),
                open.busiest,
                args.connections,
            );
        }
    }
}

/// The ratios a run with the minimal protocol's route adds, by their JSON name.
const CEILING_PAIRS: [(&str, Route, Route); 2] = [
    ("minimal_over_baseline", Route::Minimal, Route::Baseline),
    ("layered_over_minimal", Route::Layered, Route::Minimal),
];

pub(crate) fn json(
    args: &Args,
    run_id: &str,
    figures: &[RouteFigures<'_>],
    runtime: &str,
) -> Value {
    let routes: serde_json::Map<String, Value> = figures
        .iter()
        .map(|f| {
            let kinds: serde_json::Map<String, Value> = f
                .kinds
                .iter()
                .map(|(k, fig)| (k.name().to_owned(), fig.json()))
                .collect();
            let warm = &f.report.warmup;
            let mut value = json!({
                "elapsed_s": f.report.elapsed().as_secs_f64(),
                "phase_per_second": f.phase_rates(),
                "all": f.all.json(),
                "kinds": kinds,
                "client_cpu_us_per_request": f.client_cpu().map(|c| c.0),
                "server_cpu_us_per_request": f.per_request_us(f.report.server_cpu()),
                "postgres_cpu_us_per_request": f.per_request_us(f.report.postgres_cpu()),
                "client_cpu_share_of_core": f.client_cpu().map(|c| c.1),
                "warmup": {
                    "requests": warm.requests(),
                    "responses": warm.responses(),
                    "mismatches": warm.mismatches(),
                    "errors": warm.errors(),
                },
                "samples": f.report.samples(),
            });
            if let Some(open) = f.open_json() {
                value["open_loop"] = open;
            }
            (f.report.route.name().to_owned(), value)
        })
        .collect();
    let ratios = ratios(figures).map(|r| {
        let by_kind: serde_json::Map<String, Value> = r
            .p99_by_kind
            .iter()
            .map(|(k, v)| (k.name().to_owned(), json!(v)))
            .collect();
        let (first, last) = r.first_and_last().unzip();
        json!({
            "throughput": r.throughput,
            "p50": r.p50,
            "p99": r.p99,
            "p99_by_layered_kind": by_kind,
            "throughput_by_round": r.by_round,
            "throughput_first_fifth_of_rounds": first,
            "throughput_last_fifth_of_rounds": last,
        })
    });
    let mut report = json!({
        "run_id": run_id,
        "url": args.url,
        "connections": args.connections,
        "rounds": args.rounds,
        "duration_s": args.duration.map(|d| d.as_secs_f64()),
        "requests_per_phase": args.requests,
        "warmup_s": args.warmup.as_secs_f64(),
        "duplicates": args.duplicates,
        "conflicts": args.conflicts,
        "accounts": args.accounts,
        "producer": args.producer,
        "client_runtime": runtime,
        "routes": routes,
        "layered_over_baseline": ratios,
    });
    // With `--routes ceiling`: the hand-written minimal protocol against the baseline, and
    // the layer against that ceiling.
    for (name, over, under) in CEILING_PAIRS {
        if let Some(p) = pair(figures, over, under) {
            report[name] = json!({ "throughput": p.throughput, "p99": p.p99 });
        }
    }
    if let Mode::Open { rate } = args.mode() {
        report["rate_per_second"] = json!(rate);
    }
    report
}
