//! The open loop (`--rate`): the requests of a phase are due on a fixed schedule, however
//! fast the answers come, and their latency runs from the time they were due.
//!
//! A thread of its own ticks at each request's due time (a thread's sleep is precise to tens
//! of microseconds, the runtime's timer only to the millisecond); one task, the scheduler,
//! then hands the request to a free connection's task: the one freed last, so that the load
//! uses as few connections as it needs. When none is free, the request waits for the first to
//! come back and is counted late; the wait is in its latency all the same (no coordinated
//! omission).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::time::Instant;

use crate::args::Limit;
use crate::client::{join, Sender, Slot};
use crate::plan::Plan;
use crate::stats::{add_histogram, histogram, record_micros};

/// When each request of a phase is due: `rate` per second from `start`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Schedule {
    start: Instant,
    rate: f64,
}

impl Schedule {
    pub(crate) fn new(start: Instant, rate: f64) -> Schedule {
        Schedule { start, rate }
    }

    /// When request `i` (from 0) is due: `i / rate` seconds after the start, computed from
    /// the start each time, so that rounding does not add up over a long phase.
    pub(crate) fn due(&self, i: u64) -> Instant {
        self.start + Duration::from_secs_f64(i as f64 / self.rate)
    }

    /// The time between two requests.
    pub(crate) fn interval(&self) -> Duration {
        Duration::from_secs_f64(1.0 / self.rate)
    }

    /// How many requests a phase of `limit` sends: `--requests`, or every request due
    /// within the duration (due strictly before its end).
    pub(crate) fn requests(&self, limit: Limit) -> u64 {
        match limit {
            Limit::Requests(n) => n,
            Limit::Duration(d) => {
                let count = d.as_secs_f64() * self.rate;
                // A product that is a whole number but for float rounding (0.3 s at 10/s)
                // counts as one: the request due at the very end is not in the phase.
                let whole = count.round();
                if (count - whole).abs() <= 1e-9 * whole.max(1.0) {
                    whole as u64
                } else {
                    count.ceil() as u64
                }
            }
        }
    }
}

/// The free connections, the one freed last on top. Connections come back in the order they
/// were freed, so the bottom one has been free the longest.
#[derive(Debug)]
struct Free {
    stack: Vec<(usize, Instant)>,
}

impl Free {
    /// `connections` connections, all free since `since`; connection 0 is taken first.
    fn new(connections: usize, since: Instant) -> Free {
        Free {
            stack: (0..connections).rev().map(|k| (k, since)).collect(),
        }
    }

    fn put(&mut self, connection: usize, freed_at: Instant) {
        self.stack.push((connection, freed_at));
    }

    /// A connection for the request due at `due`, and whether the request is late: no
    /// connection was free yet at `due`. `None` when none is free now.
    fn take(&mut self, due: Instant) -> Option<(usize, bool)> {
        let late = self.stack.first().is_none_or(|&(_, at)| at > due);
        self.stack.pop().map(|(k, _)| (k, late))
    }

    fn len(&self) -> usize {
        self.stack.len()
    }
}

/// What the schedule of one phase (or of all phases of a route, merged) came to.
#[derive(Clone)]
pub(crate) struct OpenPhase {
    /// The target rate.
    pub(crate) rate: f64,
    /// Requests handed to a connection.
    pub(crate) sent: u64,
    /// Requests that found no free connection when they were due.
    pub(crate) late: u64,
    /// From the start to the last send, plus one interval of the schedule.
    pub(crate) window: Duration,
    /// The most connections busy at once.
    pub(crate) busiest: usize,
    /// From each request's due time to its send, in microseconds.
    pub(crate) delay: Histogram<u64>,
}

impl OpenPhase {
    fn new(rate: f64) -> OpenPhase {
        OpenPhase {
            rate,
            sent: 0,
            late: 0,
            window: Duration::ZERO,
            busiest: 0,
            delay: histogram(),
        }
    }

    /// Requests sent per second of the window: the target rate when none was late.
    pub(crate) fn achieved(&self) -> f64 {
        let secs = self.window.as_secs_f64();
        if secs > 0.0 {
            self.sent as f64 / secs
        } else {
            0.0
        }
    }

    pub(crate) fn merge(&mut self, other: &OpenPhase) -> Result<(), String> {
        add_histogram(&mut self.delay, &other.delay, "send delay")?;
        self.sent += other.sent;
        self.late += other.late;
        self.window += other.window;
        self.busiest = self.busiest.max(other.busiest);
        Ok(())
    }
}

/// A connection as the scheduler sees it: something that sends a due request and comes back
/// free when it has its answer.
pub(crate) trait Serve: Send + 'static {
    fn serve(&mut self, due: Instant) -> impl Future<Output = ()> + Send;
}

