//! The opt-in replay cache: duplicates of commands this process completed are answered from
//! memory, conflicts are still conflicts, and the cache stays within its bounds.

mod common;

use axum::http::StatusCode;
use common::{credit, send, TestApp};
use tower_inbox::inbox::ClaimMode;
use tower_inbox::middleware::ReplayCache;
use tower_inbox::quarantine::{Quarantine, QuarantineFilter, QuarantineSource};

#[tokio::test]
async fn a_cached_duplicate_is_answered_without_the_database() {
    let app = TestApp::new().await;
    let cache = ReplayCache::new(1000, 1 << 20).unwrap();
    let router = app.credits_with(|b| b.replay_cache(cache.clone()));
    let first = send(&router, credit("a1", Some("k1"), Some("app"), 10)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(cache.len(), 1, "the committed response is kept");

    // With the database gone, the cached duplicate is still answered, byte for byte; an
    // unknown key is not (503): the cache never invents an answer.
    app.pool.close().await;
    let again = send(&router, credit("a1", Some("k1"), Some("app"), 10)).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["content-type"], first.headers["content-type"]);
    let unknown = send(&router, credit("a1", Some("k2"), Some("app"), 10)).await;
    assert_eq!(unknown.status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn a_cached_key_with_another_payload_is_still_a_conflict() {
    let app = TestApp::new().await;
    let cache = ReplayCache::new(1000, 1 << 20).unwrap();
    let router = app.credits_with(|b| b.replay_cache(cache.clone()));
    send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    let other = send(&router, credit("a1", Some("k"), Some("app"), 11)).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.problem_type(), "payload-mismatch");
    assert_eq!(app.ledger_rows("a1").await, 1);
    let items = Quarantine::new(app.pool.clone())
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    assert_eq!(items.len(), 1, "quarantined as without the cache");
    assert_eq!(items[0].source, QuarantineSource::IdentityConflict);
}

#[tokio::test]
async fn the_same_key_from_another_producer_is_not_a_cache_hit() {
    let app = TestApp::new().await;
    let cache = ReplayCache::new(1000, 1 << 20).unwrap();
    let router = app.credits_with(|b| b.replay_cache(cache.clone()));
    send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    let theirs = send(&router, credit("a1", Some("k"), Some("other"), 10)).await;
    assert_eq!(theirs.status, StatusCode::CREATED);
    assert!(!theirs.replayed(), "a command of its own");
    assert_eq!(app.ledger_rows("a1").await, 2);
    assert_eq!(cache.len(), 2);
}

#[tokio::test]
async fn a_duplicate_replayed_from_the_database_is_cached_for_the_next() {
    let app = TestApp::new().await;
    // Another instance (no cache) processed the command.
    send(&app.credits(), credit("a1", Some("k"), Some("app"), 10)).await;
    let cache = ReplayCache::new(1000, 1 << 20).unwrap();
    let router = app.credits_with(|b| b.replay_cache(cache.clone()));
    assert!(cache.is_empty());
    let from_db = send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    assert!(from_db.replayed());
    assert_eq!(cache.len(), 1);
    app.pool.close().await;
    let from_memory = send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    assert!(from_memory.replayed());
    assert_eq!(from_memory.body, from_db.body);
}

#[tokio::test]
async fn rejected_and_failed_answers_are_not_cached() {
    let app = TestApp::new().await;
    let cache = ReplayCache::new(1000, 1 << 20).unwrap();
    let router = app.credits_with(|b| b.replay_cache(cache.clone()));
    let rejected = send(
        &router,
        common::credit_raw("a1", Some("k"), Some("app"), "not json"),
    )
    .await;
    assert_eq!(rejected.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(cache.is_empty(), "a rolled-back answer is not a record");
    // The corrected request with the same key is processed.
    let fixed = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(fixed.status, StatusCode::CREATED);
    assert!(!fixed.replayed());
}

#[tokio::test]
async fn the_cache_stays_within_its_entry_and_byte_limits() {
    let app = TestApp::with_pool_size(10).await;
    let cache = ReplayCache::new(50, 1 << 20).unwrap();
    let router = app.credits_with(|b| b.replay_cache(cache.clone()));
    for i in 0..300 {
        let reply = send(
            &router,
            credit(&format!("a{i}"), Some(&format!("k{i}")), Some("app"), 1),
        )
        .await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    assert!(
        cache.len() <= 50 && !cache.is_empty(),
        "{} entries",
        cache.len()
    );
    assert!(cache.weight() <= 1 << 20);

    let small = ReplayCache::new(1_000_000, 8 * 1024).unwrap();
    let router = app.credits_with(|b| b.replay_cache(small.clone()));
    for i in 0..300 {
        send(
            &router,
            credit(&format!("b{i}"), Some(&format!("m{i}")), Some("app"), 1),
        )
        .await;
    }
    assert!(small.weight() <= 8 * 1024, "{} bytes", small.weight());
    assert!(small.len() < 300);
}

#[tokio::test]
async fn the_cache_answers_duplicates_in_claim_at_commit_mode_before_the_handler() {
    let app = TestApp::new().await;
    let cache = ReplayCache::new(1000, 1 << 20).unwrap();
    let router = app.credits_with(|b| {
        b.claim_mode(ClaimMode::AtCommit)
            .replay_cache(cache.clone())
    });
    send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    // Make any run of the handler fail loudly: a cached duplicate must not reach it.
    // ALTER TABLE is the owner's.
    sqlx::query("alter table credit_ledger add constraint no_more check (false) not valid")
        .execute(&app.owner)
        .await
        .unwrap();
    let again = send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(app.ledger_rows("a1").await, 1);
}

/// Holds `EXCLUSIVE` on the inbox table: every write to it (a claim) waits, reads do not.
async fn block_inbox_writes(app: &TestApp) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = app.pool.begin().await.unwrap();
    sqlx::query("lock table tower_inbox.consumer_inbox in exclusive mode")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

#[tokio::test]
async fn a_lookup_before_the_claim_answers_duplicates_without_a_transaction_or_a_write() {
    let app = TestApp::new().await;
    // The default: the lookup comes first.
    let looking = app.credits();
    let first = send(&looking, credit("a1", Some("k"), Some("app"), 10)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed(), "a miss goes on to the claim");

    let blocker = block_inbox_writes(&app).await;
    // Every write to the inbox waits on the lock: the lookup answers from one read.
    let looked = send(&looking, credit("a1", Some("k"), Some("app"), 10)).await;
    assert_eq!(looked.status, StatusCode::CREATED);
    assert!(looked.replayed());
    assert_eq!(looked.body, first.body);
    let conflict = send(&looking, credit("a1", Some("k"), Some("app"), 11)).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    // A new key has to claim: its insert waits for the lock, and commits once it is gone.
    let new = tokio::spawn({
        let looking = looking.clone();
        async move { send(&looking, credit("a1", Some("n"), Some("app"), 10)).await }
    });
    blocker.rollback().await.unwrap();
    assert_eq!(new.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(app.ledger_rows("a1").await, 2);
}

#[tokio::test]
async fn a_lookup_answer_fills_the_replay_cache() {
    let app = TestApp::new().await;
    send(&app.credits(), credit("a1", Some("k"), Some("app"), 10)).await;
    let cache = ReplayCache::new(100, 1 << 20).unwrap();
    let router = app.credits_with(|b| b.replay_cache(cache.clone()));
    let looked = send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    assert!(looked.replayed());
    assert_eq!(cache.len(), 1);
}
