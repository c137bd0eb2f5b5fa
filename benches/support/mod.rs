//! What the benches that drive the credits example share: its router (`app`), the credit
//! commands they send, in-process calls through the router, and the database setup.
//!
//! Each bench includes this module with `mod support;` and uses part of it, hence the
//! `dead_code` allowance on the module declaration.

// The example's router, shared with the tests; the benches use only part of it.
#[allow(dead_code)]
#[path = "../../examples/credits/app.rs"]
pub mod app;

use std::error::Error;
use std::time::Duration;

use axum::body::Body;
use axum::http::header::CONTENT_TYPE;
use axum::http::{Request, Response};
use axum::Router;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tower::ServiceExt;
use tower_inbox::schema::Schema;

pub type BoxError = Box<dyn Error + Send + Sync>;

/// Accounts the credits are spread over.
pub const ACCOUNTS: u64 = 10_000;
/// The `X-Producer` every request carries (the example's stand-in for authentication).
pub const PRODUCER: &str = "bench";

/// One credit command.
pub struct Credit {
    pub key: String,
    pub account: u64,
    pub delta: i64,
}

impl Credit {
    /// The `n`th command of key stream `stream` (streams never share a key): a
    /// random-looking key, distinct for distinct `n`, that picks the account.
    pub fn new(stream: u8, n: u64, delta: i64) -> Self {
        let id = mix((u64::from(stream) << 56) | n);
        Self {
            key: format!("{id:016x}"),
            account: id % ACCOUNTS,
            delta,
        }
    }

    /// The request, to the layered route or (`baseline`) to the unprotected one.
    pub fn request(&self, baseline: bool) -> Request<Body> {
        let prefix = if baseline { "/baseline" } else { "" };
        Request::post(format!("{prefix}/accounts/acct-{}/credits", self.account))
            .header("idempotency-key", &self.key)
            .header("x-producer", PRODUCER)
            .header(CONTENT_TYPE, "application/json")
            .body(Body::from(format!(r#"{{"delta":{}}}"#, self.delta)))
            .expect("a valid request")
    }
}

/// splitmix64's finaliser: a bijection on `u64` (xor-shifts and odd multipliers are
/// invertible), so distinct inputs give distinct, well-spread outputs.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Sends a request through the router, as a server would, without a socket.
pub async fn call(router: Router, request: Request<Body>) -> Response<Body> {
    // A `Router`'s error type is `Infallible`.
    let Ok(response) = router.oneshot(request).await;
    response
}

/// Pool options as the example serves with: no ping before each acquire (see
/// examples/credits.rs), and a generous acquire timeout, so that a slow machine shows up as
/// slow figures rather than as 503s.
pub fn pool_options(size: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .test_before_acquire(false)
}

/// Connect options for the bench database `name`, found like the tests find theirs
/// (`DATABASE_URL`, else `127.0.0.1:5432`, else a throwaway cluster) and created when needed.
pub async fn connect_options(name: &str) -> Result<PgConnectOptions, BoxError> {
    let url = tower_inbox_testdb::app_database_url(name).await?;
    Ok(url.parse()?)
}

/// Runs the inbox migrations into `schema` and creates the example's tables where the pool's
/// `search_path` puts them (see `app::prepare_schema`), then names the database and the
/// schema on stderr, so that a run says where it wrote.
pub async fn prepare(pool: &PgPool, schema: &Schema, bench: &str) -> Result<(), BoxError> {
    app::prepare_schema(pool, schema).await?;
    let database: String = sqlx::query_scalar("select current_database()")
        .fetch_one(pool)
        .await?;
    eprintln!("{bench} bench: database {database}, inbox schema {schema}");
    Ok(())
}

/// `table` of `schema`, named as the crate names it (`"tower_inbox".consumer_inbox`).
pub fn table(schema: &Schema, table: &str) -> String {
    format!("\"{}\".{table}", schema.name())
}

/// Empties the inbox's tables in `schema` and the example's (where the pool's `search_path`
/// finds them, as the handlers do) and opens [`ACCOUNTS`] accounts at balance 0, so that
/// every measurement starts from the same state.
pub async fn reset_tables(pool: &PgPool, schema: &Schema) -> Result<(), sqlx::Error> {
    let inbox_tables = [
        "consumer_inbox",
        "consumer_inbox_failure",
        "inbox_quarantine",
        "message_outbox",
    ]
    .map(|name| table(schema, name))
    .join(", ");
    sqlx::raw_sql(&format!(
        "truncate credit_ledger, credit_account, {inbox_tables} restart identity;
         insert into credit_account (account_id, balance)
             select 'acct-' || g, 0 from generate_series(0, {}) g;
         analyze credit_account;",
        ACCOUNTS - 1
    ))
    .execute(pool)
    .await?;
    Ok(())
}
