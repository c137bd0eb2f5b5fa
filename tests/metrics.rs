//! Contract tests for the metrics: every protocol path moves exactly the series it should,
//! and every other series stays where it was.
//! (Over 400 lines: one contract test per protocol path over one shared recorder.)
//!
//! One global `DebuggingRecorder` serves the whole binary: the layer, the dispatcher and the
//! failure recording run on whatever thread the runtime picks, which a thread-local recorder
//! would not follow. Its snapshots drain what they read (counters are swapped to zero,
//! histograms emptied), so every snapshot goes through one [`Ledger`] that adds what it drained
//! to running totals: two tests reading at once never take each other's counts.
//!
//! Tests run in parallel, so each gives its layer (or its effects) a name of its own and
//! compares only the series that carry that name ([`Probe::consumer`], [`Probe::effect`]).
//! Series with neither a consumer nor an effect label (quarantine moves and recoveries, and
//! everything under `MetricLabels::none()`) are shared: only tests holding [`serial`] move or
//! assert them ([`Probe::shared`]).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::{post, MethodRouter};
use axum::Router;
use common::{credit, credit_raw, receiver, send, unreachable_pool, TestApp};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind as RecordedKind;
use sqlx::PgPool;
use tokio::sync::{MutexGuard, Notify};
use tower_inbox::inbox::TransientRetry;
use tower_inbox::metrics::{self as m, MetricKind, MetricLabels, StatsTask, METRICS};
use tower_inbox::outbox::{
    enqueue, Delivery, Dispatcher, Effect, EffectId, HttpTransport, OutboxMessage, Transport,
};
use tower_inbox::producer::TrustedHeader;
use tower_inbox::quarantine::{Quarantine, QuarantineFilter, QuarantineSource};
use tower_inbox::{InboxLayer, InboxLayerBuilder, InboxTx, MessageIdentity, MessageKey, Producer};

// ---------------------------------------------------------------------------------------------
// The recorder, the ledger and the probes.

/// One time series: a name and its labels, sorted.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Series {
    name: String,
    labels: BTreeMap<String, String>,
}

impl Series {
    fn new<'a>(name: &str, labels: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self {
            name: name.to_owned(),
            labels: labels
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        }
    }

    fn of(key: &metrics::Key) -> Self {
        Self::new(key.name(), key.labels().map(|l| (l.key(), l.value())))
    }

    fn label(&self, key: &str) -> Option<&str> {
        self.labels.get(key).map(String::as_str)
    }
}

impl fmt::Display for Series {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let labels: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        write!(f, "{}{{{}}}", self.name, labels.join(","))
    }
}

/// What the recorder saw of one series: counter increments, or histogram observations.
#[derive(Debug, Clone, Copy)]
struct Tally {
    kind: RecordedKind,
    total: u64,
}

/// Running totals over the draining snapshots of the global recorder.
struct Ledger {
    snapshotter: Snapshotter,
    state: Mutex<LedgerState>,
}

#[derive(Default)]
struct LedgerState {
    totals: BTreeMap<Series, Tally>,
    /// Unit and help text per name, as `describe()` registered them.
    described: BTreeMap<String, (Option<metrics::Unit>, Option<String>)>,
}

fn ledger() -> &'static Ledger {
    static LEDGER: OnceLock<Ledger> = OnceLock::new();
    LEDGER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only metrics recorder in this test binary");
        m::describe();
        Ledger {
            snapshotter,
            state: Mutex::default(),
        }
    })
}

impl Ledger {
    /// Drains the recorder into the totals and returns them. Snapshot and fold happen under
    /// one lock, so no drained value is lost between two callers.
    fn totals(&self) -> BTreeMap<Series, Tally> {
        let mut state = self.state.lock().unwrap();
        for (key, unit, description, value) in self.snapshotter.snapshot().into_vec() {
            let (kind, key) = key.into_parts();
            let n = match value {
                DebugValue::Counter(n) => n,
                DebugValue::Histogram(values) => values.len() as u64,
                // Gauges are drained to zero too, so "set to 0" and "not set since" look the
                // same here: they are read from a recorder of their own (`gauges_set_by`).
                DebugValue::Gauge(_) => continue,
            };
            state.described.insert(
                key.name().to_owned(),
                (unit, description.map(|d| d.to_string())),
            );
            state
                .totals
                .entry(Series::of(&key))
                .or_insert(Tally { kind, total: 0 })
                .total += n;
        }
        state.totals.clone()
    }

    fn described(&self, name: &str) -> Option<(Option<metrics::Unit>, Option<String>)> {
        self.state.lock().unwrap().described.get(name).cloned()
    }
}

/// Serialises the tests that move or assert the shared series.
async fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// Which series a probe looks at.
enum Scope {
    Consumer(String),
    Effect(String),
    /// Neither a consumer nor an effect label: moved by any test, so only asserted serially.
    Shared,
}

impl Scope {
    fn contains(&self, series: &Series) -> bool {
        match self {
            Self::Consumer(name) => series.label("consumer") == Some(name),
            Self::Effect(name) => series.label("effect") == Some(name),
            Self::Shared => series.label("consumer").is_none() && series.label("effect").is_none(),
        }
    }

    /// The label every expected series of this scope carries.
    fn label(&self) -> Option<(&'static str, &str)> {
        match self {
            Self::Consumer(name) => Some(("consumer", name)),
            Self::Effect(name) => Some(("effect", name)),
            Self::Shared => None,
        }
    }
}

/// An expected movement: name, the labels besides the scope's own, and by how much.
type Move<'a> = (&'a str, &'a [(&'a str, &'a str)], u64);

