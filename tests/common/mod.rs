//! Shared by the integration tests: a fresh database per test, the credits service, and
//! helpers that read the database invariants the tests assert.
//! (Over 400 lines: the one support module every integration test shares.)
#![allow(dead_code)]

#[path = "../../examples/credits/ceiling.rs"]
pub mod ceiling;
#[path = "../../examples/credits/app.rs"]
pub mod credits;
// The name `examples/credits.rs` gives the app module, which `ceiling` refers to.
use credits as app;
pub mod example;
pub mod listen;
pub mod proxy;
#[cfg(feature = "client")]
pub mod receipts;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Path;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_inbox::producer::TrustedHeader;
use tower_inbox::schema::{grant_statements, Access, Schema};
use tower_inbox::{InboxLayer, InboxLayerBuilder, InboxTx};
use tower_inbox_testdb::{Cluster, TestDatabase, TestRole};

/// A fresh database with the inbox and credits schemas, migrated by the owner, and the
/// service's pool on a role that is neither superuser nor owner of anything the crate made.
pub struct TestApp {
    /// The service's pool: a login role of its own ([`TestDatabase::login_role`]) with only
    /// what [`grant_service`] gives it. The handlers, layers, dispatchers, purgers and the
    /// stats task of the tests run on it.
    pub pool: PgPool,
    /// The owner's pool (the server's superuser, who ran the migrations): for a test's own
    /// setup that needs more than the service may do (DDL or triggers on the crate's tables,
    /// `ANALYZE`, `TRUNCATE`, ending other roles' sessions).
    pub owner: PgPool,
    /// The service's role.
    pub role: TestRole,
    // Dropped last: it drops the database, then the role.
    pub db: TestDatabase,
}

impl TestApp {
    pub async fn new() -> Self {
        Self::with_pool_size(10).await
    }

    pub async fn with_pool_size(max_connections: u32) -> Self {
        let db = TestDatabase::create().await.expect("test database");
        Self::on(db, max_connections).await
    }

    /// The schemas in `db`, e.g. a database of a private [`Cluster`] whose log a test reads.
    pub async fn on(db: TestDatabase, max_connections: u32) -> Self {
        let owner = db.pool(max_connections).await;
        credits::prepare(&owner).await.expect("schema");
        let role = db.login_role().await.expect("service role");
        grant_service(&owner, role.name()).await;
        Self {
            pool: role.pool(max_connections),
            owner,
            role,
            db,
        }
    }

