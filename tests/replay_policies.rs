//! The seed case "handler version changes during a replay plan", once per replay policy, and
//! the compensated migration's guarantees and failure paths. Every outcome is asserted on the
//! database: ledger and projection rows, and the inbox rows with their consumer name and
//! handler version.
//! (Over 400 lines: one test per replay policy and its failure paths, over shared helpers.)

mod common;

use std::collections::HashMap;
use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::{
    credit, send, unreachable_pool, wait_until_a_lock_is_awaited, Reply, TestApp,
    INSERT_REFUSED_AT_COMMIT,
};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use serde::Serialize;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::Notify;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{Claim, ClaimedMessage, Inbox, RetryReason, TransientRetry};
use tower_inbox::middleware::ConfigError;
use tower_inbox::quarantine::{Quarantine, QuarantineSource};
use tower_inbox::replay::{
    CompensatedMigration, CompensatedMigrationBuilder, MigrationDefinitionError, MigrationStep,
    ReplayPolicy, StepError, StepOutcome, TransientError,
};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

type BoxError = Box<dyn Error + Send + Sync>;

/// `(consumer_name, producer_name, handler_version, rows)` of the whole inbox.
async fn inbox_groups(pool: &PgPool) -> Vec<(String, String, String, i64)> {
    sqlx::query_as(
        "select consumer_name, producer_name, handler_version, count(*) from tower_inbox.consumer_inbox
         group by 1, 2, 3 order by 1, 2, 3",
    )
    .fetch_all(pool)
    .await
    .expect("inbox groups")
}

fn group(
    consumer: &str,
    producer: &str,
    version: &str,
    rows: i64,
) -> (String, String, String, i64) {
    (consumer.into(), producer.into(), version.into(), rows)
}

// ---------------------------------------------------------------------------------------
// No reapplication
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn no_reapplication_v2_answers_every_v1_command_as_a_duplicate() {
    const N: usize = 5;
    let app = TestApp::new().await;
    let v1 = app.credits_with(|b| b.handler_version("1"));
    let mut originals = Vec::new();
    for i in 0..N {
        let reply = send(
            &v1,
            credit(&format!("a{i}"), Some(&format!("k{i}")), Some("app"), 10),
        )
        .await;
        assert_eq!(reply.status, StatusCode::CREATED);
        originals.push(reply);
    }

    // Version 2 is deployed with the default policy, and the whole plan is redelivered.
    let v2 = app.credits_with(|b| b.handler_version("2"));
    for (i, original) in originals.iter().enumerate() {
        let replay = send(
            &v2,
            credit(&format!("a{i}"), Some(&format!("k{i}")), Some("app"), 10),
        )
        .await;
        assert!(replay.replayed(), "k{i} was applied again: {replay:?}");
        assert_eq!(replay.status, original.status);
        assert_eq!(replay.body, original.body);
    }
    for i in 0..N {
        assert_eq!(app.ledger_rows(&format!("a{i}")).await, 1);
        assert_eq!(app.balance(&format!("a{i}")).await, Some(10));
        let row = app.inbox_row("app", &format!("k{i}")).await.expect("row");
        assert_eq!(row.handler_version, "1");
    }
    assert_eq!(
        inbox_groups(&app.pool).await,
        vec![group("credits", "app", "1", N as i64)]
    );

    // A new command is processed, and recorded, by version 2.
    let fresh = send(&v2, credit("a0", Some("k-new"), Some("app"), 5)).await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    assert!(!fresh.replayed());
    assert_eq!(app.ledger_rows("a0").await, 2);
    assert_eq!(app.balance("a0").await, Some(15));
    assert_eq!(
        app.inbox_row("app", "k-new")
            .await
            .expect("row")
            .handler_version,
        "2"
    );
    // Both versions share the identity, so version 1 (still running during the deploy)
    // answers it as a duplicate too.
    assert!(send(&v1, credit("a0", Some("k-new"), Some("app"), 5))
        .await
        .replayed());
    assert_eq!(
        inbox_groups(&app.pool).await,
        vec![
            group("credits", "app", "1", N as i64),
            group("credits", "app", "2", 1)
        ]
    );
}

// ---------------------------------------------------------------------------------------
// Versioned projection
// ---------------------------------------------------------------------------------------

const PROJECTION: &str = "balance-projection";

/// A message of the credits history, as a broker would redeliver it.
#[derive(Clone)]
struct Event {
    id: String,
    account: String,
    delta: i64,
}

impl Event {
    fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of_json(&json!({"account": self.account, "delta": self.delta}))
    }

    fn identity(&self, version: &str) -> MessageIdentity {
        let consumer = ReplayPolicy::VersionedProjection
            .consumer_name(PROJECTION, version)
            .expect("consumer name");
        MessageIdentity::new(
            consumer,
            Producer::new("credits").expect("producer"),
            MessageKey::new(&self.id).expect("key"),
        )
    }
}

fn history(n: usize) -> Vec<Event> {
    (0..n)
        .map(|i| Event {
            id: format!("evt-{i:02}"),
            account: format!("a{}", i % 3),
            delta: 10 * (i as i64 + 1),
        })
        .collect()
}

#[derive(Debug, PartialEq, Eq)]
enum Projected {
    Applied,
    Duplicate { recorded_by: String },
}

