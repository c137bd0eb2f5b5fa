//! The layer rides out lost connections: a connection that died while idle, one killed in
//! the middle of the handler, or one lost at COMMIT is replaced and the command run again;
//! the claim decides, so nothing is applied twice and the client sees no 5xx.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::{credit, send, TestApp};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};
use tower_inbox::producer::TrustedHeader;
use tower_inbox::{InboxLayer, InboxTx};

/// Ends every backend of the test's database but `admin`'s own.
async fn terminate_all(app: &TestApp) -> i64 {
    let mut admin = PgConnection::connect(app.db.url()).await.unwrap();
    let ended: i64 = sqlx::query_scalar(
        "select count(*) from (
             select pg_terminate_backend(pid) from pg_stat_activity
             where datname = current_database() and pid <> pg_backend_pid()) t",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    admin.close().await.unwrap();
    ended
}

/// The example's pool: 32 connections, no test before an acquire.
async fn example_pool(app: &TestApp) -> PgPool {
    PgPoolOptions::new()
        .max_connections(32)
        .acquire_timeout(Duration::from_secs(10))
        .test_before_acquire(false)
        .connect_with(app.db.connect_options())
        .await
        .unwrap()
}

#[tokio::test]
async fn after_every_idle_connection_died_64_requests_all_succeed() {
    let app = TestApp::new().await;
    let pool = example_pool(&app).await;
    let router = common::credits::router(pool.clone()).unwrap();
    // 32 commands answered once: the replays to come. Sent 32 at a time, so that the pool
    // opens all its connections.
    let first: Vec<_> = (0..32)
        .map(|n| {
            let router = router.clone();
            tokio::spawn(async move {
                send(
                    &router,
                    credit(&format!("a{n}"), Some(&format!("old-{n}")), Some("app"), 1),
                )
                .await
            })
        })
        .collect();
    for reply in first {
        assert_eq!(reply.await.unwrap().status, StatusCode::CREATED);
    }
    assert!(pool.size() > 16, "the pool is warm: {}", pool.size());

    // A restart, a failover or an administrator: every backend ends while idle.
    assert!(terminate_all(&app).await >= i64::from(pool.size()));

    let requests: Vec<_> = (0..64)
        .map(|n| {
            let router = router.clone();
            let (account, key) = if n % 2 == 0 {
                (format!("a{}", n / 2), format!("old-{}", n / 2))
            } else {
                (format!("b{n}"), format!("new-{n}"))
            };
            tokio::spawn(async move {
                send(&router, credit(&account, Some(&key), Some("app"), 1)).await
            })
        })
        .collect();
    for (n, reply) in requests.into_iter().enumerate() {
        let reply = reply.await.unwrap();
        assert_eq!(reply.status, StatusCode::CREATED, "request {n}: {reply:?}");
        assert_eq!(reply.replayed(), n % 2 == 0, "request {n}");
    }
    for n in 0..32 {
        assert_eq!(
            app.balance(&format!("a{n}")).await,
            Some(1),
            "replayed, not applied"
        );
    }
    for n in (1..64).step_by(2) {
        assert_eq!(app.ledger_rows(&format!("b{n}")).await, 1, "applied once");
    }
}

#[tokio::test]
async fn a_connection_killed_during_the_handler_is_replaced_and_the_command_applied_once() {
    let app = TestApp::new().await;
    let kill_once = Arc::new(AtomicBool::new(true));
    // Ending a session of another role (the router's may be the owner's) takes the owner.
    let admin = app.owner.clone();
    let router = Router::new()
        .route(
            "/accounts/{account}/credits",
            post(move |Path(account): Path<String>, mut tx: InboxTx| {
                let (kill_once, admin) = (kill_once.clone(), admin.clone());
                async move {
                    common::add_one(&mut tx, &account).await;
                    if kill_once.swap(false, Ordering::SeqCst) {
                        let pid: i32 = sqlx::query_scalar("select pg_backend_pid()")
                            .fetch_one(&mut *tx)
                            .await
                            .expect("pid");
                        sqlx::query("select pg_terminate_backend($1)")
                            .bind(pid)
                            .execute(&admin)
                            .await
                            .expect("terminate");
                        // The next statement meets the dead connection; the handler answers
                        // what a handler would.
                        if sqlx::query("select 1").execute(&mut *tx).await.is_err() {
                            return (StatusCode::INTERNAL_SERVER_ERROR, "database error");
                        }
                    }
                    (StatusCode::CREATED, "credited")
                }
            }),
        )
        .layer(
            InboxLayer::builder(example_pool(&app).await, "credits")
                .producer(TrustedHeader::new("x-producer"))
                .build()
                .unwrap(),
        );
    let reply = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert_eq!(&reply.body[..], b"credited");
    assert!(!reply.replayed());
    assert_eq!(
        app.balance("a1").await,
        Some(1),
        "the killed run rolled back"
    );
    // The rerun is not a failed attempt.
    assert_eq!(app.failures("app", "k").await, None);
}
