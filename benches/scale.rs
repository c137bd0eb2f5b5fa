//! How the inbox layer scales: with a large inbox, under a purge, with many copies of one
//! command at once, and in the pooled connections it holds. Every figure is a ratio to a
//! baseline measured in the same run; nothing is timed in an assertion, but every response
//! is checked, and the one-key scenario asserts the protocol's outcome.
//! (Over 400 lines: the scenarios share the load, the figures and the database helpers.)
//!
//! ```sh
//! cargo bench --bench scale                          # every scenario but `partitions` (1M rows)
//! cargo bench --bench scale -- size hold             # some scenarios
//! SCALE_ROWS=100000 SCALE_ROUNDS=3 cargo bench --bench scale   # a quicker look
//! ```
//!
//! # Scenarios
//!
//! Chosen by the arguments after `--`, or by `SCALE_SCENARIOS` (comma-separated); all four
//! by default, in this order:
//!
//! - `size`: first-seen latency with an inbox of 0, `SCALE_ROWS`/10 and `SCALE_ROWS`
//!   processed rows (bulk-inserted with one `INSERT ... SELECT generate_series`, then `VACUUM
//!   ANALYZE`). Each size has its own schema (its own `consumer_inbox`; see Database), so
//!   that the sizes can be interleaved request by request, which cancels the machine's
//!   drift. Two probes per size: a credit through the layer (in-process, as
//!   `benches/layer.rs`), and the claim alone (`Inbox::claim`, that is the pool acquire and
//!   the one message that carries the `BEGIN` and the claim; its rollback is not timed, so
//!   the inbox keeps its size). Reports p50 and p99 and their ratios to the empty inbox, per
//!   round, and the inbox's buffer reads per request from `pg_statio_user_tables` (blocks
//!   PostgreSQL had to read, not find in shared buffers; a page added to the table counts
//!   too), every connection's counts reported before each snapshot.
//! - `purge`: first-seen credits at a steady `SCALE_PURGE_CONCURRENCY` requests in flight
//!   while `tower_inbox::retention::Purger` deletes `SCALE_PURGE_ROWS` expired rows, against
//!   the same load without a purge, for `SCALE_PURGE_BASE_SECS` before and after it. Each
//!   round refills the inbox. The purge must delete exactly the expired rows.
//! - `one-key`: `SCALE_ONE_KEY` (64) concurrent requests with one key and one body, against
//!   as many first-seen requests with distinct keys. Asserts that exactly one commits (one
//!   ledger row, the balance credited once) and that every other response is the replayed,
//!   byte-identical response or 409 `in-progress`.
//! - `hold`: how long a pooled connection is held per request, baseline against layered,
//!   one request at a time and with 32 in flight. The pool's `after_connect`,
//!   `before_acquire` and `after_release` hooks count the connections in use; the integral
//!   of that count over time divided by the requests is the mean hold per request
//!   (acquire to release, the release ping not included). This is what pool sizing needs
//!   (Little's law: connections busy = requests per second × hold per request).
//! - `partitions` (by name only; `benches/scale/partitions.rs`): the inbox purge at
//!   `SCALE_PARTITION_ROWS` rows, dropping partitions (`Layout::Partitioned`) against the
//!   batched delete, with first-seen latency during each purge and the table and index sizes.
//!
//! # Settings
//!
//! | variable | default | what |
//! |---|---|---|
//! | `SCALE_ROWS` | 1000000 | the largest inbox of `size` |
//! | `SCALE_ROUNDS` | 5 | rounds of `size` and `hold`, for the spread across rounds |
//! | `SCALE_SAMPLES` | 1000 | requests per size, probe and round (`size`) |
//! | `SCALE_PURGE_ROWS` | `SCALE_ROWS` | expired rows the purge deletes |
//! | `SCALE_PURGE_ROUNDS` | 3 | rounds of `purge` (each refills the inbox) |
//! | `SCALE_PURGE_CONCURRENCY` | 8 | requests in flight during `purge` |
//! | `SCALE_PURGE_BASE_SECS` | 10 | seconds of load without the purge, before and after it |
//! | `SCALE_PURGE_BATCH` | 200 | the purger's batch size (its default) |
//! | `SCALE_PURGE_PAUSE_MS` | 50 | the purger's pause between batches (its default) |
//! | `SCALE_PARTITION_ROWS` | 10000000 | inbox rows of `partitions` (each layout) |
//! | `SCALE_PARTITION_STEP_HOURS` | 24 | the partitioned layout's partition step in `partitions` |
//! | `SCALE_PARTITION_LAYOUTS` | `plain,partitioned` | the layouts `partitions` measures |
//! | `SCALE_ONE_KEY` | 64 | concurrent requests of `one-key` |
//! | `SCALE_ONE_KEY_TRIALS` | 20 | trials of `one-key` |
//! | `SCALE_HOLD_REQUESTS` | 2000 | requests per case, mode and round (`hold`) |
//!
//! # Database
//!
//! Found like the tests find theirs: `DATABASE_URL`, else the server on `127.0.0.1:5432`,
//! else a throwaway cluster; the database `tower_inbox_scale` is created when needed (apart
//! from the layer bench's, so the two never truncate each other's tables). When
//! `DATABASE_URL` names a database, the bench works in that one: **it drops and recreates
//! the schemas below in it.**
//!
//! Each scenario works in a schema of its own: `scale_rows_<n>` (one per size of `size`),
//! `scale_purge`, `scale_one_key` and `scale_hold`. It drops the schema with whatever an
//! earlier run left there, and `tower_inbox::schema::migrate_schema` creates it afresh with the
//! inbox tables; the layer (`InboxLayerBuilder::schema`), the claim probe
//! (`Inbox::with_schema`) and the purger (`PurgerBuilder::schema`) are given it as their
//! [`Schema`]. The scenario's pool has that schema alone as its `search_path`, so the
//! example's tables (`credit_account`, `credit_ledger`), which name no schema, are created
//! there and the handlers find them there: every scenario, and every size, has its own
//! inbox, accounts and ledger, and nothing is written to `tower_inbox` or `public`. The
//! bench's own statements (the bulk insert, `VACUUM`, `ANALYZE`, the buffer counts, the
//! one-key check) name the schema. The schemas stay after the run, to be looked into.

