//! The credits service: its schema, handlers and router. `examples/credits.rs` serves it;
//! the tests drive the same router in-process.
//! (Over 400 lines: the example service whole, its unprotected baseline route included,
//! which the benchmarks compare with; the minimal protocol's route is in `ceiling.rs`.)

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::sync::Arc;

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use tower_inbox::middleware::ConfigError;
use tower_inbox::outbox::OutboxMessage;
use tower_inbox::producer::TrustedHeader;
use tower_inbox::schema::Schema;
use tower_inbox::{InboxLayer, InboxLayerBuilder, InboxTx, MessageIdentity, MessageKey, Producer};

/// The consumer name the credits service claims commands under.
pub const CONSUMER: &str = "credits";

/// The example's own tables, from `schema.sql` beside this file (one copy: the pgbench runner
/// in `benches/pgbench/` applies the same file). A real service keeps these in its migrations.
///
/// The ledger deliberately has no unique constraint on the message identity: the inbox is
/// what keeps a retried command from being applied twice, and the tests count ledger rows to
/// prove it.
const SCHEMA: &str = include_str!("schema.sql");

/// Runs an example's `run` with its logs at `level` (or as `RUST_LOG` says): a failure is
/// one line, `<name>: <error>`, never a Debug dump, then exit status 1.
pub async fn main_of(
    name: &str,
    level: &str,
    run: impl std::future::Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>>,
) -> std::process::ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    match run.await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{name}: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A pool for the example's database: `DATABASE_URL`, else the database the tests would use
/// (the server on 127.0.0.1:5432, else a throwaway cluster from the local binaries). Says
/// which server it uses (never the password); a failure is one line naming the server and
/// `DATABASE_URL`.
pub async fn connect(
    max_connections: u32,
) -> Result<PgPool, Box<dyn std::error::Error + Send + Sync>> {
    let (url, origin) = match std::env::var("DATABASE_URL") {
        Ok(url) => (url, "DATABASE_URL"),
        Err(_) => {
            let url = tower_inbox_testdb::app_database_url("tower_inbox_credits")
                .await
                .map_err(|e| {
                    format!("DATABASE_URL is not set and no local PostgreSQL is usable: {e}")
                })?;
            let origin = match tower_inbox_testdb::server()?.kind() {
                tower_inbox_testdb::ServerKind::Throwaway => {
                    "a throwaway cluster started from the local PostgreSQL binaries; set DATABASE_URL to keep the data"
                }
                _ => "the local server; DATABASE_URL is not set",
            };
            (url, origin)
        }
    };
    let options: PgConnectOptions = url
        .parse()
        .map_err(|e| format!("DATABASE_URL is not a valid PostgreSQL URL: {e}"))?;
    let server = format!("{}:{}", options.get_host(), options.get_port());
    let database = options.get_database().unwrap_or("(the user's)").to_owned();
    tracing::info!("using PostgreSQL at {server}, database {database} ({origin})");
    // Each in-flight command holds one connection from the claim to the commit (duplicates
    // waiting for it hold none): size the pool for the concurrency you serve.
    //
    // No ping before each acquire (sqlx's default sends one, a round trip per request): a
    // connection that died while idle (a restart, a failover) fails its first statement
    // instead, and the layer runs the command again on another connection; the claim keeps
    // that from applying anything twice.
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(std::time::Duration::from_secs(3))
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot connect to PostgreSQL at {server} (DATABASE_URL): {e}").into())
}

/// Runs the inbox migrations into the default schema and creates the example's tables.
pub async fn prepare(pool: &PgPool) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    prepare_schema(pool, &Schema::default()).await
}