/// Claims the event under `version`'s own consumer identity, in the transaction that writes
/// that version's projection row.
async fn claim_for_projection(inbox: &Inbox, version: &str, event: &Event) -> Claim {
    inbox
        .claim(
            event.identity(version),
            event.fingerprint(),
            version,
            Duration::from_secs(30),
        )
        .await
        .expect("claim")
}

async fn write_projection_row(message: &mut ClaimedMessage, version: &str, event: &Event) {
    sqlx::query(
        "insert into balance_projection (version, message_id, account_id, delta)
         values ($1, $2, $3, $4)",
    )
    .bind(version)
    .bind(&event.id)
    .bind(&event.account)
    .bind(event.delta)
    .execute(&mut *message)
    .await
    .expect("projection row");
}

async fn project(inbox: &Inbox, version: &str, event: &Event) -> Projected {
    match claim_for_projection(inbox, version, event).await {
        Claim::Claimed(mut message) => {
            write_projection_row(&mut message, version, event).await;
            message.commit(None).await.expect("commit");
            Projected::Applied
        }
        Claim::Duplicate(entry) => Projected::Duplicate {
            recorded_by: entry.handler_version,
        },
        other => panic!("unexpected claim of {}: {other:?}", event.id),
    }
}

/// The projector dies mid-transaction: its connection is killed after the claim and the
/// projection write, before the commit.
async fn crash_while_projecting(inbox: &Inbox, version: &str, event: &Event) {
    let Claim::Claimed(mut message) = claim_for_projection(inbox, version, event).await else {
        panic!("{} should be first seen by {version}", event.id);
    };
    write_projection_row(&mut message, version, event).await;
    let pid: i32 = sqlx::query_scalar("select pg_backend_pid()")
        .fetch_one(&mut message)
        .await
        .expect("pid");
    sqlx::query("select pg_terminate_backend($1)")
        .bind(pid)
        .execute(inbox.pool())
        .await
        .expect("terminate");
    assert!(
        message.commit(None).await.is_err(),
        "the crashed transaction committed"
    );
}

async fn projection_rows(pool: &PgPool, version: &str) -> Vec<(String, String, i64)> {
    sqlx::query_as(
        "select message_id, account_id, delta from balance_projection where version = $1
         order by message_id, account_id, delta",
    )
    .bind(version)
    .fetch_all(pool)
    .await
    .expect("projection rows")
}

#[tokio::test]
async fn versioned_projection_replay_interrupted_and_restarted_during_live_redeliveries() {
    const N: usize = 12;
    const CRASH_AT: usize = 5;
    let app = TestApp::new().await;
    sqlx::query(
        "create table balance_projection (
            version text not null, message_id text not null, account_id text not null,
            delta bigint not null)",
    )
    .execute(&app.pool)
    .await
    .expect("projection table");
    let inbox = Inbox::new(app.pool.clone());
    let events = history(N);

    // Version 1 consumes the history live.
    for event in &events {
        assert_eq!(project(&inbox, "1", event).await, Projected::Applied);
    }
    let v1_rows = projection_rows(&app.pool, "1").await;
    assert_eq!(v1_rows.len(), N);

    // Version 2 is deployed and replays the history from the start; the replay dies
    // mid-transaction on the CRASH_AT-th message.
    for event in &events[..CRASH_AT] {
        assert_eq!(project(&inbox, "2", event).await, Projected::Applied);
    }
    crash_while_projecting(&inbox, "2", &events[CRASH_AT]).await;
    assert_eq!(projection_rows(&app.pool, "2").await.len(), CRASH_AT);

    // The replay restarts from the beginning while the broker redelivers the same messages
    // live, to version 1 instances not yet replaced and to version 2 instances.
    let replay = {
        let (inbox, events) = (inbox.clone(), events.clone());
        tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for event in &events {
                outcomes.push(project(&inbox, "2", event).await);
            }
            outcomes
        })
    };
    let live = |version: &'static str| {
        let (inbox, events) = (inbox.clone(), events.clone());
        tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for event in events.iter().rev() {
                outcomes.push(project(&inbox, version, event).await);
            }
            outcomes
        })
    };
    let (live_v1, live_v2) = (live("1"), live("2"));
    let replay = replay.await.expect("replay");
    let live_v1 = live_v1.await.expect("live v1");
    let live_v2 = live_v2.await.expect("live v2");

    // Each message was applied by version 2 exactly once, by the first replay, the
    // restarted replay or a live redelivery; everything else was a duplicate for it.
    let v1_duplicate = Projected::Duplicate {
        recorded_by: "1".into(),
    };
    assert!(live_v1.iter().all(|o| *o == v1_duplicate), "{live_v1:?}");
    let applied_after_crash = replay
        .iter()
        .chain(&live_v2)
        .filter(|o| **o == Projected::Applied)
        .count();
    assert_eq!(CRASH_AT + applied_after_crash, N);
    assert!(replay[..CRASH_AT].iter().all(|o| *o != Projected::Applied));

    let v2_rows = projection_rows(&app.pool, "2").await;
    let expected: Vec<_> = events
        .iter()
        .map(|e| (e.id.clone(), e.account.clone(), e.delta))
        .collect();
    assert_eq!(v2_rows, expected, "one version 2 row per message");
    assert_eq!(
        projection_rows(&app.pool, "1").await,
        v1_rows,
        "version 1 untouched"
    );
    assert_eq!(
        inbox_groups(&app.pool).await,
        vec![
            group("balance-projection@1", "credits", "1", N as i64),
            group("balance-projection@2", "credits", "2", N as i64),
        ]
    );

    // Later redeliveries are duplicates for both versions.
    for event in &events {
        assert_eq!(project(&inbox, "1", event).await, v1_duplicate);
        assert_eq!(
            project(&inbox, "2", event).await,
            Projected::Duplicate {
                recorded_by: "2".into()
            }
        );
    }
    assert_eq!(projection_rows(&app.pool, "2").await.len(), N);
}

