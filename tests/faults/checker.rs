//! The invariant every fault test ends with, stated once.
//!
//! After the load and a settle period (until no webhook is pending and no claim is held):
//!
//! * every command a client got a 2xx for has exactly one ledger row; every other command at
//!   most one; the ledger holds nothing no client sent;
//! * every 2xx body for one command is the same (a replay is the original answer);
//! * no inbox row is in progress (a claim never commits without its response) and no claim
//!   lock is held;
//! * every applied command has exactly one webhook effect, delivered (the receiver saw its
//!   key, for the command's account) or dead with a quarantine item giving the reason; no
//!   effect exists for a command that was not applied;
//! * every command got its 2xx in the end: the service recovered from the fault.
//!
//! A delivery can arrive more than once: the outbox delivers at least once, and the effect's
//! idempotency key lets the receiver apply it once. Deliveries that arrived again are
//! counted and printed, not refused.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::clients::{Record, PRODUCER};
use crate::receiver::Receiver;

/// How long the outbox may take to drain after the load: a killed dispatcher's lease
/// (11 s in these tests) plus its backoff.
const SETTLE: Duration = Duration::from_secs(90);

/// Waits for the settle period, checks the invariant, prints what the test did and what
/// the check found, and panics with every violation.
pub async fn check(
    test: &str,
    faults: &str,
    pool: &PgPool,
    records: &[Record],
    receiver: &Receiver,
) {
    let settled = settle(pool).await;
    let mut violations = Vec::new();

    let ledger: HashMap<String, i64> = sqlx::query_as(
        "select message_id, count(*) from credit_ledger where producer_name = $1 \
         group by message_id",
    )
    .bind(PRODUCER)
    .fetch_all(pool)
    .await
    .expect("read the ledger")
    .into_iter()
    .collect();
    let sent: HashMap<&str, &Record> = records.iter().map(|r| (r.key.as_str(), r)).collect();

    let (mut acked, mut attempts, mut transport, mut retried_5xx, mut replays) = (0, 0, 0, 0, 0);
    for record in records {
        let rows = ledger.get(&record.key).copied().unwrap_or(0);
        attempts += record.answers.len() + record.transport_errors;
        transport += record.transport_errors;
        retried_5xx += record.answers.iter().filter(|(s, _, _)| *s >= 500).count();
        replays += record.answers.iter().filter(|(_, _, r)| *r).count();
        let bodies: Vec<_> = record
            .answers
            .iter()
            .filter(|(s, _, _)| (200..300).contains(s))
            .map(|(_, b, _)| b)
            .collect();
        if record.acked() {
            acked += 1;
            if rows != 1 {
                violations.push(format!("{}: acknowledged, {rows} ledger rows", record.key));
            }
            if bodies.windows(2).any(|w| w[0] != w[1]) {
                violations.push(format!("{}: 2xx bodies differ: {bodies:?}", record.key));
            }
        } else {
            if rows > 1 {
                violations.push(format!("{}: {rows} ledger rows", record.key));
            }
            let statuses: Vec<u16> = record.answers.iter().map(|(s, _, _)| *s).collect();
            violations.push(format!(
                "{}: no 2xx after {} attempts (answers {statuses:?}, {} without an answer)",
                record.key,
                record.answers.len() + record.transport_errors,
                record.transport_errors
            ));
        }
    }
    for key in ledger.keys() {
        if !sent.contains_key(key.as_str()) {
            violations.push(format!("{key}: in the ledger, sent by no client"));
        }
    }

    let in_progress: i64 = sqlx::query_scalar(
        "select count(*) from tower_inbox.consumer_inbox where processed_at is null",
    )
    .fetch_one(pool)
    .await
    .expect("read the inbox");
    if in_progress > 0 {
        violations.push(format!("{in_progress} inbox rows committed in progress"));
    }
    if let Some(held) = settled.locks {
        violations.push(format!("{held} claim locks still held after {SETTLE:?}"));
    }

    let (delivered, redelivered) = check_effects(pool, &ledger, receiver, &mut violations).await;

    println!(
        "{test}: {faults}; {} commands, {acked} acknowledged, {attempts} attempts \
         ({transport} without an answer, {retried_5xx} 5xx, {replays} replays); \
         {} ledger rows; {delivered} webhooks delivered ({redelivered} of them more than \
         once); settled in {:.1} s",
        records.len(),
        ledger.values().sum::<i64>(),
        settled.took.as_secs_f64()
    );
    assert!(
        !records.is_empty() && acked > 0,
        "{test}: no command was acknowledged: the test proved nothing"
    );
    assert!(
        violations.is_empty(),
        "{test}: {} violations of the invariant, first ones:\n{}",
        violations.len(),
        violations
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

struct Settled {
    took: Duration,
    /// Claim locks still held at the end of the settle period, if any.
    locks: Option<i64>,
}

/// Waits until no webhook is pending and no claim lock is held, up to [`SETTLE`].
async fn settle(pool: &PgPool) -> Settled {
    let started = Instant::now();
    loop {
        let (pending, locks): (i64, i64) = sqlx::query_as(
            "select (select count(*) from tower_inbox.message_outbox where status = 'pending'), \
                    (select count(*) from pg_locks \
                     where locktype = 'advisory' and database = \
                         (select oid from pg_database where datname = current_database()))",
        )
        .fetch_one(pool)
        .await
        .expect("read the outbox and the locks");
        if pending == 0 && locks == 0 {
            return Settled {
                took: started.elapsed(),
                locks: None,
            };
        }
        if started.elapsed() > SETTLE {
            return Settled {
                took: started.elapsed(),
                locks: (locks > 0).then_some(locks),
            };
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Checks the webhook effects against the ledger and the receiver; returns how many were
/// delivered and how many of those arrived more than once.
async fn check_effects(
    pool: &PgPool,
    ledger: &HashMap<String, i64>,
    receiver: &Receiver,
    violations: &mut Vec<String>,
) -> (usize, usize) {
    let effects: Vec<(String, String, String)> = sqlx::query_as(
        "select effect_id, message_id, status from tower_inbox.message_outbox \
         where producer_name = $1",
    )
    .bind(PRODUCER)
    .fetch_all(pool)
    .await
    .expect("read the outbox");
    let quarantined: HashMap<String, String> = sqlx::query_as(
        "select coalesce(effect_id, ''), reason_code from tower_inbox.inbox_quarantine \
         where source = 'dead-effect'",
    )
    .fetch_all(pool)
    .await
    .expect("read the quarantine")
    .into_iter()
    .collect();
    let seen = receiver.seen();

    let mut per_command: HashMap<&str, usize> = HashMap::new();
    let (mut delivered, mut redelivered) = (0, 0);
    for (effect, command, status) in &effects {
        *per_command.entry(command.as_str()).or_default() += 1;
        if !ledger.contains_key(command) {
            violations.push(format!("{command}: an effect ({effect}) but no ledger row"));
        }
        match (status.as_str(), seen.get(effect)) {
            ("delivered", Some(arrived)) if arrived.account == *command => {
                delivered += 1;
                redelivered += usize::from(arrived.times > 1);
            }
            ("delivered", arrived) => violations.push(format!(
                "{command}: effect {effect} marked delivered, the receiver saw {arrived:?}"
            )),
            ("dead", _) if quarantined.contains_key(effect) => {}
            (status, _) => violations.push(format!("{command}: effect {effect} is {status}")),
        }
    }
    for command in ledger.keys() {
        let n = per_command.get(command.as_str()).copied().unwrap_or(0);
        if n != 1 {
            violations.push(format!("{command}: applied, {n} webhook effects"));
        }
    }
    let known: std::collections::HashSet<&str> =
        effects.iter().map(|(e, _, _)| e.as_str()).collect();
    for effect in seen.keys() {
        if !known.contains(effect.as_str()) {
            violations.push(format!("the receiver got {effect}, which is no effect"));
        }
    }
    (delivered, redelivered)
}

/// The checker itself: a command applied twice and one applied without its webhook are each
/// reported.
#[tokio::test]
async fn the_checker_reports_what_breaks_the_invariant() {
    use bytes::Bytes;

    let app = crate::common::TestApp::new().await;
    let receiver = Receiver::start().await;
    for key in ["doubled", "doubled", "lost"] {
        sqlx::query(
            "insert into credit_account values ($1, 1) on conflict (account_id) do nothing",
        )
        .bind(key)
        .execute(&app.pool)
        .await
        .unwrap();
        sqlx::query(
            "insert into credit_ledger (account_id, delta, balance_after, consumer_name, \
             producer_name, message_id) values ($1, 1, 1, 'credits', $2, $1)",
        )
        .bind(key)
        .bind(PRODUCER)
        .execute(&app.pool)
        .await
        .unwrap();
    }
    let acked = |key: &str| Record {
        key: key.to_owned(),
        answers: vec![(201, Bytes::from_static(b"{}"), false)],
        transport_errors: 0,
    };
    let records = [acked("doubled"), acked("lost")];
    let pool = app.pool.clone();
    let checked = tokio::spawn(async move {
        check("checker", "none", &pool, &records, &receiver).await;
    })
    .await;
    let message = checked
        .expect_err("the checker passed a doubled command")
        .into_panic();
    let message = message.downcast_ref::<String>().expect("a panic message");
    assert!(
        message.contains("doubled: acknowledged, 2 ledger rows"),
        "{message}"
    );
    assert!(
        message.contains("lost: applied, 0 webhook effects"),
        "{message}"
    );
}
