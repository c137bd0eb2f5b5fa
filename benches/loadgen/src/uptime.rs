//! Over uptime (`--report-every`): the responses per second of each interval, and the
//! server's resident memory, printed as they come and compared first against last.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::plan::Plan;

/// One `--report-every` interval of the measured rounds.
pub(crate) struct Interval {
    /// Time since the measured rounds started, at the interval's end.
    at: Duration,
    /// Responses per second in the interval, all routes and kinds.
    per_second: f64,
    /// The server's resident memory at the interval's end, in KiB (`--server-pid`).
    rss_kib: Option<u64>,
}

/// The server's resident memory in KiB: VmRSS in `/proc/PID/status` (Linux).
pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    line.trim().trim_end_matches("kB").trim().parse().ok()
}

/// Prints a line on stderr every `every` until `stop` fires, and returns the intervals.
/// Rates are taken over the time that really passed, so a late tick skews nothing.
pub(crate) async fn report_intervals(
    plan: Arc<Plan>,
    every: Duration,
    pid: Option<u32>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Vec<Interval> {
    let started = Instant::now();
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut last_at, mut last_responses) = (started, plan.responses.load(Ordering::Relaxed));
    let mut intervals = Vec::new();
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => return intervals,
            _ = ticks.tick() => {}
        }
        let now = Instant::now();
        let responses = plan.responses.load(Ordering::Relaxed);
        let interval = Interval {
            at: now - started,
            per_second: (responses - last_responses) as f64 / (now - last_at).as_secs_f64(),
            rss_kib: pid.and_then(rss_kib),
        };
        (last_at, last_responses) = (now, responses);
        let rss = interval
            .rss_kib
            .map(|kib| format!(", server RSS {:.1} MiB", kib as f64 / 1024.0))
            .unwrap_or_default();
        eprintln!(
            "loadgen: interval {:>4} at {:>7.1} s: {:>8.0} responses/s{rss}",
            intervals.len() + 1,
            interval.at.as_secs_f64(),
            interval.per_second
        );
        intervals.push(interval);
    }
}

/// Throughput and memory over the measured rounds, interval by interval.
pub(crate) struct Uptime {
    pub(crate) every: Duration,
    pub(crate) intervals: Vec<Interval>,
}

impl Uptime {
    /// Intervals averaged at each end: the first and last tenth, at least one.
    fn edge(&self) -> usize {
        (self.intervals.len() / 10).max(1)
    }

    /// The mean of `value` over the first and over the last [`edge`](Self::edge) intervals,
    /// and its minimum and maximum over all; `None` with fewer than two intervals.
    fn compare(&self, value: impl Fn(&Interval) -> Option<f64>) -> Option<[f64; 4]> {
        let n = self.edge();
        if self.intervals.len() < 2 {
            return None;
        }
        let values: Option<Vec<f64>> = self.intervals.iter().map(value).collect();
        let values = values?;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some([
            mean(&values[..n]),
            mean(&values[values.len() - n..]),
            min,
            max,
        ])
    }

    fn throughput(&self) -> Option<[f64; 4]> {
        self.compare(|i| Some(i.per_second))
    }

    fn rss_mib(&self) -> Option<[f64; 4]> {
        self.compare(|i| i.rss_kib.map(|kib| kib as f64 / 1024.0))
    }

    pub(crate) fn print(&self) {
        let n = self.intervals.len();
        println!();
        println!(
            "uptime: {n} intervals of {} s; the first {} against the last {}:",
            self.every.as_secs_f64(),
            self.edge(),
            self.edge()
        );
        let line = |what: &str, unit: &str, v: Option<[f64; 4]>| match v {
            Some([first, last, min, max]) => println!(
                "  {what}: first {first:.1} {unit}, last {last:.1} {unit}, last / first {:.3} \
                 (min {min:.1}, max {max:.1})",
                last / first
            ),
            None => println!("  {what}: fewer than two intervals, or not readable"),
        };
        line("throughput", "responses/s", self.throughput());
        if self.intervals.iter().any(|i| i.rss_kib.is_some()) {
            line("server RSS", "MiB", self.rss_mib());
        }
    }

    pub(crate) fn json(&self) -> Value {
        let pair = |v: Option<[f64; 4]>| {
            v.map(|[first, last, min, max]| {
                json!({"first": first, "last": last, "last_over_first": last / first,
                       "min": min, "max": max})
            })
        };
        json!({
            "every_s": self.every.as_secs_f64(),
            "edge_intervals": self.edge(),
            "throughput": pair(self.throughput()),
            "server_rss_mib": pair(self.rss_mib()),
            "intervals": self.intervals.iter().map(|i| json!({
                "at_s": i.at.as_secs_f64(),
                "per_second": i.per_second,
                "rss_kib": i.rss_kib,
            })).collect::<Vec<_>>(),
        })
    }
}
