//! The schedule, the choice of connection, and the scheduler on connections that answer in a
//! set time (tokio's paused clock: no wall-clock time, every instant exact).

use std::sync::{Arc, Mutex};

use super::*;
use crate::client::{join, latency};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn due_times_follow_the_rate_from_the_start() {
    let start = Instant::now();
    let schedule = Schedule::new(start, 250.0);
    assert_eq!(schedule.due(0), start);
    assert_eq!(schedule.due(1) - start, ms(4));
    assert_eq!(schedule.due(1000) - start, Duration::from_secs(4));
    assert_eq!(schedule.interval(), ms(4));
    // A third of a second apart; the third request is due one second in, exactly.
    let thirds = Schedule::new(start, 3.0);
    assert_eq!(thirds.due(1) - start, Duration::from_nanos(333_333_333));
    assert_eq!(thirds.due(3) - start, Duration::from_secs(1));
    // Below one per second.
    let slow = Schedule::new(start, 0.5);
    assert_eq!(slow.due(2) - start, Duration::from_secs(4));
}

#[test]
fn a_phase_sends_the_requests_due_within_its_duration() {
    let schedule = |rate| Schedule::new(Instant::now(), rate);
    let secs = |s: f64| Limit::Duration(Duration::from_secs_f64(s));
    assert_eq!(schedule(300.0).requests(secs(3.0)), 900);
    // Due at 0, 0.1 and 0.2 s; the one due at 0.3 s is not in a 0.3 s phase.
    assert_eq!(schedule(10.0).requests(secs(0.3)), 3);
    // Due at 0, 0.4 and 0.8 s.
    assert_eq!(schedule(2.5).requests(secs(1.0)), 3);
    assert_eq!(schedule(0.4).requests(secs(2.0)), 1);
    assert_eq!(schedule(300.0).requests(Limit::Requests(7)), 7);
}

#[test]
fn the_last_freed_connection_goes_first_and_late_means_none_was_free() {
    let t0 = Instant::now();
    let mut free = Free::new(2, t0);
    assert_eq!(free.take(t0 + ms(1)), Some((0, false)));
    assert_eq!(free.take(t0 + ms(2)), Some((1, false)));
    assert_eq!(free.take(t0 + ms(3)), None);
    // Connection 1 came back at 5 ms: the request due at 3 ms waited for it.
    free.put(1, t0 + ms(5));
    assert_eq!(free.take(t0 + ms(3)), Some((1, true)));
    // Free since 4 ms, due at 4 ms: on time.
    free.put(0, t0 + ms(4));
    assert_eq!(free.take(t0 + ms(4)), Some((0, false)));
    // With two free, the one freed last is taken, and the request is on time when the other
    // one was free at its due time.
    free.put(0, t0 + ms(6));
    free.put(1, t0 + ms(8));
    assert_eq!(free.take(t0 + ms(7)), Some((1, false)));
}

/// What a fake connection served.
#[derive(Debug, PartialEq)]
struct Served {
    connection: usize,
    due: Duration,
    sent: Duration,
    latency: Duration,
}

/// A connection whose every answer takes `service`.
struct Fake {
    id: usize,
    start: Instant,
    service: Duration,
    log: Arc<Mutex<Vec<Served>>>,
}

impl Serve for Fake {
    async fn serve(&mut self, due: Instant) {
        let sent = Instant::now();
        tokio::time::sleep(self.service).await;
        let latency = latency(
            Some(due.into_std()),
            sent.into_std(),
            Instant::now().into_std(),
        );
        self.log.lock().expect("log").push(Served {
            connection: self.id,
            due: due - self.start,
            sent: sent - self.start,
            latency,
        });
    }
}

/// Like [`tick_on_thread`], on the runtime's timer: on a paused clock, exact.
fn tick_on_timer(schedule: Schedule, requests: u64) -> UnboundedReceiver<Instant> {
    let (ticks, received) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        for i in 0..requests {
            let due = schedule.due(i);
            tokio::time::sleep_until(due).await;
            if ticks.send(due).is_err() {
                return;
            }
        }
    });
    received
}

