//! Duplicates of a command in flight wait fairly: one poller per key, a capped number of keys
//! waited on, no connection held while waiting; another producer's commands go on.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::{credit, send, wait_until_waiting, Reply, TestApp};
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Notify;
use tower_inbox::inbox::Inbox;
use tower_inbox::producer::TrustedHeader;
use tower_inbox::{InboxLayer, InboxTx};

/// Accounts named `gated-*` wait for `release` after their write; others answer at once.
fn router(
    pool: &sqlx::PgPool,
    release: Arc<Notify>,
    started: Arc<Notify>,
    runs: Arc<AtomicUsize>,
) -> (Router, Inbox) {
    let layer = InboxLayer::builder(pool.clone(), "storm")
        .producer(TrustedHeader::new("x-producer"))
        .in_flight_wait(Duration::from_secs(120))
        .waiting_keys_limit(1)
        .build()
        .unwrap();
    let inbox = layer.inbox().clone();
    let router = Router::new()
        .route(
            "/accounts/{account}/credits",
            post(move |Path(account): Path<String>, mut tx: InboxTx| {
                let (release, started, runs) = (release.clone(), started.clone(), runs.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    common::add_one(&mut tx, &account).await;
                    if account.starts_with("gated") {
                        started.notify_one();
                        release.notified().await;
                    }
                    (StatusCode::CREATED, format!("credited {account}")).into_response()
                }
            }),
        )
        .layer(layer);
    (router, inbox)
}

fn assert_replay_or_in_progress(reply: &Reply) {
    if reply.status == StatusCode::CREATED {
        assert!(reply.replayed(), "{reply:?}");
    } else {
        assert_eq!(reply.status, StatusCode::CONFLICT, "{reply:?}");
        assert_eq!(reply.problem_type(), "in-progress");
        assert!(reply.headers.contains_key("retry-after"));
    }
}

#[tokio::test]
async fn a_storm_of_duplicates_holds_no_pool_and_leaves_other_producers_served() {
    let app = TestApp::new().await;
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(app.db.connect_options())
        .await
        .unwrap();
    let (release, started, runs) = (
        Arc::new(Notify::new()),
        Arc::new(Notify::new()),
        Arc::new(AtomicUsize::new(0)),
    );
    let (router, inbox) = router(&pool, release.clone(), started.clone(), runs.clone());
    assert_eq!(inbox.waiting_keys_limit(), 1);

    let original = tokio::spawn({
        let router = router.clone();
        async move { send(&router, credit("gated-hot", Some("hot"), Some("a"), 1)).await }
    });
    started.notified().await;
    let duplicates: Vec<_> = (0..100)
        .map(|_| {
            let router = router.clone();
            tokio::spawn(async move {
                send(&router, credit("gated-hot", Some("hot"), Some("a"), 1)).await
            })
        })
        .collect();
    wait_until_waiting(&inbox, 100).await;

    // While they wait: the original holds one connection, the key's poller at most one
    // more (and only while a poll runs). Another producer's commands go through, one at a
    // time, each with a connection of its own.
    let mut most_in_use = 0;
    for n in 0..20 {
        let reply = send(
            &router,
            credit("other", Some(&format!("o{n}")), Some("b"), 1),
        )
        .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        most_in_use = most_in_use.max(pool.size() - pool.num_idle() as u32);
        assert_eq!(inbox.waiting_claims(), 100, "the duplicates still wait");
    }
    // Waiters holding connections would take all 16; allow the three above plus a few on
    // their way back to the pool (sqlx pings each connection as it is released).
    assert!(
        most_in_use <= 6,
        "{most_in_use} connections in use: waiters hold connections"
    );

    // Past the cap (one key waited on), a duplicate of another in-flight command is told
    // at once, well before its 120 s wait would end.
    let warm = tokio::spawn({
        let router = router.clone();
        async move { send(&router, credit("gated-warm", Some("warm"), Some("a"), 1)).await }
    });
    started.notified().await;
    let refused = tokio::time::timeout(
        Duration::from_secs(20),
        send(&router, credit("gated-warm", Some("warm"), Some("a"), 1)),
    )
    .await
    .expect("past the cap the duplicate does not wait");
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "in-progress");
    assert!(refused.headers.contains_key("retry-after"));

    // Both originals finish; every waiting duplicate replays.
    release.notify_one();
    release.notify_one();
    let original = original.await.unwrap();
    assert_eq!(original.status, StatusCode::CREATED);
    assert_eq!(warm.await.unwrap().status, StatusCode::CREATED);
    let mut replayed = 0;
    for duplicate in duplicates {
        let reply = duplicate.await.unwrap();
        assert_replay_or_in_progress(&reply);
        replayed += usize::from(reply.replayed());
        if reply.replayed() {
            assert_eq!(reply.body, original.body);
        }
    }
    assert_eq!(replayed, 100, "every duplicate waited for the original");
    assert_eq!(inbox.waiting_claims(), 0);
    assert_eq!(runs.load(Ordering::SeqCst), 2 + 20, "each command ran once");
    assert_eq!(app.balance("gated-hot").await, Some(1));
    assert_eq!(app.balance("other").await, Some(20));
}
