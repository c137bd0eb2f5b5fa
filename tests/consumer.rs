//! The broker consumer runner (`consumer::Consumer::process`) against a real PostgreSQL: each
//! outcome, what the broker is told, and what the database holds after it.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{credit_acct as credit, TestApp};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tokio::sync::Notify;
use tower_inbox::consumer::{Consumer, Disposition, Incoming, Processed};
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::ClaimedMessage;
use tower_inbox::outbox::OutboxMessage;
use tower_inbox::quarantine::{Quarantine, QuarantineFilter, QuarantineSource};
use tower_inbox::retention::RetentionPolicy;
use tower_inbox::{MessageKey, Producer};

fn incoming(key: &str, body: &str) -> Incoming {
    Incoming::new(
        Producer::new("payments").unwrap(),
        MessageKey::new(key).unwrap(),
        Fingerprint::of_bytes(body.as_bytes()),
    )
}

fn consumer(app: &TestApp) -> Consumer {
    Consumer::builder(app.pool.clone(), "worker")
        .in_flight_wait(Duration::from_millis(200))
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_redelivery_after_a_lost_ack_is_a_duplicate_and_applies_nothing() {
    let app = TestApp::new().await;
    let consumer = consumer(&app);
    let runs = AtomicUsize::new(0);
    let process = || {
        consumer.process(incoming("m1", "+1"), |message| {
            runs.fetch_add(1, Ordering::SeqCst);
            credit(message).boxed()
        })
    };
    let first = process().await;
    assert!(matches!(first, Processed::Applied(())), "{first:?}");
    assert_eq!(first.disposition(), Disposition::Ack);
    // The process died before its ack: the broker delivers the message again.
    let again = process().await;
    let Processed::Duplicate(entry) = &again else {
        panic!("{again:?}");
    };
    assert!(entry.processed);
    assert_eq!(again.disposition(), Disposition::Ack);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(app.balance("acct").await, Some(1));
}

#[tokio::test]
async fn the_same_id_with_another_payload_is_rejected_and_kept() {
    let app = TestApp::new().await;
    let consumer = consumer(&app);
    let applied = consumer
        .process(incoming("m1", "+1"), |m| credit(m).boxed())
        .await;
    assert!(matches!(applied, Processed::Applied(())));
    let conflict = consumer
        .process(incoming("m1", "+2"), |m| credit(m).boxed())
        .await;
    assert!(matches!(conflict, Processed::Conflict(_)), "{conflict:?}");
    assert_eq!(conflict.disposition(), Disposition::Reject);
    assert_eq!(app.balance("acct").await, Some(1));
    let items = Quarantine::new(app.pool.clone())
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].source, QuarantineSource::IdentityConflict);
}

/// A handler that writes, then fails.
fn fail(message: &mut ClaimedMessage) -> BoxFuture<'_, Result<(), &'static str>> {
    async move {
        credit(message).await.unwrap();
        Err("the body is not a command")
    }
    .boxed()
}

#[tokio::test]
async fn a_failing_message_is_retried_with_backoff_then_quarantined_and_rejected() {
    let app = TestApp::new().await;
    let consumer = Consumer::builder(app.pool.clone(), "worker")
        .quarantine_after(2)
        .failure_backoff(Duration::from_secs(1), Duration::from_secs(60))
        .build()
        .unwrap();
    let poison = |delivery: u32| incoming("poison", "not json").delivery(delivery);
    let first = consumer.process(poison(1), fail).await;
    let Processed::Failed { error, retry_in } = &first else {
        panic!("{first:?}");
    };
    assert_eq!(*error, "the body is not a command");
    assert!(*retry_in >= Duration::from_millis(500) && *retry_in <= Duration::from_secs(1));
    assert!(matches!(first.disposition(), Disposition::Retry(_)));
    let second = consumer.process(poison(2), fail).await;
    let Processed::Quarantined { quarantine_id, .. } = second else {
        panic!("{second:?}");
    };
    assert_eq!(
        Processed::<(), ()>::Quarantined {
            error: (),
            quarantine_id
        }
        .disposition(),
        Disposition::Reject
    );
    assert_eq!(app.balance("acct").await, None, "every attempt rolled back");
    assert_eq!(
        app.failures("payments", "poison").await.map(|f| f.0),
        Some(2)
    );
    // Other messages are not held up by it.
    let other = consumer
        .process(incoming("fine", "+1"), |m| credit(m).boxed())
        .await;
    assert!(matches!(other, Processed::Applied(())));
}

