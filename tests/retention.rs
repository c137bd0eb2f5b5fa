//! Retention against a real PostgreSQL: the policy, the purge (batches, dry run, what it
//! must keep), the background task, the guard, and their database error paths. Time cannot
//! be advanced, so rows are aged by moving their timestamps back. The services and purgers
//! run on `TestApp::pool`, a role that is neither superuser nor owner; DDL is the owner's.
//! (Over 400 lines: the purge's many must-keep rules and error paths share these helpers.)

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{credit, send, unreachable_pool, TestApp};
use time::OffsetDateTime;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{Claim, Inbox, InboxError};
use tower_inbox::outbox::{enqueue, Delivery, Dispatcher, Effect, OutboxMessage, Transport};
use tower_inbox::quarantine::{Decision, Quarantine, QuarantineSource};
use tower_inbox::retention::{
    GuardedClaim, PurgedTable, Purger, RetentionError, RetentionGuard, RetentionPolicy,
};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);
/// Past every window below.
const OLD: Duration = Duration::from_secs(10 * 24 * 3600);
/// Inside every window below.
const RECENT: Duration = Duration::from_secs(2 * 24 * 3600);
const CONSUMER: &str = "ledger";
const WAIT: Duration = Duration::from_secs(5);

/// Four days: a dead letter can be redriven within three, plus a day of margin.
fn inbox_policy() -> RetentionPolicy {
    RetentionPolicy::builder()
        .retry_horizon(HOUR)
        .dead_letter_redrive(3 * DAY)
        .safety_margin(DAY)
        .build()
        .expect("policy")
}

fn identity(key: &str) -> MessageIdentity {
    MessageIdentity::new(
        CONSUMER,
        Producer::new("payments").unwrap(),
        MessageKey::new(key).unwrap(),
    )
}

fn body(key: &str) -> Fingerprint {
    Fingerprint::of_bytes(format!(r#"{{"credit":"{key}","delta":10}}"#).as_bytes())
}

fn ago(age: Duration) -> OffsetDateTime {
    OffsetDateTime::now_utc() - age
}

/// A consumer applying one credit of 10 to `acct` under the claim, as a broker consumer would.
async fn apply(message: &mut tower_inbox::inbox::ClaimedMessage) {
    let id = message.identity().clone();
    sqlx::query(
        "insert into credit_account (account_id, balance) values ('acct', 10)
         on conflict (account_id) do update set balance = credit_account.balance + 10",
    )
    .execute(&mut *message)
    .await
    .unwrap();
    sqlx::query(
        "insert into credit_ledger (account_id, delta, balance_after, consumer_name, producer_name, message_id)
         select 'acct', 10, balance, $1, $2, $3 from credit_account where account_id = 'acct'",
    )
    .bind(id.consumer())
    .bind(id.producer().name())
    .bind(id.message_id().as_str())
    .execute(&mut *message)
    .await
    .unwrap();
}

/// Processes `key` once, first-seen: claim, ledger write, commit.
async fn process(inbox: &Inbox, key: &str) {
    match inbox.claim(identity(key), body(key), "v1", WAIT).await {
        Ok(Claim::Claimed(mut message)) => {
            apply(&mut message).await;
            message.commit(None).await.unwrap();
        }
        other => panic!("{key} was not first-seen: {other:?}"),
    }
}

/// Claims `key` through the guard, produced at `produced_at`.
async fn guarded(
    guard: &RetentionGuard,
    key: &str,
    produced_at: OffsetDateTime,
) -> Result<GuardedClaim, InboxError> {
    guard
        .claim(identity(key), body(key), "v1", WAIT, produced_at)
        .await
}

/// Counts a rolled-back attempt at `key`; from the `quarantine_after`th on it is quarantined.
async fn fail(inbox: &Inbox, key: &str, quarantine_after: u32) -> Option<i64> {
    inbox
        .record_failure(
            &identity(key),
            body(key),
            "v1",
            "handler-error",
            quarantine_after,
        )
        .await
        .unwrap()
}

/// Runs `statement` with `$1` = key and `$2` = age in seconds.
async fn backdate(app: &TestApp, statement: &str, key: &str, age: Duration) {
    let done = sqlx::query(statement)
        .bind(key)
        .bind(age.as_secs_f64())
        .execute(&app.pool)
        .await
        .unwrap();
    assert!(done.rows_affected() > 0, "nothing to backdate for {key}");
}

/// Moves an inbox row back in time as if it had been received and processed `age` ago.
async fn age_inbox_row(app: &TestApp, key: &str, age: Duration) {
    backdate(
        app,
        "update tower_inbox.consumer_inbox
         set received_at = now() - make_interval(secs => $2),
             processed_at = now() - make_interval(secs => $2) + interval '1 second'
         where message_id = $1",
        key,
        age,
    )
    .await;
}

/// Inserts `n` processed inbox rows `prefix-1..n`, received and processed `age` ago.
async fn insert_processed(app: &TestApp, prefix: &str, n: i32, age: Duration) {
    sqlx::query(
        "insert into tower_inbox.consumer_inbox
             (consumer_name, producer_name, message_id, payload_sha256, handler_version,
              received_at, processed_at, response_status)
         select $1, 'payments', $2 || '-' || g, repeat('a', 64), 'v1',
                now() - make_interval(secs => $4), now() - make_interval(secs => $4), 200
         from generate_series(1, $3) g",
    )
    .bind(CONSUMER)
    .bind(prefix)
    .bind(n)
    .bind(age.as_secs_f64())
    .execute(&app.pool)
    .await
    .unwrap();
}

/// Runs `statement` as the owner: DDL on the crate's tables, which the service's role (the
/// pool the tests' services run on) may not do.
async fn as_owner(app: &TestApp, statement: &str) {
    sqlx::query(statement)
        .execute(&app.owner)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
}

async fn run_sql(app: &TestApp, statement: &str) {
    sqlx::query(statement)
        .execute(&app.pool)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
}

async fn count(app: &TestApp, query: &str) -> i64 {
    sqlx::query_scalar(query)
        .fetch_one(&app.pool)
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"))
}

async fn inbox_has(app: &TestApp, key: &str) -> bool {
    sqlx::query_scalar::<_, bool>(
        "select exists (select 1 from tower_inbox.consumer_inbox where message_id = $1)",
    )
    .bind(key)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

async fn ledger_for(app: &TestApp, key: &str) -> i64 {
    sqlx::query_scalar("select count(*) from credit_ledger where message_id = $1")
        .bind(key)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// Rows per table, to show a dry run changed nothing.
async fn table_counts(app: &TestApp) -> [i64; 4] {
    [
        count(app, "select count(*) from tower_inbox.consumer_inbox").await,
        count(
            app,
            "select count(*) from tower_inbox.consumer_inbox_failure",
        )
        .await,
        count(app, "select count(*) from tower_inbox.message_outbox").await,
        count(app, "select count(*) from tower_inbox.inbox_quarantine").await,
    ]
}

fn purger(app: &TestApp) -> Purger {
    Purger::builder(app.pool.clone())
        .inbox(inbox_policy())
        .build()
        .unwrap()
}

/// A purger for every table, each with the inbox's four-day window.
fn full_purger(app: &TestApp) -> Purger {
    Purger::builder(app.pool.clone())
        .inbox(inbox_policy())
        .outbox(inbox_policy())
        .quarantine(inbox_policy())
        .build()
        .unwrap()
}

#[tokio::test]
async fn inbox_retention_expires_before_a_simulated_redrive() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());
    let policy = inbox_policy();
    let guard = RetentionGuard::new(inbox.clone(), &policy);
    process(&inbox, "evt-forgotten").await;
    process(&inbox, "evt-remembered").await;
    age_inbox_row(&app, "evt-forgotten", OLD).await;
    age_inbox_row(&app, "evt-remembered", RECENT).await;
    assert_eq!(app.balance("acct").await, Some(20));

    let report = purger(&app).purge().await.unwrap();
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1);
    assert!(!inbox_has(&app, "evt-forgotten").await, "past the window");
    assert!(inbox_has(&app, "evt-remembered").await, "inside the window");

    // A redrive inside the window is a duplicate, guard or not.
    let redrive = guarded(&guard, "evt-remembered", ago(RECENT + HOUR))
        .await
        .unwrap();
    assert!(
        matches!(redrive, GuardedClaim::Claim(Claim::Duplicate(_))),
        "{redrive:?}"
    );
    assert_eq!(ledger_for(&app, "evt-remembered").await, 1);

    // Without the guard, the forgotten message would be claimed as new: applied twice.
    match inbox
        .claim(identity("evt-forgotten"), body("evt-forgotten"), "v1", WAIT)
        .await
        .unwrap()
    {
        Claim::Claimed(message) => message.rollback().await.unwrap(),
        other => panic!("the unguarded inbox should have forgotten it: {other:?}"),
    }

    // The guard refuses it: produced before the window, first seen.
    let produced_at = ago(OLD + HOUR);
    let refused = guarded(&guard, "evt-forgotten", produced_at).await.unwrap();
    let GuardedClaim::Expired(expired) = refused else {
        panic!("not refused: {refused:?}");
    };
    assert_eq!(expired.identity, identity("evt-forgotten"));
    assert_eq!(expired.produced_at, produced_at);
    assert!(expired.oldest_accepted > produced_at);
    assert!(
        !inbox_has(&app, "evt-forgotten").await,
        "the claim rolled back"
    );
    assert_eq!(ledger_for(&app, "evt-forgotten").await, 1, "applied once");
    assert_eq!(app.balance("acct").await, Some(20));

    let items = Quarantine::new(app.pool.clone())
        .for_identity(&identity("evt-forgotten"))
        .await
        .unwrap();
    assert_eq!(items.len(), 1);
    let item = &items[0];
    assert_eq!(item.id, expired.quarantine_id);
    assert_eq!(item.source, QuarantineSource::ExpiredMessage);
    assert_eq!(item.reason_code, "retention-expired");
    assert_eq!(item.payload_sha256, body("evt-forgotten").to_hex());
    assert_eq!(item.decision, None);

    // A second redrive is counted on the same open item, still not applied.
    let again = guarded(&guard, "evt-forgotten", produced_at).await.unwrap();
    assert!(matches!(again, GuardedClaim::Expired(ref e) if e.quarantine_id == item.id));
    let item = Quarantine::new(app.pool.clone())
        .get(item.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(item.attempts, 2);
    assert_eq!(ledger_for(&app, "evt-forgotten").await, 1);

    // A new message produced just now goes through the guard as usual.
    match guarded(&guard, "evt-new", ago(HOUR)).await.unwrap() {
        GuardedClaim::Claim(Claim::Claimed(mut message)) => {
            apply(&mut message).await;
            message.commit(None).await.unwrap();
        }
        other => panic!("a fresh message was refused: {other:?}"),
    }
    assert_eq!(ledger_for(&app, "evt-new").await, 1);
    assert_eq!(app.balance("acct").await, Some(30));
}

#[tokio::test]
async fn the_guard_answers_old_duplicates_conflicts_and_in_flight_originals_as_usual() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());
    let guard = RetentionGuard::new(inbox.clone(), &inbox_policy());
    process(&inbox, "evt-1").await;
    // Old by its production time, but its row is still there: not purged yet.
    age_inbox_row(&app, "evt-1", OLD).await;
    let produced_at = ago(OLD + HOUR);

    let duplicate = guarded(&guard, "evt-1", produced_at).await.unwrap();
    assert!(
        matches!(duplicate, GuardedClaim::Claim(Claim::Duplicate(_))),
        "{duplicate:?}"
    );
    let conflict = guard
        .claim(identity("evt-1"), body("other"), "v1", WAIT, produced_at)
        .await
        .unwrap();
    assert!(
        matches!(conflict, GuardedClaim::Claim(Claim::Conflict(_))),
        "{conflict:?}"
    );

    // An original in flight is in progress, not expired.
    let Claim::Claimed(held) = inbox
        .claim(identity("evt-2"), body("evt-2"), "v1", WAIT)
        .await
        .unwrap()
    else {
        panic!("evt-2 not claimed");
    };
    let waiting = guard
        .claim(
            identity("evt-2"),
            body("evt-2"),
            "v1",
            Duration::ZERO,
            produced_at,
        )
        .await
        .unwrap();
    assert!(
        matches!(waiting, GuardedClaim::Claim(Claim::InProgress)),
        "{waiting:?}"
    );
    held.rollback().await.unwrap();

    assert_eq!(ledger_for(&app, "evt-1").await, 1);
    assert_eq!(ledger_for(&app, "evt-2").await, 0);
    assert_eq!(
        count(
            &app,
            "select count(*) from tower_inbox.inbox_quarantine where source = 'expired-message'"
        )
        .await,
        0,
        "nothing refused as expired"
    );
}