#[tokio::test]
async fn versioned_projection_on_the_layer_applies_each_key_once_per_version() {
    let app = TestApp::new().await;
    let versioned = |version: &'static str| {
        app.credits_with(move |b| {
            b.replay_policy(ReplayPolicy::VersionedProjection)
                .handler_version(version)
        })
    };
    let (v1, v2) = (versioned("1"), versioned("2"));
    let request = || credit("a1", Some("k"), Some("app"), 10);

    assert!(!send(&v1, request()).await.replayed());
    let first_v2: Reply = send(&v2, request()).await;
    assert_eq!(first_v2.status, StatusCode::CREATED);
    assert!(!first_v2.replayed(), "version 2 is a new consumer identity");
    assert!(send(&v2, request()).await.replayed());
    assert!(send(&v1, request()).await.replayed());

    // The credits handler has a side effect, so each version applied it: exactly why this
    // policy is for projections only.
    let ledger: Vec<(String, i64)> = sqlx::query_as(
        "select consumer_name, delta from credit_ledger where account_id = 'a1' order by id",
    )
    .fetch_all(&app.pool)
    .await
    .expect("ledger");
    assert_eq!(
        ledger,
        vec![("credits@1".to_owned(), 10), ("credits@2".to_owned(), 10)]
    );
    assert_eq!(
        inbox_groups(&app.pool).await,
        vec![
            group("credits@1", "app", "1", 1),
            group("credits@2", "app", "2", 1)
        ]
    );
}

#[tokio::test]
async fn a_versioned_projection_version_with_an_at_sign_fails_build() {
    let app = TestApp::new().await;
    let builder = || {
        tower_inbox::InboxLayer::builder(app.pool.clone(), "proj")
            .producer(tower_inbox::producer::TrustedHeader::new("x-producer"))
    };
    let versioned = builder()
        .replay_policy(ReplayPolicy::VersionedProjection)
        .handler_version("2@beta")
        .build();
    assert_eq!(versioned.err(), Some(ConfigError::BadHandlerVersion));
    // Without the version in the identity, '@' splits nothing and is accepted.
    assert!(builder().handler_version("2@beta").build().is_ok());
    let empty_consumer = tower_inbox::InboxLayer::builder(app.pool.clone(), "")
        .producer(tower_inbox::producer::TrustedHeader::new("x-producer"))
        .replay_policy(ReplayPolicy::VersionedProjection)
        .build();
    assert_eq!(empty_consumer.err(), Some(ConfigError::BadConsumerName));
}

// ---------------------------------------------------------------------------------------
// Compensated migration
// ---------------------------------------------------------------------------------------

const MIGRATION: &str = "credits-bonus-fix-2026-12";
const MIGRATION_PRODUCER: &str = "migration:credits-bonus-fix-2026-12";

/// Version 1's bug: credits of 100 or more should have earned a 10 % bonus.
#[derive(Debug, Clone, Serialize)]
struct MissingBonus {
    account: String,
    command: String,
    bonus: i64,
}

/// The commands version 1 processed, and the balances once each bonus is paid.
const COMMANDS: [(&str, &str, i64); 5] = [
    ("a0", "k0", 100),
    ("a1", "k1", 50),
    ("a2", "k2", 200),
    ("a3", "k3", 300),
    ("a0", "k4", 150),
];
const FIXED_BALANCES: [(&str, i64); 4] = [("a0", 275), ("a1", 50), ("a2", 220), ("a3", 330)];

/// Runs the commands through version 1 and derives one step per affected command from the
/// ledger, with an operation ID derived from the command's identity.
async fn buggy_v1(app: &TestApp) -> Vec<MigrationStep<MissingBonus>> {
    let v1 = app.credits_with(|b| b.handler_version("1"));
    for (account, key, delta) in COMMANDS {
        let reply = send(&v1, credit(account, Some(key), Some("app"), delta)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let affected: Vec<(String, String, String, i64)> = sqlx::query_as(
        "select producer_name, message_id, account_id, delta from credit_ledger
         where consumer_name = 'credits' and delta >= 100 order by id",
    )
    .fetch_all(&app.pool)
    .await
    .expect("affected commands");
    affected
        .into_iter()
        .map(|(producer, command, account, delta)| {
            MigrationStep::new(
                format!("bonus/{producer}/{command}"),
                MissingBonus {
                    account,
                    command,
                    bonus: delta / 10,
                },
            )
            .expect("step")
        })
        .collect()
}

fn bonus_migration(pool: &PgPool) -> CompensatedMigration {
    bonus_migration_with(pool, |b| b.handler_version("fix-1"))
}

fn bonus_migration_with(
    pool: &PgPool,
    configure: impl FnOnce(CompensatedMigrationBuilder) -> CompensatedMigrationBuilder,
) -> CompensatedMigration {
    configure(CompensatedMigration::builder(
        Inbox::new(pool.clone()),
        "credits",
        MIGRATION,
    ))
    .build()
    .expect("migration")
}

/// The compensation: pays the bonus and writes a ledger row that names the step.
fn pay_bonus<'a>(
    tx: &'a mut ClaimedMessage,
    fix: &'a MissingBonus,
) -> BoxFuture<'a, Result<(), sqlx::Error>> {
    async move {
        let balance: i64 = sqlx::query_scalar(
            "update credit_account set balance = balance + $1 where account_id = $2
             returning balance",
        )
        .bind(fix.bonus)
        .bind(&fix.account)
        .fetch_one(&mut *tx)
        .await?;
        let id = tx.identity().clone();
        sqlx::query(
            "insert into credit_ledger
                 (account_id, delta, balance_after, consumer_name, producer_name, message_id)
             values ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&fix.account)
        .bind(fix.bonus)
        .bind(balance)
        .bind(id.consumer())
        .bind(id.producer().name())
        .bind(id.message_id().as_str())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
    .boxed()
}

/// Pays the bonus, then runs `sql` in the same transaction.
fn pay_bonus_then<'a>(
    tx: &'a mut ClaimedMessage,
    fix: &'a MissingBonus,
    sql: &'static str,
) -> BoxFuture<'a, Result<(), sqlx::Error>> {
    async move {
        pay_bonus(tx, fix).await?;
        sqlx::query(sql).execute(&mut *tx).await?;
        Ok(())
    }
    .boxed()
}