/// Runs the inbox migrations into `schema` (build the layer with the same
/// [`schema`](InboxLayerBuilder::schema)) and creates the example's tables, which name no
/// schema: they go where the pool's `search_path` puts them, `public` unless it says
/// otherwise, and the handlers find them there.
pub async fn prepare_schema(
    pool: &PgPool,
    schema: &Schema,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tower_inbox::schema::migrate_schema(pool, schema).await?;
    // One advisory lock so that two instances starting together do not race on CREATE.
    let mut tx = pool.begin().await?;
    sqlx::query("select pg_advisory_xact_lock(7367245)")
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(SCHEMA).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// The service's routes with the example's inbox settings.
pub fn router(pool: PgPool) -> Result<Router, ConfigError> {
    let inbox = inbox_layer(pool.clone()).build()?;
    Ok(routes(pool, inbox))
}

/// The example's inbox settings, open to further changes before `build()`.
pub fn inbox_layer(pool: PgPool) -> InboxLayerBuilder {
    InboxLayer::builder(pool, CONSUMER)
        // Stands in for authentication: a gateway would set it from the client's credentials.
        .producer(TrustedHeader::new("x-producer"))
        .body_limit(1024 * 1024)
}

/// The credit command behind `inbox`, the read beside it.
pub fn routes(pool: PgPool, inbox: InboxLayer) -> Router {
    routes_with_webhook(pool, inbox, None)
}

/// Like [`routes`]; with a webhook URL every first-seen credit also enqueues one outbox
/// effect to it, in the same transaction.
pub fn routes_with_webhook(pool: PgPool, inbox: InboxLayer, webhook: Option<String>) -> Router {
    let state = AppState {
        pool,
        webhook: webhook.map(Arc::from),
    };
    Router::new()
        .route("/accounts/{account_id}/credits", post(credit))
        .route_layer(inbox)
        .route("/accounts/{account_id}", get(account))
        .with_state(state)
}

/// Installs a Prometheus recorder as the process's `metrics` recorder and describes the
/// crate's metrics. The claim wait gets real histogram buckets (the others keep the
/// exporter's default summaries). Once per process: a second install fails.
pub fn install_prometheus() -> Result<PrometheusHandle, BuildError> {
    let claim_wait = Matcher::Full(tower_inbox::metrics::CLAIM_WAIT.to_owned());
    let buckets = [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(claim_wait, &buckets)?
        .install_recorder()?;
    tower_inbox::metrics::describe();
    Ok(handle)
}

/// Adds `GET /metrics`: every recorded metric in the Prometheus text format.
pub fn with_metrics_route(router: Router, handle: PrometheusHandle) -> Router {
    router.route(
        "/metrics",
        get(move || {
            let text = handle.render();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    text,
                )
            }
        }),
    )
}

#[derive(Clone)]
struct AppState {
    pool: PgPool,
    webhook: Option<Arc<str>>,
}

/// The body of a credit.
#[derive(Deserialize)]
pub struct CreditRequest {
    /// How much to add to the balance.
    pub delta: i64,
}

/// The answer to a credit.
#[derive(Serialize)]
pub struct Credited {
    /// The account credited.
    pub account_id: String,
    /// Its balance after the credit.
    pub balance: i64,
    /// What the credit added.
    pub delta: i64,
}

async fn credit(
    State(state): State<AppState>,
    Path(account_id): Path<String>,
    mut tx: InboxTx,
    body: Result<Json<CreditRequest>, JsonRejection>,
) -> Response {
    // Every malformed body is 422, which the layer rolls back unrecorded: the client may
    // fix the body and retry with the same key.
    let Json(request) = match body {
        Ok(body) => body,
        Err(rejection) => return problem(StatusCode::UNPROCESSABLE_ENTITY, &rejection.body_text()),
    };
    let identity = tx.identity().clone();
    // `&mut *tx` is the watched executor: a serialization failure or deadlock in these
    // statements makes the layer re-run the handler, whatever it answers.
    let balance = match apply_credit(&mut *tx, &account_id, request.delta, &identity).await {
        Ok(balance) => balance,
        Err(response) => return response,
    };
    let body = Credited {
        account_id,
        balance,
        delta: request.delta,
    };
    if let Some(url) = &state.webhook {
        // Never call the webhook here: the effect commits with the credit, and the
        // dispatcher delivers it later with the effect ID as its idempotency key.
        let payload = serde_json::to_vec(&body).unwrap_or_default();
        let message =
            OutboxMessage::new(url.as_ref(), payload).header("content-type", "application/json");
        if let Err(e) = tx.enqueue("credit-webhook", &message).await {
            tracing::error!(error = %e, "could not enqueue the webhook");
            return problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the credit could not be applied",
            );
        }
    }
    (StatusCode::CREATED, Json(body)).into_response()
}

/// The credit itself: add `delta` to the account and write the ledger row, on `conn` (the
/// claimed transaction, or the baseline's or the minimal route's own). A refusal is the
/// response to give: 422 for an account ID out of bounds or a balance that would overflow.
pub async fn apply_credit<C>(
    conn: &mut C,
    account_id: &str,
    delta: i64,
    identity: &MessageIdentity,
) -> Result<i64, Response>
where
    for<'c> &'c mut C: sqlx::Executor<'c, Database = sqlx::Postgres>,
{
    if account_id.is_empty() || account_id.len() > 128 {
        return Err(problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "account_id must be 1 to 128 bytes",
        ));
    }
    match credit_rows(conn, account_id, delta, identity).await {
        Ok(balance) => Ok(balance),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("22003") => Err(problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the balance would overflow",
        )),
        Err(e) => Err(server_error(e)),
    }
}