#[tokio::test]
async fn purge_under_concurrent_claims_loses_nothing_still_inside_the_window() {
    const OLD_ROWS: i32 = 400;
    const IN_WINDOW: usize = 30;
    const WORKERS: usize = 8;
    const OPS: usize = 24;
    let app = TestApp::with_pool_size(WORKERS as u32 + 4).await;
    let inbox = Inbox::new(app.pool.clone());
    insert_processed(&app, "old", OLD_ROWS, OLD).await;
    for i in 0..IN_WINDOW {
        let key = format!("in-{i}");
        process(&inbox, &key).await;
        age_inbox_row(&app, &key, RECENT).await;
    }
    let purger = Purger::builder(app.pool.clone())
        .inbox(inbox_policy())
        .batch_size(7)
        .build()
        .unwrap();

    let barrier = Arc::new(tokio::sync::Barrier::new(WORKERS + 1));
    let purge = {
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            purger.purge().await
        })
    };
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let inbox = inbox.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let mut answers = Vec::new();
                for op in 0..OPS {
                    // Alternate a new key with a duplicate of an in-window key.
                    let key = if op % 2 == 0 {
                        format!("new-{w}-{op}")
                    } else {
                        format!("in-{}", (w * OPS + op) % IN_WINDOW)
                    };
                    // Apply whatever the inbox says to apply, as a real consumer would:
                    // the database then shows whether anything was applied twice.
                    let answer = match inbox.claim(identity(&key), body(&key), "v1", WAIT).await {
                        Ok(Claim::Claimed(mut message)) => {
                            apply(&mut message).await;
                            message.commit(None).await.unwrap();
                            "claimed"
                        }
                        Ok(Claim::Duplicate(_)) => "duplicate",
                        Ok(other) => panic!("{key}: {other:?}"),
                        Err(err) => panic!("{key}: {err}"),
                    };
                    answers.push((key, answer));
                }
                answers
            })
        })
        .collect();
    let report = purge.await.unwrap().unwrap();
    let mut answers = Vec::new();
    for worker in workers {
        answers.extend(worker.await.unwrap());
    }

    for (key, answer) in &answers {
        let expected = if key.starts_with("new-") {
            "claimed"
        } else {
            "duplicate"
        };
        assert_eq!(*answer, expected, "{key}");
    }
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), OLD_ROWS as u64);
    assert!(report.table(PurgedTable::ConsumerInbox).unwrap().batches > 1);
    assert_eq!(
        count(
            &app,
            "select count(*) from tower_inbox.consumer_inbox where message_id like 'old-%'"
        )
        .await,
        0,
        "every processed row past the window is gone"
    );
    assert_eq!(
        count(
            &app,
            "select count(*) from tower_inbox.consumer_inbox where message_id like 'in-%' and processed_at is not null"
        )
        .await,
        IN_WINDOW as i64,
        "every row inside the window survives"
    );
    let new_keys = WORKERS * OPS / 2;
    assert_eq!(
        count(
            &app,
            "select count(*) from tower_inbox.consumer_inbox where message_id like 'new-%' and processed_at is not null"
        )
        .await,
        new_keys as i64,
        "every new commit survives"
    );
    assert_eq!(
        count(
            &app,
            "select count(*) from (select message_id from credit_ledger group by message_id having count(*) <> 1) twice"
        )
        .await,
        0,
        "no message applied twice"
    );
    assert_eq!(
        count(&app, "select count(*) from credit_ledger").await,
        (IN_WINDOW + new_keys) as i64
    );
}

