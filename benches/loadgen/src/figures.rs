//! The figures a report prints: per route and kind, the ratios of the layered route to the
//! baseline, and in open loop the schedule's.

use std::time::Duration;

use serde_json::{json, Value};

use crate::open::OpenPhase;
use crate::plan::{Kind, Route, KINDS};
use crate::run::RouteReport;
use crate::stats::{KindStats, FAILURES};

/// What the report prints for one kind (or all kinds) of one route: the counts, the rate
/// over the route's measured time and the latency percentiles.
pub(crate) struct Figures {
    pub(crate) stats: KindStats,
    pub(crate) per_second: f64,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    pub(crate) p999_us: u64,
}

impl Figures {
    pub(crate) fn of(mut stats: KindStats, elapsed: Duration) -> Figures {
        stats.statuses.sort_unstable();
        let secs = elapsed.as_secs_f64();
        Figures {
            per_second: if secs > 0.0 {
                stats.responses as f64 / secs
            } else {
                0.0
            },
            p50_us: stats.latency.value_at_quantile(0.5),
            p99_us: stats.latency.value_at_quantile(0.99),
            p999_us: stats.latency.value_at_quantile(0.999),
            stats,
        }
    }

    pub(crate) fn json(&self) -> Value {
        let stats = &self.stats;
        let errors: serde_json::Map<String, Value> = FAILURES
            .iter()
            .map(|f| (f.name().to_owned(), json!(stats.errors[*f as usize])))
            .collect();
        let statuses: serde_json::Map<String, Value> = stats
            .statuses
            .iter()
            .map(|(s, n)| (s.to_string(), json!(n)))
            .collect();
        json!({
            "requests": stats.requests(),
            "responses": stats.responses,
            "per_second": self.per_second,
            "p50_us": self.p50_us,
            "p99_us": self.p99_us,
            "p999_us": self.p999_us,
            "max_us": stats.latency.max(),
            "mismatches": stats.mismatches,
            "errors": errors,
            "statuses": statuses,
            "replayed": stats.replayed,
        })
    }
}

/// One route's figures: all kinds, then each kind that was sent.
pub(crate) struct RouteFigures<'a> {
    pub(crate) report: &'a RouteReport,
    pub(crate) all: Figures,
    pub(crate) kinds: Vec<(Kind, Figures)>,
    /// In open loop, what the schedules of the route's phases came to.
    pub(crate) open: Option<OpenPhase>,
}

impl<'a> RouteFigures<'a> {
    pub(crate) fn of(report: &'a RouteReport) -> Result<RouteFigures<'a>, String> {
        let elapsed = report.elapsed();
        Ok(RouteFigures {
            report,
            all: Figures::of(report.stats.all()?, elapsed),
            kinds: KINDS
                .iter()
                .filter(|k| report.stats.kinds[k.index()].requests() > 0)
                .map(|&k| {
                    (
                        k,
                        Figures::of(report.stats.kinds[k.index()].clone(), elapsed),
                    )
                })
                .collect(),
            open: report.open()?,
        })
    }

    pub(crate) fn phase_rates(&self) -> Vec<f64> {
        self.report
            .phases
            .iter()
            .map(|p| p.responses as f64 / p.elapsed.as_secs_f64().max(f64::EPSILON))
            .collect()
    }

    /// In open loop, the achieved rate of each phase.
    pub(crate) fn phase_achieved(&self) -> Vec<f64> {
        self.report
            .phases
            .iter()
            .filter_map(|p| p.open.as_ref().map(OpenPhase::achieved))
            .collect()
    }

    /// In open loop, the schedule's figures as JSON.
    pub(crate) fn open_json(&self) -> Option<Value> {
        let open = self.open.as_ref()?;
        Some(json!({
            "target_per_second": open.rate,
            "achieved_per_second": open.achieved(),
            "phase_achieved_per_second": self.phase_achieved(),
            "sent": open.sent,
            "late": open.late,
            "send_delay_p50_us": open.delay.value_at_quantile(0.5),
            "send_delay_p99_us": open.delay.value_at_quantile(0.99),
            "send_delay_max_us": open.delay.max(),
            "connections_busiest": open.busiest,
        }))
    }

    /// Microseconds of `cpu` per request of this route.
    pub(crate) fn per_request_us(&self, cpu: Option<Duration>) -> Option<f64> {
        let requests = self.report.stats.requests().max(1) as f64;
        Some(cpu?.as_secs_f64() / requests * 1e6)
    }

    /// The client's CPU time per request and its share of one core.
    pub(crate) fn client_cpu(&self) -> Option<(f64, f64)> {
        let cpu = self.report.cpu()?.as_secs_f64();
        let requests = self.report.stats.requests().max(1) as f64;
        let wall = self.report.elapsed().as_secs_f64().max(f64::EPSILON);
        Some((cpu / requests * 1e6, cpu / wall))
    }
}

/// Layered over baseline: throughput, p50, p99, and the p99 of each layered kind.
pub(crate) struct Ratios {
    pub(crate) throughput: f64,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) p99_by_kind: Vec<(Kind, f64)>,
    /// Each round's layered phase over the same round's baseline phase (the phase just before
    /// it, or two before with `--routes ceiling`): machine noise that hits both cancels out,
    /// so a trend here is the layer's own (over uptime, say).
    pub(crate) by_round: Vec<f64>,
}

impl Ratios {
    /// The mean of the first and of the last fifth of [`by_round`](Self::by_round) (at least
    /// one round each, `rounds / 5` rounded down otherwise), once there are two rounds.
    pub(crate) fn first_and_last(&self) -> Option<(f64, f64)> {
        let n = self.by_round.len();
        if n < 2 {
            return None;
        }
        let k = (n / 5).max(1);
        let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len() as f64;
        Some((mean(&self.by_round[..k]), mean(&self.by_round[n - k..])))
    }
}

/// The figures of `route`, when the run loaded it.
fn find<'a, 'r>(figures: &'a [RouteFigures<'r>], route: Route) -> Option<&'a RouteFigures<'r>> {
    figures.iter().find(|f| f.report.route == route)
}

/// `a / b`, or NaN when `b` measured nothing.
fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::NAN
    }
}

pub(crate) fn ratios(figures: &[RouteFigures<'_>]) -> Option<Ratios> {
    let (baseline, layered) = (
        find(figures, Route::Baseline)?,
        find(figures, Route::Layered)?,
    );
    Some(Ratios {
        throughput: ratio(layered.all.per_second, baseline.all.per_second),
        p50: ratio(layered.all.p50_us as f64, baseline.all.p50_us as f64),
        p99: ratio(layered.all.p99_us as f64, baseline.all.p99_us as f64),
        p99_by_kind: layered
            .kinds
            .iter()
            .map(|(k, f)| (*k, ratio(f.p99_us as f64, baseline.all.p99_us as f64)))
            .collect(),
        by_round: layered
            .phase_rates()
            .into_iter()
            .zip(baseline.phase_rates())
            .map(|(l, b)| ratio(l, b))
            .collect(),
    })
}

/// One route over another in the same run: throughput and p99.
pub(crate) struct Pair {
    pub(crate) throughput: f64,
    pub(crate) p99: f64,
}

/// `over`'s figures divided by `under`'s, when the run loaded both routes.
pub(crate) fn pair(figures: &[RouteFigures<'_>], over: Route, under: Route) -> Option<Pair> {
    let (over, under) = (find(figures, over)?, find(figures, under)?);
    Some(Pair {
        throughput: ratio(over.all.per_second, under.all.per_second),
        p99: ratio(over.all.p99_us as f64, under.all.p99_us as f64),
    })
}
