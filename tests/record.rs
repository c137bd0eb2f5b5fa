//! The edges of recording and committing: a claim never commits without its response, the
//! recording limit counts headers, a reserved producer cannot reach the inbox, a lost
//! connection (COMMIT included) is run again and the claim decides, and the answer once the
//! reruns run out says what is known.

mod common;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::proxy::{Cut, Proxy};
use common::{credit, send, TestApp};
use sqlx::postgres::PgPoolOptions;
use tower_inbox::producer::TrustedHeader;
use tower_inbox::{InboxLayer, InboxLayerBuilder, InboxTx};

fn layer(
    pool: &sqlx::PgPool,
    configure: impl FnOnce(InboxLayerBuilder) -> InboxLayerBuilder,
) -> InboxLayer {
    configure(InboxLayer::builder(pool.clone(), "test").producer(TrustedHeader::new("x-producer")))
        .build()
        .expect("layer")
}

/// What the handler of [`credit_router`] does to its own claim row before answering.
const KEEP: u8 = 0;
/// Deletes it: the record finds nothing to record on.
const DELETE: u8 = 1;
/// Updates it in place, which moves it to a new `ctid`: the record, which finds the row where
/// the claim put it, finds nothing there.
const MOVE: u8 = 2;

/// A credit handler answering `body_len` bytes that does `sabotage` to its claim row.
fn credit_router(pool: &sqlx::PgPool, sabotage: Arc<AtomicU8>, body_len: usize) -> Router {
    Router::new()
        .route(
            "/accounts/{account}/credits",
            post(move |Path(account): Path<String>, mut tx: InboxTx| {
                let sabotage = sabotage.clone();
                async move {
                    common::add_one(&mut tx, &account).await;
                    let sabotage = sabotage.load(Ordering::SeqCst);
                    let statement = match sabotage {
                        DELETE => "delete from tower_inbox.consumer_inbox where message_id = $1",
                        MOVE => {
                            "update tower_inbox.consumer_inbox set handler_version = handler_version
                             where message_id = $1"
                        }
                        _ => "select $1",
                    };
                    let key = tx.identity().message_id().as_str().to_owned();
                    let touched = sqlx::query(statement)
                        .bind(key)
                        .execute(&mut *tx)
                        .await
                        .expect("sabotage the claim");
                    if sabotage != KEEP {
                        assert_eq!(touched.rows_affected(), 1, "the claim row was there");
                    }
                    (StatusCode::CREATED, "x".repeat(body_len)).into_response()
                }
            }),
        )
        .layer(layer(pool, |b| b))
}

#[tokio::test]
async fn a_record_that_finds_no_claimed_row_commits_nothing_and_the_key_stays_retryable() {
    // A small body and one far over the 32 KiB that once took another path.
    for (sabotage_with, body_len) in [(DELETE, 16), (DELETE, 256 * 1024), (MOVE, 16)] {
        let case = format!("sabotage {sabotage_with}, body {body_len}");
        let app = TestApp::new().await;
        let sabotage = Arc::new(AtomicU8::new(sabotage_with));
        let router = credit_router(&app.pool, sabotage.clone(), body_len);

        let reply = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{case}");
        assert_eq!(reply.problem_type(), "internal");
        assert_eq!(app.inbox_rows().await, 0, "{case}: no claim committed");
        assert_eq!(
            app.balance("a1").await,
            None,
            "{case}: the business write rolled back with it"
        );

        sabotage.store(KEEP, Ordering::SeqCst);
        let retry = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{case}");
        assert!(!retry.replayed(), "{case}: the retry runs");
        assert_eq!(retry.body.len(), body_len);
        let row = app.inbox_row("app", "k").await.expect("claimed row");
        assert!(row.processed);
        assert_eq!(row.body.map(|b| b.len()), Some(body_len));
        let again = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
        assert!(again.replayed(), "{case}");
        assert_eq!(app.balance("a1").await, Some(1), "{case}: applied once");
    }
}

#[tokio::test]
async fn headers_count_against_the_recording_limit() {
    let app = TestApp::new().await;
    let router = Router::new()
        .route(
            "/accounts/{account}/credits",
            post(|mut tx: InboxTx| async move {
                sqlx::query("insert into credit_account (account_id, balance) values ('a1', 1)")
                    .execute(&mut *tx)
                    .await
                    .expect("write");
                // A tiny body under big headers.
                (
                    StatusCode::CREATED,
                    [("x-big", "h".repeat(600)), ("x-bigger", "h".repeat(600))],
                    "ok",
                )
                    .into_response()
            }),
        )
        .layer(layer(&app.pool, |b| b.recorded_response_limit(1024)));
    let reply = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.problem_type(), "response-too-large");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.balance("a1").await, None);

    // The same headers fit a larger limit, and are replayed.
    let router = Router::new()
        .route(
            "/accounts/{account}/credits",
            post(|| async {
                (
                    StatusCode::CREATED,
                    [("x-big", "h".repeat(600)), ("x-bigger", "h".repeat(600))],
                    "ok",
                )
            }),
        )
        .layer(layer(&app.pool, |b| b.recorded_response_limit(2048)));
    let first = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert!(again.replayed());
    assert_eq!(again.headers["x-bigger"], first.headers["x-bigger"]);
}