/// A step that writes nothing.
fn do_nothing<'a, I>(
    _: &'a mut ClaimedMessage,
    _: &'a I,
) -> BoxFuture<'a, Result<(), sqlx::Error>> {
    async { Ok(()) }.boxed()
}

/// `step`, counting its calls.
fn counting<'c, I: 'c, E: 'c>(
    calls: &'c AtomicUsize,
    step: for<'a> fn(&'a mut ClaimedMessage, &'a I) -> BoxFuture<'a, Result<(), E>>,
) -> impl for<'a> FnMut(&'a mut ClaimedMessage, &'a I) -> BoxFuture<'a, Result<(), E>> + Copy + 'c {
    move |tx, input| {
        calls.fetch_add(1, Ordering::SeqCst);
        step(tx, input)
    }
}

/// `(message_id, account_id, delta)` of every compensation ledger row.
async fn compensations(pool: &PgPool) -> Vec<(String, String, i64)> {
    sqlx::query_as(
        "select message_id, account_id, delta from credit_ledger where producer_name = $1
         order by message_id",
    )
    .bind(MIGRATION_PRODUCER)
    .fetch_all(pool)
    .await
    .expect("compensations")
}

async fn balances(app: &TestApp) -> Vec<(&'static str, i64)> {
    let mut out = Vec::new();
    for (account, _) in FIXED_BALANCES {
        out.push((account, app.balance(account).await.expect("account")));
    }
    out
}

fn expected_compensations(steps: &[MigrationStep<MissingBonus>]) -> Vec<(String, String, i64)> {
    let mut rows: Vec<_> = steps
        .iter()
        .map(|s| {
            let fix = s.input();
            (s.operation_id().to_string(), fix.account.clone(), fix.bonus)
        })
        .collect();
    rows.sort();
    rows
}

/// Raises a real error with `sqlstate` from the database, aborting the transaction.
async fn raise(conn: &mut ClaimedMessage, sqlstate: &str) -> sqlx::Error {
    let sql = format!("do $$ begin raise exception 'forced' using errcode = '{sqlstate}'; end $$");
    sqlx::query(&sql)
        .execute(conn)
        .await
        .expect_err("the raise must fail")
}

#[tokio::test]
async fn compensated_migration_interrupted_then_rerun_applies_each_compensation_once() {
    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    assert_eq!(steps.len(), 4);
    let migration = bonus_migration(&app.pool);

    // The first run stops at the third step, whose account turns out frozen: the step
    // paid its bonus, then failed, so everything it wrote rolls back with its claim.
    let frozen = steps[2].input().command.clone();
    let failed = migration
        .run(steps.clone(), |tx, fix| {
            let frozen = fix.command == frozen;
            async move {
                pay_bonus(tx, fix).await?;
                if frozen {
                    return Err::<(), BoxError>("account frozen".into());
                }
                Ok(())
            }
            .boxed()
        })
        .await
        .expect_err("the third step fails");
    assert_eq!(&failed.operation_id, steps[2].operation_id());
    assert!(matches!(&failed.error, StepError::Failed(e) if e.to_string() == "account frozen"));
    assert_eq!(failed.report.applied(), 2);
    assert_eq!(failed.report.skipped(), 0);
    assert_eq!(
        compensations(&app.pool).await,
        expected_compensations(&steps[..2])
    );
    assert_eq!(
        balances(&app).await,
        [("a0", 260), ("a1", 50), ("a2", 220), ("a3", 300)]
    );
    assert_eq!(
        Inbox::new(app.pool.clone())
            .lookup(&migration.identity(steps[2].operation_id()))
            .await
            .expect("lookup"),
        None,
        "the failed step's claim rolled back"
    );

    // The re-run applies only the remaining steps.
    let calls = AtomicUsize::new(0);
    let rerun = migration
        .run(steps.clone(), counting(&calls, pay_bonus))
        .await
        .expect("re-run");
    assert_eq!((rerun.applied(), rerun.skipped()), (2, 2));
    let applied: Vec<bool> = rerun
        .steps()
        .iter()
        .map(|s| s.outcome.is_applied())
        .collect();
    assert_eq!(applied, [false, false, true, true]);
    assert_eq!(
        rerun.steps()[0].outcome,
        StepOutcome::AlreadyApplied {
            handler_version: "fix-1".into()
        }
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        compensations(&app.pool).await,
        expected_compensations(&steps)
    );
    assert_eq!(balances(&app).await, FIXED_BALANCES);

    // A finished migration run again applies nothing.
    let again = migration
        .run(steps.clone(), pay_bonus)
        .await
        .expect("third run");
    assert_eq!((again.applied(), again.skipped()), (0, 4));
    assert_eq!(again.migration(), MIGRATION);
    assert_eq!(
        compensations(&app.pool).await,
        expected_compensations(&steps)
    );
    assert_eq!(balances(&app).await, FIXED_BALANCES);
    // The version 1 commands are untouched; the steps are the migration producer's own.
    assert_eq!(
        inbox_groups(&app.pool).await,
        vec![
            group("credits", "app", "1", 5),
            group("credits", MIGRATION_PRODUCER, "fix-1", 4)
        ]
    );
}

