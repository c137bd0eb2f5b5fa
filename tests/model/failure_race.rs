//! The race the model used to tolerate, made deterministic: a failed attempt rolls back first
//! and counts its failure afterwards, in a transaction of its own, and a retry can claim the
//! key in between. Its claim then sees no failure record, so its commit recovers nothing; a
//! quarantine item the late count opened would stay open about a command that succeeded,
//! fire the open-quarantine alert and keep the command's row from the purge. The count takes
//! the key's claim lock first and opens an item only when it holds the lock and nothing has
//! committed the command; these tests hold the retry at each point of the race.

use std::time::Duration;

use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{Claim, ClaimedMessage, Inbox, RecordedResponse};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

use crate::common::TestApp;

const CONSUMER: &str = "failure-race";

fn identity(key: &str) -> MessageIdentity {
    MessageIdentity::new(
        CONSUMER,
        Producer::new("app").expect("producer"),
        MessageKey::new(key).expect("key"),
    )
}

fn payload() -> Fingerprint {
    Fingerprint::of_bytes(b"credit 1")
}

/// The retry: claims `key`, which must be free.
async fn claim(inbox: &Inbox, key: &str) -> ClaimedMessage {
    match inbox
        .claim(identity(key), payload(), "v1", Duration::ZERO)
        .await
        .expect("claim")
    {
        Claim::Claimed(message) => message,
        other => panic!("{key} was not free: {other:?}"),
    }
}

async fn commit(message: ClaimedMessage) {
    let response = RecordedResponse {
        status: 201,
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"{}"),
    };
    message.commit(Some(&response)).await.expect("commit");
}

/// The original's failure, counted after its rollback, with a quarantine from the first.
async fn count_failure(inbox: &Inbox, key: &str) -> Option<i64> {
    inbox
        .record_failure(&identity(key), payload(), "v1", "handler-error", 1)
        .await
        .expect("record the failure")
}

/// The key's failure count and its open quarantine items.
async fn state(app: &TestApp, key: &str) -> (Option<i32>, i64) {
    let attempts = app.failures("app", key).await.map(|(attempts, _)| attempts);
    let open: i64 = sqlx::query_scalar(
        "select count(*) from tower_inbox.inbox_quarantine
         where consumer_name = $1 and message_id = $2 and decision is null",
    )
    .bind(CONSUMER)
    .bind(key)
    .fetch_one(&app.pool)
    .await
    .expect("open items");
    (attempts, open)
}

#[tokio::test]
async fn a_failure_counted_while_a_retry_holds_the_claim_opens_no_item() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());

    let retry = claim(&inbox, "held").await;
    assert_eq!(count_failure(&inbox, "held").await, None);
    assert_eq!(state(&app, "held").await, (Some(1), 0), "counted, no item");
    commit(retry).await;
    assert!(app
        .inbox_row("app", "held")
        .await
        .is_some_and(|r| r.processed));
    assert_eq!(state(&app, "held").await, (Some(1), 0), "nothing left open");
}

#[tokio::test]
async fn a_failure_counted_after_a_retry_committed_opens_no_item() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());

    commit(claim(&inbox, "done").await).await;
    assert_eq!(count_failure(&inbox, "done").await, None);
    assert_eq!(state(&app, "done").await, (Some(1), 0));
}

#[tokio::test]
async fn when_the_retry_fails_too_its_count_opens_the_item_with_both_failures() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());

    let retry = claim(&inbox, "twice").await;
    assert_eq!(count_failure(&inbox, "twice").await, None);
    retry.rollback().await.expect("rollback");
    let item = count_failure(&inbox, "twice").await;
    assert!(
        item.is_some(),
        "the retry's own failure quarantines the command"
    );
    assert_eq!(state(&app, "twice").await, (Some(2), 1));
    let attempts: i32 =
        sqlx::query_scalar("select attempts from tower_inbox.inbox_quarantine where id = $1")
            .bind(item)
            .fetch_one(&app.pool)
            .await
            .expect("item");
    assert_eq!(attempts, 2);
}

#[tokio::test]
async fn without_a_retry_the_failure_opens_the_item() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());

    assert!(count_failure(&inbox, "alone").await.is_some());
    assert_eq!(state(&app, "alone").await, (Some(1), 1));
}