    /// Sets `setting` to `value` (a SQL literal) for the database's new sessions, as the
    /// owner (`ALTER DATABASE`, which the service's role may not run; some settings, such as
    /// `deadlock_timeout`, only a superuser may set). Sessions opened before keep theirs.
    pub async fn set_for_new_sessions(&self, setting: &str, value: &str) {
        let sql = format!(
            "alter database \"{}\" set {setting} = {value}",
            self.db.name()
        );
        sqlx::query(&sql)
            .execute(&self.owner)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Another pool of the service's role to the same database whose sessions start with
    /// `settings` (`lock_timeout`, `statement_timeout`, ...).
    pub fn pool_with(&self, max_connections: u32, settings: &[(&str, &str)]) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(30))
            .connect_lazy_with(
                self.role
                    .connect_options()
                    .options(settings.iter().copied()),
            )
    }

    /// The credits service exactly as the example serves it.
    pub fn credits(&self) -> Router {
        credits::router(self.pool.clone()).expect("router")
    }

    /// The credits service with changed inbox settings.
    pub fn credits_with(
        &self,
        configure: impl FnOnce(tower_inbox::InboxLayerBuilder) -> tower_inbox::InboxLayerBuilder,
    ) -> Router {
        let layer = configure(credits::inbox_layer(self.pool.clone()))
            .build()
            .expect("layer");
        credits::routes(self.pool.clone(), layer)
    }

    pub async fn ledger_rows(&self, account: &str) -> i64 {
        sqlx::query_scalar("select count(*) from credit_ledger where account_id = $1")
            .bind(account)
            .fetch_one(&self.pool)
            .await
            .expect("ledger count")
    }

    pub async fn balance(&self, account: &str) -> Option<i64> {
        sqlx::query_scalar("select balance from credit_account where account_id = $1")
            .bind(account)
            .fetch_optional(&self.pool)
            .await
            .expect("balance")
    }

    /// Creates a table where [`INSERT_REFUSED_AT_COMMIT`] is accepted when sent and refused
    /// at COMMIT (a deferred unique constraint): a commit that fails for good.
    pub async fn create_refused_at_commit(&self) {
        sqlx::raw_sql(
            "create table once_only (id int, constraint once unique (id) deferrable initially deferred);
             insert into once_only values (1);",
        )
        .execute(&self.pool)
        .await
        .expect("schema");
    }

    /// Rows of the table [`create_refused_at_commit`](Self::create_refused_at_commit) made:
    /// 1 unless a refused insert committed.
    pub async fn refused_at_commit_rows(&self) -> i64 {
        sqlx::query_scalar("select count(*) from once_only")
            .fetch_one(&self.pool)
            .await
            .expect("count")
    }

    pub async fn inbox_rows(&self) -> i64 {
        sqlx::query_scalar("select count(*) from tower_inbox.consumer_inbox")
            .fetch_one(&self.pool)
            .await
            .expect("inbox count")
    }

    /// The committed inbox row for a key, if any.
    pub async fn inbox_row(&self, producer: &str, key: &str) -> Option<InboxRow> {
        sqlx::query_as::<_, (String, String, bool, Option<i16>, Option<Vec<u8>>)>(
            "select payload_sha256, handler_version, processed_at is not null, response_status, response_body
             from tower_inbox.consumer_inbox where producer_name = $1 and message_id = $2",
        )
        .bind(producer)
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .expect("inbox row")
        .map(|(sha, version, processed, status, body)| InboxRow {
            payload_sha256: sha,
            handler_version: version,
            processed,
            status: status.map(|s| s as u16),
            body: body.map(Bytes::from),
        })
    }

    /// `(attempts, last_reason)` of the failure record for a key.
    pub async fn failures(&self, producer: &str, key: &str) -> Option<(i32, String)> {
        sqlx::query_as(
            "select attempts, last_reason from tower_inbox.consumer_inbox_failure
             where producer_name = $1 and message_id = $2",
        )
        .bind(producer)
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .expect("failure row")
    }

    /// Waits (bounded) until the failure record for a key reaches `attempts`: a record
    /// written by a task spawned when a request future was dropped.
    pub async fn wait_for_failures(
        &self,
        producer: &str,
        key: &str,
        attempts: i32,
    ) -> (i32, String) {
        for _ in 0..200 {
            if let Some(f) = self.failures(producer, key).await {
                if f.0 >= attempts {
                    return f;
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("no failure record with {attempts} attempts for {producer}/{key}");
    }
}

/// Gives `role` what the README's least-privilege section gives a service that runs its own
/// purge, as the owner (`owner`): the crate's grants for the default schema, the credits
/// example's tables, and `CREATE` on `public` for the business tables tests make for their
/// handlers (the application's side, owned by the service there). It also revokes `EXECUTE`
/// on the outbox's trigger function from `PUBLIC`, so the suite shows that a trigger's
/// function needs no grant.
pub async fn grant_service(owner: &PgPool, role: &str) {
    let crate_grants = grant_statements(&Schema::default(), role, Access::ServiceAndPurge)
        .expect("grant statements");
    let application = [
        format!(
            "grant select, insert, update, delete on credit_account, credit_ledger to \"{role}\""
        ),
        format!("grant create on schema public to \"{role}\""),
        "revoke execute on function tower_inbox.tower_inbox_outbox_notify() from public".to_owned(),
    ];
    for statement in crate_grants.iter().chain(&application) {
        sqlx::query(statement)
            .execute(owner)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
}

/// Runs the grants `access` needs in `schema` for `role`, as the owner.
pub async fn grant_in(owner: &PgPool, schema: &Schema, role: &str, access: Access) {
    for grant in grant_statements(schema, role, access).expect("grant statements") {
        sqlx::query(&grant)
            .execute(owner)
            .await
            .unwrap_or_else(|e| panic!("{grant}: {e}"));
    }
}

/// A private cluster whose log holds every warning and error with the statement that raised
/// it, and no statement parameters: `log_min_messages=warning`, `log_min_error_statement=error`
/// and `log_parameter_max_length_on_error=0` (the last two are the defaults, made explicit).
pub async fn logging_cluster() -> Cluster {
    Cluster::builder()
        .setting("log_min_messages", "warning")
        .setting("log_min_error_statement", "error")
        .setting("log_parameter_max_length_on_error", "0")
        .start()
        .await
        .expect("private cluster")
}

/// The lines of a server log at WARNING or above.
pub fn log_problems(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| {
            ["ERROR:", "WARNING:", "FATAL:", "PANIC:"]
                .iter()
                .any(|severity| line.contains(severity))
        })
        .collect()
}

/// The log of `cluster` since `mark` has no line at WARNING or above.
pub fn assert_log_quiet(cluster: &Cluster, mark: tower_inbox_testdb::LogMark) {
    let log = cluster.log_since(mark).expect("server log");
    let problems = log_problems(&log);
    assert!(
        problems.is_empty(),
        "{}\n--- log:\n{log}",
        problems.join("\n")
    );
}

/// Waits (bounded, 10 s) until `done`.
pub async fn until(mut done: impl FnMut() -> bool) {
    for _ in 0..400 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("condition not reached in 10 s");
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxRow {
    pub payload_sha256: String,
    pub handler_version: String,
    pub processed: bool,
    pub status: Option<u16>,
    pub body: Option<Bytes>,
}

/// Accepted when sent, refused at COMMIT; see [`TestApp::create_refused_at_commit`].
pub const INSERT_REFUSED_AT_COMMIT: &str = "insert into once_only values (1)";

/// A pool to a port where nothing listens: every acquire fails.
pub fn unreachable_pool() -> PgPool {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&format!("postgres://postgres@127.0.0.1:{port}/none"))
        .expect("lazy pool")
}

/// Waits (bounded) until some backend of this database waits for a lock: a duplicate
/// blocked on the original's claim, or one side of a lock cycle.
pub async fn wait_until_a_lock_is_awaited(pool: &PgPool) {
    for _ in 0..400 {
        let waiting: i64 = sqlx::query_scalar(
            "select count(*) from pg_stat_activity
             where datname = current_database() and wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .expect("pg_stat_activity");
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no backend ever waited for a lock");
}

/// Waits (bounded) until `claims` claims of `inbox` wait for an original in flight.
pub async fn wait_until_waiting(inbox: &tower_inbox::inbox::Inbox, claims: usize) {
    for _ in 0..1000 {
        if inbox.waiting_claims() >= claims {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{claims} claims never waited at once (now {})",
        inbox.waiting_claims()
    );
}

/// Adds one to `account`'s balance (opening it at one) in the claimed transaction, as the
/// test handlers' business write.
pub async fn add_one(tx: &mut tower_inbox::InboxTx, account: &str) {
    sqlx::query(
        "insert into credit_account (account_id, balance) values ($1, 1)
         on conflict (account_id) do update set balance = credit_account.balance + 1",
    )
    .bind(account)
    .execute(&mut **tx)
    .await
    .expect("write");
}

/// Asserts that a purge failed on the inbox because its lock timeout ran out
/// (`lock_not_available`, 55P03) rather than waiting.
pub fn assert_inbox_purge_gave_up_on_a_lock(
    result: Result<tower_inbox::retention::PurgeReport, tower_inbox::retention::PurgeError>,
) {
    let err = result.expect_err("the purge should have given up");
    assert_eq!(
        err.table,
        tower_inbox::retention::PurgedTable::ConsumerInbox
    );
    let tower_inbox::inbox::InboxError::Database(sqlx::Error::Database(db)) = &err.source else {
        panic!("{:?}", err.source);
    };
    assert_eq!(db.code().as_deref(), Some("55P03"), "lock_not_available");
}

/// The broker consumers' business write: one more on the account `acct`, in the claimed
/// transaction.
pub fn credit_acct(
    message: &mut tower_inbox::inbox::ClaimedMessage,
) -> futures_util::future::BoxFuture<'_, Result<(), sqlx::Error>> {
    Box::pin(async move {
        sqlx::query(
            "insert into credit_account (account_id, balance) values ('acct', 1)
             on conflict (account_id) do update set balance = credit_account.balance + 1",
        )
        .execute(&mut *message)
        .await
        .map(|_| ())
    })
}

/// `POST /accounts/{account}/credits` with `{"delta": delta}`.
pub fn credit(
    account: &str,
    key: Option<&str>,
    producer: Option<&str>,
    delta: i64,
) -> Request<Body> {
    credit_raw(account, key, producer, format!(r#"{{"delta": {delta}}}"#))
}

pub fn credit_raw(
    account: &str,
    key: Option<&str>,
    producer: Option<&str>,
    body: impl Into<Body>,
) -> Request<Body> {
    let mut builder = Request::post(format!("/accounts/{account}/credits"))
        .header("content-type", "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    if let Some(producer) = producer {
        builder = builder.header("x-producer", producer);
    }
    builder.body(body.into()).expect("request")
}

/// A response read to its end.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The problem `type` slug (what follows '#'), asserting the problem+json shape.
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "not a problem response: {self:?}"
        );
        let json = self.json();
        assert_eq!(json["status"], self.status.as_u16(), "{json}");
        assert!(
            json["title"].is_string() && json["detail"].is_string(),
            "{json}"
        );
        let uri = json["type"].as_str().expect("type").to_owned();
        uri.rsplit_once('#')
            .map(|(_, slug)| slug.to_owned())
            .unwrap_or(uri)
    }
}

/// [`send`] from a task of its own: a request in flight while the test goes on.
pub fn spawn_send(router: &Router, request: Request<Body>) -> tokio::task::JoinHandle<Reply> {
    let router = router.clone();
    tokio::spawn(async move { send(&router, request).await })
}

pub async fn send(router: &Router, request: Request<Body>) -> Reply {
    let response = router.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// A handler that writes, tells the test it is in flight, and waits for a release; then
/// answers with the status the test chose.
pub struct Gate {
    pub started: Arc<Notify>,
    pub release: Arc<Notify>,
    pub status: Arc<std::sync::Mutex<StatusCode>>,
    /// The layer's inbox: how many duplicates wait for the original.
    pub inbox: tower_inbox::inbox::Inbox,
}

/// The credit route (consumer `credits`) behind a [`Gate`]d handler, which also counts its
/// calls.
pub fn gated_router(
    app: &TestApp,
    configure: impl FnOnce(InboxLayerBuilder) -> InboxLayerBuilder,
) -> (Router, Gate, Arc<AtomicUsize>) {
    gated_router_on(&app.pool, configure)
}

/// [`gated_router`] with the layer on `pool`.
pub fn gated_router_on(
    pool: &PgPool,
    configure: impl FnOnce(InboxLayerBuilder) -> InboxLayerBuilder,
) -> (Router, Gate, Arc<AtomicUsize>) {
    let layer = configure(
        InboxLayer::builder(pool.clone(), "credits").producer(TrustedHeader::new("x-producer")),
    )
    .build()
    .expect("layer");
    let gate = Gate {
        started: Arc::new(Notify::new()),
        release: Arc::new(Notify::new()),
        status: Arc::new(std::sync::Mutex::new(StatusCode::CREATED)),
        inbox: layer.inbox().clone(),
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let (started, release, status, counter) = (
        gate.started.clone(),
        gate.release.clone(),
        gate.status.clone(),
        calls.clone(),
    );
    let handler = move |Path(account): Path<String>, mut tx: InboxTx| {
        let (started, release, status) = (started.clone(), release.clone(), status.clone());
        let call = counter.fetch_add(1, Ordering::SeqCst);
        async move {
            add_one(&mut tx, &account).await;
            started.notify_one();
            release.notified().await;
            let status = *status.lock().unwrap();
            (status, format!("call {call}")).into_response()
        }
    };
    let router = Router::new()
        .route("/accounts/{account}/credits", post(handler))
        .layer(layer);
    (router, gate, calls)
}

/// A webhook receiver on loopback (`POST /hook`) that answers the scripted statuses in turn,
/// then 200; returns its URL.
pub async fn receiver(statuses: impl IntoIterator<Item = u16>) -> String {
    let script = Arc::new(std::sync::Mutex::new(
        statuses
            .into_iter()
            .collect::<std::collections::VecDeque<_>>(),
    ));
    let router = Router::new().route(
        "/hook",
        post(move || {
            let status = script.lock().unwrap().pop_front().unwrap_or(200);
            async move { StatusCode::from_u16(status).unwrap() }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{addr}/hook")
}