/// Delivers effects whose destination is `ok` and refuses the rest for good.
struct ScriptedTransport;

impl Transport for ScriptedTransport {
    async fn deliver(&self, effect: &Effect) -> Delivery {
        if effect.destination == "ok" {
            Delivery::Delivered {
                status: Some(200),
                result: "receipt".into(),
            }
        } else {
            Delivery::Permanent {
                status: Some(404),
                reason_code: "http-404".into(),
                error: "no such receiver".into(),
            }
        }
    }
}

/// Enqueues one effect per `(key, destination)` and runs a dispatcher over them once:
/// `ok` ends delivered, anything else dead with an open quarantine item.
async fn dispatch(app: &TestApp, effects: &[(&str, &str)]) {
    let mut tx = app.pool.begin().await.unwrap();
    for (key, destination) in effects {
        enqueue(
            &mut *tx,
            &identity(key),
            "webhook",
            &OutboxMessage::new(*destination, "{}"),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let report = Dispatcher::builder(app.pool.clone(), ScriptedTransport)
        .max_attempts(1)
        .build()
        .unwrap()
        .dispatch_due()
        .await
        .unwrap();
    assert_eq!(report.delivered + report.dead, effects.len());
}

/// The quarantine item about `key` from `source`.
async fn item_id(app: &TestApp, source: &str, key: &str) -> i64 {
    sqlx::query_scalar(
        "select id from tower_inbox.inbox_quarantine where source = $1 and message_id = $2
         order by id desc limit 1",
    )
    .bind(source)
    .bind(key)
    .fetch_one(&app.pool)
    .await
    .unwrap_or_else(|e| panic!("no {source} item for {key}: {e}"))
}

/// Decides on a quarantine item as a person would, then moves the decision `age` back.
async fn decide(app: &TestApp, id: i64, decision: Decision, age: Duration) {
    let quarantine = Quarantine::new(app.pool.clone());
    match decision {
        Decision::Repair => quarantine.repair(id, "oncall", "fixed").await.unwrap(),
        Decision::Discard => quarantine.discard(id, "oncall", "given up").await.unwrap(),
    }
    age_decision(app, id, age).await;
}

async fn age_decision(app: &TestApp, id: i64, age: Duration) {
    sqlx::query(
        "update tower_inbox.inbox_quarantine
         set decided_at = now() - make_interval(secs => $2),
             recovered_at = case when recovered_at is null then null
                                 else now() - make_interval(secs => $2) end
         where id = $1",
    )
    .bind(id)
    .bind(age.as_secs_f64())
    .execute(&app.pool)
    .await
    .unwrap();
}

async fn item_exists(app: &TestApp, id: i64) -> bool {
    Quarantine::new(app.pool.clone())
        .get(id)
        .await
        .unwrap()
        .is_some()
}

async fn effect_status(app: &TestApp, key: &str) -> Option<String> {
    sqlx::query_scalar("select status from tower_inbox.message_outbox where message_id = $1")
        .bind(key)
        .fetch_optional(&app.pool)
        .await
        .unwrap()
}

const AGE_DELIVERY: &str = "update tower_inbox.message_outbox
    set delivered_at = now() - make_interval(secs => $2),
        created_at = now() - make_interval(secs => $2)
    where message_id = $1";

/// Old and recent rows in every table: (inbox, failures, outbox, quarantine) that a purge
/// with four-day windows deletes, and others it keeps.
async fn seed_every_table(app: &TestApp) -> [u64; 4] {
    let inbox = Inbox::new(app.pool.clone());
    insert_processed(app, "old", 3, OLD).await;
    insert_processed(app, "recent", 2, RECENT).await;
    for key in ["fail-old-1", "fail-old-2", "fail-recent"] {
        fail(&inbox, key, 100).await;
    }
    for key in ["fail-old-1", "fail-old-2"] {
        backdate(
            app,
            "update tower_inbox.consumer_inbox_failure
             set first_failed_at = now() - make_interval(secs => $2),
                 last_failed_at = now() - make_interval(secs => $2)
             where message_id = $1",
            key,
            OLD,
        )
        .await;
    }
    dispatch(
        app,
        &[("fx-old-1", "ok"), ("fx-old-2", "ok"), ("fx-recent", "ok")],
    )
    .await;
    for key in ["fx-old-1", "fx-old-2"] {
        backdate(app, AGE_DELIVERY, key, OLD).await;
    }
    for key in ["old-1", "old-2", "old-3"] {
        inbox
            .record_conflict(&identity(key), body("other"), "v1")
            .await
            .unwrap();
    }
    // Two decided long ago, one still open: that one keeps old-3's inbox row too.
    for key in ["old-1", "old-2"] {
        let id = item_id(app, "identity-conflict", key).await;
        decide(app, id, Decision::Discard, OLD).await;
    }
    [2, 2, 2, 2]
}

#[tokio::test]
async fn a_dry_run_reports_what_a_purge_deletes_and_deletes_nothing() {
    let app = TestApp::new().await;
    let expected = seed_every_table(&app).await;
    let purger = full_purger(&app);
    let before = table_counts(&app).await;

    let db_now = || async {
        sqlx::query_scalar::<_, OffsetDateTime>("select now()")
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };
    let window = time::Duration::try_from(inbox_policy().window()).unwrap();
    let earliest = db_now().await - window;
    let dry = purger.dry_run().await.unwrap();
    let latest = db_now().await - window;
    assert!(dry.dry_run);
    assert_eq!(
        table_counts(&app).await,
        before,
        "a dry run deletes nothing"
    );
    let tables = [
        PurgedTable::ConsumerInbox,
        PurgedTable::ConsumerInboxFailure,
        PurgedTable::MessageOutbox,
        PurgedTable::InboxQuarantine,
    ];
    assert_eq!(
        dry.tables.iter().map(|t| t.table).collect::<Vec<_>>(),
        tables
    );
    for (table, rows) in tables.iter().zip(expected) {
        let entry = dry.table(*table).unwrap();
        assert_eq!(entry.rows, rows, "{table}");
        assert_eq!(entry.batches, 0, "{table}");
        assert!(
            entry.cutoff >= earliest && entry.cutoff <= latest,
            "{table}: the cutoff is now minus the window"
        );
    }
    assert!(dry
        .to_string()
        .contains("consumer_inbox: would delete 2 rows older than"));

    let purged = purger.purge().await.unwrap();
    assert!(!purged.dry_run);
    for (table, rows) in tables.iter().zip(expected) {
        assert_eq!(
            purged.rows(*table),
            rows,
            "{table}: the purge deletes what the dry run counted"
        );
    }
    let after = table_counts(&app).await;
    for i in 0..4 {
        assert_eq!(after[i], before[i] - expected[i] as i64);
    }
    assert_eq!(purger.dry_run().await.unwrap().total_rows(), 0);
}

#[tokio::test]
async fn a_backlog_is_deleted_in_paced_batches() {
    const PAUSE: Duration = Duration::from_millis(150);
    let app = TestApp::new().await;
    insert_processed(&app, "old", 30, OLD).await;
    let paced = Purger::builder(app.pool.clone())
        .inbox(inbox_policy())
        .batch_size(10)
        .pause_between_batches(PAUSE)
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let report = paced.purge().await.unwrap();
    let took = started.elapsed();
    let inbox = report.table(PurgedTable::ConsumerInbox).unwrap();
    // Three full batches, then an empty one that ends the pass.
    assert_eq!((inbox.rows, inbox.batches), (30, 4));
    // A pause follows each full batch; sleeps never end early, so this lower bound holds on
    // any machine, and without the pauses the pass takes a few milliseconds.
    assert!(took >= PAUSE * 3, "took {took:?}, less than three pauses");

    // Without a pause the same backlog goes the same way.
    insert_processed(&app, "again", 30, OLD).await;
    let unpaced = Purger::builder(app.pool.clone())
        .inbox(inbox_policy())
        .batch_size(10)
        .pause_between_batches(Duration::ZERO)
        .build()
        .unwrap();
    let report = unpaced.purge().await.unwrap();
    let inbox = report.table(PurgedTable::ConsumerInbox).unwrap();
    assert_eq!((inbox.rows, inbox.batches), (30, 4));

    // Only a full batch is followed by a pause: fewer rows than a batch, and the pass ends
    // without one (a pause there would take the whole minute).
    insert_processed(&app, "few", 5, OLD).await;
    let slow = Purger::builder(app.pool.clone())
        .inbox(inbox_policy())
        .batch_size(10)
        .pause_between_batches(Duration::from_secs(60))
        .build()
        .unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), slow.purge())
        .await
        .expect("a pass with one short batch does not pause")
        .unwrap();
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 5);
}

