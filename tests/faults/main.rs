//! The fault suite: the credits example (`examples/credits.rs`, with its webhook outbox)
//! under retrying clients while something breaks, checked by one invariant
//! ([`checker`]): every command a client got a 2xx for is applied exactly once, every other
//! at most once, every 2xx body for one key is the same, nothing is left in progress, and
//! every applied command's webhook reached the receiver (or sits in the quarantine with a
//! reason).
//!
//! | test | what breaks |
//! |---|---|
//! | [`kill_loop`] | the service process, SIGKILLed at random points and started again |
//! | [`backends`] | the service's database sessions, ended with `pg_terminate_backend`, some during `COMMIT` |
//! | [`database_crash`] | PostgreSQL itself (`pg_ctl stop -m immediate`), started again under load |
//! | [`network`] | the network between service and database: latency, every connection cut, the answer to `COMMIT` dropped, connections left half-open |
//! | [`failover`] | the primary, SIGKILLed; its synchronous standby promoted and PgBouncer (the service's one address) pointed at it |
//! | [`instances`] | three instances on one database behind round-robin clients, each with its dispatcher: instances SIGKILLed, sessions ended |
//!
//! Each test prints what it did (kills, terminations, commands, attempts, retries), so a
//! reader can see that the faults happened. The defaults keep the suite to a couple of
//! minutes; `TOWER_INBOX_FAULTS_LONG=1` runs the long variants (more faults, longer loads).

#[path = "../common/mod.rs"]
mod common;

mod backends;
mod checker;
mod clients;
mod database_crash;
mod failover;
mod instances;
mod kill_loop;
mod network;
mod receiver;
mod service;

/// What every fault test starts with: the webhook receiver, the service on `database_url`
/// (started), four retrying clients sending commands whose keys start with `run`, and the
/// test's random choices.
pub async fn under_load(
    test: &str,
    database_url: &str,
    run: &str,
) -> (receiver::Receiver, service::Service, clients::Load, Rng) {
    let receiver = receiver::Receiver::start().await;
    let mut service = service::Service::new(test, database_url, receiver.url());
    service.start().await;
    let load = clients::Load::start(&service.url(""), run, 4);
    (receiver, service, load, Rng::from_clock(test))
}

/// How much of each fault a test runs: `short` by default, `long` with
/// `TOWER_INBOX_FAULTS_LONG=1`.
pub fn scaled(short: usize, long: usize) -> usize {
    if std::env::var("TOWER_INBOX_FAULTS_LONG").is_ok_and(|v| v == "1") {
        long
    } else {
        short
    }
}

/// A small pseudo-random generator (xorshift), seeded from the clock: the faults land at
/// different points on every run, and the seed is printed so a run's choices can be told.
pub struct Rng(u64);

impl Rng {
    pub fn from_clock(test: &str) -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        println!("{test}: seed {seed}");
        Self(seed)
    }

    /// A number in `low..high`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        low + self.0 % (high - low).max(1)
    }

    /// A duration between `low` and `high` milliseconds.
    pub fn millis(&mut self, low: u64, high: u64) -> std::time::Duration {
        std::time::Duration::from_millis(self.between(low, high))
    }
}