#[tokio::test]
async fn a_migration_step_reused_with_a_different_input_is_a_quarantined_conflict() {
    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    let migration = bonus_migration(&app.pool);
    migration.run(steps.clone(), pay_bonus).await.expect("run");

    let original = &steps[0];
    let changed = MigrationStep::new(
        original.operation_id().as_str(),
        MissingBonus {
            bonus: original.input().bonus + 1,
            ..original.input().clone()
        },
    )
    .expect("step");
    let calls = AtomicUsize::new(0);
    let result = migration
        .apply_step(&changed, counting(&calls, pay_bonus))
        .await;
    let Err(StepError::Conflict {
        recorded_sha256,
        input_sha256,
    }) = result
    else {
        panic!("expected a conflict, got {result:?}");
    };
    assert_eq!(recorded_sha256, original.fingerprint().to_hex());
    assert_eq!(input_sha256, changed.fingerprint().to_hex());
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "the conflicting step did not run"
    );
    assert_eq!(
        compensations(&app.pool).await,
        expected_compensations(&steps)
    );
    assert_eq!(balances(&app).await, FIXED_BALANCES);
    let entry = Inbox::new(app.pool.clone())
        .lookup(&migration.identity(original.operation_id()))
        .await
        .expect("lookup")
        .expect("original");
    assert_eq!(entry.payload_sha256, original.fingerprint().to_hex());

    let items = Quarantine::new(app.pool.clone())
        .for_identity(&migration.identity(original.operation_id()))
        .await
        .expect("quarantine");
    assert_eq!(items.len(), 1, "{items:?}");
    assert_eq!(items[0].source, QuarantineSource::IdentityConflict);
    assert_eq!(items[0].reason_code, "payload-mismatch");
    assert_eq!(items[0].payload_sha256, changed.fingerprint().to_hex());
    assert_eq!(items[0].producer_name.as_deref(), Some(MIGRATION_PRODUCER));
    assert_eq!(items[0].handler_version.as_deref(), Some("fix-1"));

    // The same input is still simply a step applied before.
    let same = migration
        .apply_step(original, pay_bonus)
        .await
        .expect("same");
    assert!(!same.is_applied());
}

#[tokio::test]
async fn a_conflict_is_refused_even_when_the_quarantine_cannot_keep_it() {
    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    let migration = bonus_migration(&app.pool);
    migration
        .apply_step(&steps[0], pay_bonus)
        .await
        .expect("apply");
    // DROP TABLE is the owner's.
    sqlx::query("drop table tower_inbox.inbox_quarantine")
        .execute(&app.owner)
        .await
        .expect("drop");
    let changed =
        MigrationStep::new(steps[0].operation_id().as_str(), "something else").expect("step");
    let result = migration.apply_step(&changed, do_nothing).await;
    assert!(
        matches!(result, Err(StepError::Conflict { .. })),
        "{result:?}"
    );
    assert_eq!(
        compensations(&app.pool).await,
        expected_compensations(&steps[..1])
    );
}

#[tokio::test]
async fn a_deadlocked_step_is_rerun_and_applied_once() {
    let app = TestApp::new().await;
    // The step's backend detects the deadlock fast. deadlock_timeout is a superuser's
    // setting, which the service's role may not set: the owner sets it for the database's new
    // sessions, before the service's pool opens any.
    app.set_for_new_sessions("deadlock_timeout", "'50ms'").await;
    let steps = buggy_v1(&app).await;
    let migration = bonus_migration(&app.pool);
    let step = &steps[0];
    let other_account = steps[1].input().account.clone();

    // Another transaction holds the other account's row and will ask for this step's
    // account once the step holds it: a real lock cycle on the first attempt.
    let step_holds_row = Arc::new(Notify::new());
    let other = {
        // deadlock_timeout is a superuser's setting: the other transaction is the owner's.
        let pool = app.owner.clone();
        let (account, other_account) = (step.input().account.clone(), other_account.clone());
        let step_holds_row = step_holds_row.clone();
        tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("begin");
            // Only the step's backend looks for the deadlock, so it is the one chosen.
            sqlx::query("set local deadlock_timeout = '60s'")
                .execute(&mut *tx)
                .await
                .expect("timeout");
            lock_account(&mut *tx, &other_account)
                .await
                .expect("lock other");
            step_holds_row.notified().await;
            lock_account(&mut *tx, &account)
                .await
                .expect("lock step's account");
            tx.rollback().await.expect("rollback");
        })
    };

    let calls = AtomicUsize::new(0);
    // The owner's: the other transaction's wait shows in pg_stat_activity only to its role
    // (or a superuser), not to the service's.
    let pool = app.owner.clone();
    let outcome = migration
        .apply_step(step, |tx: &mut ClaimedMessage, fix: &MissingBonus| {
            let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
            let (pool, notify, other_account) =
                (pool.clone(), step_holds_row.clone(), other_account.clone());
            async move {
                if first {
                    lock_account(&mut *tx, &fix.account).await?;
                    notify.notify_one();
                    wait_until_a_lock_is_awaited(&pool).await;
                    lock_account(&mut *tx, &other_account).await?;
                }
                pay_bonus(tx, fix).await
            }
            .boxed()
        })
        .await
        .expect("applied on the re-run");
    other.await.expect("other transaction");

    assert_applied_once_on_the_second_attempt(&app, &steps, outcome, &calls).await;
}

