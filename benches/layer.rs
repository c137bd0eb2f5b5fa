//! What the inbox layer costs: the credits example's `POST /accounts/{id}/credits` through
//! the layer against the same credit without it, in-process (no sockets, through
//! `tower::ServiceExt::oneshot` on the axum `Router`) against a real PostgreSQL.
//!
//! ```sh
//! cargo bench --bench layer                      # both groups, criterion's default timing
//! cargo bench --bench layer -- latency/          # one group
//! cargo bench --bench layer -- --warm-up-time 1 --measurement-time 3   # a quick look
//! ```
//!
//! # Cases
//!
//! In this order in each group, so that the baseline is read first:
//!
//! - `baseline`: `POST /baseline/accounts/{id}/credits`, the credit (account upsert, ledger
//!   insert) in a transaction of its own, without the layer.
//! - `first_seen`: a new key through the layer: the claim, the same credit, the recorded
//!   response and the commit, in one transaction.
//! - `first_seen_at_commit`: a new key with `ClaimMode::AtCommit`: the credit first, then the
//!   claim and the record in one statement, then the commit.
//! - `duplicate`: a replay of a key committed at the start of the group: the recorded
//!   response comes back and nothing is written (the claim finds the row and rolls back).
//! - `duplicate_lookup`: the same with `lookup_before_claim(true)`: one primary-key read, no
//!   transaction.
//! - `duplicate_cached`: the same with a `ReplayCache`: answered from memory once warmed up
//!   (the warm-up fills it from the database).
//! - `conflict`: a committed key sent again with another payload (another delta), answered
//!   409. Not read-only: every conflict also opens, or counts once more, a quarantine item
//!   (one per key and conflicting payload) in a transaction of its own, so it pays a commit.
//!
//! # Groups
//!
//! - `latency/<case>`: one request at a time; the time is one request's latency.
//! - `concurrent32/<case>`: each iteration fires 32 requests at once on the multi-thread
//!   runtime and waits for all of them. The time is the batch's; the throughput
//!   (elements per second) is requests per second.
//!
//! Each group starts from empty tables (the example's and the inbox's), 10 000 accounts at
//! balance 0 and 1 024 committed keys for `duplicate` and `conflict`. Keys look random, like
//! the UUIDs clients send, and choose their account, so concurrent credits rarely wait on one
//! account's row lock. The pool has 40 connections (32 requests in flight, one connection
//! each) and, as the example's, no ping before each acquire. Every response's status is checked, so that an error answered quickly cannot pass
//! for a fast request; nothing is timed in an assertion. No metrics recorder and no tracing
//! subscriber are installed, so their cost is not part of these figures.
//!
//! After the run, the bench prints every case's time as a ratio to the baseline of the same
//! group and the same run (read from criterion's `estimates.json` files).
//!
//! # Database
//!
//! Found like the tests find theirs: `DATABASE_URL`, else the server on `127.0.0.1:5432`,
//! else a throwaway cluster from the local binaries; the database `tower_inbox_bench` is
//! created when needed. When `DATABASE_URL` names a database, that database is used as it is:
//! **the bench truncates the credits and inbox tables in it.**

// The example's router and what the benches share; this one uses only part of it.
#[allow(dead_code)]
mod support;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Body;
use axum::http::{Response, StatusCode};
use axum::Router;
use criterion::{Criterion, SamplingMode, Throughput};
use sqlx::PgPool;
use tokio::runtime::Runtime;
use tokio::task::JoinSet;
use tower_inbox::inbox::ClaimMode;
use tower_inbox::middleware::ReplayCache;
use tower_inbox::schema::Schema;
use tower_inbox::InboxLayerBuilder;

use support::{app, call, BoxError, Credit};

/// Keys committed at the start of each group, replayed by `duplicate` and `conflict`.
const COMMITTED_KEYS: u64 = 1_024;
/// Requests in flight at once in the `concurrent32` group.
const CONCURRENCY: u64 = 32;
/// Room for every request in flight, with some to spare.
const POOL_SIZE: u32 = 40;
/// The groups, in the order they run.
const GROUPS: [&str; 2] = ["latency", "concurrent32"];

/// What one benchmark sends.
#[derive(Clone, Copy, Debug)]
enum Case {
    Baseline,
    FirstSeen,
    FirstSeenAtCommit,
    Duplicate,
    DuplicateLookup,
    DuplicateCached,
    Conflict,
}