/// The credit's business writes, on the claimed transaction: the account upserted and one
/// ledger row naming the command. Returns the new balance. Shared by the HTTP service and
/// the broker consumer (`examples/credits_consumer.rs`).
pub async fn credit_rows<C>(
    conn: &mut C,
    account_id: &str,
    delta: i64,
    identity: &MessageIdentity,
) -> Result<i64, sqlx::Error>
where
    for<'c> &'c mut C: sqlx::Executor<'c, Database = sqlx::Postgres>,
{
    let balance: i64 = sqlx::query_scalar(
        "insert into credit_account (account_id, balance) values ($1, $2)
         on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
         returning balance",
    )
    .bind(account_id)
    .bind(delta)
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query(
        "insert into credit_ledger
             (account_id, delta, balance_after, consumer_name, producer_name, message_id)
         values ($1, $2, $3, $4, $5, $6)",
    )
    .bind(account_id)
    .bind(delta)
    .bind(balance)
    .bind(identity.consumer())
    .bind(identity.producer().name())
    .bind(identity.message_id().as_str())
    .execute(&mut *conn)
    .await?;
    Ok(balance)
}

/// The consumer name the unprotected baseline writes its ledger rows under.
pub const BASELINE_CONSUMER: &str = "credits-baseline";

/// `POST /baseline/accounts/{account_id}/credits`: the same credit in a transaction of its
/// own, **without** the inbox layer: a retry credits again. It exists to measure what the
/// layer costs (`benches/loadgen`, `benches/`), and is only served when asked for.
pub fn baseline_routes(pool: PgPool) -> Router {
    Router::new()
        .route(
            "/baseline/accounts/{account_id}/credits",
            post(baseline_credit),
        )
        .with_state(pool)
}

async fn baseline_credit(
    State(pool): State<PgPool>,
    Path(account_id): Path<String>,
    headers: axum::http::HeaderMap,
    body: Result<Json<CreditRequest>, JsonRejection>,
) -> Response {
    let Json(request) = match body {
        Ok(body) => body,
        Err(rejection) => return problem(StatusCode::UNPROCESSABLE_ENTITY, &rejection.body_text()),
    };
    // The same ledger columns as the layered route, so both write the same rows.
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let identity = match (
        Producer::new(header("x-producer").unwrap_or("baseline")),
        MessageKey::new(header("idempotency-key").unwrap_or("none")),
    ) {
        (Ok(producer), Ok(key)) => MessageIdentity::new(BASELINE_CONSUMER, producer, key),
        _ => return problem(StatusCode::BAD_REQUEST, "bad x-producer or idempotency-key"),
    };
    let mut tx = match pool.begin().await {
        Ok(tx) => tx,
        Err(e) => return server_error(e),
    };
    let balance = match apply_credit(&mut *tx, &account_id, request.delta, &identity).await {
        Ok(balance) => balance,
        Err(response) => return response,
    };
    if let Err(e) = tx.commit().await {
        return server_error(e);
    }
    let body = Credited {
        account_id,
        balance,
        delta: request.delta,
    };
    (StatusCode::CREATED, Json(body)).into_response()
}

async fn account(
    State(AppState { pool, .. }): State<AppState>,
    Path(account_id): Path<String>,
) -> Response {
    let balance: Result<Option<i64>, sqlx::Error> =
        sqlx::query_scalar("select balance from credit_account where account_id = $1")
            .bind(&account_id)
            .fetch_optional(&pool)
            .await;
    match balance {
        Ok(Some(balance)) => {
            Json(json!({ "account_id": account_id, "balance": balance })).into_response()
        }
        Ok(None) => problem(StatusCode::NOT_FOUND, "no such account"),
        Err(e) => server_error(e),
    }
}

fn server_error(e: sqlx::Error) -> Response {
    tracing::error!(error = %e, "credits query failed");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the credit could not be applied",
    )
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body = json!({ "type": "about:blank", "title": status.canonical_reason(), "status": status.as_u16(), "detail": detail });
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}