/// An observer sees each batch with the table's running totals, and stopping it ends the
/// purge after that batch: what it deleted is committed, the rest is left for the next run.
#[tokio::test]
async fn an_observed_purge_reports_each_batch_and_stops_when_asked() {
    let app = TestApp::new().await;
    insert_processed(&app, "old", 30, OLD).await;
    let purger = Purger::builder(app.pool.clone())
        .inbox(inbox_policy())
        .batch_size(10)
        .pause_between_batches(Duration::ZERO)
        .build()
        .unwrap();
    let mut seen = Vec::new();
    // No pause: one call per batch.
    let report = purger
        .purge_observed(|table| {
            seen.push((table.table, table.rows, table.batches));
            if table.batches == 2 {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        })
        .await
        .unwrap();
    assert_eq!(
        seen,
        [
            (PurgedTable::ConsumerInbox, 10, 1),
            (PurgedTable::ConsumerInbox, 20, 2)
        ]
    );
    assert!(report.stopped);
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 20);
    assert!(
        report.table(PurgedTable::ConsumerInboxFailure).is_none(),
        "the tables after the stop are not purged"
    );
    assert!(
        report.to_string().contains("stopped before the end"),
        "{report}"
    );
    assert_eq!(
        count(&app, "select count(*) from tower_inbox.consumer_inbox").await,
        10
    );
    // The next run takes the rest.
    let rest = purger.purge().await.unwrap();
    assert!(!rest.stopped);
    assert_eq!(rest.rows(PurgedTable::ConsumerInbox), 10);
}

/// Row addresses are unique within one table only. On a partitioned table (which this
/// version does not create, but an operator might) the purge's delete by address must not
/// reach a row of another partition that sits at the same address: it deletes nothing.
#[tokio::test]
async fn the_purge_deletes_nothing_from_a_partitioned_table() {
    let app = TestApp::new().await;
    as_owner(
        &app,
        "alter table tower_inbox.inbox_quarantine rename to inbox_quarantine_plain",
    )
    .await;
    as_owner(
        &app,
        "create table tower_inbox.inbox_quarantine
             (like tower_inbox.inbox_quarantine_plain including defaults)
             partition by range (decided_at)",
    )
    .await;
    as_owner(
        &app,
        "create table tower_inbox.inbox_quarantine_old partition of tower_inbox.inbox_quarantine
             for values from ('2000-01-01') to ('2020-01-01')",
    )
    .await;
    as_owner(
        &app,
        "create table tower_inbox.inbox_quarantine_new partition of tower_inbox.inbox_quarantine
             for values from ('2020-01-01') to ('2100-01-01')",
    )
    .await;
    // The new table is granted to the service as the old one was.
    common::grant_service(&app.owner, app.role.name()).await;
    // One decided item in each partition, each the first row of its partition: the same
    // address, (0,1). Only the old one is past the window.
    for decided_at in ["'2010-01-01'", "now()"] {
        as_owner(
            &app,
            &format!(
                "insert into tower_inbox.inbox_quarantine
                     (id, item_key, source, payload_sha256, payload_ref, reason_code,
                      decision, decided_by, decided_at, decision_reason)
                 select coalesce(max(id), 0) + 1, 'k' || (coalesce(max(id), 0) + 1),
                        'handler-failure', repeat('a', 64), 'sha256:x', 'handler-failed',
                        'discard', 'ops', {decided_at}::timestamptz, 'test'
                 from tower_inbox.inbox_quarantine"
            ),
        )
        .await;
    }
    let addresses = count(
        &app,
        "select count(distinct ctid) from tower_inbox.inbox_quarantine",
    )
    .await;
    assert_eq!(addresses, 1, "both rows sit at the same address");
    let purger = Purger::builder(app.pool.clone())
        .quarantine(inbox_policy())
        .build()
        .unwrap();
    let report = purger.purge().await.unwrap();
    assert_eq!(report.rows(PurgedTable::InboxQuarantine), 0);
    assert_eq!(
        count(&app, "select count(*) from tower_inbox.inbox_quarantine").await,
        2,
        "neither row deleted, above all not the one inside the window"
    );
}