/// A handler whose first run credits, then runs `failing` through the watched executor: the
/// runner must run it again, and only the second run commits.
async fn first_run_fails_with(failing: &'static str) {
    let app = TestApp::new().await;
    let consumer = consumer(&app);
    let runs = AtomicUsize::new(0);
    let processed = consumer
        .process(incoming("m1", "+1"), |message| {
            let run = runs.fetch_add(1, Ordering::SeqCst);
            async move {
                credit(message).await?;
                if run == 0 {
                    sqlx::query(failing).execute(&mut *message).await?;
                }
                Ok::<_, sqlx::Error>(run)
            }
            .boxed()
        })
        .await;
    assert!(matches!(processed, Processed::Applied(1)), "{processed:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(app.balance("acct").await, Some(1));
}

#[tokio::test]
async fn a_serialization_failure_reruns_the_handler_and_applies_once() {
    first_run_fails_with("do $$ begin raise exception 'x' using errcode = '40001'; end $$").await;
}

#[tokio::test]
async fn a_connection_lost_in_the_handler_reruns_on_another_and_applies_once() {
    // The server ends this session: the statement fails, the connection is gone, and
    // nothing of the run committed.
    first_run_fails_with("select pg_terminate_backend(pg_backend_pid())").await;
}

#[tokio::test]
async fn a_message_held_by_another_consumer_is_retried_later_then_a_duplicate() {
    let app = TestApp::new().await;
    let consumer = consumer(&app);
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let holder = {
        let (consumer, started, release) = (consumer.clone(), started.clone(), release.clone());
        tokio::spawn(async move {
            consumer
                .process(incoming("m1", "+1"), |message| {
                    let (started, release) = (started.clone(), release.clone());
                    async move {
                        credit(message).await?;
                        started.notify_one();
                        release.notified().await;
                        Ok::<_, sqlx::Error>(())
                    }
                    .boxed()
                })
                .await
        })
    };
    started.notified().await;
    let busy = consumer
        .process(incoming("m1", "+1"), |m| credit(m).boxed())
        .await;
    assert!(matches!(busy, Processed::InProgress), "{busy:?}");
    assert!(matches!(busy.disposition(), Disposition::Retry(_)));
    release.notify_one();
    assert!(matches!(holder.await.unwrap(), Processed::Applied(())));
    let later = consumer
        .process(incoming("m1", "+1"), |m| credit(m).boxed())
        .await;
    assert!(matches!(later, Processed::Duplicate(_)), "{later:?}");
    assert_eq!(app.balance("acct").await, Some(1));
}

#[tokio::test]
async fn a_message_older_than_the_window_is_rejected_and_kept() {
    let app = TestApp::new().await;
    let policy = RetentionPolicy::builder()
        .retry_horizon(Duration::from_secs(3600))
        .safety_margin(Duration::from_secs(3600))
        .build()
        .unwrap();
    let consumer = Consumer::builder(app.pool.clone(), "worker")
        .retention(policy)
        .build()
        .unwrap();
    let old = time::OffsetDateTime::now_utc() - time::Duration::days(30);
    let processed = consumer
        .process(incoming("old", "+1").produced_at(old), |m| {
            credit(m).boxed()
        })
        .await;
    assert!(matches!(processed, Processed::Expired(_)), "{processed:?}");
    assert_eq!(processed.disposition(), Disposition::Reject);
    assert_eq!(app.balance("acct").await, None);
    let fresh = time::OffsetDateTime::now_utc();
    let processed = consumer
        .process(incoming("new", "+1").produced_at(fresh), |m| {
            credit(m).boxed()
        })
        .await;
    assert!(matches!(processed, Processed::Applied(())), "{processed:?}");
}

#[tokio::test]
async fn outbox_effects_commit_with_the_claim_and_only_once() {
    let app = TestApp::new().await;
    let consumer = consumer(&app);
    for _ in 0..2 {
        consumer
            .process(incoming("m1", "+1"), |message| {
                async move {
                    credit(message).await?;
                    let event = OutboxMessage::new("credits.events.acct", &b"{}"[..]);
                    message.enqueue("credited", &event).await.unwrap();
                    Ok::<_, sqlx::Error>(())
                }
                .boxed()
            })
            .await;
    }
    let effects: i64 = sqlx::query_scalar("select count(*) from tower_inbox.message_outbox")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(effects, 1);
}
