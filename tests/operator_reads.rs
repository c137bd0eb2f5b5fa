//! The reads operators use (the command line's, and anyone's tooling) when the database is
//! unreachable: each returns its component's error, promptly, and panics on nothing.

mod common;

use common::unreachable_pool;
use tower_inbox::inbox::Inbox;
use tower_inbox::outbox::{EffectId, Outbox, OutboxFilter};
use tower_inbox::quarantine::{Quarantine, QuarantineFilter, QuarantineQuery, QuarantineState};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

#[tokio::test]
async fn every_operator_read_fails_cleanly_when_the_database_is_down() {
    let pool = unreachable_pool();
    let identity = MessageIdentity::new(
        "ops",
        Producer::new("app").unwrap(),
        MessageKey::new("k1").unwrap(),
    );
    let inbox = Inbox::new(pool.clone());
    let outbox = Outbox::new(pool.clone());
    let quarantine = Quarantine::new(pool);
    let errors = [
        inbox.lookup(&identity).await.err().map(|e| e.to_string()),
        inbox.times(&identity).await.err().map(|e| e.to_string()),
        inbox
            .failure_record(&identity)
            .await
            .err()
            .map(|e| e.to_string()),
        inbox
            .claims_in_flight(&["ops"])
            .await
            .err()
            .map(|e| e.to_string()),
        outbox
            .entry(&EffectId::new("e1"))
            .await
            .err()
            .map(|e| e.to_string()),
        outbox
            .list(OutboxFilter::Dead, None, 10)
            .await
            .err()
            .map(|e| e.to_string()),
        outbox
            .for_message(&identity)
            .await
            .err()
            .map(|e| e.to_string()),
        quarantine
            .list(QuarantineFilter::Open, 10)
            .await
            .err()
            .map(|e| e.to_string()),
        quarantine.get(1).await.err().map(|e| e.to_string()),
        quarantine
            .for_identity(&identity)
            .await
            .err()
            .map(|e| e.to_string()),
        quarantine
            .latest_for_effect("e1")
            .await
            .err()
            .map(|e| e.to_string()),
        quarantine
            .query(
                &QuarantineQuery {
                    state: QuarantineState::Decided,
                    reason: None,
                    consumer: None,
                },
                10,
            )
            .await
            .err()
            .map(|e| e.to_string()),
    ];
    for (i, error) in errors.iter().enumerate() {
        let error = error
            .as_deref()
            .unwrap_or_else(|| panic!("read {i} succeeded"));
        assert!(!error.is_empty(), "read {i}");
    }
}