#[tokio::test]
async fn in_flight_and_recently_processed_rows_are_kept() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());
    // Claimed long ago and never recorded (a consumer that records separately and died).
    sqlx::query(
        "insert into tower_inbox.consumer_inbox (consumer_name, producer_name, message_id, payload_sha256,
                                     handler_version, received_at)
         values ($1, 'payments', 'in-flight', repeat('b', 64), 'v1', now() - interval '30 days')",
    )
    .bind(CONSUMER)
    .execute(&app.pool)
    .await
    .unwrap();
    // Received long ago, processed only recently.
    process(&inbox, "late").await;
    backdate(
        &app,
        "update tower_inbox.consumer_inbox set received_at = now() - make_interval(secs => $2)
         where message_id = $1",
        "late",
        OLD,
    )
    .await;
    // An uncommitted claim right now.
    let Claim::Claimed(held) = inbox
        .claim(identity("held"), body("held"), "v1", WAIT)
        .await
        .unwrap()
    else {
        panic!("not claimed");
    };
    insert_processed(&app, "old", 2, OLD).await;

    let report = purger(&app).purge().await.unwrap();
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 2);
    assert!(inbox_has(&app, "in-flight").await);
    assert!(inbox_has(&app, "late").await);
    held.rollback().await.unwrap();
    assert_eq!(
        count(
            &app,
            "select count(*) from tower_inbox.consumer_inbox where message_id like 'old-%'"
        )
        .await,
        0
    );
}

#[tokio::test]
async fn compensated_migration_steps_outlive_the_window() {
    use futures_util::FutureExt;
    use tower_inbox::replay::{CompensatedMigration, MigrationStep, StepOutcome};

    let app = TestApp::new().await;
    let migration =
        CompensatedMigration::builder(Inbox::new(app.pool.clone()), CONSUMER, "bonus-fix")
            .build()
            .unwrap();
    let step = MigrationStep::new("bonus/acct", 5).unwrap();
    fn bonus<'a>(
        message: &'a mut tower_inbox::inbox::ClaimedMessage,
        _: &'a i32,
    ) -> futures_util::future::BoxFuture<'a, Result<(), sqlx::Error>> {
        async move {
            apply(message).await;
            Ok(())
        }
        .boxed()
    }
    let first = migration.apply_step(&step, bonus).await.unwrap();
    assert!(matches!(first, StepOutcome::Applied { .. }));
    age_inbox_row(&app, "bonus/acct", OLD).await;
    insert_processed(&app, "old", 1, OLD).await;

    let report = purger(&app).purge().await.unwrap();
    assert_eq!(
        report.rows(PurgedTable::ConsumerInbox),
        1,
        "only the ordinary row"
    );
    // Running the finished migration again, long after, applies nothing.
    let again = migration.apply_step(&step, bonus).await.unwrap();
    assert!(matches!(again, StepOutcome::AlreadyApplied { .. }));
    assert_eq!(ledger_for(&app, "bonus/acct").await, 1);
}

#[tokio::test]
async fn rows_an_open_quarantine_item_refers_to_are_kept_until_it_is_decided() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());
    process(&inbox, "conflicted").await;
    age_inbox_row(&app, "conflicted", OLD).await;
    inbox
        .record_conflict(&identity("conflicted"), body("other"), "v1")
        .await
        .unwrap();
    // Failed once, quarantined at the first failure.
    let failing = fail(&inbox, "failing", 1).await.expect("quarantined");
    backdate(
        &app,
        "update tower_inbox.consumer_inbox_failure set last_failed_at = now() - make_interval(secs => $2)
         where message_id = $1",
        "failing",
        OLD,
    )
    .await;
    let purger = purger(&app);

    let report = purger.purge().await.unwrap();
    assert_eq!(report.total_rows(), 0);
    assert!(inbox_has(&app, "conflicted").await);
    assert!(app.failures("payments", "failing").await.is_some());

    let conflict = item_id(&app, "identity-conflict", "conflicted").await;
    decide(&app, conflict, Decision::Discard, Duration::ZERO).await;
    decide(&app, failing, Decision::Discard, Duration::ZERO).await;
    let report = purger.purge().await.unwrap();
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1);
    assert_eq!(report.rows(PurgedTable::ConsumerInboxFailure), 1);
    assert!(!inbox_has(&app, "conflicted").await);
    assert!(app.failures("payments", "failing").await.is_none());
    // The decisions are recent: the items themselves stay.
    assert!(item_exists(&app, conflict).await && item_exists(&app, failing).await);
}

#[tokio::test]
async fn failure_records_go_when_their_last_failure_is_past_the_window() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());
    for key in ["stale", "fresh"] {
        fail(&inbox, key, 100).await;
    }
    backdate(
        &app,
        "update tower_inbox.consumer_inbox_failure
         set first_failed_at = now() - make_interval(secs => $2) - interval '1 day',
             last_failed_at = now() - make_interval(secs => $2)
         where message_id = $1",
        "stale",
        OLD,
    )
    .await;
    // Failed first long ago, and again just now: still failing, kept.
    fail(&inbox, "fresh", 100).await;
    backdate(
        &app,
        "update tower_inbox.consumer_inbox_failure set first_failed_at = now() - make_interval(secs => $2)
         where message_id = $1",
        "fresh",
        OLD,
    )
    .await;

    let report = purger(&app).purge().await.unwrap();
    assert_eq!(report.rows(PurgedTable::ConsumerInboxFailure), 1);
    assert!(app.failures("payments", "stale").await.is_none());
    assert_eq!(
        app.failures("payments", "fresh").await,
        Some((2, "handler-error".into()))
    );
}