#[allow(dead_code)]
mod support;

use std::collections::BTreeSet;
use std::fmt;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Response, StatusCode};
use axum::Router;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::Barrier;
use tokio::task::JoinSet;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{Claim, Inbox};
use tower_inbox::middleware::ConfigError;
use tower_inbox::retention::{PurgeReport, PurgedTable, Purger, RetentionPolicy};
use tower_inbox::schema::Schema;
use tower_inbox::{MessageIdentity, MessageKey, Producer};

use support::{app, call, BoxError, Credit, PRODUCER};

/// The bench's database, apart from `benches/layer.rs`'s.
const DATABASE: &str = "tower_inbox_scale";
/// Requests in flight in the `hold` scenario's concurrent mode, as in `benches/layer.rs`.
const HOLD_CONCURRENCY: usize = 32;
/// The body of every credit the bench sends, and so the claim probe's fingerprint input.
const BODY: &[u8] = br#"{"delta":1}"#;
const DAY: Duration = Duration::from_secs(24 * 3600);

// Key streams: disjoint key spaces for each kind of request (see `Credit::new`).
const STREAM_SIZE_LAYER: u8 = 1;
const STREAM_SIZE_CLAIM: u8 = 2;
const STREAM_PURGE: u8 = 3;
const STREAM_ONE_KEY: u8 = 4;
const STREAM_ONE_KEY_BASE: u8 = 5;
const STREAM_HOLD_BASELINE: u8 = 6;
const STREAM_HOLD_LAYERED: u8 = 7;

/// The bench's settings, from the environment.
struct Config {
    scenarios: Vec<Scenario>,
    rows: u64,
    rounds: u32,
    samples: u64,
    purge_rows: u64,
    purge_rounds: u32,
    purge_concurrency: u32,
    purge_base: Duration,
    purge_batch: u32,
    purge_pause: Duration,
    one_key: u32,
    one_key_trials: u32,
    hold_requests: u64,
}

/// Reads `name` as a number of at least `min`, or `default` when unset. Underscores are
/// allowed as digit separators (`1_000_000`).
fn env_num<T>(name: &str, default: T, min: T) -> Result<T, String>
where
    T: FromStr + PartialOrd + fmt::Display + Copy,
{
    let Ok(text) = std::env::var(name) else {
        return Ok(default);
    };
    let value: T = text
        .replace('_', "")
        .parse()
        .map_err(|_| format!("{name}={text:?} is not a whole number"))?;
    if value < min {
        return Err(format!("{name}={text:?} must be at least {min}"));
    }
    Ok(value)
}

