//! Response bodies, response headers and producer identities never reach the PostgreSQL
//! server log, even when the statement carrying them fails and the server logs it: every
//! value is a bound parameter, and the server logs a failing statement's text without its
//! parameters (`log_parameter_max_length_on_error` is 0 by default).
//!
//! Each test forces one statement to fail, checks that the server logged the statement,
//! and looks for the markers in the whole log, as text and as the hex the server prints
//! `bytea` in (names are bound as UTF-8 bytes). Then the same request, with the fault gone,
//! stores the markers in the rows where they belong: they were really sent.

mod common;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use common::{logging_cluster, send, Reply, TestApp};
use http::request::Parts;
use http::{Request, StatusCode};
use sqlx::PgPool;
use tower_inbox::inbox::ClaimMode;
use tower_inbox::{InboxLayer, InboxTx, Producer, ProducerError};
use tower_inbox_testdb::{Cluster, LogMark};

const PRODUCER: &str = "producer-SECRET-Q4";
const TENANT: &str = "tenant-SECRET-T7";
const HEADER_VALUE: &str = "hdr-SECRET-Z8";
const BODY: &str = "body-SECRET-W3";
/// Every marker; the idempotency key is no secret and may be logged.
const MARKERS: [&str; 4] = [PRODUCER, TENANT, HEADER_VALUE, BODY];
/// The identity's markers, what failure and quarantine rows hold.
const IDENTITY_MARKERS: [&str; 2] = [PRODUCER, TENANT];

/// Raised by the fault triggers.
const REFUSED: &str = "refused by the test";

/// What the logged text of each statement holds.
const CLAIM: [&str; 2] = [
    "insert into tower_inbox.consumer_inbox (",
    "null, null, null, null, null where",
];
const CLAIM_AT_COMMIT: [&str; 2] = [
    "insert into tower_inbox.consumer_inbox (",
    "pg_catalog.clock_timestamp(), $9",
];
const RECORD: [&str; 1] = ["update tower_inbox.consumer_inbox i"];

const BOTH_MODES: [(ClaimMode, &str); 2] = [
    (ClaimMode::First, "first"),
    (ClaimMode::AtCommit, "at-commit"),
];

/// The markers `text` holds, as themselves or in hex.
fn markers_in(text: &str) -> Vec<&'static str> {
    let text = text.to_lowercase();
    MARKERS
        .into_iter()
        .filter(|marker| {
            let hex: String = marker.bytes().map(|b| format!("{b:02x}")).collect();
            text.contains(&marker.to_lowercase()) || text.contains(&hex)
        })
        .collect()
}

/// The producer named by `x-producer`, in the tenant named by `x-tenant`.
fn producer(parts: &Parts) -> Result<Producer, ProducerError> {
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| ProducerError::new(format!("no {name}")))
    };
    Producer::new(header("x-producer")?)?.with_tenant(header("x-tenant")?)
}

/// A command whose handler answers `status` with a secret header and body.
fn secret_router(pool: &PgPool, mode: ClaimMode, status: StatusCode) -> Router {
    let layer = InboxLayer::builder(pool.clone(), "credits")
        .producer(producer)
        .claim_mode(mode)
        .build()
        .expect("layer");
    let handler = move |_tx: InboxTx| async move { (status, [("x-secret", HEADER_VALUE)], BODY) };
    Router::new().route("/cmd", post(handler)).layer(layer)
}

fn command(key: &str, payload: &'static str) -> Request<Body> {
    Request::post("/cmd")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .header("x-producer", PRODUCER)
        .header("x-tenant", TENANT)
        .body(Body::from(payload))
        .expect("request")
}

fn assert_internal(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.problem_type(), "internal");
}

/// The credits schemas on a private cluster, and the log from after their setup.
struct Logged {
    app: TestApp,
    cluster: Cluster,
    mark: LogMark,
}

impl Logged {
    async fn start() -> Self {
        let cluster = logging_cluster().await;
        let app = TestApp::on(cluster.database().await.expect("database"), 5).await;
        let mark = cluster.log_mark().expect("log mark");
        Self { app, cluster, mark }
    }