#[tokio::test]
async fn outbox_retention_deletes_delivered_and_discarded_effects_only() {
    let app = TestApp::new().await;
    dispatch(
        &app,
        &[
            ("delivered-old", "ok"),
            ("delivered-recent", "ok"),
            ("dead-open", "refuse"),
            ("dead-discarded-old", "refuse"),
            ("dead-discarded-recent", "refuse"),
            ("dead-reopened", "refuse"),
        ],
    )
    .await;
    // Enqueued long ago and never dispatched.
    let mut tx = app.pool.begin().await.unwrap();
    enqueue(
        &mut *tx,
        &identity("pending-old"),
        "webhook",
        &OutboxMessage::new("ok", "{}"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    backdate(
        &app,
        "update tower_inbox.message_outbox set created_at = now() - make_interval(secs => $2),
                                   next_attempt_at = now() + interval '1 day'
         where message_id = $1",
        "pending-old",
        OLD,
    )
    .await;
    backdate(&app, AGE_DELIVERY, "delivered-old", OLD).await;
    for (key, age) in [
        ("dead-discarded-old", OLD),
        ("dead-discarded-recent", HOUR),
        ("dead-reopened", OLD),
    ] {
        let id = item_id(&app, "dead-effect", key).await;
        decide(&app, id, Decision::Discard, age).await;
    }
    // Died again after its discard: a new open item a person has to see.
    run_sql(&app, "insert into tower_inbox.inbox_quarantine (source, item_key, consumer_name, producer_name, tenant_id,
                                       message_id, effect_id, payload_sha256, payload_ref, reason_code)
         select 'dead-effect', 'dead-effect:' || effect_id, consumer_name, producer_name, tenant_id,
                message_id, effect_id, repeat('c', 64), 'message_outbox:' || effect_id, 'http-404'
         from tower_inbox.message_outbox where message_id = 'dead-reopened'").await;

    let purger = Purger::builder(app.pool.clone())
        .outbox(inbox_policy())
        .build()
        .unwrap();
    let report = purger.purge().await.unwrap();
    assert_eq!(report.tables.len(), 1, "only the outbox has a policy");
    assert_eq!(report.rows(PurgedTable::MessageOutbox), 2);
    assert_eq!(effect_status(&app, "delivered-old").await, None);
    assert_eq!(effect_status(&app, "dead-discarded-old").await, None);
    for (key, status) in [
        ("delivered-recent", "delivered"),
        ("dead-open", "dead"),
        ("dead-discarded-recent", "dead"),
        ("dead-reopened", "dead"),
        ("pending-old", "pending"),
    ] {
        assert_eq!(
            effect_status(&app, key).await.as_deref(),
            Some(status),
            "{key}"
        );
    }
    assert_eq!(
        count(&app, "select count(*) from tower_inbox.inbox_quarantine").await,
        5,
        "the outbox purge leaves the quarantine alone"
    );
}

#[tokio::test]
async fn quarantine_retention_keeps_open_items_and_repairs_awaiting_recovery() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone());
    let quarantine = Quarantine::new(app.pool.clone());

    // Conflicts: one discarded long ago, one still open (and old).
    process(&inbox, "conflicted").await;
    for other in ["a", "b"] {
        inbox
            .record_conflict(&identity("conflicted"), body(other), "v1")
            .await
            .unwrap();
    }
    let conflicts: Vec<i64> = sqlx::query_scalar(
        "select id from tower_inbox.inbox_quarantine where source = 'identity-conflict' order by id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    decide(&app, conflicts[0], Decision::Discard, OLD).await;
    sqlx::query(
        "update tower_inbox.inbox_quarantine set first_failed_at = now() - interval '30 days' where id = $1",
    )
    .bind(conflicts[1])
    .execute(&app.pool)
    .await
    .unwrap();

    // A failing command repaired long ago whose retry never committed: recovery awaited.
    let awaiting = fail(&inbox, "awaiting", 1).await.unwrap();
    decide(&app, awaiting, Decision::Repair, OLD).await;
    // One whose retry committed (recovered) long ago.
    let recovered = fail(&inbox, "recovered", 1).await.unwrap();
    decide(&app, recovered, Decision::Repair, Duration::ZERO).await;
    process(&inbox, "recovered").await;
    let item = quarantine.get(recovered).await.unwrap().unwrap();
    assert!(
        item.recovered_at.is_some(),
        "the commit marked it recovered"
    );
    age_decision(&app, recovered, OLD).await;

    // Dead effects: one repaired and awaiting delivery, one discarded but still in the
    // outbox (no outbox policy here, so it stays, and so does the decision about it).
    dispatch(
        &app,
        &[("fx-repaired", "refuse"), ("fx-discarded", "refuse")],
    )
    .await;
    let repaired = item_id(&app, "dead-effect", "fx-repaired").await;
    decide(&app, repaired, Decision::Repair, OLD).await;
    let discarded = item_id(&app, "dead-effect", "fx-discarded").await;
    decide(&app, discarded, Decision::Discard, OLD).await;

    // An expired message, discarded long ago.
    let guard = RetentionGuard::new(inbox.clone(), &inbox_policy());
    let GuardedClaim::Expired(expired) = guarded(&guard, "ancient", ago(OLD)).await.unwrap() else {
        panic!("not refused");
    };
    decide(&app, expired.quarantine_id, Decision::Discard, OLD).await;

    let only_quarantine = Purger::builder(app.pool.clone())
        .quarantine(inbox_policy())
        .build()
        .unwrap();
    let report = only_quarantine.purge().await.unwrap();
    assert_eq!(report.rows(PurgedTable::InboxQuarantine), 3);
    assert!(!item_exists(&app, conflicts[0]).await, "decided long ago");
    assert!(!item_exists(&app, recovered).await, "recovered long ago");
    assert!(
        !item_exists(&app, expired.quarantine_id).await,
        "decided long ago"
    );
    assert!(item_exists(&app, conflicts[1]).await, "open");
    assert!(
        item_exists(&app, awaiting).await,
        "repair awaiting its recovery"
    );
    assert!(item_exists(&app, repaired).await, "effect pending delivery");
    assert!(
        item_exists(&app, discarded).await,
        "its dead effect is still there"
    );
    assert_eq!(
        effect_status(&app, "fx-repaired").await.as_deref(),
        Some("pending")
    );

    // With the outbox purged too, the discarded effect goes first, then its decision.
    let report = full_purger(&app).purge().await.unwrap();
    assert_eq!(report.rows(PurgedTable::MessageOutbox), 1);
    assert_eq!(effect_status(&app, "fx-discarded").await, None);
    assert!(!item_exists(&app, discarded).await);
    assert!(item_exists(&app, repaired).await && item_exists(&app, awaiting).await);
    let open = quarantine.get(conflicts[1]).await.unwrap().unwrap();
    assert_eq!(open.decision, None);
    let kept = quarantine.get(awaiting).await.unwrap().unwrap();
    assert_eq!(
        (kept.decision, kept.recovered_at),
        (Some(Decision::Repair), None)
    );
}

#[tokio::test]
async fn the_layer_replays_commands_inside_the_window_after_a_purge() {
    let app = TestApp::new().await;
    let router = app.credits();
    let first = send(&router, credit("acct", Some("k-kept"), Some("app"), 5)).await;
    assert_eq!(first.status, http::StatusCode::CREATED);
    send(&router, credit("acct", Some("k-gone"), Some("app"), 5)).await;
    age_inbox_row(&app, "k-kept", RECENT).await;
    age_inbox_row(&app, "k-gone", OLD).await;

    let report = Purger::builder(app.pool.clone())
        .inbox(inbox_policy())
        .build()
        .unwrap()
        .purge()
        .await
        .unwrap();
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1);

    let retry = send(&router, credit("acct", Some("k-kept"), Some("app"), 5)).await;
    assert!(retry.replayed());
    assert_eq!(
        retry.body, first.body,
        "the recorded response survived the purge"
    );
    assert_eq!(app.ledger_rows("acct").await, 2);
    assert_eq!(app.balance("acct").await, Some(10));
}

/// A shared buffer for what the code logged on one test's thread.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

thread_local! {
    /// The buffer, and the least severe level, this thread's test captures, if any.
    static CAPTURING: std::cell::RefCell<Option<(Logs, tracing::Level)>> =
        const { std::cell::RefCell::new(None) };
}

/// Ends a capture when dropped.
struct Capture;

