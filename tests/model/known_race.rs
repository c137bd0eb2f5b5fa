//! A race in the crate that the model tolerates (`spec::FailedBefore::Racing`), made
//! deterministic. Ignored until it is fixed; then the test passes, and the model's tolerance
//! should go.
//!
//! A failed attempt rolls back first and counts its failure afterwards, in a transaction of
//! its own. A retry waiting for it claims the key in between, so its claim sees no failure
//! record and its commit recovers nothing; the failure counted a moment later opens (or
//! updates) a quarantine item about a command that has already succeeded, and nothing ever
//! recovers it. The item stays open: it fires the open-quarantine alert and keeps the
//! command's inbox row from being purged until someone decides it. In the model test's
//! interleaving (a patient duplicate that claims after its original failed) this happened in
//! about one run in seven without any help; here a table lock holds the failure record back.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use tokio::sync::Notify;
use tower_inbox::producer::TrustedHeader;
use tower_inbox::{InboxLayer, InboxTx};

use crate::common::{
    add_one, credit, spawn_send, wait_until_a_lock_is_awaited, wait_until_waiting, TestApp,
};

#[tokio::test]
#[ignore = "known race: a failure counted after a concurrent retry committed leaves an open \
            quarantine item about a command that succeeded"]
async fn a_retry_that_commits_while_the_failure_is_counted_leaves_no_open_item() {
    let app = TestApp::new().await;
    let layer = InboxLayer::builder(app.pool.clone(), "credits")
        .producer(TrustedHeader::new("x-producer"))
        .in_flight_wait(Duration::from_secs(60))
        .quarantine_after(1)
        .build()
        .expect("layer");
    let inbox = layer.inbox().clone();
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (started, release) = (started.clone(), release.clone());
        move |Path(account): Path<String>, mut tx: InboxTx| {
            let (started, release) = (started.clone(), release.clone());
            let first = runs.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                add_one(&mut tx, &account).await;
                if !first {
                    return StatusCode::CREATED.into_response();
                }
                // The original: in flight until released, then a failure.
                started.notify_one();
                release.notified().await;
                StatusCode::INTERNAL_SERVER_ERROR.into_response()
            }
        }
    };
    let router = Router::new()
        .route("/accounts/{account}/credits", post(handler))
        .layer(layer);

    let original = spawn_send(&router, credit("a1", Some("k"), Some("app"), 1));
    started.notified().await;
    let retry = spawn_send(&router, credit("a1", Some("k"), Some("app"), 1));
    wait_until_waiting(&inbox, 1).await;
    // Reads of the failure table go on (the retry's claim asks whether the command failed
    // before); the original's failure record waits.
    let mut hold = app.pool.begin().await.expect("begin");
    sqlx::query("lock table tower_inbox.consumer_inbox_failure in exclusive mode")
        .execute(&mut *hold)
        .await
        .expect("lock");
    release.notify_one();
    wait_until_a_lock_is_awaited(&app.pool).await;
    let retry = retry.await.expect("retry");
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    hold.commit().await.expect("commit");
    let original = original.await.expect("original");
    assert_eq!(original.status, StatusCode::INTERNAL_SERVER_ERROR);

    assert!(app.inbox_row("app", "k").await.is_some_and(|r| r.processed));
    let open: i64 = sqlx::query_scalar(
        "select count(*) from tower_inbox.inbox_quarantine
         where message_id = 'k' and decision is null",
    )
    .fetch_one(&app.pool)
    .await
    .expect("open items");
    assert_eq!(open, 0, "an open item about a command that succeeded");
}