impl Config {
    fn from_env() -> Result<Self, String> {
        let rows = env_num("SCALE_ROWS", 1_000_000, 0)?;
        let purge_base: u64 = env_num("SCALE_PURGE_BASE_SECS", 10, 1)?;
        Ok(Self {
            scenarios: Scenario::chosen()?,
            rows,
            rounds: env_num("SCALE_ROUNDS", 5, 1)?,
            samples: env_num("SCALE_SAMPLES", 1000, 1)?,
            purge_rows: env_num("SCALE_PURGE_ROWS", rows, 1)?,
            purge_rounds: env_num("SCALE_PURGE_ROUNDS", 3, 1)?,
            purge_concurrency: env_num("SCALE_PURGE_CONCURRENCY", 8, 1)?,
            purge_base: Duration::from_secs(purge_base),
            purge_batch: env_num("SCALE_PURGE_BATCH", 200, 1)?,
            purge_pause: Duration::from_millis(env_num("SCALE_PURGE_PAUSE_MS", 50, 0)?),
            one_key: env_num("SCALE_ONE_KEY", 64, 2)?,
            one_key_trials: env_num("SCALE_ONE_KEY_TRIALS", 20, 1)?,
            hold_requests: env_num("SCALE_HOLD_REQUESTS", 2000, 1)?,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Scenario {
    Size,
    Purge,
    OneKey,
    Hold,
    Partitions,
}

impl Scenario {
    const ALL: [Self; 5] = [
        Self::Size,
        Self::Purge,
        Self::OneKey,
        Self::Hold,
        Self::Partitions,
    ];
    /// What a run without names runs: `partitions` loads 20 million rows, so it is run by
    /// name only.
    const DEFAULT: [Self; 4] = [Self::Size, Self::Purge, Self::OneKey, Self::Hold];

    fn name(self) -> &'static str {
        match self {
            Self::Size => "size",
            Self::Purge => "purge",
            Self::OneKey => "one-key",
            Self::Hold => "hold",
            Self::Partitions => "partitions",
        }
    }

    /// The scenarios named by the arguments (cargo's own `--bench` and other options are
    /// skipped), else by `SCALE_SCENARIOS`, else all of them; always in their fixed order.
    fn chosen() -> Result<Vec<Self>, String> {
        let mut names: Vec<String> = std::env::args()
            .skip(1)
            .filter(|arg| !arg.starts_with('-'))
            .collect();
        if names.is_empty() {
            if let Ok(list) = std::env::var("SCALE_SCENARIOS") {
                names = list
                    .split(',')
                    .map(str::trim)
                    .filter(|name| !name.is_empty())
                    .map(str::to_owned)
                    .collect();
            }
        }
        if names.is_empty() {
            return Ok(Self::DEFAULT.to_vec());
        }
        let mut chosen = BTreeSet::new();
        for name in &names {
            let scenario = Self::ALL
                .into_iter()
                .find(|s| s.name() == name)
                .ok_or_else(|| {
                    let known: Vec<_> = Self::ALL.iter().map(|s| s.name()).collect();
                    format!("unknown scenario {name:?}; known: {}", known.join(", "))
                })?;
            chosen.insert(scenario);
        }
        Ok(chosen.into_iter().collect())
    }
}

// ---------------------------------------------------------------------------------------
// Figures

/// The `q` quantile (nearest rank) of sorted samples.
fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// p50 and p99 of some latencies.
#[derive(Clone, Copy)]
struct Percentiles {
    p50: Duration,
    p99: Duration,
}

impl Percentiles {
    fn of(samples: &[Duration]) -> Self {
        let mut sorted = samples.to_vec();
        sorted.sort_unstable();
        Self {
            p50: quantile(&sorted, 0.50),
            p99: quantile(&sorted, 0.99),
        }
    }

    /// Both ratios to `base`: (p50, p99).
    fn over(self, base: Self) -> (f64, f64) {
        (
            self.p50.as_secs_f64() / base.p50.as_secs_f64(),
            self.p99.as_secs_f64() / base.p99.as_secs_f64(),
        )
    }
}

/// A ratio measured once per round: its median and range across rounds.
struct Spread {
    median: f64,
    low: f64,
    high: f64,
}

impl Spread {
    fn of(mut values: Vec<f64>) -> Self {
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = match n {
            0 => f64::NAN,
            _ if n % 2 == 1 => values[n / 2],
            _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
        };
        Self {
            median,
            low: values.first().copied().unwrap_or(f64::NAN),
            high: values.last().copied().unwrap_or(f64::NAN),
        }
    }
}

impl fmt::Display for Spread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = format!("{:.2} ({:.2}–{:.2})", self.median, self.low, self.high);
        f.pad(&text)
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

// ---------------------------------------------------------------------------------------
// Requests

/// What a request must be answered with: 201, replayed or not.
fn check(response: &Response<Body>, replayed: bool) -> Result<(), String> {
    let was_replayed = response.headers().contains_key("idempotent-replayed");
    if response.status() != StatusCode::CREATED || was_replayed != replayed {
        return Err(format!(
            "expected 201{}, got {}{}",
            if replayed { " replayed" } else { "" },
            response.status(),
            if was_replayed { " replayed" } else { "" },
        ));
    }
    Ok(())
}

/// One kind of credit request: the `n`th command of `stream`, to the layered route or the
/// baseline, first-seen or a replay of the same command sent before.
#[derive(Clone, Copy)]
struct Probe {
    stream: u8,
    baseline: bool,
    replayed: bool,
}

impl Probe {
    /// Sends the `n`th request and checks its answer; returns its latency.
    async fn send(self, router: &Router, n: u64) -> Result<Duration, String> {
        let request = Credit::new(self.stream, n, 1).request(self.baseline);
        let started = Instant::now();
        let response = call(router.clone(), request).await;
        let latency = started.elapsed();
        check(&response, self.replayed)?;
        Ok(latency)
    }
}

/// Hands out request numbers to closed-loop workers until a count is reached or it is
/// stopped.
struct Feed {
    next: AtomicU64,
    end: u64,
    stopped: AtomicBool,
}

impl Feed {
    fn new(start: u64, count: u64) -> Arc<Self> {
        Arc::new(Self {
            next: AtomicU64::new(start),
            end: start.saturating_add(count),
            stopped: AtomicBool::new(false),
        })
    }

    fn take(&self) -> Option<u64> {
        if self.stopped.load(Ordering::Relaxed) {
            return None;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        (n < self.end).then_some(n)
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
    }
}

/// `workers` closed loops sending `probe` requests (a new one as soon as the last is
/// answered) until `feed` runs dry; returns every latency.
async fn closed_loop(
    router: &Router,
    probe: Probe,
    workers: usize,
    feed: &Arc<Feed>,
) -> Result<Vec<Duration>, BoxError> {
    let mut tasks = JoinSet::new();
    for _ in 0..workers {
        let (router, feed) = (router.clone(), feed.clone());
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            while let Some(n) = feed.take() {
                latencies.push(probe.send(&router, n).await?);
            }
            Ok::<_, String>(latencies)
        });
    }
    let mut latencies = Vec::new();
    while let Some(done) = tasks.join_next().await {
        latencies.extend(done??);
    }
    Ok(latencies)
}

// ---------------------------------------------------------------------------------------
// Database

/// Where the bench's schemas live.
struct Database {
    options: PgConnectOptions,
}

impl Database {
    async fn open() -> Result<Self, BoxError> {
        Ok(Self {
            options: support::connect_options(DATABASE).await?,
        })
    }

    /// A fresh schema `name` for one scenario (or one size of `size`), and a pool with
    /// `options` whose `search_path` is that schema alone (see the module docs, Database).
    /// The schema is dropped first with whatever an earlier run left there (tables of an
    /// older layout would make the migrations fail), so every run starts from the empty
    /// tables and the opened accounts.
    async fn workspace(&self, name: &str, options: PgPoolOptions) -> Result<Workspace, BoxError> {
        self.workspace_of(Schema::new(name)?, options).await
    }

    /// [`workspace`](Self::workspace) for `schema`, of its layout.
    async fn workspace_of(
        &self,
        schema: Schema,
        options: PgPoolOptions,
    ) -> Result<Workspace, BoxError> {
        let name = schema.name().to_owned();
        let mut admin = PgConnection::connect_with(&self.options).await?;
        sqlx::raw_sql(&format!("drop schema if exists \"{name}\" cascade"))
            .execute(&mut admin)
            .await?;
        admin.close().await?;
        let pool = options
            .connect_with(
                self.options
                    .clone()
                    .options([("search_path", format!("\"{name}\""))]),
            )
            .await?;
        support::prepare(&pool, &schema, &format!("scale ({name})")).await?;
        support::reset_tables(&pool, &schema).await?;
        Ok(Workspace { schema, pool })
    }
}

/// One scenario's schema, and a pool whose `search_path` is that schema.
struct Workspace {
    schema: Schema,
    pool: PgPool,
}

impl Workspace {
    /// `name`, a table of this schema, qualified.
    fn table(&self, name: &str) -> String {
        support::table(&self.schema, name)
    }

    /// The example's routes behind its inbox layer, with the inbox in this schema.
    fn layered_router(&self) -> Result<Router, ConfigError> {
        let layer = app::inbox_layer(self.pool.clone())
            .schema(self.schema.clone())
            .build()?;
        Ok(app::routes(self.pool.clone(), layer))
    }
}

/// Adds `rows` processed rows to the inbox in one statement, each like a recorded credit
/// (random-looking keys, a JSON body of about 50 bytes), received `age` ago or a little
/// earlier (one row per millisecond, oldest first), then vacuums and analyzes it.
async fn fill_inbox(ws: &Workspace, rows: u64, age: Duration) -> Result<Duration, BoxError> {
    fill_rows(
        ws,
        rows,
        "now() - make_interval(secs => $4 + ($3 - g) / 1000.0)",
        age.as_secs_f64(),
    )
    .await
}

/// Adds `rows` processed rows as [`fill_inbox`] does, the `g`th of `$3` received at
/// `received` (an expression of `g`, `$3` and `$4`, bound to `param`); then vacuums and
/// analyzes the inbox. How long it took.
async fn fill_rows(
    ws: &Workspace,
    rows: u64,
    received: &str,
    param: f64,
) -> Result<Duration, BoxError> {
    let inbox = ws.table("consumer_inbox");
    let started = Instant::now();
    if rows > 0 {
        sqlx::query(&format!(
            "insert into {inbox}
                 (consumer_name, producer_name, tenant_id, message_id, payload_sha256,
                  handler_version, received_at, processed_at, response_status,
                  response_header_names, response_header_values, response_body)
             select $1, $2, '', 'fill-' || md5(g::text), md5(g::text) || md5(g::text), '',
                    t, t, 201, array['content-type'], array[convert_to('application/json', 'UTF8')],
                    convert_to(format('{{\"account_id\":\"acct-%s\",\"balance\":%s,\"delta\":1}}',
                                      g % 10000, g), 'UTF8')
             from generate_series(1, $3) g, lateral (select {received}) r(t)"
        ))
        .bind(app::CONSUMER)
        .bind(PRODUCER)
        .bind(i64::try_from(rows)?)
        .bind(param)
        .execute(&ws.pool)
        .await?;
    }
    // A statement of its own: VACUUM cannot run in the implicit transaction of several.
    sqlx::raw_sql(&format!("vacuum analyze {inbox}"))
        .execute(&ws.pool)
        .await?;
    Ok(started.elapsed())
}

/// The inbox's blocks read (not found in shared buffers) and found, heap and indexes
/// together, so far: every connection of the scenario's pool, which must be at rest, reports
/// its counts first (see [`flush_statistics`]).
async fn inbox_blocks(ws: &Workspace) -> Result<(i64, i64), sqlx::Error> {
    flush_statistics(&ws.pool).await?;
    sqlx::query_as(
        "select coalesce(heap_blks_read, 0) + coalesce(idx_blks_read, 0),
                coalesce(heap_blks_hit, 0) + coalesce(idx_blks_hit, 0)
         from pg_statio_user_tables
         where relname = 'consumer_inbox' and schemaname = $1",
    )
    .bind(ws.schema.name())
    .fetch_one(&ws.pool)
    .await
}

/// Makes every connection of `pool` (all idle) report its pending statistics now.
///
/// A PostgreSQL 15 backend reports its counts as it goes idle, but not twice within a
/// second: counts from within a second of its last report wait for its next transaction
/// after that second, or for 10 s of idleness. Without this, what a pooled connection did
/// just before a snapshot of `pg_statio_user_tables` would be counted after it: the bulk
/// fill's new pages (a page added to a table counts as read) landed in the measured
/// requests' blocks read.
async fn flush_statistics(pool: &PgPool) -> Result<(), sqlx::Error> {
    // Held together, so that each acquire takes another of the open connections.
    let mut connections = Vec::new();
    for _ in 0..pool.size() {
        connections.push(pool.acquire().await?);
    }
    for conn in &mut connections {
        // The backend reports before it answers ready for the next query.
        sqlx::query("select pg_stat_force_next_flush()")
            .execute(&mut **conn)
            .await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// size

/// One inbox size: its schema and pool, routes and claim probe.
struct SizedInbox {
    rows: u64,
    ws: Workspace,
    router: Router,
    inbox: Inbox,
    layered: Vec<Vec<Duration>>,
    claims: Vec<Vec<Duration>>,
}

impl SizedInbox {
    /// The claim alone of the `n`th key: acquire, `BEGIN`, the claim statement. The rollback
    /// that follows is not timed.
    async fn claim(&self, n: u64) -> Result<Duration, BoxError> {
        let key = Credit::new(STREAM_SIZE_CLAIM, n, 1).key;
        let identity = MessageIdentity::new(
            app::CONSUMER,
            Producer::new(PRODUCER)?,
            MessageKey::new(key)?,
        );
        let fingerprint = Fingerprint::of_bytes(BODY);
        let started = Instant::now();
        let claim = self
            .inbox
            .claim(identity, fingerprint, "", Duration::from_secs(2))
            .await?;
        let latency = started.elapsed();
        match claim {
            Claim::Claimed(message) => message.rollback().await?,
            _ => return Err("a new key's claim was not Claimed".into()),
        }
        Ok(latency)
    }
}

async fn size(config: &Config, db: &Database) -> Result<(), BoxError> {
    let mut sizes: Vec<u64> = vec![0, config.rows / 10, config.rows];
    sizes.dedup();
    let layered = Probe {
        stream: STREAM_SIZE_LAYER,
        baseline: false,
        replayed: false,
    };
    let mut inboxes = Vec::new();
    for &rows in &sizes {
        let ws = db
            .workspace(&format!("scale_rows_{rows}"), support::pool_options(4))
            .await?;
        let took = fill_inbox(&ws, rows, Duration::from_secs(3600)).await?;
        eprintln!("size: {rows} rows inserted and vacuumed in {took:.1?}");
        let router = ws.layered_router()?;
        inboxes.push(SizedInbox {
            rows,
            inbox: Inbox::new(ws.pool.clone()).with_schema(ws.schema.clone()),
            ws,
            router,
            layered: Vec::new(),
            claims: Vec::new(),
        });
    }
    // Unmeasured: connections, prepared statements, the first pages in memory.
    let warmup = 100;
    for s in &inboxes {
        for n in 0..warmup {
            layered.send(&s.router, n).await?;
            s.claim(n).await?;
        }
    }
    let mut blocks_before = Vec::new();
    for s in &inboxes {
        // What autovacuum does after 50 new rows (the server may have it off). Without it,
        // plans cached while the empty inbox was analyzed at 0 rows stay sequential scans as
        // it grows (a primary-key update that reads every row), and the empty inbox would
        // measure slower than the large ones; ANALYZE invalidates those plans.
        sqlx::raw_sql(&format!("analyze {}", s.ws.table("consumer_inbox")))
            .execute(&s.ws.pool)
            .await?;
    }
    for s in &inboxes {
        blocks_before.push(inbox_blocks(&s.ws).await?);
    }
    for round in 0..u64::from(config.rounds) {
        eprintln!("size: round {}/{}", round + 1, config.rounds);
        for s in &mut inboxes {
            s.layered.push(Vec::new());
            s.claims.push(Vec::new());
        }
        // Request by request across the sizes, starting with another size each round.
        for i in 0..config.samples {
            let n = warmup + round * config.samples + i;
            for k in 0..inboxes.len() {
                let s = &mut inboxes[(k + round as usize) % sizes.len()];
                let latency = layered.send(&s.router, n).await?;
                s.layered.last_mut().expect("pushed above").push(latency);
                let latency = s.claim(n).await?;
                s.claims.last_mut().expect("pushed above").push(latency);
            }
        }
    }

    println!("\n## size: first-seen latency by inbox size ({} rounds × {} requests per size and probe, interleaved)", config.rounds, config.samples);
    println!(
        "{:>9}  {:<7}  {:>8}  {:>8}  {:>22}  {:>22}  {:>14}",
        "rows", "probe", "p50 µs", "p99 µs", "p50 × empty", "p99 × empty", "blocks read/rq"
    );
    let empty = &inboxes[0];
    for (s, before) in inboxes.iter().zip(&blocks_before) {
        let after = inbox_blocks(&s.ws).await?;
        let requests = 2 * u64::from(config.rounds) * config.samples;
        let read_per_request = (after.0 - before.0) as f64 / requests as f64;
        for (probe, rounds, base) in [
            ("layer", &s.layered, &empty.layered),
            ("claim", &s.claims, &empty.claims),
        ] {
            let all: Vec<Duration> = rounds.iter().flatten().copied().collect();
            let pooled = Percentiles::of(&all);
            let (p50, p99): (Vec<f64>, Vec<f64>) = rounds
                .iter()
                .zip(base)
                .map(|(mine, base)| Percentiles::of(mine).over(Percentiles::of(base)))
                .unzip();
            println!(
                "{:>9}  {:<7}  {:>8.0}  {:>8.0}  {:>22}  {:>22}  {:>14.3}",
                s.rows,
                probe,
                us(pooled.p50),
                us(pooled.p99),
                Spread::of(p50),
                Spread::of(p99),
                read_per_request,
            );
        }
    }
    println!("(ratios: median over rounds of each round's percentile ÷ the empty inbox's in the same round, (min–max); blocks read: inbox heap and index blocks not found in shared buffers or added, per request of both probes)");
    for s in inboxes {
        s.ws.pool.close().await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// purge

async fn purge(config: &Config, db: &Database) -> Result<(), BoxError> {
    let workers = config.purge_concurrency as usize;
    // The purger shares the pool with the requests, as in examples/credits.rs.
    let ws = db
        .workspace(
            "scale_purge",
            support::pool_options(config.purge_concurrency + 2),
        )
        .await?;
    let router = ws.layered_router()?;
    let probe = Probe {
        stream: STREAM_PURGE,
        baseline: false,
        replayed: false,
    };
    // Rows a month old are past this window; the requests' own rows are not.
    let policy = RetentionPolicy::builder()
        .retry_horizon(DAY)
        .safety_margin(DAY)
        .build()?;
    let purger = Purger::builder(ws.pool.clone())
        .schema(ws.schema.clone())
        .inbox(policy)
        .batch_size(config.purge_batch)
        .pause_between_batches(config.purge_pause)
        .build()?;
    let mut load = Feeds::default();

    println!(
        "\n## purge: first-seen latency at {workers} in flight while {} expired rows are purged (batches of {}, {} ms apart)",
        config.purge_rows,
        config.purge_batch,
        config.purge_pause.as_millis()
    );
    println!(
        "{:>5}  {:>9}  {:>9}  {:>9}  {:>9}  {:>8}  {:>8}  {:>10}  {:>10}",
        "round",
        "purge s",
        "rows/s",
        "base p50",
        "base p99",
        "p50",
        "p99",
        "p50 × base",
        "p99 × base"
    );
    let (mut p50s, mut p99s) = (Vec::new(), Vec::new());
    for round in 1..=config.purge_rounds {
        support::reset_tables(&ws.pool, &ws.schema).await?;
        fill_inbox(&ws, config.purge_rows, 30 * DAY).await?;
        let (base, during, report, took) = load_around_purge(
            &router,
            probe,
            workers,
            &purger,
            config.purge_base,
            &mut load,
        )
        .await?;

        let deleted = report.rows(PurgedTable::ConsumerInbox);
        if deleted != config.purge_rows {
            return Err(format!(
                "the purge deleted {deleted} inbox rows, expected the {} expired ones",
                config.purge_rows
            )
            .into());
        }
        let base = Percentiles::of(&base);
        let during = Percentiles::of(&during);
        let (p50, p99) = during.over(base);
        println!(
            "{:>5}  {:>9.1}  {:>9.0}  {:>9.0}  {:>9.0}  {:>8.0}  {:>8.0}  {:>10.2}  {:>10.2}",
            round,
            took.as_secs_f64(),
            deleted as f64 / took.as_secs_f64(),
            us(base.p50),
            us(base.p99),
            us(during.p50),
            us(during.p99),
            p50,
            p99,
        );
        p50s.push(p50);
        p99s.push(p99);
    }
    println!(
        "purge ÷ no purge: p50 {}, p99 {} (median over rounds (min–max); latencies in µs; the baseline is the same load for {:?} before and after the purge)",
        Spread::of(p50s),
        Spread::of(p99s),
        config.purge_base
    );
    ws.pool.close().await;
    Ok(())
}

/// The keys of a scenario's successive loads: each feed starts where the last one ended.
#[derive(Default)]
struct Feeds {
    next: u64,
}

impl Feeds {
    fn next(&mut self, count: u64) -> Arc<Feed> {
        let feed = Feed::new(self.next, count);
        self.next += count;
        feed
    }
}

/// An unmeasured warm-up, then the load alone for `base`, the load while `purger` purges,
/// and the load alone for `base` again: the latencies without the purge and during it, the
/// purge's report and how long it took.
async fn load_around_purge(
    router: &Router,
    probe: Probe,
    workers: usize,
    purger: &Purger,
    base: Duration,
    feeds: &mut Feeds,
) -> Result<(Vec<Duration>, Vec<Duration>, PurgeReport, Duration), BoxError> {
    closed_loop(router, probe, workers, &feeds.next(200)).await?;
    let timed = |feed: Arc<Feed>| {
        let router = router.clone();
        async move {
            let stopper = feed.clone();
            let timer = tokio::spawn(async move {
                tokio::time::sleep(base).await;
                stopper.stop();
            });
            let latencies = closed_loop(&router, probe, workers, &feed).await;
            timer.abort();
            latencies
        }
    };
    let mut without = timed(feeds.next(u64::MAX / 4)).await?;
    let feed = feeds.next(u64::MAX / 4);
    let stopper = feed.clone();
    let purging = purger.clone();
    let started = Instant::now();
    let purge = tokio::spawn(async move {
        let report = purging.purge().await;
        let took = started.elapsed();
        stopper.stop();
        report.map(|r| (r, took))
    });
    let during = closed_loop(router, probe, workers, &feed).await?;
    let (report, took) = purge.await??;
    without.extend(timed(feeds.next(u64::MAX / 4)).await?);
    Ok((without, during, report, took))
}

// ---------------------------------------------------------------------------------------
// partitions

#[path = "scale/partitions.rs"]
mod partitions;

// ---------------------------------------------------------------------------------------
// one-key

/// How the copies of one command were answered.
#[derive(Default)]
struct OneKeyOutcome {
    replayed: u32,
    in_progress: u32,
}

/// Sends `copies` copies of one command at once (to account `account`, new) and checks the
/// protocol: one commit, every other answer the replayed response or 409 in-progress.
async fn one_key_trial(
    router: &Router,
    ws: &Workspace,
    copies: u32,
    n: u64,
) -> Result<(Duration, OneKeyOutcome), BoxError> {
    let credit = Credit {
        account: support::ACCOUNTS + n,
        ..Credit::new(STREAM_ONE_KEY, n, 1)
    };
    let barrier = Arc::new(Barrier::new(copies as usize));
    let mut tasks = JoinSet::new();
    let started = Instant::now();
    for _ in 0..copies {
        let (router, barrier) = (router.clone(), barrier.clone());
        let request = credit.request(false);
        tasks.spawn(async move {
            barrier.wait().await;
            let response = call(router, request).await;
            let (parts, body) = response.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX).await;
            (parts, body)
        });
    }
    let mut answers = Vec::new();
    while let Some(answer) = tasks.join_next().await {
        let (parts, body) = answer?;
        answers.push((parts, body?));
    }
    let took = started.elapsed();

    let replayed =
        |parts: &axum::http::response::Parts| parts.headers.contains_key("idempotent-replayed");
    let originals: Vec<_> = answers
        .iter()
        .filter(|(parts, _)| parts.status == StatusCode::CREATED && !replayed(parts))
        .collect();
    let [(_, original)] = originals.as_slice() else {
        return Err(format!(
            "one key: {} of {copies} copies were answered as first-seen, expected exactly one",
            originals.len()
        )
        .into());
    };
    let mut outcome = OneKeyOutcome::default();
    for (parts, body) in &answers {
        if parts.status == StatusCode::CREATED && replayed(parts) && body == original {
            outcome.replayed += 1;
        } else if parts.status == StatusCode::CONFLICT
            && String::from_utf8_lossy(body).contains("in-progress")
        {
            outcome.in_progress += 1;
        } else if replayed(parts) || parts.status != StatusCode::CREATED {
            return Err(format!(
                "one key: a copy got {} {}, neither the replayed response nor in-progress",
                parts.status,
                String::from_utf8_lossy(body)
            )
            .into());
        }
    }
    let (ledger, balance): (i64, Option<i64>) = sqlx::query_as(&format!(
        "select (select count(*) from {} where message_id = $1),
                (select balance from {} where account_id = $2)",
        ws.table("credit_ledger"),
        ws.table("credit_account"),
    ))
    .bind(&credit.key)
    .bind(format!("acct-{}", credit.account))
    .fetch_one(&ws.pool)
    .await?;
    if ledger != 1 || balance != Some(1) {
        return Err(format!(
            "one key: {ledger} ledger rows and balance {balance:?}, expected 1 and Some(1)"
        )
        .into());
    }
    Ok((took, outcome))
}

/// Sends `copies` first-seen commands with distinct keys at once: the baseline for one key.
async fn distinct_keys_trial(router: &Router, copies: u32, n: u64) -> Result<Duration, BoxError> {
    let probe = Probe {
        stream: STREAM_ONE_KEY_BASE,
        baseline: false,
        replayed: false,
    };
    let barrier = Arc::new(Barrier::new(copies as usize));
    let mut tasks = JoinSet::new();
    let started = Instant::now();
    for i in 0..u64::from(copies) {
        let (router, barrier) = (router.clone(), barrier.clone());
        tasks.spawn(async move {
            barrier.wait().await;
            probe.send(&router, n * 1_000_000 + i).await
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(started.elapsed())
}

async fn one_key(config: &Config, db: &Database) -> Result<(), BoxError> {
    let copies = config.one_key;
    // One connection per copy: a duplicate waiting for the original holds one.
    let ws = db
        .workspace("scale_one_key", support::pool_options(copies + 2))
        .await?;
    let router = ws.layered_router()?;
    let (mut same, mut distinct, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut outcome = OneKeyOutcome::default();
    // Trial 0 warms the pool up and is not counted.
    for trial in 0..=u64::from(config.one_key_trials) {
        let base = distinct_keys_trial(&router, copies, trial).await?;
        let (took, answers) = one_key_trial(&router, &ws, copies, trial).await?;
        if trial > 0 {
            same.push(took);
            distinct.push(base);
            ratios.push(took.as_secs_f64() / base.as_secs_f64());
            outcome.replayed += answers.replayed;
            outcome.in_progress += answers.in_progress;
        }
    }
    let median = |mut v: Vec<Duration>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    println!(
        "\n## one-key: {copies} concurrent requests, one key and one body ({} trials)",
        config.one_key_trials
    );
    println!(
        "every trial: exactly one commit (one ledger row, balance credited once); the others: {} replayed identical responses, {} 409 in-progress",
        outcome.replayed, outcome.in_progress
    );
    println!(
        "time for all {copies}: median {:.1} ms (one key) vs {:.1} ms ({copies} distinct keys); one key ÷ distinct keys {}",
        median(same).as_secs_f64() * 1e3,
        median(distinct).as_secs_f64() * 1e3,
        Spread::of(ratios)
    );
    ws.pool.close().await;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// hold

/// The pool's connections in use, integrated over time, from its hooks.
#[derive(Default)]
struct HoldMeter(Mutex<Hold>);

#[derive(Default)]
struct Hold {
    in_use: i64,
    since: Option<Instant>,
    /// Connection-seconds in use since the last reset.
    area: f64,
    acquires: u64,
}

impl HoldMeter {
    fn lock(&self) -> std::sync::MutexGuard<'_, Hold> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One more (`by` = 1) or one fewer (-1) connection in use from now on.
    fn change(&self, by: i64) {
        let now = Instant::now();
        let mut hold = self.lock();
        if let Some(since) = hold.since {
            hold.area += hold.in_use as f64 * (now - since).as_secs_f64();
        }
        hold.since = Some(now);
        hold.in_use += by;
        if by > 0 {
            hold.acquires += 1;
        }
    }

    /// Starts a measurement; every connection must be idle.
    fn reset(&self) {
        *self.lock() = Hold {
            since: Some(Instant::now()),
            ..Hold::default()
        };
    }

    /// Connection-seconds in use and acquisitions since the reset, and connections in use.
    fn read(&self) -> (f64, u64, i64) {
        self.change(0);
        let hold = self.lock();
        (hold.area, hold.acquires, hold.in_use)
    }
}

/// A pool whose hooks keep `meter`. A connection is counted as taken when it is opened for
/// an acquire (`after_connect`: without `min_connections`, the pool opens connections only
/// for acquires) or taken from the idle ones (`before_acquire`), and as given back when it is
/// released (`after_release`, before the pool's release ping).
fn metered_pool_options(size: u32, meter: &Arc<HoldMeter>) -> PgPoolOptions {
    let (connected, acquired, released) = (meter.clone(), meter.clone(), meter.clone());
    support::pool_options(size)
        .after_connect(move |_, _| {
            connected.change(1);
            Box::pin(std::future::ready(Ok(())))
        })
        .before_acquire(move |_, _| {
            acquired.change(1);
            Box::pin(std::future::ready(Ok(true)))
        })
        .after_release(move |_, _| {
            released.change(-1);
            Box::pin(std::future::ready(Ok(true)))
        })
}

/// What one hold measurement found.
struct HoldFigures {
    elapsed: Duration,
    /// Mean connection time held per request.
    hold: Duration,
    acquires: f64,
}

/// Waits until every connection is back in the pool: they go back in a task of their own,
/// after the release hook and the release ping.
async fn settle(pool: &PgPool) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while pool.num_idle() < pool.size() as usize {
        if Instant::now() > deadline {
            return Err("hold: connections still in use 5 s after the last response".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

async fn measure_hold(
    router: &Router,
    pool: &PgPool,
    meter: &HoldMeter,
    probe: Probe,
    workers: usize,
    start: u64,
    count: u64,
) -> Result<HoldFigures, BoxError> {
    settle(pool).await?;
    meter.reset();
    let started = Instant::now();
    closed_loop(router, probe, workers, &Feed::new(start, count)).await?;
    let elapsed = started.elapsed();
    settle(pool).await?;
    let (area, acquires, in_use) = meter.read();
    if in_use != 0 {
        return Err(
            format!("hold: the pool hooks counted {in_use} connections in use at rest").into(),
        );
    }
    Ok(HoldFigures {
        elapsed,
        hold: Duration::from_secs_f64(area / count as f64),
        acquires: acquires as f64 / count as f64,
    })
}

async fn hold(config: &Config, db: &Database) -> Result<(), BoxError> {
    let meter = Arc::new(HoldMeter::default());
    let size = HOLD_CONCURRENCY as u32 + 8;
    let ws = db
        .workspace("scale_hold", metered_pool_options(size, &meter))
        .await?;
    let layered_router = ws.layered_router()?;
    let baseline_router = app::baseline_routes(ws.pool.clone());
    let cases = [
        (
            "baseline",
            &baseline_router,
            Probe {
                stream: STREAM_HOLD_BASELINE,
                baseline: true,
                replayed: false,
            },
        ),
        (
            "first_seen",
            &layered_router,
            Probe {
                stream: STREAM_HOLD_LAYERED,
                baseline: false,
                replayed: false,
            },
        ),
        // The first-seen commands of the same round sent again.
        (
            "duplicate",
            &layered_router,
            Probe {
                stream: STREAM_HOLD_LAYERED,
                baseline: false,
                replayed: true,
            },
        ),
    ];
    let modes = [("latency", 1), ("concurrent32", HOLD_CONCURRENCY)];
    let count = config.hold_requests;
    // Open every connection before measuring.
    for (_, router, probe) in &cases[..2] {
        closed_loop(
            router,
            *probe,
            HOLD_CONCURRENCY,
            &Feed::new(u64::MAX / 2, 200),
        )
        .await?;
    }
    // figures[mode][case][round]
    let mut figures: Vec<Vec<Vec<HoldFigures>>> = modes
        .iter()
        .map(|_| cases.iter().map(|_| Vec::new()).collect())
        .collect();
    for round in 0..u64::from(config.rounds) {
        eprintln!("hold: round {}/{}", round + 1, config.rounds);
        for (m, &(_, workers)) in modes.iter().enumerate() {
            let start = (round * 2 + m as u64) * count;
            for (c, (_, router, probe)) in cases.iter().enumerate() {
                let f =
                    measure_hold(router, &ws.pool, &meter, *probe, workers, start, count).await?;
                figures[m][c].push(f);
            }
        }
    }

    println!("\n## hold: pooled connection time per request ({} rounds × {count} requests per case and mode)", config.rounds);
    println!(
        "{:<13}  {:<10}  {:>8}  {:>9}  {:>9}  {:>9}  {:>8}  {:>20}",
        "mode", "case", "req/s", "hold µs", "latency µs", "hold/lat", "acq/rq", "hold × baseline"
    );
    for (m, &(mode, workers)) in modes.iter().enumerate() {
        for (c, (case, _, _)) in cases.iter().enumerate() {
            let rounds = &figures[m][c];
            let total: Duration = rounds.iter().map(|f| f.elapsed).sum();
            let requests = count * rounds.len() as u64;
            let rate = requests as f64 / total.as_secs_f64();
            let hold =
                rounds.iter().map(|f| f.hold.as_secs_f64()).sum::<f64>() / rounds.len() as f64;
            // Mean latency by Little's law: requests in flight ÷ requests per second.
            let latency = workers as f64 / rate;
            let acquires = rounds.iter().map(|f| f.acquires).sum::<f64>() / rounds.len() as f64;
            let ratio = Spread::of(
                rounds
                    .iter()
                    .zip(&figures[m][0])
                    .map(|(f, base)| f.hold.as_secs_f64() / base.hold.as_secs_f64())
                    .collect(),
            );
            println!(
                "{:<13}  {:<10}  {:>8.0}  {:>9.0}  {:>9.0}  {:>9.2}  {:>8.2}  {:>20}",
                mode,
                case,
                rate,
                hold * 1e6,
                latency * 1e6,
                hold / latency,
                acquires,
                ratio,
            );
        }
    }
    println!("(hold: mean acquire-to-release time per request, from the pool hooks; connections busy on average = req/s × hold; ratio: median over rounds of hold ÷ the baseline's in the same round, (min–max))");
    ws.pool.close().await;
    Ok(())
}

// ---------------------------------------------------------------------------------------

async fn run(config: Config) -> Result<(), BoxError> {
    let db = Database::open().await?;
    for scenario in &config.scenarios {
        eprintln!("scale: {}", scenario.name());
        match scenario {
            Scenario::Size => size(&config, &db).await,
            Scenario::Purge => purge(&config, &db).await,
            Scenario::OneKey => one_key(&config, &db).await,
            Scenario::Hold => hold(&config, &db).await,
            Scenario::Partitions => partitions::run(&config, &db).await,
        }
        .map_err(|e| format!("{}: {e}", scenario.name()))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("scale bench: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("scale bench: cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scale bench: {e}");
            ExitCode::FAILURE
        }
    }
}