impl Drop for Capture {
    fn drop(&mut self) {
        CAPTURING.with(|c| c.borrow_mut().take());
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Collects everything logged at `level` or above on this thread (the test's
    /// current-thread runtime, so its spawned tasks too), span closes included.
    ///
    /// One subscriber serves the whole binary, set once as the global default, and routes
    /// by thread. A subscriber of each test's own (`set_default`) is not enough here: the
    /// other tests purge at the same time on threads without one, and tracing's per-callsite
    /// interest and maximum level, shared by all threads, then hid this thread's spans now
    /// and then.
    fn capture(&self, level: tracing::Level) -> Capture {
        static INSTALLED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
        INSTALLED.get_or_init(|| {
            use tracing_subscriber::layer::SubscriberExt;
            // Dynamic: asked at every span and event, never cached per callsite.
            let captured = tracing_subscriber::filter::dynamic_filter_fn(|meta, _| {
                CAPTURING.with(|c| {
                    c.borrow()
                        .as_ref()
                        .is_some_and(|(_, level)| meta.level() <= level)
                })
            });
            let layer = tracing_subscriber::fmt::layer()
                .with_writer(|| ThreadWriter)
                .with_ansi(false)
                .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE);
            let subscriber = tracing_subscriber::registry()
                .with(tracing_subscriber::Layer::with_filter(layer, captured));
            tracing::subscriber::set_global_default(subscriber)
                .expect("no other global subscriber in this test binary");
        });
        CAPTURING.with(|c| *c.borrow_mut() = Some((self.clone(), level)));
        Capture
    }
}

/// Writes to the buffer of the thread it runs on, or nowhere.
struct ThreadWriter;

impl std::io::Write for ThreadWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURING.with(|c| {
            if let Some((logs, _)) = c.borrow().as_ref() {
                logs.0.lock().unwrap().extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Polls `check` every 25 ms until it holds, for at most 30 s.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..1200 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("never happened: {what}");
}

/// Waits until the inbox row `key` is gone: `why` says which run should have deleted it.
async fn eventually_purged(app: &TestApp, key: &str, why: &str) {
    eventually(why, || async { !inbox_has(app, key).await }).await;
}

type Task = tokio::task::JoinHandle<Result<(), RetentionError>>;

fn spawn_task(purger: Purger, period: Duration) -> (tokio::sync::oneshot::Sender<()>, Task) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(purger.run(period, async {
        let _ = stopped.await;
    }));
    (stop, task)
}

/// Stops the task and expects it to end cleanly; the bound only keeps a hang from hanging
/// the suite.
async fn stop_task(stop: tokio::sync::oneshot::Sender<()>, task: Task) {
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the task stops on shutdown")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn the_background_task_purges_every_period_until_shut_down() {
    let app = TestApp::new().await;
    insert_processed(&app, "first", 1, OLD).await;
    let (stop, task) = spawn_task(purger(&app), Duration::from_millis(50));
    eventually_purged(&app, "first-1", "the first run purged").await;
    insert_processed(&app, "second", 1, OLD).await;
    eventually_purged(&app, "second-1", "a later run purged").await;
    stop_task(stop, task).await;
    insert_processed(&app, "after", 1, OLD).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(inbox_has(&app, "after-1").await, "no run after shutdown");
}

#[tokio::test]
async fn the_background_task_stops_at_shutdown_without_waiting_for_the_period() {
    let app = TestApp::new().await;
    insert_processed(&app, "old", 1, OLD).await;
    // Runs at once, then would sleep an hour.
    let (stop, task) = spawn_task(purger(&app), HOUR);
    eventually_purged(&app, "old-1", "the first run purged").await;
    stop_task(stop, task).await;
}

#[tokio::test]
async fn the_background_task_logs_failures_and_keeps_going() {
    let logs = Logs::default();
    let _capture = logs.capture(tracing::Level::WARN);
    let app = TestApp::new().await;
    insert_processed(&app, "old", 1, OLD).await;
    as_owner(
        &app,
        "alter table tower_inbox.consumer_inbox rename to consumer_inbox_away",
    )
    .await;
    let (stop, task) = spawn_task(purger(&app), Duration::from_millis(50));
    eventually("two failed runs logged", || async {
        logs.text().matches("retention purge failed").count() >= 2
    })
    .await;
    assert!(logs.text().contains("consumer_inbox"), "{}", logs.text());
    as_owner(
        &app,
        "alter table tower_inbox.consumer_inbox_away rename to consumer_inbox",
    )
    .await;
    eventually_purged(&app, "old-1", "a run after the failures purged").await;
    stop_task(stop, task).await;
}

#[tokio::test]
async fn an_unreachable_database_is_a_clear_error_and_the_task_survives_it() {
    let logs = Logs::default();
    let _capture = logs.capture(tracing::Level::WARN);
    let pool = unreachable_pool();
    let purger = Purger::builder(pool.clone())
        .inbox(inbox_policy())
        .quarantine(inbox_policy())
        .build()
        .unwrap();
    for result in [purger.purge().await, purger.dry_run().await] {
        let err = result.unwrap_err();
        assert_eq!(err.table, PurgedTable::ConsumerInbox);
        assert_eq!(err.deleted, 0);
        assert!(
            matches!(err.source, InboxError::Unavailable(_)),
            "{:?}",
            err.source
        );
        assert!(err
            .to_string()
            .contains("retention purge of consumer_inbox failed"));
    }

    let guard = RetentionGuard::new(Inbox::new(pool), &inbox_policy());
    let err = guarded(&guard, "k", ago(OLD)).await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");

    let (stop, task) = spawn_task(purger, Duration::from_millis(50));
    eventually("two failed runs logged", || async {
        logs.text().matches("retention purge failed").count() >= 2
    })
    .await;
    assert!(!task.is_finished(), "the task keeps going");
    stop_task(stop, task).await;
}

#[tokio::test]
async fn a_purge_gives_up_on_a_lock_it_cannot_get_soon() {
    let app = TestApp::new().await;
    insert_processed(&app, "old", 3, OLD).await;
    let mut blocker = app.pool.begin().await.unwrap();
    sqlx::query("lock table tower_inbox.consumer_inbox in access exclusive mode")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let purger = Purger::builder(app.pool.clone())
        .inbox(inbox_policy())
        .lock_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    // The bound only keeps a missing lock_timeout from hanging the suite.
    let result = tokio::time::timeout(Duration::from_secs(60), purger.purge())
        .await
        .expect("the purge gives up instead of waiting");
    common::assert_inbox_purge_gave_up_on_a_lock(result);
    blocker.rollback().await.unwrap();

    assert_eq!(
        count(&app, "select count(*) from tower_inbox.consumer_inbox").await,
        3
    );
    assert_eq!(
        purger
            .purge()
            .await
            .unwrap()
            .rows(PurgedTable::ConsumerInbox),
        3
    );
}

#[tokio::test]
async fn a_failed_quarantine_write_fails_the_guard_and_applies_nothing() {
    let app = TestApp::new().await;
    let guard = RetentionGuard::new(Inbox::new(app.pool.clone()), &inbox_policy());
    as_owner(
        &app,
        "alter table tower_inbox.inbox_quarantine rename to inbox_quarantine_away",
    )
    .await;
    let err = guarded(&guard, "ancient", ago(OLD)).await.unwrap_err();
    assert!(matches!(err, InboxError::Database(_)), "{err:?}");
    assert!(!err.is_retryable());
    assert!(!inbox_has(&app, "ancient").await, "the claim rolled back");
    assert_eq!(ledger_for(&app, "ancient").await, 0);
}

#[tokio::test]
async fn the_purge_span_names_table_cutoff_rows_and_dry_run_and_no_payload() {
    let logs = Logs::default();
    let _capture = logs.capture(tracing::Level::INFO);
    let app = TestApp::new().await;
    insert_processed(&app, "old", 2, OLD).await;
    run_sql(
        &app,
        "update tower_inbox.consumer_inbox set response_body = 'SECRET-PAYLOAD'",
    )
    .await;
    let purger = purger(&app);
    purger.dry_run().await.unwrap();
    purger.purge().await.unwrap();
    let text = logs.text();
    let closes: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(r#"retention.purge{table="consumer_inbox" "#))
        .collect();
    assert_eq!(closes.len(), 2, "{text}");
    for (close, dry_run) in closes.iter().zip(["dry_run=true", "dry_run=false"]) {
        for field in [dry_run, " cutoff=", " rows=2"] {
            assert!(close.contains(field), "{field} missing: {close}");
        }
    }
    assert!(!text.contains("SECRET-PAYLOAD"));
}

#[test]
fn purged_rows_and_expired_messages_are_counted() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use tower_inbox::metrics::{
        EXPIRED, INBOX_PURGED, OUTBOX_PURGED, QUARANTINE_MOVES, QUARANTINE_PURGED,
    };

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // The local recorder only sees this thread, so the whole test runs on it.
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let app = TestApp::new().await;
                seed_every_table(&app).await;
                full_purger(&app).dry_run().await.unwrap();
                full_purger(&app).purge().await.unwrap();
                let guard = RetentionGuard::new(Inbox::new(app.pool.clone()), &inbox_policy());
                // Refused twice: two expired deliveries, one item opened.
                for _ in 0..2 {
                    guarded(&guard, "ancient", ago(OLD)).await.unwrap();
                }
            });
    });
    // Each counter as `name{key=value,...}`, so a wrong label shows up as a missing series.
    let counters: std::collections::HashMap<String, u64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Counter(n) => {
                let key = key.key();
                let labels: Vec<String> = key
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                Some((format!("{}{{{}}}", key.name(), labels.join(",")), n))
            }
            _ => None,
        })
        .collect();
    let expected = [
        (format!("{INBOX_PURGED}{{table=consumer_inbox}}"), 2),
        (format!("{INBOX_PURGED}{{table=consumer_inbox_failure}}"), 2),
        (format!("{OUTBOX_PURGED}{{}}"), 2),
        (format!("{QUARANTINE_PURGED}{{}}"), 2),
        (format!("{EXPIRED}{{consumer={CONSUMER}}}"), 2),
        (format!("{QUARANTINE_MOVES}{{source=expired-message}}"), 1),
    ];
    for (series, value) in expected {
        assert_eq!(
            counters.get(&series),
            Some(&value),
            "{series} in {counters:?}"
        );
    }
}

