//! A run: the preflight, the warmup and the interleaved rounds, phase by phase, in closed or
//! open loop, and what each route measured.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::args::{Args, Limit, Mode};
use crate::client::{connect, preflight, Slot};
use crate::cpu::CpuTimes;
use crate::open::OpenPhase;
use crate::plan::{resolve, Plan, Route};
use crate::stats::{Stats, SAMPLES_PRINTED};
use crate::uptime::{report_intervals, rss_kib, Uptime};
use crate::{closed, open};

/// One phase's figures.
#[derive(Clone)]
pub(crate) struct Phase {
    /// Responses received (transport errors not counted), like the route's throughput.
    pub(crate) responses: u64,
    pub(crate) elapsed: Duration,
    /// The load generator's own CPU time during the phase, where the platform tells it.
    cpu: Option<Duration>,
    /// The server's CPU time during the phase (`--server-pid`, Linux).
    server_cpu: Option<Duration>,
    /// PostgreSQL's CPU time during the phase (`--postgres-cpu`, Linux).
    postgres_cpu: Option<Duration>,
    /// In open loop, what the schedule came to.
    pub(crate) open: Option<OpenPhase>,
}

/// Runs one phase of `route` on all its connections and hands the slots back.
async fn run_phase(
    plan: &Arc<Plan>,
    slots: Vec<Slot>,
    limit: Limit,
    mode: Mode,
) -> Result<(Vec<Slot>, Phase), String> {
    let before: u64 = slots.iter().map(|s| s.stats.responses()).sum();
    // Connect first, so that the phase measures requests, not handshakes. A connection that
    // fails here is retried (and counted) by its task.
    let mut senders = Vec::with_capacity(slots.len());
    for _ in &slots {
        senders.push(connect(&plan.target).await.ok());
    }
    let cpu_before = CpuTimes::now(plan.server_pid, plan.postgres_cpu);
    let started = Instant::now();
    let (slots, open) = match mode {
        Mode::Closed => (
            closed::run(plan, slots, senders, limit, started).await?,
            None,
        ),
        Mode::Open { rate } => {
            let (slots, open) = open::run(plan, slots, senders, limit, rate, started).await?;
            (slots, Some(open))
        }
    };
    let elapsed = started.elapsed();
    let cpu = CpuTimes::now(plan.server_pid, plan.postgres_cpu).since(&cpu_before);
    let after: u64 = slots.iter().map(|s| s.stats.responses()).sum();
    Ok((
        slots,
        Phase {
            responses: after - before,
            elapsed,
            cpu: cpu.own,
            server_cpu: cpu.server,
            postgres_cpu: cpu.postgres,
            open,
        },
    ))
}

/// Everything one route measured.
pub(crate) struct RouteReport {
    pub(crate) route: Route,
    pub(crate) stats: Stats,
    pub(crate) phases: Vec<Phase>,
    pub(crate) warmup: Stats,
}

impl RouteReport {
    pub(crate) fn elapsed(&self) -> Duration {
        self.phases.iter().map(|p| p.elapsed).sum()
    }

    pub(crate) fn cpu(&self) -> Option<Duration> {
        self.phases.iter().map(|p| p.cpu).sum()
    }

    pub(crate) fn server_cpu(&self) -> Option<Duration> {
        self.phases.iter().map(|p| p.server_cpu).sum()
    }

    pub(crate) fn postgres_cpu(&self) -> Option<Duration> {
        self.phases.iter().map(|p| p.postgres_cpu).sum()
    }

    /// In open loop, the schedules of all phases together.
    pub(crate) fn open(&self) -> Result<Option<OpenPhase>, String> {
        let mut phases = self.phases.iter().filter_map(|p| p.open.as_ref());
        let Some(first) = phases.next() else {
            return Ok(None);
        };
        let mut all = first.clone();
        for phase in phases {
            all.merge(phase)?;
        }
        Ok(Some(all))
    }

    /// The first distinct mismatches and errors, warmup included.
    pub(crate) fn samples(&self) -> Vec<&str> {
        let mut samples: Vec<&str> = Vec::new();
        for sample in self.warmup.samples.iter().chain(&self.stats.samples) {
            if samples.len() < SAMPLES_PRINTED && !samples.contains(&sample.as_str()) {
                samples.push(sample);
            }
        }
        samples
    }
}

/// A run id unique enough that re-runs against the same database never share a key: the
/// time in milliseconds and 16 random bits, in hex.
fn run_id() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    format!("{millis:x}{:04x}", fastrand::u16(..))
}

/// What a run measured: its id, each route's figures and, with `--report-every`, the
/// intervals.
pub(crate) type RunResult = (String, Vec<RouteReport>, Option<Uptime>);

/// Runs the warmup and the rounds.
pub(crate) async fn run(args: &Args) -> Result<RunResult, String> {
    let target = resolve(&args.url).await?;
    let plan = Arc::new(Plan::new(args, target, run_id())?);
    if let Some(pid) = args.server_pid {
        rss_kib(pid).ok_or_else(|| {
            format!("--server-pid {pid}: cannot read VmRSS from /proc/{pid}/status")
        })?;
    }
    let routes = args.routes.list();
    preflight(&plan, routes).await?;

    let (limit, mode) = (args.limit(), args.mode());
    // Per route, its connections' slots, then what it measured.
    let mut state: Vec<(Vec<Slot>, RouteReport)> = routes
        .iter()
        .map(|&route| {
            let slots = (0..args.connections)
                .map(|connection| Slot::new(&plan.run_id, route, connection))
                .collect();
            let report = RouteReport {
                route,
                stats: Stats::new(),
                phases: Vec::new(),
                warmup: Stats::new(),
            };
            (slots, report)
        })
        .collect();

    if !args.warmup.is_zero() {
        for (slots, report) in &mut state {
            let warmup = Limit::Duration(args.warmup);
            let (mut warm, _) = run_phase(&plan, std::mem::take(slots), warmup, mode).await?;
            // Keep the keys answered for duplicates, drop the figures (but not the errors).
            for slot in &mut warm {
                report.warmup.merge(&slot.stats)?;
                slot.stats.clear();
            }
            *slots = warm;
        }
    }
    let reporter = args.report_every.map(|every| {
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(report_intervals(
            plan.clone(),
            every,
            args.server_pid,
            stopped,
        ));
        (every, stop, task)
    });
    for _ in 0..args.rounds {
        for (slots, report) in &mut state {
            let (done, phase) = run_phase(&plan, std::mem::take(slots), limit, mode).await?;
            report.phases.push(phase);
            *slots = done;
        }
    }
    let mut reports = Vec::with_capacity(state.len());
    for (slots, mut report) in state {
        for slot in &slots {
            report.stats.merge(&slot.stats)?;
        }
        reports.push(report);
    }
    let uptime = match reporter {
        Some((every, stop, task)) => {
            let _ = stop.send(());
            let intervals = task
                .await
                .map_err(|e| format!("the interval reports failed: {e}"))?;
            Some(Uptime { every, intervals })
        }
        None => None,
    };
    Ok((plan.run_id.clone(), reports, uptime))
}
