//! Expected inputs leave nothing in the PostgreSQL server log: every duplicate, conflict,
//! rejection, failure and refusal the protocol answers is answered without the server raising
//! an error or warning. A log full of expected errors hides the real ones.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use common::{
    credit, credit_raw, gated_router, logging_cluster, send, spawn_send,
    wait_until_a_lock_is_awaited, wait_until_waiting, Reply, TestApp,
};
use time::OffsetDateTime;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{ClaimMode, Inbox};
use tower_inbox::quarantine::{Quarantine, QuarantineSource};
use tower_inbox::retention::{GuardedClaim, RetentionGuard, RetentionPolicy};
use tower_inbox::{MessageIdentity, MessageKey, Producer};
use tower_inbox_testdb::{Cluster, LogMark};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// The log since `mark` has no problem line; returns a mark for the next section.
fn assert_quiet(cluster: &Cluster, mark: LogMark, section: &str) -> LogMark {
    let log = cluster.log_since(mark).expect("server log");
    let problems = common::log_problems(&log);
    assert!(
        problems.is_empty(),
        "{section}: the server logged {} problem line(s):\n{}\n--- the log since the section \
         began:\n{log}",
        problems.len(),
        problems.join("\n")
    );
    cluster.log_mark().expect("log mark")
}

fn assert_first_seen(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
    assert!(!reply.replayed());
}