#[tokio::test]
async fn the_migration_keeps_the_record_step_a_hot_update() {
    // One connection, so the statistics read below come from the backend that did the work.
    let app = TestApp::with_pool_size(1).await;
    let indexed: Vec<String> =
        sqlx::query_scalar("select indexdef from pg_indexes where tablename = 'consumer_inbox'")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert!(
        indexed.iter().any(|d| d.contains("(received_at)")),
        "{indexed:?}"
    );
    for definition in &indexed {
        assert!(
            !definition.contains("processed_at") && !definition.contains("response_"),
            "{definition}"
        );
    }
    let inbox = Inbox::new(app.pool.clone());
    for i in 0..5 {
        process(&inbox, &format!("k-{i}")).await;
    }
    run_sql(&app, "select pg_stat_force_next_flush()").await;
    let (updates, hot): (i64, i64) = sqlx::query_as(
        "select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables where relname = 'consumer_inbox'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(updates, 5, "one record update per message");
    assert_eq!(hot, 5, "every record update was HOT");
}

#[tokio::test]
async fn storage_budgets_and_purge_settings_that_would_break_retention_are_refused() {
    let err = RetentionPolicy::builder()
        .retry_horizon(DAY)
        .backup_restore(30 * DAY)
        .safety_margin(DAY)
        .window(7 * DAY)
        .build()
        .unwrap_err();
    assert!(
        matches!(err, RetentionError::WindowTooShort { ref scenario, .. } if scenario == "backup restore"),
        "{err:?}"
    );
    assert!(err.to_string().contains("backup restore"), "{err}");
    assert_eq!(
        RetentionPolicy::builder()
            .safety_margin(DAY)
            .window(7 * DAY)
            .build()
            .unwrap_err(),
        RetentionError::NoScenario,
        "a bare TTL"
    );
    // The builders never connect: an unreachable pool is enough.
    let pool = unreachable_pool();
    let refused = |b: tower_inbox::retention::PurgerBuilder| b.build().map(|_| ()).unwrap_err();
    assert_eq!(
        refused(Purger::builder(pool.clone())),
        RetentionError::NothingToPurge
    );
    assert!(matches!(
        refused(
            Purger::builder(pool.clone())
                .inbox(inbox_policy())
                .batch_size(0)
        ),
        RetentionError::BadLimit(_)
    ));
    assert!(matches!(
        refused(
            Purger::builder(pool.clone())
                .inbox(inbox_policy())
                .pause_between_batches(Duration::from_secs(61))
        ),
        RetentionError::BadLimit(_)
    ));
    assert_eq!(
        refused(
            Purger::builder(pool.clone())
                .inbox(inbox_policy())
                .lock_timeout(Duration::ZERO)
        ),
        RetentionError::ZeroDuration("the lock timeout".into()),
        "zero would make PostgreSQL wait forever"
    );
    let purger = Purger::builder(pool).inbox(inbox_policy()).build().unwrap();
    assert_eq!(
        purger
            .run(Duration::ZERO, std::future::pending())
            .await
            .unwrap_err(),
        RetentionError::ZeroDuration("the purge period".into())
    );
}

#[tokio::test]
async fn the_guard_judges_age_by_the_database_clock_not_the_applications() {
    // The database's clock runs two hours behind this process's, as after a skew between
    // the application's host and the database's.
    let cluster = tower_inbox_testdb::Cluster::builder()
        .clock_offset_seconds(-2 * 3600)
        .start()
        .await
        .expect("a cluster on a skewed clock");
    let db = cluster.database().await.expect("db");
    let pool = db.pool(4).await;
    common::credits::prepare(&pool).await.expect("schema");
    let db_now: OffsetDateTime = sqlx::query_scalar("select now()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let skew = OffsetDateTime::now_utc() - db_now;
    assert!(
        skew > time::Duration::minutes(100),
        "the skew is in place: {skew}"
    );

    let inbox = Inbox::new(pool.clone());
    let guard = RetentionGuard::new(inbox.clone(), &inbox_policy());
    let window = time::Duration::try_from(guard.window()).unwrap();
    // Inside the window by the database's clock (an hour to spare), outside it by this
    // process's (which is two hours ahead).
    let inside = db_now - window + time::Duration::hours(1);
    match guarded(&guard, "evt-inside", inside).await.unwrap() {
        GuardedClaim::Claim(Claim::Claimed(message)) => message.commit(None).await.unwrap(),
        other => panic!("refused by the application's clock: {other:?}"),
    }
    // Outside it by both.
    let outside = db_now - window - time::Duration::hours(1);
    match guarded(&guard, "evt-outside", outside).await.unwrap() {
        GuardedClaim::Expired(expired) => {
            // The oldest accepted time is the database's now minus the window.
            let oldest = expired.oldest_accepted - (db_now - window);
            assert!(
                oldest >= time::Duration::ZERO && oldest < time::Duration::minutes(10),
                "oldest accepted {} is not the database's now - window {}",
                expired.oldest_accepted,
                db_now - window
            );
        }
        other => panic!("an expired message was claimed: {other:?}"),
    }
    assert!(inbox
        .lookup(&identity("evt-inside"))
        .await
        .unwrap()
        .is_some());
    assert!(inbox
        .lookup(&identity("evt-outside"))
        .await
        .unwrap()
        .is_none());
}
