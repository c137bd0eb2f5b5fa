//! `POST /minimal/accounts/{account_id}/credits`: the credit with the fewest statements that
//! claim it and record its response, written by hand with sqlx and no layer. It is the
//! ceiling the layered route is measured against over HTTP (`benches/loadgen --routes
//! ceiling`, `benches/http_table.sh`), as `benches/pgbench/minimal_*.sql` is in the database.
//!
//! **It is not a safe protocol**, only the cost of one: a key seen before is answered 409
//! (no replay, no payload comparison), a duplicate of a command in flight waits on the
//! primary key instead of being detected, and a failed attempt leaves no record. It is
//! served only with `CREDITS_BASELINE_ROUTE=1`, beside the unprotected baseline.
//!
//! It does what any such protocol must, and no more: the body's SHA-256 (of its raw bytes,
//! cheaper than the layer's canonical JSON), then, in one transaction, one statement per
//! round trip, like the layer with the same [`ClaimMode`](tower_inbox::inbox::ClaimMode):
//!
//! - claim first: `INSERT … ON CONFLICT DO NOTHING RETURNING`, the credit's two statements,
//!   `UPDATE` with the response, `COMMIT` (as `minimal_first_seen.sql`);
//! - claim at commit: the credit's two statements, then the `INSERT` with the response,
//!   `COMMIT` (as `minimal_at_commit.sql`).
//!
//! The credit refuses what the baseline refuses (an account ID out of bounds, a balance that
//! would overflow: 422), and the record must find the claimed row (read from the `UPDATE`'s
//! command tag, as no `RETURNING` is sent).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use sqlx::PgPool;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::{MessageIdentity, MessageKey, Producer};

use super::app::{apply_credit, CreditRequest, Credited};

/// The consumer name the minimal route claims its commands under, apart from the layer's.
pub const MINIMAL_CONSUMER: &str = "credits-minimal";

const CLAIM: &str = "insert into tower_inbox.consumer_inbox
         (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version)
     values ($1, $2, '', $3, $4, '1')
     on conflict do nothing returning 1";

const RECORD: &str = "update tower_inbox.consumer_inbox
     set processed_at = clock_timestamp(), response_status = 201,
         response_header_names = $4, response_header_values = $5, response_body = $6
     where consumer_name = $1 and producer_name = $2 and tenant_id = '' and message_id = $3";

const CLAIM_WITH_RESPONSE: &str = "insert into tower_inbox.consumer_inbox
         (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version,
          processed_at, response_status, response_header_names, response_header_values,
          response_body)
     values ($1, $2, '', $3, $4, '1', clock_timestamp(), 201, $5, $6, $7)
     on conflict do nothing returning 1";

#[derive(Clone)]
struct Minimal {
    pool: PgPool,
    at_commit: bool,
}

/// The minimal protocol's route; `at_commit` claims with the commit's last statement.
pub fn minimal_routes(pool: PgPool, at_commit: bool) -> Router {
    Router::new()
        .route(
            "/minimal/accounts/{account_id}/credits",
            post(minimal_credit),
        )
        .with_state(Minimal { pool, at_commit })
}

async fn minimal_credit(
    State(Minimal { pool, at_commit }): State<Minimal>,
    Path(account_id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Ok(request) = serde_json::from_slice::<CreditRequest>(&body) else {
        return refuse(StatusCode::UNPROCESSABLE_ENTITY, "the body is not a credit");
    };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let identity = match (
        Producer::new(header("x-producer").unwrap_or("minimal")),
        MessageKey::new(header("idempotency-key").unwrap_or_default()),
    ) {
        (Ok(producer), Ok(key)) => MessageIdentity::new(MINIMAL_CONSUMER, producer, key),
        _ => return refuse(StatusCode::BAD_REQUEST, "bad x-producer or idempotency-key"),
    };
    let sha = Fingerprint::of_bytes(&body).to_hex();
    match run(
        &pool,
        at_commit,
        &account_id,
        request.delta,
        &identity,
        &sha,
    )
    .await
    {
        Ok(Some(body)) => (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Ok(None) => refuse(StatusCode::CONFLICT, "this key was seen before"),
        Err(Failed::Refused(response)) => response,
        Err(Failed::Database(e)) => {
            tracing::error!(error = %e, "the minimal route's transaction failed");
            refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the credit could not be applied",
            )
        }
    }
}

/// Why the minimal route's transaction ended without a credit.
enum Failed {
    /// The credit refused the request (the baseline's checks): the response to give.
    Refused(Response),
    Database(sqlx::Error),
}

impl From<sqlx::Error> for Failed {
    fn from(e: sqlx::Error) -> Self {
        Self::Database(e)
    }
}

/// The protocol's transaction: the response's body, or `None` when the key was taken. On
/// any early return the transaction is dropped, so rolled back.
async fn run(
    pool: &PgPool,
    at_commit: bool,
    account_id: &str,
    delta: i64,
    identity: &MessageIdentity,
    sha: &str,
) -> Result<Option<Vec<u8>>, Failed> {
    let (consumer, producer) = (identity.consumer(), identity.producer().name());
    let key = identity.message_id().as_str();
    let names = ["content-type"];
    let values = [b"application/json".as_slice()];
    let mut tx = pool.begin().await?;
    if !at_commit {
        let claimed: Option<i32> = sqlx::query_scalar(CLAIM)
            .bind(consumer)
            .bind(producer)
            .bind(key)
            .bind(sha)
            .fetch_optional(&mut *tx)
            .await?;
        if claimed.is_none() {
            return Ok(None);
        }
    }
    let balance = apply_credit(&mut *tx, account_id, delta, identity)
        .await
        .map_err(Failed::Refused)?;
    let body = serde_json::to_vec(&Credited {
        account_id: account_id.to_owned(),
        balance,
        delta,
    })
    .map_err(|e| Failed::Database(sqlx::Error::Encode(e.into())))?;
    if at_commit {
        let claimed: Option<i32> = sqlx::query_scalar(CLAIM_WITH_RESPONSE)
            .bind(consumer)
            .bind(producer)
            .bind(key)
            .bind(sha)
            .bind(&names[..])
            .bind(&values[..])
            .bind(&body)
            .fetch_optional(&mut *tx)
            .await?;
        if claimed.is_none() {
            return Ok(None);
        }
    } else {
        let recorded = sqlx::query(RECORD)
            .bind(consumer)
            .bind(producer)
            .bind(key)
            .bind(&names[..])
            .bind(&values[..])
            .bind(&body)
            .execute(&mut *tx)
            .await?;
        // Read from the command tag, without a RETURNING: the claim's row must be there.
        if recorded.rows_affected() != 1 {
            return Err(Failed::Database(sqlx::Error::RowNotFound));
        }
    }
    tx.commit().await?;
    Ok(Some(body))
}

fn refuse(status: StatusCode, detail: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        detail.to_owned(),
    )
        .into_response()
}