async fn lock_account<'c>(
    conn: impl sqlx::Executor<'c, Database = sqlx::Postgres>,
    account: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("select 1 from credit_account where account_id = $1 for update")
        .bind(account)
        .execute(conn)
        .await
        .map(|_| ())
}

#[tokio::test]
async fn serialization_failures_are_rerun_a_bounded_number_of_times() {
    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    let migration = bonus_migration_with(&app.pool, |b| {
        b.retry(TransientRetry::new(
            3,
            Duration::from_millis(1),
            Duration::from_millis(5),
        ))
    });

    let calls = AtomicUsize::new(0);
    let result = migration
        .apply_step(&steps[0], |tx: &mut ClaimedMessage, fix: &MissingBonus| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                pay_bonus(tx, fix).await?;
                Err::<(), BoxError>(Box::new(raise(tx, "40001").await))
            }
            .boxed()
        })
        .await;
    let Err(StepError::Failed(err)) = result else {
        panic!("expected the step to fail, got {result:?}");
    };
    assert_eq!(err.retry_reason(), Some(RetryReason::SerializationFailure));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "three attempts, then it gives up"
    );
    assert_eq!(compensations(&app.pool).await, vec![]);
    assert_eq!(app.balance(&steps[0].input().account).await, Some(250));
    assert_eq!(
        inbox_groups(&app.pool).await,
        vec![group("credits", "app", "1", 5)]
    );

    // With no re-runs allowed the first transient failure is final.
    let once = bonus_migration_with(&app.pool, |b| b.retry(TransientRetry::never()));
    let calls = AtomicUsize::new(0);
    let result = once
        .apply_step(&steps[0], |tx: &mut ClaimedMessage, _: &MissingBonus| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move { Err::<(), sqlx::Error>(raise(tx, "40P01").await) }.boxed()
        })
        .await;
    assert!(
        matches!(&result, Err(StepError::Failed(e)) if e.retry_reason() == Some(RetryReason::Deadlock))
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_watched_failure_the_step_swallowed_or_a_requested_rerun_reruns_it() {
    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    let migration = bonus_migration_with(&app.pool, |b| {
        b.retry(TransientRetry::new(
            3,
            Duration::from_millis(1),
            Duration::from_millis(5),
        ))
    });
    // The first attempt pays the bonus, then a statement run through the claimed message
    // (watched) deadlocks and the function ignores it and returns Ok: the transaction is
    // aborted all the same, so the step is re-run rather than committed.
    let calls = AtomicUsize::new(0);
    let outcome = migration
        .apply_step(&steps[0], |tx: &mut ClaimedMessage, fix: &MissingBonus| {
            let call = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                pay_bonus(tx, fix).await?;
                if call == 0 {
                    let sql = "do $$ begin raise exception 'x' using errcode = '40P01'; end $$";
                    let ignored = sqlx::query(sql).execute(&mut *tx).await;
                    assert!(ignored.is_err());
                }
                Ok::<(), BoxError>(())
            }
            .boxed()
        })
        .await
        .expect("applied on the second attempt");
    assert!(matches!(outcome, StepOutcome::Applied { attempts: 2, .. }));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(compensations(&app.pool).await.len(), 1);

    // A function that asks for a re-run every time runs out of attempts, writing nothing.
    let calls = AtomicUsize::new(0);
    let result = migration
        .apply_step(&steps[1], |tx: &mut ClaimedMessage, fix: &MissingBonus| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                pay_bonus(tx, fix).await?;
                tx.request_retry();
                Ok::<(), BoxError>(())
            }
            .boxed()
        })
        .await;
    assert!(
        matches!(result, Err(StepError::Rerun(RetryReason::Requested))),
        "{result:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(
        compensations(&app.pool).await.len(),
        1,
        "nothing of step 2 kept"
    );
}