#[tokio::test]
async fn a_producer_under_the_migration_prefix_is_refused_at_the_edge() {
    let app = TestApp::new().await;
    let router = app.credits();
    let reply = send(
        &router,
        credit("a1", Some("step-1"), Some("migration:bonus-fix"), 5),
    )
    .await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(reply.problem_type(), "producer-missing");
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("reserved"), "{detail}");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.balance("a1").await, None);
}

/// The credits example on a pool of `size` connections that go through `proxy`, with no
/// test before an acquire (as the example's pool).
async fn credits_through(app: &TestApp, proxy: &Proxy, size: u32) -> (Router, sqlx::PgPool) {
    let options = app
        .db
        .connect_options()
        .host("127.0.0.1")
        .port(proxy.addr().port());
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .test_before_acquire(false)
        .connect_lazy_with(options);
    (common::credits::router(pool.clone()).expect("router"), pool)
}

#[tokio::test]
async fn a_commit_whose_answer_is_lost_is_run_again_and_the_claim_decides() {
    for cut in [Cut::Before, Cut::After] {
        let app = TestApp::new().await;
        let proxy = Proxy::start(upstream(&app)).await;
        let (router, _pool) = credits_through(&app, &proxy, 4).await;

        // The simple-query COMMIT, which ends in a NUL ("READ COMMITTED" in a BEGIN that
        // names it does not).
        proxy.arm(b"COMMIT\0", cut);
        let reply = send(&router, credit("a1", Some("k"), Some("app"), 7)).await;
        proxy.cut_done().await;
        // The layer ran it again on another connection: the claim found the committed row
        // (and replayed it), or the key free (and ran the command once).
        assert_eq!(reply.status, StatusCode::CREATED, "{cut:?}: {reply:?}");
        assert_eq!(reply.replayed(), cut == Cut::After, "{cut:?}");
        assert_eq!(app.balance("a1").await, Some(7), "{cut:?}: applied once");
        assert_eq!(app.ledger_rows("a1").await, 1, "{cut:?}");
    }
}

#[tokio::test]
async fn commits_lost_every_time_end_in_503_outcome_unknown_and_commit_nothing_twice() {
    let app = TestApp::new().await;
    let proxy = Proxy::start(upstream(&app)).await;
    let (router, _pool) = credits_through(&app, &proxy, 4).await;
    // Every COMMIT is lost before it reaches the server: nothing ever commits, and every run
    // ends not knowing it.
    proxy.arm_always(b"COMMIT\0", Cut::Before);
    let reply = send(&router, credit("a1", Some("k"), Some("app"), 7)).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
    assert_eq!(reply.problem_type(), "unavailable");
    assert!(reply.headers.contains_key("retry-after"));
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("unknown"), "{detail}");
    assert!(!detail.contains("nothing was committed"), "{detail}");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.balance("a1").await, None);

    // The database is reachable again: the client's retry runs the command once.
    proxy.disarm();
    let retry = send(&router, credit("a1", Some("k"), Some("app"), 7)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert!(send(&router, credit("a1", Some("k"), Some("app"), 7))
        .await
        .replayed());
    assert_eq!(app.ledger_rows("a1").await, 1);
}

#[tokio::test]
async fn a_claim_whose_connection_keeps_dying_ends_in_503_after_the_budget() {
    let app = TestApp::new().await;
    let proxy = Proxy::start(upstream(&app)).await;
    let (router, pool) = credits_through(&app, &proxy, 4).await;
    proxy.arm_always(b"pg_try_advisory_xact_lock", Cut::Before);
    let reply = send(&router, credit("a1", Some("k"), Some("app"), 7)).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
    assert_eq!(reply.problem_type(), "unavailable");
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    // The bound: the transient budget (3) plus the pool's size (4), then it stops.
    assert!(detail.contains("failed 7 times"), "{detail}");
    assert!(detail.contains("nothing was committed"), "{detail}");
    proxy.disarm();
    drop(pool);
    let retry = send(&router, credit("a1", Some("k"), Some("app"), 7)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(app.ledger_rows("a1").await, 1);
}

fn upstream(app: &TestApp) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], app.db.connect_options().get_port()))
}
