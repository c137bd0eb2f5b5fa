//! The claim-at-commit mode: the handler's statements first, the inbox row with the recorded
//! response last. The invariant is the same as claiming first: at most one committed
//! transition per command, sequential and concurrent duplicates answered from the record.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::{credit, send, TestApp};
use tower_inbox::inbox::{ClaimMode, IsolationLevel};
use tower_inbox::producer::TrustedHeader;
use tower_inbox::quarantine::{Quarantine, QuarantineFilter, QuarantineSource};
use tower_inbox::{InboxLayer, InboxTx};

fn at_commit(app: &TestApp) -> Router {
    app.credits_with(|b| b.claim_mode(ClaimMode::AtCommit))
}

#[tokio::test]
async fn a_sequential_duplicate_is_rolled_back_and_replayed() {
    let app = TestApp::new().await;
    let router = at_commit(&app);
    let first = send(&router, credit("a1", Some("k1"), Some("app"), 10)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    let again = send(&router, credit("a1", Some("k1"), Some("app"), 10)).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, first.body, "byte for byte");
    // The duplicate ran the handler, and all of it rolled back.
    assert_eq!(app.ledger_rows("a1").await, 1);
    assert_eq!(app.balance("a1").await, Some(10));
    let row = app.inbox_row("app", "k1").await.expect("recorded");
    assert!(row.processed);
    assert_eq!(row.status, Some(201));
    assert_eq!(row.body.as_deref(), Some(&first.body[..]));
}

async fn concurrent_duplicates(level: IsolationLevel) {
    let app = TestApp::with_pool_size(40).await;
    let router = app.credits_with(|b| {
        b.claim_mode(ClaimMode::AtCommit)
            .isolation_level(level)
            .in_flight_wait(Duration::from_secs(10))
    });
    let replies = futures_util::future::join_all(
        (0..24).map(|_| send(&router, credit("acct", Some("same"), Some("app"), 7))),
    )
    .await;
    let mut first_seen = 0;
    for reply in &replies {
        match reply.status {
            StatusCode::CREATED => {
                assert_eq!(reply.json()["balance"], 7, "{level:?}");
                first_seen += usize::from(!reply.replayed());
            }
            StatusCode::CONFLICT => assert_eq!(reply.problem_type(), "in-progress"),
            other => panic!("{level:?}: unexpected {other}: {:?}", reply.body),
        }
    }
    assert_eq!(first_seen, 1, "{level:?}: exactly one first-seen answer");
    assert_eq!(app.ledger_rows("acct").await, 1, "{level:?}: applied once");
    assert_eq!(app.balance("acct").await, Some(7), "{level:?}");
    assert_eq!(app.inbox_rows().await, 1);
}

#[tokio::test]
async fn concurrent_duplicates_commit_once_at_read_committed() {
    concurrent_duplicates(IsolationLevel::ReadCommitted).await;
}

#[tokio::test]
async fn concurrent_duplicates_commit_once_at_repeatable_read() {
    concurrent_duplicates(IsolationLevel::RepeatableRead).await;
}

#[tokio::test]
async fn concurrent_duplicates_commit_once_at_serializable() {
    concurrent_duplicates(IsolationLevel::Serializable).await;
}

#[tokio::test]
async fn a_different_payload_is_a_conflict_and_the_original_stays() {
    let app = TestApp::new().await;
    let router = at_commit(&app);
    let first = send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = send(&router, credit("a1", Some("k"), Some("app"), 11)).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.problem_type(), "payload-mismatch");
    assert_eq!(app.ledger_rows("a1").await, 1);
    assert_eq!(app.balance("a1").await, Some(10));
    let items = Quarantine::new(app.pool.clone())
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].source, QuarantineSource::IdentityConflict);
}