#[tokio::test]
async fn a_serialization_failure_at_commit_reruns_the_step() {
    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    // The first commit that carries a compensation row is refused the way a serializable
    // transaction is refused at commit; the sequence survives that rollback.
    sqlx::raw_sql(
        "create sequence commit_refusals;
         -- security definer: the sequence is the owner's, the service only fires the trigger.
         create function refuse_first_commit() returns trigger language plpgsql
             security definer as $$
         begin
             if nextval('commit_refusals') = 1 then
                 raise exception 'could not serialize access' using errcode = '40001';
             end if;
             return null;
         end $$;
         create constraint trigger refuse_first_commit after insert on credit_ledger
             deferrable initially deferred for each row
             when (new.producer_name like 'migration:%')
             execute function refuse_first_commit();",
    )
    // A trigger on the example's table is the owner's to create.
    .execute(&app.owner)
    .await
    .expect("trigger");
    let migration = bonus_migration(&app.pool);
    let calls = AtomicUsize::new(0);
    let outcome = migration
        .apply_step(&steps[0], counting(&calls, pay_bonus))
        .await
        .expect("applied");
    assert_applied_once_on_the_second_attempt(&app, &steps, outcome, &calls).await;
}

/// The first step ran twice (the first attempt rolled back) and its compensation committed
/// once.
async fn assert_applied_once_on_the_second_attempt(
    app: &TestApp,
    steps: &[MigrationStep<MissingBonus>],
    outcome: StepOutcome<()>,
    calls: &AtomicUsize,
) {
    assert_eq!(
        outcome,
        StepOutcome::Applied {
            value: (),
            attempts: 2
        }
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        compensations(&app.pool).await,
        expected_compensations(&steps[..1])
    );
    assert_eq!(app.balance(&steps[0].input().account).await, Some(260));
}

#[tokio::test]
async fn a_failing_step_rolls_back_its_writes_and_stays_retryable() {
    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    let migration = bonus_migration(&app.pool);

    let result = migration
        .apply_step(&steps[0], |tx, fix| {
            // A constraint the compensation breaks: a real, permanent database error.
            pay_bonus_then(tx, fix, "insert into credit_ledger (account_id, delta, balance_after, consumer_name, producer_name, message_id) values ('no-such-account', 1, 1, 'c', 'p', 'm')")
        })
        .await;
    let Err(StepError::Failed(err)) = result else {
        panic!("expected the step to fail, got {result:?}");
    };
    assert!(!err.is_transient());
    assert_eq!(compensations(&app.pool).await, vec![]);
    assert_eq!(app.balance("a0").await, Some(250));
    assert_eq!(app.ledger_rows("no-such-account").await, 0);
    assert_eq!(
        inbox_groups(&app.pool).await,
        vec![group("credits", "app", "1", 5)]
    );

    // The process running the step dies mid-transaction: the rollback itself fails, and
    // still nothing of the step is left.
    let result = migration
        .apply_step(&steps[0], |tx, fix| {
            pay_bonus_then(tx, fix, "select pg_terminate_backend(pg_backend_pid())")
        })
        .await;
    assert!(matches!(result, Err(StepError::Failed(_))), "{result:?}");
    assert_eq!(compensations(&app.pool).await, vec![]);
    assert_eq!(app.balance("a0").await, Some(250));

    let outcome = migration
        .apply_step(&steps[0], pay_bonus)
        .await
        .expect("retry");
    assert!(outcome.is_applied());
    assert_eq!(app.balance("a0").await, Some(260));
}

#[tokio::test]
async fn a_step_held_by_another_runner_is_in_progress() {
    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    let migration =
        bonus_migration_with(&app.pool, |b| b.in_flight_wait(Duration::from_millis(50)));
    let step = &steps[0];

    // Another runner claimed the step and has not finished.
    let Claim::Claimed(held) = Inbox::new(app.pool.clone())
        .claim(
            migration.identity(step.operation_id()),
            step.fingerprint(),
            "1",
            Duration::ZERO,
        )
        .await
        .expect("claim")
    else {
        panic!("the step should be first seen");
    };
    let calls = AtomicUsize::new(0);
    let counted = counting(&calls, pay_bonus);
    let failed = migration
        .run(steps.clone(), counted)
        .await
        .expect_err("in progress");
    assert!(matches!(failed.error, StepError::InProgress), "{failed:?}");
    assert_eq!(failed.report.steps().len(), 0);
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    // It rolls back (it crashed), so this runner applies the step.
    held.rollback().await.expect("rollback");
    let report = migration.run(steps.clone(), counted).await.expect("run");
    assert_eq!(report.applied(), steps.len());
    assert_eq!(
        compensations(&app.pool).await,
        expected_compensations(&steps)
    );
}

#[tokio::test]
async fn concurrent_runners_apply_each_step_once() {
    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    let migration = bonus_migration_with(&app.pool, |b| b.in_flight_wait(Duration::from_secs(30)));
    let runners: Vec<_> = (0..3)
        .map(|_| {
            let (migration, steps) = (migration.clone(), steps.clone());
            tokio::spawn(async move { migration.run(steps, pay_bonus).await })
        })
        .collect();
    let mut applied = 0;
    for runner in runners {
        let report = runner.await.expect("runner").expect("run");
        assert_eq!(report.steps().len(), steps.len());
        applied += report.applied();
    }
    assert_eq!(applied, steps.len());
    assert_eq!(
        compensations(&app.pool).await,
        expected_compensations(&steps)
    );
    assert_eq!(balances(&app).await, FIXED_BALANCES);
}