impl Case {
    /// Every case, the baseline first.
    const ALL: [Self; 7] = [
        Self::Baseline,
        Self::FirstSeen,
        Self::FirstSeenAtCommit,
        Self::Duplicate,
        Self::DuplicateLookup,
        Self::DuplicateCached,
        Self::Conflict,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::FirstSeen => "first_seen",
            Self::FirstSeenAtCommit => "first_seen_at_commit",
            Self::Duplicate => "duplicate",
            Self::DuplicateLookup => "duplicate_lookup",
            Self::DuplicateCached => "duplicate_cached",
            Self::Conflict => "conflict",
        }
    }

    /// The `n`th request of this case: a new key each time for the baseline and first-seen
    /// commands, one of the committed keys for the others.
    fn credit(self, n: u64) -> Credit {
        match self {
            Self::Baseline => Credit::new(KeyStream::Baseline as u8, n, 1),
            Self::FirstSeen => Credit::new(KeyStream::FirstSeen as u8, n, 1),
            Self::FirstSeenAtCommit => Credit::new(KeyStream::FirstSeenAtCommit as u8, n, 1),
            // Exactly what was committed: same key, same account, same body.
            Self::Duplicate | Self::DuplicateLookup | Self::DuplicateCached => {
                Credit::new(KeyStream::Committed as u8, n % COMMITTED_KEYS, 1)
            }
            // The same key with another delta: another fingerprint.
            Self::Conflict => Credit::new(KeyStream::Committed as u8, n % COMMITTED_KEYS, 2),
        }
    }

    /// Panics unless `response` is what this case must answer.
    fn check(self, response: &Response<Body>) {
        let replayed = response.headers().contains_key("idempotent-replayed");
        let (status, want_replayed) = match self {
            Self::Baseline | Self::FirstSeen | Self::FirstSeenAtCommit => {
                (StatusCode::CREATED, false)
            }
            Self::Duplicate | Self::DuplicateLookup | Self::DuplicateCached => {
                (StatusCode::CREATED, true)
            }
            Self::Conflict => (StatusCode::CONFLICT, false),
        };
        assert_eq!(response.status(), status, "{self:?}: unexpected status");
        assert_eq!(replayed, want_replayed, "{self:?}: Idempotent-Replayed");
    }
}

/// Disjoint key spaces, so that no two streams ever share a key.
#[derive(Clone, Copy)]
enum KeyStream {
    Baseline = 1,
    FirstSeen = 2,
    Committed = 3,
    FirstSeenAtCommit = 4,
}

/// The runtime, the pool and the two routers every benchmark uses.
struct Bench {
    runtime: Runtime,
    pool: PgPool,
    baseline: Router,
    layered: Router,
    at_commit: Router,
    lookup: Router,
    cached: Router,
}

impl Bench {
    fn new() -> Result<Self, BoxError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let routers = runtime.block_on(async {
            let options = support::connect_options("tower_inbox_bench").await?;
            let pool = support::pool_options(POOL_SIZE)
                .connect_with(options)
                .await?;
            // The layer's default schema, `tower_inbox`; the example's tables on the default
            // `search_path` (`public`).
            support::prepare(&pool, &Schema::default(), "layer").await?;
            let routes = |configure: fn(InboxLayerBuilder) -> InboxLayerBuilder| {
                let layer = configure(app::inbox_layer(pool.clone())).build()?;
                Ok::<_, BoxError>(app::routes(pool.clone(), layer))
            };
            let layered = routes(|b| b)?;
            let at_commit = routes(|b| b.claim_mode(ClaimMode::AtCommit))?;
            let lookup = routes(|b| b.lookup_before_claim(true))?;
            let cached = routes(|b| {
                b.replay_cache(ReplayCache::new(100_000, 64 << 20).expect("cache limits"))
            })?;
            let baseline = app::baseline_routes(pool.clone());
            Ok::<_, BoxError>((pool, baseline, layered, at_commit, lookup, cached))
        })?;
        let (pool, baseline, layered, at_commit, lookup, cached) = routers;
        Ok(Self {
            runtime,
            pool,
            baseline,
            layered,
            at_commit,
            lookup,
            cached,
        })
    }

    fn router(&self, case: Case) -> &Router {
        match case {
            Case::Baseline => &self.baseline,
            Case::FirstSeen | Case::Duplicate | Case::Conflict => &self.layered,
            Case::FirstSeenAtCommit => &self.at_commit,
            Case::DuplicateLookup => &self.lookup,
            Case::DuplicateCached => &self.cached,
        }
    }

    /// Empties the tables, opens the accounts and commits the keys that `duplicate` and
    /// `conflict` send again, so that every group starts from the same state.
    fn reset(&self) {
        self.runtime.block_on(async {
            support::reset_tables(&self.pool, &Schema::default())
                .await
                .expect("reset the tables");
            for start in (0..COMMITTED_KEYS).step_by(CONCURRENCY as usize) {
                let mut commits = JoinSet::new();
                for n in start..(start + CONCURRENCY).min(COMMITTED_KEYS) {
                    let router = self.layered.clone();
                    commits.spawn(async move {
                        let response = call(router, Case::Duplicate.credit(n).request(false)).await;
                        // Its first sending is a first-seen command.
                        Case::FirstSeen.check(&response);
                    });
                }
                commits.join_all().await;
            }
        });
    }
}