#[tokio::test]
async fn a_duplicate_of_an_in_flight_original_waits_then_replays_or_gets_409() {
    let app = TestApp::with_pool_size(10).await;
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (entered, release, runs) = (entered.clone(), release.clone(), runs.clone());
        move |mut tx: InboxTx| {
            let (entered, release, runs) = (entered.clone(), release.clone(), runs.clone());
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst);
                let id = tx.identity().message_id().as_str().to_owned();
                sqlx::query("insert into applied values ($1)")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .expect("insert");
                if run == 0 {
                    // The original stops here, before its commit claims the key.
                    entered.notify_one();
                    release.notified().await;
                }
                (StatusCode::CREATED, "done")
            }
        }
    };
    sqlx::query("create table applied (message_id text not null)")
        .execute(&app.pool)
        .await
        .unwrap();
    let layer = |wait: Duration| {
        InboxLayer::builder(app.pool.clone(), "at-commit")
            .producer(TrustedHeader::new("x-producer"))
            .claim_mode(ClaimMode::AtCommit)
            .in_flight_wait(wait)
            .build()
            .unwrap()
    };
    let router = Router::new()
        .route("/run", post(handler.clone()))
        .layer(layer(Duration::from_secs(30)));
    let request = || {
        axum::http::Request::post("/run")
            .header("idempotency-key", "k")
            .header("x-producer", "app")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let original = tokio::spawn({
        let router = router.clone();
        async move { send(&router, request()).await }
    });
    entered.notified().await;
    // Nothing is claimed while the original's handler runs: the duplicate runs too, and
    // commits first. The original then finds the key taken and rolls back.
    let duplicate = send(&router, request()).await;
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(!duplicate.replayed());
    release.notify_one();
    let original = original.await.unwrap();
    assert_eq!(original.status, StatusCode::CREATED);
    assert!(
        original.replayed(),
        "the original lost the race and replays"
    );
    let applied: i64 = sqlx::query_scalar("select count(*) from applied")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(applied, 1, "exactly one run committed");
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // A duplicate whose commit meets an uncommitted claim waits for it, within the bound.
    // TRUNCATE of the crate's table is the owner's.
    sqlx::query("truncate tower_inbox.consumer_inbox, applied")
        .execute(&app.owner)
        .await
        .unwrap();
    // Another process holds an uncommitted claim of the key.
    let identity = tower_inbox::MessageIdentity::new(
        "at-commit",
        tower_inbox::Producer::new("app").unwrap(),
        tower_inbox::MessageKey::new("k").unwrap(),
    );
    let claim = tower_inbox::inbox::Inbox::new(app.pool.clone())
        .claim(
            identity,
            tower_inbox::fingerprint::Fingerprint::of_bytes(b"other"),
            "1",
            Duration::ZERO,
        )
        .await
        .unwrap();
    let tower_inbox::inbox::Claim::Claimed(holder) = claim else {
        panic!("the key is free: {claim:?}");
    };
    let impatient = Router::new()
        .route("/run", post(handler))
        .layer(layer(Duration::from_millis(100)));
    let reply = send(&impatient, request()).await;
    assert_eq!(reply.status, StatusCode::CONFLICT);
    assert_eq!(reply.problem_type(), "in-progress");
    holder.rollback().await.unwrap();
    let applied: i64 = sqlx::query_scalar("select count(*) from applied")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(applied, 0, "the refused duplicate rolled back");
    let reply = send(&impatient, request()).await;
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "free again once it rolled back"
    );
}

#[tokio::test]
async fn failures_roll_back_and_a_later_success_recovers_the_quarantine_item() {
    let app = TestApp::new().await;
    let fail = Arc::new(AtomicUsize::new(2));
    let handler = {
        let fail = fail.clone();
        move |mut tx: InboxTx| {
            let fail = fail.clone();
            async move {
                sqlx::query("insert into credit_account values ('x', 1)")
                    .execute(&mut *tx)
                    .await
                    .expect("write");
                if fail
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
                {
                    return StatusCode::SERVICE_UNAVAILABLE;
                }
                StatusCode::CREATED
            }
        }
    };
    let router = Router::new().route("/run", post(handler)).layer(
        InboxLayer::builder(app.pool.clone(), "at-commit")
            .producer(TrustedHeader::new("x-producer"))
            .claim_mode(ClaimMode::AtCommit)
            .quarantine_after(2)
            .build()
            .unwrap(),
    );
    let request = || {
        axum::http::Request::post("/run")
            .header("idempotency-key", "k")
            .header("x-producer", "app")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    for _ in 0..2 {
        let reply = send(&router, request()).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(app.inbox_rows().await, 0);
        assert_eq!(app.balance("x").await, None);
    }
    let quarantine = Quarantine::new(app.pool.clone());
    let open = quarantine.list(QuarantineFilter::Open, 10).await.unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].source, QuarantineSource::HandlerFailure);

    let reply = send(&router, request()).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(app.balance("x").await, Some(1));
    let item = quarantine.get(open[0].id).await.unwrap().unwrap();
    assert!(
        item.recovered_at.is_some(),
        "recovered in the commit's own statement"
    );
}

#[tokio::test]
async fn a_serialization_failure_at_the_claim_statement_reruns_the_handler() {
    let app = TestApp::new().await;
    // The first two claims at commit fail the way SERIALIZABLE fails them.
    sqlx::raw_sql(
        "create sequence claims;
         -- security definer: the sequence is the owner's, the service only fires the trigger.
         create function refuse_claims() returns trigger language plpgsql
             security definer as $$
         begin
             if nextval('claims') <= 2 then
                 raise exception 'forced' using errcode = '40001';
             end if;
             return new;
         end $$;
         create trigger refuse_claims before insert on tower_inbox.consumer_inbox
             for each row execute function refuse_claims();",
    )
    // A trigger on the crate's table is the owner's to create.
    .execute(&app.owner)
    .await
    .unwrap();
    let router = at_commit(&app);
    let reply = send(&router, credit("a1", Some("k"), Some("app"), 5)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert!(!reply.replayed());
    assert_eq!(
        app.ledger_rows("a1").await,
        1,
        "two runs rolled back, one committed"
    );
    assert_eq!(app.balance("a1").await, Some(5));
}