#[tokio::test]
async fn database_failures_of_a_step_are_errors_and_commit_nothing() {
    let step = MigrationStep::new("op-1", json!({"account": "a1"})).expect("step");
    let calls = AtomicUsize::new(0);
    let counted = counting(&calls, do_nothing);

    // Unreachable database: the claim fails, the step does not run.
    let down = CompensatedMigration::builder(Inbox::new(unreachable_pool()), "c", MIGRATION)
        .build()
        .expect("migration");
    let result = down.apply_step(&step, counted).await;
    assert!(
        matches!(&result, Err(StepError::Inbox(e)) if e.is_retryable()),
        "{result:?}"
    );

    // A database without the inbox migrations.
    let db = tower_inbox_testdb::TestDatabase::create()
        .await
        .expect("db");
    let bare = CompensatedMigration::builder(Inbox::new(db.pool(2).await), "c", MIGRATION)
        .build()
        .expect("migration");
    let result = bare.apply_step(&step, counted).await;
    assert!(
        matches!(&result, Err(StepError::Inbox(e)) if !e.is_retryable()),
        "{result:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    // The commit is refused (a deferred constraint): not re-run, nothing committed.
    let app = TestApp::new().await;
    app.create_refused_at_commit().await;
    let migration = CompensatedMigration::builder(Inbox::new(app.pool.clone()), "c", MIGRATION)
        .build()
        .expect("migration");
    let result = migration
        .apply_step(&step, |tx: &mut ClaimedMessage, _: &serde_json::Value| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                sqlx::query(INSERT_REFUSED_AT_COMMIT)
                    .execute(&mut *tx)
                    .await
                    .map(|_| ())
            }
            .boxed()
        })
        .await;
    assert!(
        matches!(&result, Err(StepError::Inbox(e)) if !e.is_retryable()),
        "{result:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.refused_at_commit_rows().await, 1);
}

#[tokio::test]
async fn migration_steps_are_counted_by_outcome() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // The test runtime is single-threaded, so every step runs under this recorder.
    let _guard = metrics::set_default_local_recorder(&recorder);

    let app = TestApp::new().await;
    let steps = buggy_v1(&app).await;
    let migration = bonus_migration(&app.pool);
    let first_attempt = AtomicUsize::new(0);
    migration
        .run(steps.clone(), |tx, fix| {
            let first = first_attempt.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    return Err(raise(tx, "40001").await);
                }
                pay_bonus(tx, fix).await
            }
            .boxed()
        })
        .await
        .expect("run");
    migration
        .run(steps.clone(), pay_bonus)
        .await
        .expect("re-run");
    let changed = MigrationStep::new(steps[0].operation_id().as_str(), "changed").expect("step");
    let conflict = migration.apply_step(&changed, do_nothing).await;
    assert!(matches!(conflict, Err(StepError::Conflict { .. })));

    let mut counters = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let DebugValue::Counter(n) = value else {
            continue;
        };
        let key = key.key();
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        counters.insert(format!("{}{{{}}}", key.name(), labels.join(",")), n);
    }
    let steps_total = |outcome: &str| {
        counters
            .get(&format!(
                "inbox_migration_steps_total{{migration={MIGRATION},outcome={outcome}}}"
            ))
            .copied()
    };
    assert_eq!(steps_total("applied"), Some(4), "{counters:?}");
    assert_eq!(steps_total("already-applied"), Some(4));
    assert_eq!(steps_total("conflict"), Some(1));
    assert_eq!(
        counters
            .get("inbox_transaction_retries_total{consumer=credits,reason=serialization-failure}")
            .copied(),
        Some(1),
        "{counters:?}"
    );
    assert!(tower_inbox::metrics::METRICS
        .iter()
        .any(|m| m.name == tower_inbox::metrics::MIGRATION_STEPS
            && m.labels == ["migration", "outcome"]));
}

#[tokio::test]
async fn bad_migration_definitions_are_refused() {
    let app = TestApp::new().await;
    let build = |consumer: &str, name: &str, version: &str| {
        CompensatedMigration::builder(Inbox::new(app.pool.clone()), consumer, name)
            .handler_version(version)
            .build()
            .err()
    };
    assert_eq!(build("c", "", "1"), Some(MigrationDefinitionError::BadName));
    assert_eq!(
        build("c", &"n".repeat(246), "1"),
        Some(MigrationDefinitionError::BadName)
    );
    assert_eq!(build("c", &"n".repeat(245), "1"), None);
    assert_eq!(
        build("c", "fix\n", "1"),
        Some(MigrationDefinitionError::BadName)
    );
    assert_eq!(
        build("", "fix", "1"),
        Some(MigrationDefinitionError::BadConsumerName)
    );
    assert_eq!(
        build("c", "fix", ""),
        Some(MigrationDefinitionError::BadHandlerVersion)
    );

    assert!(matches!(
        MigrationStep::new("has space", 1).err(),
        Some(MigrationDefinitionError::BadOperationId(_))
    ));
    let non_string_keys: HashMap<(i32, i32), i32> = [((1, 2), 3)].into();
    assert!(matches!(
        MigrationStep::new("op", non_string_keys).err(),
        Some(MigrationDefinitionError::UnserializableInput(_))
    ));
    // Key order does not change a JSON input's fingerprint; bytes are taken as they are.
    assert_eq!(
        MigrationStep::new("op", json!({"a": 1, "b": 2}))
            .unwrap()
            .fingerprint(),
        MigrationStep::new("op", json!({"b": 2, "a": 1}))
            .unwrap()
            .fingerprint(),
    );
    assert_ne!(
        MigrationStep::from_bytes("op", br#"{"a":1,"b":2}"#)
            .unwrap()
            .fingerprint(),
        MigrationStep::from_bytes("op", br#"{"b":2,"a":1}"#)
            .unwrap()
            .fingerprint(),
    );
}