/// Sends the `n`th request of `case` and checks the answer.
async fn send(router: Router, case: Case, n: u64) {
    let baseline = matches!(case, Case::Baseline);
    let response = call(router, case.credit(n).request(baseline)).await;
    case.check(&response);
}

/// Sends the next `CONCURRENCY` requests of `case` at once and waits for all of them.
async fn batch(router: &Router, case: Case, counter: &AtomicU64) {
    let mut requests = JoinSet::new();
    for _ in 0..CONCURRENCY {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        requests.spawn(send(router.clone(), case, n));
    }
    requests.join_all().await;
}

fn latency(c: &mut Criterion, bench: &Bench) {
    bench.reset();
    let mut group = c.benchmark_group("latency");
    group.throughput(Throughput::Elements(1));
    for case in Case::ALL {
        let router = bench.router(case);
        // Outside the closure: criterion calls it once per sample, and keys must not repeat.
        let counter = AtomicU64::new(0);
        group.bench_function(case.name(), |b| {
            b.to_async(&bench.runtime).iter(|| {
                send(
                    router.clone(),
                    case,
                    counter.fetch_add(1, Ordering::Relaxed),
                )
            });
        });
    }
    group.finish();
}

fn concurrent(c: &mut Criterion, bench: &Bench) {
    bench.reset();
    let mut group = c.benchmark_group("concurrent32");
    group.throughput(Throughput::Elements(CONCURRENCY));
    // An iteration takes milliseconds: sample a fixed number of batches each time.
    group.sampling_mode(SamplingMode::Flat);
    for case in Case::ALL {
        let router = bench.router(case);
        let counter = AtomicU64::new(0);
        group.bench_function(case.name(), |b| {
            b.to_async(&bench.runtime).iter_custom(|iters| {
                let counter = &counter;
                async move {
                    let mut busy = Duration::ZERO;
                    for _ in 0..iters {
                        let started = Instant::now();
                        batch(router, case, counter).await;
                        busy += started.elapsed();
                    }
                    busy
                }
            });
        });
    }
    group.finish();
}

/// Prints each case's time over the baseline's, from the estimates criterion saved in this
/// run (older files, from benchmarks this run filtered out, are ignored).
fn print_ratios(run_started: SystemTime) {
    let dir = match std::env::var_os("CRITERION_HOME") {
        Some(home) => PathBuf::from(home),
        // `target/tmp` for benches; criterion writes to `target/criterion`.
        None => PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("../criterion"),
    };
    let estimate = |group: &str, case: Case| -> Option<f64> {
        let file = dir.join(group).join(case.name()).join("new/estimates.json");
        if std::fs::metadata(&file).ok()?.modified().ok()? < run_started {
            return None;
        }
        let estimates: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&file).ok()?).ok()?;
        // The figure criterion prints: the slope when it sampled linearly, else the mean.
        ["slope", "mean"]
            .into_iter()
            .find_map(|kind| estimates[kind]["point_estimate"].as_f64())
    };
    for group in GROUPS {
        let Some(baseline) = estimate(group, Case::Baseline) else {
            if Case::ALL
                .iter()
                .any(|&case| estimate(group, case).is_some())
            {
                println!("\n{group}: no ratios, its baseline did not run in this run");
            }
            continue;
        };
        println!("\n{group}, against the baseline of this run:");
        println!(
            "  {:<11} {:>12}  {:>15}  {:>15}",
            "case", "time", "× baseline time", "× throughput"
        );
        for case in Case::ALL {
            if let Some(time) = estimate(group, case) {
                println!(
                    "  {:<11} {:>9.1} µs  {:>15.2}  {:>15.2}",
                    case.name(),
                    time / 1e3,
                    time / baseline,
                    baseline / time
                );
            }
        }
    }
}

fn main() {
    let run_started = SystemTime::now();
    let mut c = Criterion::default().configure_from_args();
    let bench = Bench::new().expect("bench setup: a PostgreSQL server and the credits schema");
    latency(&mut c, &bench);
    concurrent(&mut c, &bench);
    c.final_summary();
    print_ratios(run_started);
}