/// Runs `requests` requests at `rate` over `connections` fakes answering in `service`.
async fn run_fakes(
    rate: f64,
    connections: usize,
    service: Duration,
    requests: u64,
) -> (Vec<Served>, OpenPhase) {
    let start = Instant::now();
    let log = Arc::new(Mutex::new(Vec::new()));
    let fakes = (0..connections)
        .map(|id| Fake {
            id,
            start,
            service,
            log: log.clone(),
        })
        .collect();
    let schedule = Schedule::new(start, rate);
    let (tasks, phase) = dispatch(fakes, schedule, tick_on_timer(schedule, requests))
        .await
        .expect("dispatch");
    let fakes = join(tasks).await.expect("join");
    assert_eq!(fakes.len(), connections);
    let served = std::mem::take(&mut *log.lock().expect("log"));
    (served, phase)
}

#[tokio::test(start_paused = true)]
async fn a_fast_service_gets_every_request_on_time_on_one_connection() {
    let (served, phase) = run_fakes(100.0, 3, ms(5), 5).await;
    let expected: Vec<Served> = (0..5)
        .map(|i| Served {
            connection: 0,
            due: ms(10 * i),
            sent: ms(10 * i),
            latency: ms(5),
        })
        .collect();
    assert_eq!(served, expected);
    assert_eq!((phase.sent, phase.late, phase.busiest), (5, 0, 1));
    assert_eq!(phase.delay.max(), 0);
    // The last send at 40 ms, plus one interval.
    assert_eq!(phase.window, ms(50));
    assert!((phase.achieved() - 100.0).abs() < 1e-9);
}

#[tokio::test(start_paused = true)]
async fn a_slow_service_makes_requests_late_and_their_wait_counts() {
    // One connection, a request due every 10 ms, 25 ms per answer: from the second request
    // on, each waits for the connection, and its latency runs from its due time.
    let (served, phase) = run_fakes(100.0, 1, ms(25), 4).await;
    let expected: Vec<Served> = [(0, 0, 25), (10, 25, 40), (20, 50, 55), (30, 75, 70)]
        .into_iter()
        .map(|(due, sent, latency)| Served {
            connection: 0,
            due: ms(due),
            sent: ms(sent),
            latency: ms(latency),
        })
        .collect();
    assert_eq!(served, expected);
    assert_eq!((phase.sent, phase.late, phase.busiest), (4, 3, 1));
    // Waited 0, 15, 30 and 45 ms for the connection (in microseconds, to the histogram's
    // 3 significant digits).
    let delay = &phase.delay;
    assert_eq!(delay.min(), 0);
    assert!(delay.equivalent(delay.max(), 45_000), "{}", delay.max());
    assert!(delay.equivalent(delay.value_at_quantile(0.5), 15_000));
    assert_eq!(phase.delay.len(), 4);
    assert_eq!(phase.window, ms(85));
    assert!((phase.achieved() - 4.0 / 0.085).abs() < 1e-9);
}

#[tokio::test(start_paused = true)]
async fn a_backlog_spreads_over_more_connections() {
    // 25 ms per answer at one request every 10 ms needs three connections at once.
    let (served, phase) = run_fakes(100.0, 4, ms(25), 6).await;
    assert_eq!(phase.late, 0);
    assert_eq!(phase.busiest, 3);
    assert!(served
        .iter()
        .all(|s| s.sent == s.due && s.latency == ms(25)));
    let mut used: Vec<usize> = served.iter().map(|s| s.connection).collect();
    used.sort_unstable();
    used.dedup();
    assert_eq!(used, [0, 1, 2]);
}

#[test]
fn merged_phases_add_up() {
    let mut all = OpenPhase::new(100.0);
    let mut one = OpenPhase::new(100.0);
    (one.sent, one.late, one.window, one.busiest) = (10, 2, ms(120), 3);
    record_micros(&mut one.delay, ms(7));
    let mut two = OpenPhase::new(100.0);
    (two.sent, two.late, two.window, two.busiest) = (10, 0, ms(80), 5);
    all.merge(&one).expect("merge");
    all.merge(&two).expect("merge");
    assert_eq!(
        (all.sent, all.late, all.window, all.busiest),
        (20, 2, ms(200), 5)
    );
    assert_eq!(all.delay.len(), 1);
    assert!((all.achieved() - 100.0).abs() < 1e-9);
}