    async fn sql(&self, sql: &str) {
        // The faults are triggers on the crate's tables: the owner's to create.
        sqlx::raw_sql(sql)
            .execute(&self.app.owner)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// A trigger `fault` `before <event>` on `tower_inbox.<table>` running `action`.
    async fn fault(&self, event: &str, table: &str, action: &str) {
        self.sql(&format!(
            "create or replace function public.fault() returns trigger language plpgsql
             as $$ begin {action}; return new; end $$;
             create trigger fault before {event} on tower_inbox.{table}
             for each row execute function public.fault();"
        ))
        .await;
    }

    /// A [`fault`](Self::fault) raising [`REFUSED`].
    async fn refuse(&self, event: &str, table: &str) {
        self.fault(event, table, &format!("raise exception '{REFUSED}'"))
            .await;
    }

    async fn repair(&self, table: &str) {
        self.sql(&format!("drop trigger fault on tower_inbox.{table}"))
            .await;
    }

    /// The server logged `error` and a failing statement holding every one of `statement`,
    /// and no marker anywhere.
    fn assert_logged_without_markers(&self, error: &str, statement: &[&str]) {
        let log = self.cluster.log_since(self.mark).expect("server log");
        assert!(
            log.lines()
                .any(|line| line.contains("ERROR:") && line.contains(error)),
            "no ERROR line with {error:?}:\n{log}"
        );
        assert!(
            log.lines().any(|line| line.contains("STATEMENT:")
                && statement.iter().all(|part| line.contains(part))),
            "no STATEMENT line with {statement:?}:\n{log}"
        );
        let leaked = markers_in(&log);
        assert!(leaked.is_empty(), "the log holds {leaked:?}:\n{log}");
    }

    /// Sends the command `key` over `pool`, claimed in `mode`; its handler answers 201.
    async fn send(&self, pool: &PgPool, mode: ClaimMode, key: &str) -> Reply {
        let router = secret_router(pool, mode, StatusCode::CREATED);
        send(&router, command(key, "{}")).await
    }

    /// [`send`](Self::send) commits, and the inbox row holds every marker.
    async fn assert_commits_and_stores(&self, pool: &PgPool, mode: ClaimMode, key: &str) {
        let reply = self.send(pool, mode, key).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        self.assert_stored("consumer_inbox", key, &MARKERS).await;
    }

    /// The row of `key` in `tower_inbox.<table>` holds exactly the markers `expected`.
    async fn assert_stored(&self, table: &str, key: &str, expected: &[&str]) {
        let rows: Vec<String> = sqlx::query_scalar(&format!(
            "select t::text from tower_inbox.{table} t where message_id = $1"
        ))
        .bind(key)
        .fetch_all(&self.app.pool)
        .await
        .expect("rows");
        assert_eq!(rows.len(), 1, "{table}: {rows:?}");
        assert_eq!(markers_in(&rows[0]), expected, "{table}: {}", rows[0]);
    }
}

#[tokio::test]
async fn a_refused_record_logs_no_response_and_no_producer() {
    let t = Logged::start().await;
    t.refuse("update", "consumer_inbox").await;
    assert_internal(&t.send(&t.app.pool, ClaimMode::First, "record").await);
    t.assert_logged_without_markers(REFUSED, &RECORD);

    t.repair("consumer_inbox").await;
    t.assert_commits_and_stores(&t.app.pool, ClaimMode::First, "record")
        .await;
}

#[tokio::test]
async fn a_refused_claim_logs_no_response_and_no_producer() {
    let t = Logged::start().await;
    t.refuse("insert", "consumer_inbox").await;
    // Claimed first, the claim carries the identity; at commit, the response too.
    for (mode, key) in BOTH_MODES {
        assert_internal(&t.send(&t.app.pool, mode, key).await);
    }
    t.assert_logged_without_markers(REFUSED, &CLAIM);
    t.assert_logged_without_markers(REFUSED, &CLAIM_AT_COMMIT);

    t.repair("consumer_inbox").await;
    for (mode, key) in BOTH_MODES {
        t.assert_commits_and_stores(&t.app.pool, mode, key).await;
    }
}

#[tokio::test]
async fn a_claim_past_its_lock_timeout_logs_no_response_and_no_producer() {
    let t = Logged::start().await;
    // One connection, on which both claims are prepared before the lock is taken: a cold
    // one would time out parsing the statement, before any value is bound to it.
    let impatient = t.app.pool_with(1, &[("lock_timeout", "200ms")]);
    for (mode, key) in BOTH_MODES {
        t.assert_commits_and_stores(&impatient, mode, &format!("warm-{key}"))
            .await;
    }
    let mut holder = t.app.pool.begin().await.expect("begin");
    sqlx::query("lock table tower_inbox.consumer_inbox in exclusive mode")
        .execute(&mut *holder)
        .await
        .expect("lock");
    for (mode, key) in BOTH_MODES {
        assert_internal(&t.send(&impatient, mode, key).await);
    }
    let timeout = "canceling statement due to lock timeout";
    t.assert_logged_without_markers(timeout, &CLAIM);
    t.assert_logged_without_markers(timeout, &CLAIM_AT_COMMIT);

    holder.rollback().await.expect("unlock");
    for (mode, key) in BOTH_MODES {
        t.assert_commits_and_stores(&impatient, mode, key).await;
    }
}

#[tokio::test]
async fn a_cancelled_claim_or_record_logs_no_response_and_no_producer() {
    let t = Logged::start().await;
    let hasty = t.app.pool_with(5, &[("statement_timeout", "1s")]);
    let cases = [
        ("update", ClaimMode::First, "record"),
        ("insert", ClaimMode::AtCommit, "claim-at-commit"),
    ];
    for (event, mode, key) in cases {
        t.fault(event, "consumer_inbox", "perform pg_sleep(30)")
            .await;
        assert_internal(&t.send(&hasty, mode, key).await);
        t.repair("consumer_inbox").await;
    }
    let cancelled = "canceling statement due to statement timeout";
    t.assert_logged_without_markers(cancelled, &RECORD);
    t.assert_logged_without_markers(cancelled, &CLAIM_AT_COMMIT);

    for (_, mode, key) in cases {
        t.assert_commits_and_stores(&hasty, mode, key).await;
    }
}

#[tokio::test]
async fn a_refused_failure_record_logs_no_producer() {
    let t = Logged::start().await;
    t.refuse("insert or update", "consumer_inbox_failure").await;
    // The handler's 5xx is rolled back and answered as it is, whether or not its failure
    // could be counted.
    let router = secret_router(&t.app.pool, ClaimMode::First, StatusCode::BAD_GATEWAY);
    let failed = send(&router, command("failing", "{}")).await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY);
    assert_eq!(&failed.body[..], BODY.as_bytes());
    t.assert_logged_without_markers(REFUSED, &["insert into tower_inbox.consumer_inbox_failure"]);