/// A load-generator connection on one route.
struct Connection {
    slot: Slot,
    sender: Option<Sender>,
    plan: Arc<Plan>,
}

impl Serve for Connection {
    async fn serve(&mut self, due: Instant) {
        self.slot
            .send(&self.plan, &mut self.sender, Some(due.into_std()))
            .await;
    }
}

/// Runs one open-loop phase that started at `started` at `rate` requests per second over
/// every connection (`slots` and their opened `senders`) until `limit`, and hands the slots
/// back with what the schedule came to.
pub(crate) async fn run(
    plan: &Arc<Plan>,
    slots: Vec<Slot>,
    senders: Vec<Option<Sender>>,
    limit: Limit,
    rate: f64,
    started: std::time::Instant,
) -> Result<(Vec<Slot>, OpenPhase), String> {
    let connections = slots
        .into_iter()
        .zip(senders)
        .map(|(slot, sender)| Connection {
            slot,
            sender,
            plan: plan.clone(),
        })
        .collect();
    let schedule = Schedule::new(Instant::from_std(started), rate);
    let ticks = tick_on_thread(schedule, schedule.requests(limit))?;
    let (tasks, phase) = dispatch(connections, schedule, ticks).await?;
    let slots = join(tasks).await?.into_iter().map(|c| c.slot).collect();
    Ok((slots, phase))
}

/// Sends the due time of each of the first `requests` requests of `schedule` when it is due,
/// from a thread of its own: its sleep wakes within tens of microseconds of the due time,
/// where the runtime's timer rounds up to the next millisecond. The thread ends after the
/// last one, or when the receiver is dropped.
fn tick_on_thread(schedule: Schedule, requests: u64) -> Result<UnboundedReceiver<Instant>, String> {
    let (ticks, received) = mpsc::unbounded_channel();
    std::thread::Builder::new()
        .name("loadgen-schedule".to_owned())
        .spawn(move || {
            for i in 0..requests {
                let due = schedule.due(i);
                let wait = due
                    .into_std()
                    .saturating_duration_since(std::time::Instant::now());
                if !wait.is_zero() {
                    std::thread::sleep(wait);
                }
                if ticks.send(due).is_err() {
                    return;
                }
            }
        })
        .map_err(|e| format!("cannot start the schedule's thread: {e}"))?;
    Ok(received)
}

/// One connection's task: serves each request the scheduler hands it, and says when it is
/// free again.
async fn work<C: Serve>(
    connection: usize,
    mut state: C,
    mut due: UnboundedReceiver<Instant>,
    freed: UnboundedSender<(usize, Instant)>,
) -> C {
    while let Some(due) = due.recv().await {
        state.serve(due).await;
        let _ = freed.send((connection, Instant::now()));
    }
    state
}

/// The scheduler: hands each request of `schedule` to a free connection as its due time
/// comes on `ticks`, until `ticks` ends, then lets the connections' tasks finish. Returns the
/// tasks (each hands its connection back) and what the schedule came to.
async fn dispatch<C: Serve>(
    connections: Vec<C>,
    schedule: Schedule,
    mut ticks: UnboundedReceiver<Instant>,
) -> Result<(Vec<tokio::task::JoinHandle<C>>, OpenPhase), String> {
    let gone = || "every connection task ended".to_owned();
    let n = connections.len();
    let (freed_tx, mut freed) = mpsc::unbounded_channel();
    let mut jobs = Vec::with_capacity(n);
    let tasks = connections
        .into_iter()
        .enumerate()
        .map(|(k, state)| {
            let (job, due) = mpsc::unbounded_channel();
            jobs.push(job);
            tokio::spawn(work(k, state, due, freed_tx.clone()))
        })
        .collect();
    drop(freed_tx);
    let mut free = Free::new(n, schedule.start);
    let mut phase = OpenPhase::new(schedule.rate);
    let mut last_send = None;
    while let Some(due) = ticks.recv().await {
        let (k, late) = loop {
            while let Ok((k, at)) = freed.try_recv() {
                free.put(k, at);
            }
            if let Some(taken) = free.take(due) {
                break taken;
            }
            let (k, at) = freed.recv().await.ok_or_else(gone)?;
            free.put(k, at);
        };
        let now = Instant::now();
        jobs[k].send(due).map_err(|_| gone())?;
        record_micros(&mut phase.delay, now - due);
        phase.sent += 1;
        phase.late += u64::from(late);
        phase.busiest = phase.busiest.max(n - free.len());
        last_send = Some(now);
    }
    if let Some(last) = last_send {
        phase.window = last - schedule.start + schedule.interval();
    }
    Ok((tasks, phase))
}

#[cfg(test)]
mod tests;