/// A command committed for the first time: one claim, one first-seen.
const COMMITTED: &[Move<'static>] = &[(m::FIRST_SEEN, &[], 1), (m::CLAIM_WAIT, &[], 1)];
/// A duplicate answered from the record by the lookup before the claim (the default): no
/// claim ran, none is timed.
const REPLAYED: &[Move<'static>] = &[(m::DUPLICATES, &[], 1)];
/// A duplicate answered by a claim that found the key taken (the lookup off).
const REPLAYED_BY_CLAIM: &[Move<'static>] = &[(m::DUPLICATES, &[], 1), (m::CLAIM_WAIT, &[], 1)];
/// The same key with another payload, found by the lookup.
const CONFLICTED: &[Move<'static>] = &[(m::IDENTITY_CONFLICTS, &[], 1)];
/// A guarded request without a key, refused (the default).
const KEY_REFUSED: &[Move<'static>] = &[
    (m::KEY_MISSING, &[("action", "refused")], 1),
    (m::REQUESTS_REFUSED, &[("reason", "key-missing")], 1),
];

/// The totals of one scope at a point in time; [`Probe::assert_moved`] compares against now.
struct Probe {
    scope: Scope,
    before: BTreeMap<Series, Tally>,
}

impl Probe {
    fn new(scope: Scope) -> Self {
        Self {
            scope,
            before: ledger().totals(),
        }
    }

    /// The series labelled `consumer=<name>`.
    fn consumer(name: &str) -> Self {
        Self::new(Scope::Consumer(name.to_owned()))
    }

    /// The series labelled `effect=<name>`.
    fn effect(name: &str) -> Self {
        Self::new(Scope::Effect(name.to_owned()))
    }

    /// The shared series; the guard proves no other test moves them meanwhile.
    fn shared(_serial: &MutexGuard<'static, ()>) -> Self {
        Self::new(Scope::Shared)
    }

    /// How far each series of the scope moved since the probe (or the last assertion).
    fn moved(&mut self) -> BTreeMap<String, u64> {
        let now = ledger().totals();
        let mut moved = BTreeMap::new();
        for (series, tally) in now.iter().filter(|(s, _)| self.scope.contains(s)) {
            let before = self.before.get(series).map_or(0, |t| t.total);
            if tally.total != before {
                check_contract(series, tally.kind, ledger().described(&series.name));
                moved.insert(series.to_string(), tally.total - before);
            }
        }
        self.before = now;
        moved
    }

    /// Asserts that exactly the `expected` series of the scope moved, each by exactly its
    /// amount, since the probe was made or last asserted; then starts counting afresh.
    #[track_caller]
    fn assert_moved(&mut self, expected: &[Move<'_>]) {
        let expected: BTreeMap<String, u64> = expected
            .iter()
            .map(|(name, labels, n)| {
                let labels = self.scope.label().into_iter().chain(labels.iter().copied());
                (Series::new(name, labels).to_string(), *n)
            })
            .collect();
        assert_eq!(self.moved(), expected);
    }
}

/// How `describe()` registered a name: unit and help text.
type Described = Option<(Option<metrics::Unit>, Option<String>)>;

/// A recorded series must be one [`METRICS`] lists, with its kind, only declared labels, and
/// the unit and help text `describe()` registered for it.
#[track_caller]
fn check_contract(series: &Series, kind: RecordedKind, described: Described) {
    let Some(info) = METRICS.iter().find(|i| i.name == series.name) else {
        panic!("{series} is recorded but not listed in METRICS");
    };
    let declared = match info.kind {
        MetricKind::Counter => RecordedKind::Counter,
        MetricKind::Gauge => RecordedKind::Gauge,
        MetricKind::Histogram => RecordedKind::Histogram,
    };
    assert_eq!(kind, declared, "{series} is recorded as another kind");
    for label in series.labels.keys() {
        assert!(
            info.labels.contains(&label.as_str()),
            "{series} carries the undeclared label {label}"
        );
    }
    assert_eq!(
        described,
        Some((Some(info.unit), Some(info.description.to_owned()))),
        "{series} is not described as METRICS says"
    );
}

/// Runs `future` with a fresh recorder of its own and returns the gauges it set. The stats
/// task sets its gauges on the task that calls `collect`, so a thread-local recorder around
/// each poll sees all of them; being fresh, it holds only what this run set.
async fn gauges_set_by<T>(future: impl Future<Output = T>) -> (T, BTreeMap<String, f64>) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, m::describe);
    let mut future = std::pin::pin!(future);
    let output = std::future::poll_fn(|cx| {
        metrics::with_local_recorder(&recorder, || future.as_mut().poll(cx))
    })
    .await;
    let mut gauges = BTreeMap::new();
    for (key, unit, description, value) in snapshotter.snapshot().into_vec() {
        let (kind, key) = key.into_parts();
        let series = Series::of(&key);
        check_contract(
            &series,
            kind,
            Some((unit, description.map(|d| d.to_string()))),
        );
        let DebugValue::Gauge(value) = value else {
            panic!("the stats task recorded {series} as {value:?}");
        };
        gauges.insert(series.to_string(), value.into_inner());
    }
    (output, gauges)
}

// ---------------------------------------------------------------------------------------------
// Services under test.

fn layer(
    pool: &PgPool,
    consumer: &str,
    configure: impl FnOnce(InboxLayerBuilder) -> InboxLayerBuilder,
) -> InboxLayer {
    configure(
        InboxLayer::builder(pool.clone(), consumer).producer(TrustedHeader::new("x-producer")),
    )
    .build()
    .expect("layer")
}

/// The credits example under a consumer name of the test's own.
fn credits(
    app: &TestApp,
    consumer: &str,
    configure: impl FnOnce(InboxLayerBuilder) -> InboxLayerBuilder,
) -> Router {
    common::credits::routes(app.pool.clone(), layer(&app.pool, consumer, configure))
}

/// `handler` at the credits path (so `credit()` requests reach it), behind the layer.
fn guarded(
    pool: &PgPool,
    consumer: &str,
    configure: impl FnOnce(InboxLayerBuilder) -> InboxLayerBuilder,
    handler: MethodRouter,
) -> Router {
    Router::new()
        .route("/accounts/{account}/credits", handler)
        .layer(layer(pool, consumer, configure))
}

/// Panics after the claim: the layer must roll back and count `handler-panicked`.
async fn panicking_handler(_tx: InboxTx) -> StatusCode {
    panic!("the handler broke")
}

/// A handler that writes nothing and answers the status currently in `status`.
fn answering(status: Arc<AtomicU16>) -> MethodRouter {
    post(move |_tx: InboxTx| {
        let status = StatusCode::from_u16(status.load(Ordering::SeqCst)).expect("status");
        async move { status }
    })
}

// ---------------------------------------------------------------------------------------------
// The reference: names, prefixes, README.

fn kind_name(kind: MetricKind) -> &'static str {
    match kind {
        MetricKind::Counter => "counter",
        MetricKind::Gauge => "gauge",
        MetricKind::Histogram => "histogram",
    }
}

/// The README's row for a metric, as generated from [`METRICS`].
fn readme_row(info: &m::MetricInfo) -> String {
    let labels = if info.labels.is_empty() {
        "none".to_owned()
    } else {
        let names: Vec<String> = info.labels.iter().map(|l| format!("`{l}`")).collect();
        names.join(", ")
    };
    format!(
        "| `{}` | {} | {} | {} | {} |",
        info.name,
        kind_name(info.kind),
        info.unit.as_str(),
        labels,
        info.description
    )
}

#[test]
fn every_metric_has_a_known_prefix_a_unique_name_and_a_readme_row() {
    let mut names = BTreeSet::new();
    for info in METRICS {
        assert!(
            ["inbox_", "outbox_", "quarantine_"]
                .iter()
                .any(|prefix| info.name.starts_with(prefix)),
            "{} has no known prefix",
            info.name
        );
        assert!(names.insert(info.name), "{} is listed twice", info.name);
    }

    let readme = include_str!("../README.md");
    let section = readme
        .split_once("\n## Metrics\n")
        .expect("README has a ## Metrics section")
        .1;
    let section = section.split("\n## ").next().expect("section text");
    let rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `")).collect();
    let expected: Vec<String> = METRICS.iter().map(readme_row).collect();
    assert_eq!(
        rows,
        expected,
        "the README's metrics table differs from METRICS; expected rows:\n{}",
        expected.join("\n")
    );
    let metrics_at = readme.find("\n## Metrics\n").expect("metrics section");
    let limits_at = readme
        .find("\n## What it does not do\n")
        .expect("limits section");
    assert!(
        metrics_at < limits_at,
        "## Metrics comes before ## What it does not do"
    );
}

// ---------------------------------------------------------------------------------------------
// The inbox paths.

#[tokio::test]
async fn a_first_seen_command_counts_first_seen_and_one_claim_wait() {
    let app = TestApp::new().await;
    let router = credits(&app, "first-seen", |b| b);
    let mut probe = Probe::consumer("first-seen");
    let reply = send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    probe.assert_moved(COMMITTED);
}

#[tokio::test]
async fn a_sequential_duplicate_counts_a_duplicate_and_no_claim_wait() {
    let app = TestApp::new().await;
    let router = credits(&app, "duplicate", |b| b);
    send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    let mut probe = Probe::consumer("duplicate");
    let reply = send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    assert!(reply.replayed());
    probe.assert_moved(REPLAYED);
    assert_eq!(app.ledger_rows("a1").await, 1);
}

#[tokio::test]
async fn a_duplicate_found_by_the_claim_counts_a_duplicate_and_one_claim_wait() {
    let app = TestApp::new().await;
    let router = credits(&app, "claimed-duplicate", |b| b.lookup_before_claim(false));
    send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    let mut probe = Probe::consumer("claimed-duplicate");
    let reply = send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    assert!(reply.replayed());
    probe.assert_moved(REPLAYED_BY_CLAIM);
    assert_eq!(app.ledger_rows("a1").await, 1);
}

#[tokio::test]
async fn a_cached_duplicate_counts_a_duplicate_and_a_cache_hit_and_no_claim() {
    let serial = serial().await;
    let app = TestApp::new().await;
    let cache = tower_inbox::middleware::ReplayCache::new(100, 1 << 20).unwrap();
    let router = credits(&app, "cached", |b| b.replay_cache(cache));
    let mut probe = Probe::consumer("cached");
    send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    probe.assert_moved(COMMITTED);
    let reply = send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    assert!(reply.replayed());
    probe.assert_moved(&[(m::DUPLICATES, &[], 1), (m::CACHE_HITS, &[], 1)]);
    // A conflict found in the cache is counted and quarantined like one found in the
    // database, without a claim.
    let mut shared = Probe::shared(&serial);
    let conflict = send(&router, credit("a1", Some("k1"), Some("app"), 6)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    probe.assert_moved(&[(m::IDENTITY_CONFLICTS, &[], 1), (m::CACHE_HITS, &[], 1)]);
    shared.assert_moved(&[(m::QUARANTINE_MOVES, &[("source", "identity-conflict")], 1)]);
}

#[tokio::test]
async fn a_duplicate_answered_by_the_lookup_counts_a_duplicate_and_no_claim() {
    let app = TestApp::new().await;
    let router = credits(&app, "looked-up", |b| b.lookup_before_claim(true));
    let mut probe = Probe::consumer("looked-up");
    send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    probe.assert_moved(COMMITTED);
    let reply = send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    assert!(reply.replayed());
    probe.assert_moved(&[(m::DUPLICATES, &[], 1)]);
}

#[tokio::test]
async fn claim_at_commit_counts_first_seen_and_a_lost_claim_as_a_duplicate() {
    let app = TestApp::new().await;
    // Without the lookup, the duplicate runs and loses its claim at commit.
    let router = credits(&app, "at-commit", |b| {
        b.claim_mode(tower_inbox::inbox::ClaimMode::AtCommit)
            .lookup_before_claim(false)
    });
    let mut probe = Probe::consumer("at-commit");
    send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    // The claim wait is the claim at commit's own statement.
    probe.assert_moved(COMMITTED);
    let reply = send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    assert!(reply.replayed());
    probe.assert_moved(REPLAYED_BY_CLAIM);
    assert_eq!(app.ledger_rows("a1").await, 1);
}

#[tokio::test]
async fn an_identity_conflict_is_counted_and_quarantined_once_per_payload() {
    let serial = serial().await;
    let app = TestApp::new().await;
    let router = credits(&app, "conflict", |b| b);
    send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    let mut probe = Probe::consumer("conflict");
    let mut shared = Probe::shared(&serial);

    let conflict = send(&router, credit("a1", Some("k1"), Some("app"), 6)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    probe.assert_moved(CONFLICTED);
    shared.assert_moved(&[(m::QUARANTINE_MOVES, &[("source", "identity-conflict")], 1)]);

    // The same conflicting payload again: counted as a conflict, but the item is already
    // open, so nothing more moves into the quarantine.
    let again = send(&router, credit("a1", Some("k1"), Some("app"), 6)).await;
    assert_eq!(again.problem_type(), "payload-mismatch");
    probe.assert_moved(CONFLICTED);
    shared.assert_moved(&[]);

    // Another payload under the same key is another item.
    send(&router, credit("a1", Some("k1"), Some("app"), 7)).await;
    probe.assert_moved(CONFLICTED);
    shared.assert_moved(&[(m::QUARANTINE_MOVES, &[("source", "identity-conflict")], 1)]);
    let open = Quarantine::new(app.pool.clone())
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    assert_eq!(open.len(), 2, "one open item per conflicting payload");
}

#[tokio::test]
async fn a_duplicate_of_an_in_flight_original_counts_in_progress() {
    let app = TestApp::new().await;
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = post({
        let (started, release) = (started.clone(), release.clone());
        move |_tx: InboxTx| async move {
            started.notify_one();
            release.notified().await;
            StatusCode::CREATED
        }
    });
    let router = guarded(
        &app.pool,
        "in-progress",
        |b| b.in_flight_wait(Duration::from_millis(50)),
        handler,
    );
    let original = tokio::spawn({
        let router = router.clone();
        async move { send(&router, credit("a1", Some("k1"), Some("app"), 1)).await }
    });
    // The original has claimed and holds its row lock until released.
    started.notified().await;
    let mut probe = Probe::consumer("in-progress");
    let duplicate = send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    assert_eq!(duplicate.problem_type(), "in-progress");
    probe.assert_moved(&[(m::IN_PROGRESS, &[], 1), (m::CLAIM_WAIT, &[], 1)]);

    release.notify_one();
    assert_eq!(original.await.unwrap().status, StatusCode::CREATED);
    probe.assert_moved(&[(m::FIRST_SEEN, &[], 1)]);
}

#[tokio::test]
async fn a_missing_key_is_counted_whether_refused_or_passed_through() {
    let app = TestApp::new().await;
    let required = credits(&app, "key-required", |b| b);
    let mut probe = Probe::consumer("key-required");
    let refused = send(&required, credit("a1", None, Some("app"), 5)).await;
    assert_eq!(refused.problem_type(), "key-missing");
    // Refused and counted as missing: no claim, so neither first-seen nor duplicate.
    probe.assert_moved(KEY_REFUSED);

    let handler = post(|tx: Option<InboxTx>| async move {
        assert!(tx.is_none(), "a keyless request is not claimed");
        StatusCode::OK
    });
    let optional = guarded(
        &app.pool,
        "key-optional",
        |b| b.key_required(false),
        handler,
    );
    let mut probe = Probe::consumer("key-optional");
    let passed = send(&optional, credit("a1", None, Some("app"), 5)).await;
    assert_eq!(passed.status, StatusCode::OK);
    probe.assert_moved(&[(m::KEY_MISSING, &[("action", "passed")], 1)]);
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn refusals_before_the_claim_are_counted_by_problem_type() {
    let app = TestApp::new().await;
    let router = credits(&app, "refusals", |b| b.body_limit(16));
    let torn: Vec<Result<&'static str, std::io::Error>> =
        vec![Ok(r#"{"del"#), Err(std::io::Error::other("client died"))];
    let cases = [
        (credit("a1", Some("a b"), Some("app"), 1), "key-malformed"),
        (credit("a1", Some("k1"), None, 1), "producer-missing"),
        (
            credit_raw(
                "a1",
                Some("k1"),
                Some("app"),
                r#"{"delta": 1, "pad": "xxxxxxxx"}"#,
            ),
            "body-too-large",
        ),
        (
            credit_raw(
                "a1",
                Some("k1"),
                Some("app"),
                axum::body::Body::from_stream(futures_util::stream::iter(torn)),
            ),
            "body-unreadable",
        ),
    ];
    for (request, reason) in cases {
        let mut probe = Probe::consumer("refusals");
        let reply = send(&router, request).await;
        assert_eq!(reply.problem_type(), reason);
        probe.assert_moved(&[(m::REQUESTS_REFUSED, &[("reason", reason)], 1)]);
    }
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn handler_failures_are_counted_by_reason_and_rejections_are_not() {
    let serial = serial().await;
    let app = TestApp::new().await;
    let status = Arc::new(AtomicU16::new(503));
    let failing = guarded(&app.pool, "failures", |b| b, answering(status.clone()));
    let panicking = guarded(&app.pool, "failures", |b| b, post(panicking_handler));
    let mut probe = Probe::consumer("failures");
    // Nothing reaches quarantine_after (3 by default): the shared series stay put.
    let mut shared = Probe::shared(&serial);

    let reply = send(&failing, credit("a1", Some("k-5xx"), Some("app"), 1)).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    probe.assert_moved(&[
        (
            m::HANDLER_FAILURES,
            &[("reason", "handler-error-status")],
            1,
        ),
        (m::CLAIM_WAIT, &[], 1),
    ]);

    let reply = send(&panicking, credit("a1", Some("k-panic"), Some("app"), 1)).await;
    assert_eq!(reply.problem_type(), "handler-panicked");
    probe.assert_moved(&[
        (m::HANDLER_FAILURES, &[("reason", "handler-panicked")], 1),
        (m::CLAIM_WAIT, &[], 1),
    ]);

    // A rejected request shape rolls back without counting a failure.
    status.store(422, Ordering::SeqCst);
    let reply = send(&failing, credit("a1", Some("k-422"), Some("app"), 1)).await;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
    probe.assert_moved(&[(m::CLAIM_WAIT, &[], 1)]);
    assert_eq!(app.failures("app", "k-422").await, None);

    shared.assert_moved(&[]);
}

#[tokio::test]
async fn repeated_failures_open_one_quarantine_item_and_a_success_recovers_it() {
    let serial = serial().await;
    let app = TestApp::new().await;
    let status = Arc::new(AtomicU16::new(500));
    let router = guarded(
        &app.pool,
        "quarantined",
        |b| b.quarantine_after(2),
        answering(status.clone()),
    );
    let mut probe = Probe::consumer("quarantined");
    let mut shared = Probe::shared(&serial);
    let failure: [Move<'_>; 2] = [
        (
            m::HANDLER_FAILURES,
            &[("reason", "handler-error-status")],
            1,
        ),
        (m::CLAIM_WAIT, &[], 1),
    ];

    send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    probe.assert_moved(&failure);
    shared.assert_moved(&[]);

    // The second failure reaches quarantine_after: one item opens.
    send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    probe.assert_moved(&failure);
    shared.assert_moved(&[(m::QUARANTINE_MOVES, &[("source", "handler-failure")], 1)]);

    // A third one counts on the open item; nothing more moves into the quarantine.
    send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    probe.assert_moved(&failure);
    shared.assert_moved(&[]);

    status.store(201, Ordering::SeqCst);
    let reply = send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    probe.assert_moved(COMMITTED);
    shared.assert_moved(&[(
        m::QUARANTINE_RECOVERIES,
        &[("source", "handler-failure")],
        1,
    )]);
}

#[tokio::test]
async fn database_errors_are_counted_by_kind() {
    // Nothing listens: the transaction cannot even begin, so no claim is timed.
    let down = guarded(
        &unreachable_pool(),
        "db-unreachable",
        |b| b,
        answering(Arc::new(AtomicU16::new(201))),
    );
    let mut probe = Probe::consumer("db-unreachable");
    let reply = send(&down, credit("a1", Some("k1"), Some("app"), 1)).await;
    assert_eq!(reply.problem_type(), "unavailable");
    probe.assert_moved(&[(m::DATABASE_ERRORS, &[("kind", "unavailable")], 1)]);

    // A database without the migrations: the claim statement itself fails.
    let bare = tower_inbox_testdb::TestDatabase::create()
        .await
        .expect("db");
    let bare_pool = bare.pool(2).await;
    let unmigrated = guarded(
        &bare_pool,
        "db-unmigrated",
        |b| b,
        answering(Arc::new(AtomicU16::new(201))),
    );
    let mut probe = Probe::consumer("db-unmigrated");
    let reply = send(&unmigrated, credit("a1", Some("k1"), Some("app"), 1)).await;
    assert_eq!(reply.problem_type(), "internal");
    // The lookup fails first; a failed claim is not timed.
    probe.assert_moved(&[(m::DATABASE_ERRORS, &[("kind", "internal")], 1)]);

    // A deferred constraint refuses the COMMIT: counted by the commit, not as first seen.
    let app = TestApp::new().await;
    let refused_at_commit = guarded(
        &app.pool,
        "db-commit",
        |b| b,
        post(|mut tx: InboxTx| async move {
            let statements = [
                "create temp table once_only (id int unique deferrable initially deferred)
                 on commit drop",
                "insert into once_only values (1), (1)",
            ];
            for statement in statements {
                sqlx::query(statement)
                    .execute(&mut *tx)
                    .await
                    .expect("accepted until COMMIT");
            }
            StatusCode::CREATED
        }),
    );
    let mut probe = Probe::consumer("db-commit");
    let reply = send(&refused_at_commit, credit("a1", Some("k1"), Some("app"), 1)).await;
    assert_eq!(reply.problem_type(), "internal");
    // The claim succeeded (and was timed); the commit failed.
    probe.assert_moved(&[
        (m::DATABASE_ERRORS, &[("kind", "internal")], 1),
        (m::CLAIM_WAIT, &[], 1),
    ]);
}

/// What a handler does on its first run only, so that its re-run can commit.
#[derive(Clone, Copy)]
enum FirstRun {
    /// Asks for a re-run.
    RequestsRetry,
    /// Runs a statement that fails with this SQLSTATE through the watched transaction, as a
    /// real serialization failure or deadlock would.
    Raises(&'static str),
}

fn failing_first_run(how: FirstRun) -> MethodRouter {
    let first = Arc::new(AtomicBool::new(true));
    post(move |mut tx: InboxTx| {
        let first = first.swap(false, Ordering::SeqCst);
        async move {
            match how {
                _ if !first => {}
                FirstRun::RequestsRetry => tx.request_retry(),
                FirstRun::Raises(sqlstate) => {
                    let raise =
                        format!("do $$ begin raise exception using errcode = '{sqlstate}'; end $$");
                    let failed = sqlx::query(&raise).execute(&mut *tx).await;
                    assert!(failed.is_err(), "the statement raises {sqlstate}");
                }
            }
            StatusCode::CREATED
        }
    })
}

#[tokio::test]
async fn a_requested_rerun_counts_a_retry_and_one_first_seen() {
    let app = TestApp::new().await;
    let handler = failing_first_run(FirstRun::RequestsRetry);
    let router = guarded(&app.pool, "rerun-requested", |b| b, handler);
    let mut probe = Probe::consumer("rerun-requested");
    let reply = send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    // Two claims (one per run), one re-run, one commit, and no failure.
    probe.assert_moved(&[
        (m::TRANSACTION_RETRIES, &[("reason", "requested")], 1),
        (m::FIRST_SEEN, &[], 1),
        (m::CLAIM_WAIT, &[], 2),
    ]);
}

#[tokio::test]
async fn watched_serialization_failures_and_deadlocks_count_retries_by_reason() {
    let app = TestApp::new().await;
    for (sqlstate, reason) in [("40001", "serialization-failure"), ("40P01", "deadlock")] {
        let consumer = format!("rerun-{reason}");
        let handler = failing_first_run(FirstRun::Raises(sqlstate));
        let router = guarded(&app.pool, &consumer, |b| b, handler);
        let mut probe = Probe::consumer(&consumer);
        let reply = send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reason}");
        probe.assert_moved(&[
            (m::TRANSACTION_RETRIES, &[("reason", reason)], 1),
            (m::FIRST_SEEN, &[], 1),
            (m::CLAIM_WAIT, &[], 2),
        ]);
    }
}

#[tokio::test]
async fn exhausted_reruns_count_retries_and_one_transaction_conflict_failure() {
    let serial = serial().await;
    let app = TestApp::new().await;
    let handler = post(|mut tx: InboxTx| async move {
        tx.request_retry();
        StatusCode::CREATED
    });
    let retry = TransientRetry::new(3, Duration::from_millis(1), Duration::from_millis(2));
    let router = guarded(
        &app.pool,
        "rerun-exhausted",
        |b| b.transient_retry(retry),
        handler,
    );
    let mut probe = Probe::consumer("rerun-exhausted");
    let mut shared = Probe::shared(&serial);
    let reply = send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "transaction-conflict");
    probe.assert_moved(&[
        (m::TRANSACTION_RETRIES, &[("reason", "requested")], 2),
        (
            m::HANDLER_FAILURES,
            &[("reason", "transaction-conflict")],
            1,
        ),
        (m::CLAIM_WAIT, &[], 3),
    ]);
    shared.assert_moved(&[]);
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn the_producer_label_is_recorded_only_when_asked_for() {
    let app = TestApp::new().await;
    let labels = MetricLabels::consumer().with_producer(true);
    let router = credits(&app, "with-producer", |b| b.metric_labels(labels));
    let mut probe = Probe::consumer("with-producer");
    send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    // Per-message series gain the producer; consumer-level ones (the claim wait) do not.
    probe.assert_moved(&[
        (m::FIRST_SEEN, &[("producer", "app")], 1),
        (m::CLAIM_WAIT, &[], 1),
    ]);
    send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    probe.assert_moved(&[(m::DUPLICATES, &[("producer", "app")], 1)]);
    send(&router, credit("a1", None, Some("app"), 1)).await;
    probe.assert_moved(KEY_REFUSED);
}

#[tokio::test]
async fn without_identity_labels_the_series_carry_no_consumer() {
    let serial = serial().await;
    let app = TestApp::new().await;
    let router = credits(&app, "no-labels", |b| b.metric_labels(MetricLabels::none()));
    let mut probe = Probe::consumer("no-labels");
    let mut shared = Probe::shared(&serial);
    send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    probe.assert_moved(&[]);
    shared.assert_moved(COMMITTED);
    send(&router, credit("a1", None, Some("app"), 1)).await;
    probe.assert_moved(&[]);
    shared.assert_moved(KEY_REFUSED);
}

// ---------------------------------------------------------------------------------------------
// The outbox paths.

/// Commits one effect named `effect` to `url`.
async fn enqueue_effect(pool: &PgPool, effect: &str, url: &str) -> EffectId {
    let identity = MessageIdentity::new(
        "outbox-metrics",
        Producer::new("app").unwrap(),
        MessageKey::new(effect).unwrap(),
    );
    let mut tx = pool.begin().await.unwrap();
    let enqueued = enqueue(&mut *tx, &identity, effect, &OutboxMessage::new(url, "{}"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    enqueued.effect_id
}

fn dispatcher(pool: &PgPool, max_attempts: u32) -> Dispatcher<HttpTransport> {
    Dispatcher::builder(
        pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .delivery_timeout(Duration::from_secs(5))
    .lease(Duration::from_secs(6))
    .max_attempts(max_attempts)
    .build()
    .unwrap()
}

/// Makes a retried effect due now instead of after its backoff.
async fn make_due(pool: &PgPool) {
    sqlx::query(
        "update tower_inbox.message_outbox set next_attempt_at = now() where status = 'pending'",
    )
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_delivery_counts_delivered() {
    let app = TestApp::new().await;
    let url = receiver([]).await;
    enqueue_effect(&app.pool, "delivered", &url).await;
    let mut probe = Probe::effect("delivered");
    assert_eq!(
        dispatcher(&app.pool, 3)
            .dispatch_due()
            .await
            .unwrap()
            .delivered,
        1
    );
    probe.assert_moved(&[(m::OUTBOX_DELIVERIES, &[("outcome", "delivered")], 1)]);
}

#[tokio::test]
async fn a_retried_delivery_counts_each_attempt_by_outcome() {
    let app = TestApp::new().await;
    let url = receiver([503, 503]).await;
    enqueue_effect(&app.pool, "retried", &url).await;
    let d = dispatcher(&app.pool, 3);
    let mut probe = Probe::effect("retried");
    assert_eq!(d.dispatch_due().await.unwrap().retried, 1);
    probe.assert_moved(&[(m::OUTBOX_DELIVERIES, &[("outcome", "retry")], 1)]);
    make_due(&app.pool).await;
    assert_eq!(d.dispatch_due().await.unwrap().retried, 1);
    make_due(&app.pool).await;
    assert_eq!(d.dispatch_due().await.unwrap().delivered, 1);
    probe.assert_moved(&[
        (m::OUTBOX_DELIVERIES, &[("outcome", "retry")], 1),
        (m::OUTBOX_DELIVERIES, &[("outcome", "delivered")], 1),
    ]);
}

#[tokio::test]
async fn a_permanent_refusal_goes_dead_and_its_repaired_delivery_counts_a_recovery() {
    let serial = serial().await;
    let app = TestApp::new().await;
    let url = receiver([404]).await;
    enqueue_effect(&app.pool, "dead", &url).await;
    let d = dispatcher(&app.pool, 3);
    let mut probe = Probe::effect("dead");
    let mut shared = Probe::shared(&serial);
    assert_eq!(d.dispatch_due().await.unwrap().dead, 1);
    probe.assert_moved(&[
        (m::OUTBOX_DELIVERIES, &[("outcome", "dead")], 1),
        (m::OUTBOX_DEAD_LETTERS, &[("reason", "http-404")], 1),
    ]);
    shared.assert_moved(&[(m::QUARANTINE_MOVES, &[("source", "dead-effect")], 1)]);

    let quarantine = Quarantine::new(app.pool.clone());
    let open = quarantine.list(QuarantineFilter::Open, 10).await.unwrap();
    assert_eq!(open.len(), 1);
    quarantine
        .repair(open[0].id, "oncall", "receiver fixed")
        .await
        .unwrap();
    // Deciding to repair is not a recovery; only the delivery that follows is.
    shared.assert_moved(&[]);
    let report = d.dispatch_due().await.unwrap();
    assert_eq!((report.delivered, report.recovered), (1, 1));
    probe.assert_moved(&[(m::OUTBOX_DELIVERIES, &[("outcome", "delivered")], 1)]);
    shared.assert_moved(&[(m::QUARANTINE_RECOVERIES, &[("source", "dead-effect")], 1)]);
}

#[tokio::test]
async fn a_retryable_failure_on_the_last_attempt_goes_dead_as_attempts_exhausted() {
    let serial = serial().await;
    let app = TestApp::new().await;
    let url = receiver([503]).await;
    enqueue_effect(&app.pool, "exhausted", &url).await;
    let mut probe = Probe::effect("exhausted");
    let mut shared = Probe::shared(&serial);
    assert_eq!(
        dispatcher(&app.pool, 1).dispatch_due().await.unwrap().dead,
        1
    );
    probe.assert_moved(&[
        (m::OUTBOX_DELIVERIES, &[("outcome", "dead")], 1),
        (
            m::OUTBOX_DEAD_LETTERS,
            &[("reason", "attempts-exhausted")],
            1,
        ),
    ]);
    shared.assert_moved(&[(m::QUARANTINE_MOVES, &[("source", "dead-effect")], 1)]);
}

/// A transport that panics on every call.
struct Panicking;

impl Transport for Panicking {
    async fn deliver(&self, _: &Effect) -> Delivery {
        panic!("transport bug")
    }
}

#[tokio::test]
async fn a_panicking_transport_counts_a_retry_then_a_dead_letter() {
    let serial = serial().await;
    let app = TestApp::new().await;
    enqueue_effect(&app.pool, "panicking", "http://127.0.0.1:9/never-called").await;
    let d = Dispatcher::builder(app.pool.clone(), Panicking)
        .max_attempts(2)
        .build()
        .unwrap();
    let mut probe = Probe::effect("panicking");
    let mut shared = Probe::shared(&serial);
    assert_eq!(d.dispatch_due().await.unwrap().retried, 1);
    probe.assert_moved(&[(m::OUTBOX_DELIVERIES, &[("outcome", "retry")], 1)]);
    make_due(&app.pool).await;
    assert_eq!(d.dispatch_due().await.unwrap().dead, 1);
    probe.assert_moved(&[
        (m::OUTBOX_DELIVERIES, &[("outcome", "dead")], 1),
        (
            m::OUTBOX_DEAD_LETTERS,
            &[("reason", "attempts-exhausted")],
            1,
        ),
    ]);
    shared.assert_moved(&[(m::QUARANTINE_MOVES, &[("source", "dead-effect")], 1)]);
}

#[tokio::test]
async fn every_quarantine_item_a_delivery_recovers_is_counted() {
    let serial = serial().await;
    let app = TestApp::new().await;
    let url = receiver([404, 404]).await;
    enqueue_effect(&app.pool, "repaired-twice", &url).await;
    let d = dispatcher(&app.pool, 3);
    let quarantine = Quarantine::new(app.pool.clone());
    let mut shared = Probe::shared(&serial);

    // Dead, repaired, dead again (the first repair is still awaiting recovery, so a second
    // item opens), repaired again.
    for _ in 0..2 {
        assert_eq!(d.dispatch_due().await.unwrap().dead, 1);
        shared.assert_moved(&[(m::QUARANTINE_MOVES, &[("source", "dead-effect")], 1)]);
        let open = quarantine.list(QuarantineFilter::Open, 10).await.unwrap();
        assert_eq!(open.len(), 1);
        quarantine
            .repair(open[0].id, "oncall", "try again")
            .await
            .unwrap();
    }
    assert_eq!(d.dispatch_due().await.unwrap().delivered, 1);
    let recovered: i64 = sqlx::query_scalar(
        "select count(*) from tower_inbox.inbox_quarantine where source = 'dead-effect' and recovered_at is not null",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(recovered, 2, "the delivery recovers both repaired items");
    // Two items moved in; both are recovered, so both are counted, as a committed command
    // counts every handler-failure item it recovers.
    shared.assert_moved(&[(m::QUARANTINE_RECOVERIES, &[("source", "dead-effect")], 2)]);
}

// ---------------------------------------------------------------------------------------------
// The stats task.

/// Inbox rows per consumer, counted directly.
async fn inbox_rows_by_consumer(pool: &PgPool) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "select consumer_name, count(*) from tower_inbox.consumer_inbox group by consumer_name",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

async fn count(pool: &PgPool, sql: &str) -> f64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(pool)
        .await
        .unwrap() as f64
}

#[tokio::test]
async fn the_stats_task_sets_the_gauges_to_what_the_database_holds() {
    // Quarantining through the layer moves the shared quarantine counters.
    let _serial = serial().await;
    let app = TestApp::new().await;
    let a = credits(&app, "stats-a", |b| b);
    let b = credits(&app, "stats-b", |b| b);
    for key in ["k1", "k2"] {
        send(&a, credit("a1", Some(key), Some("app"), 1)).await;
    }
    send(&b, credit("a1", Some("k1"), Some("app"), 1)).await;
    let conflict = send(&a, credit("a1", Some("k1"), Some("app"), 2)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    let failing = guarded(
        &app.pool,
        "stats-failing",
        |b| b.quarantine_after(1),
        answering(Arc::new(AtomicU16::new(500))),
    );
    send(&failing, credit("a1", Some("k1"), Some("app"), 1)).await;
    // Committed and never dispatched: pending.
    enqueue_effect(&app.pool, "stats-pending", "http://127.0.0.1:9/unused").await;

    let mut task = StatsTask::new(app.pool.clone());
    let (stats, gauges) = gauges_set_by(task.collect()).await;
    let stats = stats.unwrap();

    let rows = inbox_rows_by_consumer(&app.pool).await;
    assert_eq!(
        rows,
        BTreeMap::from([("stats-a".into(), 2), ("stats-b".into(), 1)])
    );
    let reported: BTreeMap<String, i64> = stats
        .inbox
        .iter()
        .map(|c| (c.consumer.clone(), c.rows))
        .collect();
    assert_eq!(reported, rows);
    let pending = count(
        &app.pool,
        "select count(*) from tower_inbox.message_outbox where status = 'pending'",
    )
    .await;
    assert_eq!(pending, 1.0);
    assert_eq!(stats.outbox_pending as f64, pending);
    assert!(stats.inbox_table_bytes > 0);
    let open = |source: &str| {
        format!(
            "select count(*) from tower_inbox.inbox_quarantine where decision is null and source = '{source}'"
        )
    };
    let mut expected = BTreeMap::new();
    for c in &stats.inbox {
        let consumer = [("consumer", c.consumer.as_str())];
        expected.insert(
            Series::new(m::INBOX_ROWS, consumer).to_string(),
            rows[&c.consumer] as f64,
        );
        expected.insert(
            Series::new(m::INBOX_OLDEST_AGE, consumer).to_string(),
            c.oldest_row_age.as_secs_f64(),
        );
    }
    expected.insert(
        m::INBOX_TABLE_BYTES.to_owned() + "{}",
        stats.inbox_table_bytes as f64,
    );
    // Nothing is in flight between requests.
    assert_eq!(stats.claims_in_flight, 0);
    expected.insert(m::CLAIMS_IN_FLIGHT.to_owned() + "{}", 0.0);
    expected.insert(m::OLDEST_CLAIM_IN_FLIGHT_AGE.to_owned() + "{}", 0.0);
    expected.insert(m::OUTBOX_PENDING.to_owned() + "{}", pending);
    expected.insert(
        m::OUTBOX_OLDEST_PENDING_AGE.to_owned() + "{}",
        stats.outbox_oldest_pending_age.as_secs_f64(),
    );
    // Every source is reported, zeros included, each with its count in the database.
    let mut open_by_source = Vec::new();
    for &source in QuarantineSource::ALL {
        let n = count(&app.pool, &open(source.as_str())).await;
        open_by_source.push((source, n as i64));
        expected.insert(
            Series::new(m::QUARANTINE_OPEN, [("source", source.as_str())]).to_string(),
            n,
        );
    }
    assert_eq!(stats.quarantine_open, open_by_source);
    let opened: Vec<_> = open_by_source.iter().filter(|(_, n)| *n > 0).collect();
    assert_eq!(
        opened,
        [
            &(QuarantineSource::IdentityConflict, 1),
            &(QuarantineSource::HandlerFailure, 1)
        ]
    );
    assert_eq!(gauges, expected);

    // Once the table is analyzed the rows are the statistics' estimate, which for a table
    // this small is the count itself.
    // ANALYZE of the crate's table is the owner's (the service's role would skip it).
    sqlx::query("analyze tower_inbox.consumer_inbox")
        .execute(&app.owner)
        .await
        .unwrap();
    let analyzed = task.collect().await.unwrap();
    let estimated: BTreeMap<String, i64> = analyzed
        .inbox
        .iter()
        .map(|c| (c.consumer.clone(), c.rows))
        .collect();
    assert_eq!(estimated, rows);
    // And it is the estimate: a row more, not analyzed yet, is not counted.
    send(&b, credit("a1", Some("k2"), Some("app"), 1)).await;
    let stale = task.collect().await.unwrap();
    assert_eq!(
        stale
            .inbox
            .iter()
            .find(|c| c.consumer == "stats-b")
            .map(|c| c.rows),
        Some(1)
    );

    // stats-a's rows all go and the conflict is decided: the next collection sets them to
    // zero rather than leaving the last values behind.
    sqlx::query("delete from tower_inbox.consumer_inbox where consumer_name = 'stats-a'")
        .execute(&app.pool)
        .await
        .unwrap();
    let quarantine = Quarantine::new(app.pool.clone());
    let open_items = quarantine.list(QuarantineFilter::Open, 10).await.unwrap();
    let conflict = open_items
        .iter()
        .find(|i| i.source == QuarantineSource::IdentityConflict)
        .expect("the open conflict");
    quarantine
        .discard(conflict.id, "oncall", "told the client")
        .await
        .unwrap();
    // The estimate follows the next ANALYZE (autovacuum's, here the test's).
    // ANALYZE of the crate's table is the owner's (the service's role would skip it).
    sqlx::query("analyze tower_inbox.consumer_inbox")
        .execute(&app.owner)
        .await
        .unwrap();
    let (stats, gauges) = gauges_set_by(task.collect()).await;
    let stats = stats.unwrap();
    assert_eq!(
        inbox_rows_by_consumer(&app.pool).await,
        BTreeMap::from([("stats-b".into(), 2)])
    );
    assert_eq!(stats.inbox.len(), 1);
    assert_eq!(gauges["inbox_rows{consumer=stats-a}"], 0.0);
    assert_eq!(
        gauges["inbox_oldest_row_age_seconds{consumer=stats-a}"],
        0.0
    );
    assert_eq!(gauges["inbox_rows{consumer=stats-b}"], 2.0);
    assert_eq!(gauges["quarantine_open{source=identity-conflict}"], 0.0);
    assert_eq!(count(&app.pool, &open("identity-conflict")).await, 0.0);
    assert_eq!(gauges["quarantine_open{source=handler-failure}"], 1.0);
}

/// A claim is invisible until its commit; the stats task sees it in flight all the same,
/// through its transaction's lock, with the transaction's age, and no longer once it ends.
#[tokio::test]
async fn the_stats_task_sees_claims_in_flight_and_how_old_the_oldest_is() {
    let _serial = serial().await;
    let app = TestApp::new().await;
    let inbox = tower_inbox::inbox::Inbox::new(app.pool.clone());
    let identity = |key: &str| {
        MessageIdentity::new(
            "stats-flight",
            Producer::new("app").unwrap(),
            MessageKey::new(key).unwrap(),
        )
    };
    let claim = |key: &'static str| {
        let inbox = inbox.clone();
        async move {
            let fingerprint = tower_inbox::fingerprint::Fingerprint::of_bytes(key.as_bytes());
            match inbox
                .claim(identity(key), fingerprint, "v1", Duration::ZERO)
                .await
                .unwrap()
            {
                tower_inbox::inbox::Claim::Claimed(claimed) => claimed,
                other => panic!("{other:?}"),
            }
        }
    };
    let mut task = StatsTask::new(app.pool.clone());
    let older = claim("k1").await;
    // Far apart, so that the younger claim is still younger after a rollback and a
    // collection on a loaded machine.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let younger = claim("k2").await;
    let (stats, gauges) = gauges_set_by(task.collect()).await;
    let stats = stats.unwrap();
    assert_eq!(stats.claims_in_flight, 2);
    // The older claim's transaction is the age: at least the pause before the second.
    let age = stats.oldest_claim_in_flight_age;
    assert!(age >= Duration::from_secs(3), "{age:?}");
    assert_eq!(gauges["inbox_claims_in_flight{}"], 2.0);
    assert_eq!(
        gauges["inbox_oldest_claim_in_flight_seconds{}"],
        age.as_secs_f64()
    );
    // Invisible to the tables, as the stats say.
    assert_eq!(inbox_rows_by_consumer(&app.pool).await.len(), 0);

    older.rollback().await.unwrap();
    let stats = task.collect().await.unwrap();
    assert_eq!(stats.claims_in_flight, 1);
    assert!(stats.oldest_claim_in_flight_age < age);
    younger.rollback().await.unwrap();
    let stats = task.collect().await.unwrap();
    assert_eq!(stats.claims_in_flight, 0);
    assert_eq!(stats.oldest_claim_in_flight_age, Duration::ZERO);
}