    t.repair("consumer_inbox_failure").await;
    let failed = send(&router, command("failing", "{}")).await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY);
    t.assert_stored("consumer_inbox_failure", "failing", &IDENTITY_MARKERS)
        .await;
}

#[tokio::test]
async fn a_refused_conflict_quarantine_logs_no_producer() {
    let t = Logged::start().await;
    let router = secret_router(&t.app.pool, ClaimMode::First, StatusCode::CREATED);
    let first = send(&router, command("reused", r#"{"n": 1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    t.refuse("insert or update", "inbox_quarantine").await;
    // The conflict is answered whether or not it could be kept.
    let conflict = send(&router, command("reused", r#"{"n": 2}"#)).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    t.assert_logged_without_markers(REFUSED, &["insert into tower_inbox.inbox_quarantine"]);

    t.repair("inbox_quarantine").await;
    let conflict = send(&router, command("reused", r#"{"n": 2}"#)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    t.assert_stored("inbox_quarantine", "reused", &IDENTITY_MARKERS)
        .await;
}

/// The markers are found where the server does log parameters: the check above can fail.
#[tokio::test]
async fn markers_are_found_in_a_log_with_statement_parameters() {
    let t = Logged::start().await;
    let telling = t
        .app
        .pool_with(5, &[("log_parameter_max_length_on_error", "-1")]);
    // The claim at commit binds every marker: the identity and the response.
    t.refuse("insert", "consumer_inbox").await;
    assert_internal(&t.send(&telling, ClaimMode::AtCommit, "telling").await);
    let log = t.cluster.log_since(t.mark).expect("server log");
    assert_eq!(markers_in(&log), MARKERS, "{log}");
}