fn assert_replay_of(reply: &Reply, original: &Reply) {
    assert_eq!(reply.status, original.status, "{:?}", reply.body);
    assert!(reply.replayed(), "not a replay: {reply:?}");
    assert_eq!(reply.body, original.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expected_inputs_leave_no_error_or_warning_in_the_server_log() {
    let cluster = logging_cluster().await;
    let app = TestApp::on(cluster.database().await.expect("database"), 10).await;
    let router = app.credits();
    // Migrations may log notices; only what the requests cause counts.
    let mark = cluster.log_mark().expect("log mark");

    // A sequential duplicate replays.
    let first = send(&router, credit("a1", Some("seq"), Some("app"), 10)).await;
    assert_first_seen(&first);
    let again = send(&router, credit("a1", Some("seq"), Some("app"), 10)).await;
    assert_replay_of(&again, &first);
    let mark = assert_quiet(&cluster, mark, "sequential duplicate");

    // 200 requests of one key: 100 at once from the start (one claims, the others wait for
    // it, or give up with 409 in-progress), then 100 one after another.
    let storm = || send(&router, credit("a2", Some("storm"), Some("app"), 3));
    let mut replies = futures_util::future::join_all((0..100).map(|_| storm())).await;
    for _ in 0..100 {
        replies.push(storm().await);
    }
    let mut first_seen = 0;
    for reply in &replies {
        match reply.status {
            StatusCode::CREATED => first_seen += usize::from(!reply.replayed()),
            StatusCode::CONFLICT => assert_eq!(reply.problem_type(), "in-progress"),
            other => panic!("unexpected {other}: {:?}", reply.body),
        }
    }
    assert_eq!(first_seen, 1, "exactly one first-seen answer");
    assert!(replies[100..].iter().all(Reply::replayed));
    assert_eq!(app.ledger_rows("a2").await, 1);
    let mark = assert_quiet(&cluster, mark, "200 duplicates of one key");

    // The key again with another payload: 409, quarantined.
    let mismatch = send(&router, credit("a1", Some("seq"), Some("app"), 11)).await;
    assert_eq!(mismatch.status, StatusCode::CONFLICT);
    assert_eq!(mismatch.problem_type(), "payload-mismatch");
    let mark = assert_quiet(&cluster, mark, "payload mismatch");

    // With lookup first off, the claim statement itself finds the key taken.
    let no_lookup = app.credits_with(|b| b.lookup_before_claim(false));
    assert_replay_of(
        &send(&no_lookup, credit("a1", Some("seq"), Some("app"), 10)).await,
        &first,
    );
    let conflict = send(&no_lookup, credit("a1", Some("seq"), Some("app"), 12)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    let mark = assert_quiet(&cluster, mark, "duplicate without lookup first");

    // In-flight duplicates, with and without lookup first: one waits and replays, one
    // gives up with 409 in-progress.
    let mut mark = mark;
    for lookup in [true, false] {
        let key = format!("in-flight-{lookup}");
        let (router, gate, calls) = gated_router(&app, |b| {
            b.lookup_before_claim(lookup)
                .in_flight_wait(Duration::from_secs(30))
        });
        let impatient = app.credits_with(|b| {
            b.lookup_before_claim(lookup)
                .in_flight_wait(Duration::from_millis(50))
        });
        let original = spawn_send(&router, credit("a3", Some(&key), Some("app"), 1));
        gate.started.notified().await;
        let waiting = spawn_send(&router, credit("a3", Some(&key), Some("app"), 1));
        wait_until_waiting(&gate.inbox, 1).await;
        let gave_up = send(&impatient, credit("a3", Some(&key), Some("app"), 1)).await;
        assert_eq!(gave_up.status, StatusCode::CONFLICT);
        assert_eq!(gave_up.problem_type(), "in-progress");
        gate.release.notify_one();
        let original = original.await.expect("original");
        assert_first_seen(&original);
        assert_replay_of(&waiting.await.expect("waiting duplicate"), &original);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        mark = assert_quiet(
            &cluster,
            mark,
            &format!("in-flight duplicates, lookup {lookup}"),
        );
    }

    // Claim at commit, sequential duplicates: answered by the lookup, or (lookup off) run
    // and rolled back when the claim at commit finds the key taken.
    let at_commit = app.credits_with(|b| b.claim_mode(ClaimMode::AtCommit));
    let at_commit_blind =
        app.credits_with(|b| b.claim_mode(ClaimMode::AtCommit).lookup_before_claim(false));
    let first = send(&at_commit, credit("a4", Some("commit"), Some("app"), 5)).await;
    assert_first_seen(&first);
    for router in [&at_commit, &at_commit_blind] {
        let again = send(router, credit("a4", Some("commit"), Some("app"), 5)).await;
        assert_replay_of(&again, &first);
    }
    let conflict = send(
        &at_commit_blind,
        credit("a4", Some("commit"), Some("app"), 6),
    )
    .await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    assert_eq!(app.ledger_rows("a4").await, 1);
    let mark = assert_quiet(&cluster, mark, "claim at commit, sequential duplicates");

    // Claim at commit, racing: the duplicate runs while the original is in flight (its
    // write waits for the original's row lock), and its claim at commit finds the key taken.
    let (router, gate, calls) = gated_router(&app, |b| {
        b.claim_mode(ClaimMode::AtCommit)
            .lookup_before_claim(false)
            .in_flight_wait(Duration::from_secs(30))
    });
    let original = spawn_send(&router, credit("a5", Some("race"), Some("app"), 1));
    gate.started.notified().await;
    let racing = spawn_send(&router, credit("a5", Some("race"), Some("app"), 1));
    wait_until_a_lock_is_awaited(&app.pool).await;
    gate.release.notify_one();
    let original = original.await.expect("original");
    assert_first_seen(&original);
    gate.started.notified().await;
    gate.release.notify_one();
    assert_replay_of(&racing.await.expect("racing duplicate"), &original);
    assert_eq!(calls.load(Ordering::SeqCst), 2, "both ran the handler");
    assert_eq!(app.balance("a5").await, Some(1), "one committed");
    let mark = assert_quiet(&cluster, mark, "claim at commit, racing duplicate");

    // A 422 rolls back unrecorded; the key stays usable.
    let router = app.credits();
    let invalid = send(
        &router,
        credit_raw("a6", Some("fixed"), Some("app"), r#"{"delta": "ten"}"#),
    )
    .await;
    assert_eq!(invalid.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_first_seen(&send(&router, credit("a6", Some("fixed"), Some("app"), 4)).await);
    let mark = assert_quiet(&cluster, mark, "key reused after a 422");

    // A handler 5xx rolls back, and its failure is recorded.
    let (failing, gate, _) = gated_router(&app, |b| b);
    *gate.status.lock().unwrap() = StatusCode::SERVICE_UNAVAILABLE;
    gate.release.notify_one();
    let failed = send(&failing, credit("a7", Some("down"), Some("app"), 1)).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(app.balance("a7").await, None, "rolled back");
    assert_eq!(app.failures("app", "down").await.map(|f| f.0), Some(1));
    let mark = assert_quiet(&cluster, mark, "handler 5xx");

    // The retention guard refuses a first-seen message produced long before its window.
    let policy = RetentionPolicy::builder()
        .retry_horizon(DAY)
        .safety_margin(DAY)
        .build()
        .expect("policy");
    let guard = RetentionGuard::new(Inbox::new(app.pool.clone()), &policy);
    let identity = MessageIdentity::new(
        common::credits::CONSUMER,
        Producer::new("app").unwrap(),
        MessageKey::new("expired").unwrap(),
    );
    let produced_at = OffsetDateTime::now_utc() - 30 * DAY;
    let refused = guard
        .claim(
            identity.clone(),
            Fingerprint::of_bytes(b"{}"),
            "v1",
            Duration::from_secs(1),
            produced_at,
        )
        .await
        .expect("guarded claim");
    assert!(matches!(refused, GuardedClaim::Expired(_)), "{refused:?}");
    let items = Quarantine::new(app.pool.clone())
        .for_identity(&identity)
        .await
        .expect("quarantine");
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].source, QuarantineSource::ExpiredMessage);
    let mark = assert_quiet(&cluster, mark, "retention guard");

    // The check reads the log the server writes: an error is there at once.
    let err = sqlx::query("select 1/0")
        .execute(&app.pool)
        .await
        .expect_err("division by zero");
    assert!(err.to_string().contains("division by zero"), "{err}");
    let log = cluster.log_since(mark).expect("server log");
    let problems = common::log_problems(&log);
    assert!(
        problems
            .iter()
            .any(|line| line.contains("ERROR:") && line.contains("division by zero")),
        "the server log does not show the error:\n{log}"
    );
}
