//! What the database holds about a case, read the same way after every step, and the checks
//! of answers and facts against the model.

use std::collections::BTreeMap;

use sqlx::PgPool;

use crate::common::Reply;
use crate::harness::Seen;
use crate::ops::{response_body, KEYS};
use crate::spec::{DecisionAnswer, Expect, Model};

/// The committed inbox row of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowFacts {
    pub payload_sha256: String,
    pub processed: bool,
    pub status: Option<u16>,
    pub body: Option<String>,
    /// Received before the purge window.
    pub old: bool,
}

/// The failure record of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureFacts {
    pub attempts: i32,
    /// Last failed before the purge window.
    pub old: bool,
}

/// A quarantine item, without its times (only whether they are past the window) and, for a
/// failing command, without its payload hash: two failed attempts with different payloads
/// may be counted in either order, and the item keeps the last one's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemFacts {
    pub source: String,
    pub reason_code: String,
    pub conflict_sha256: Option<String>,
    pub attempts: i32,
    pub decision: Option<String>,
    pub decided_old: bool,
    pub recovered: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFacts {
    /// Business writes committed under the key.
    pub effects: i64,
    pub row: Option<RowFacts>,
    pub failures: Option<FailureFacts>,
    /// Its quarantine items, oldest first.
    pub items: Vec<ItemFacts>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    pub keys: Vec<KeyFacts>,
    /// Requests waiting in the patient layer for an original in flight.
    pub waiting: usize,
    /// Claims in flight of the case's consumer, from their advisory locks.
    pub in_flight: usize,
}

/// The key index of a message ID `k<index>`.
fn key_index(message_id: &str) -> usize {
    message_id
        .strip_prefix('k')
        .and_then(|n| n.parse().ok())
        .filter(|&n| n < KEYS)
        .unwrap_or_else(|| panic!("not a model key: {message_id}"))
}

/// What the database holds for `consumer`'s keys, with the ids of each key's items.
pub async fn read(pool: &PgPool, consumer: &str) -> (Vec<KeyFacts>, Vec<Vec<i64>>) {
    const OLD: &str = "pg_catalog.now() - interval '1 day'";
    let mut keys = vec![
        KeyFacts {
            effects: 0,
            row: None,
            failures: None,
            items: Vec::new(),
        };
        KEYS
    ];
    let effects: Vec<(String, i64)> = sqlx::query_as(
        "select message_id, count(*) from model_effect where consumer_name = $1 group by 1",
    )
    .bind(consumer)
    .fetch_all(pool)
    .await
    .expect("effects");
    for (id, n) in effects {
        keys[key_index(&id)].effects = n;
    }
    type Row = (String, String, bool, Option<i16>, Option<Vec<u8>>, bool);
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "select message_id, payload_sha256, processed_at is not null, response_status,
                    response_body, received_at < {OLD}
             from tower_inbox.consumer_inbox where consumer_name = $1"
    ))
    .bind(consumer)
    .fetch_all(pool)
    .await
    .expect("inbox rows");
    for (id, payload_sha256, processed, status, body, old) in rows {
        keys[key_index(&id)].row = Some(RowFacts {
            payload_sha256,
            processed,
            status: status.map(|s| u16::try_from(s).expect("a status")),
            body: body.map(|b| String::from_utf8_lossy(&b).into_owned()),
            old,
        });
    }
    let failures: Vec<(String, i32, bool)> = sqlx::query_as(&format!(
        "select message_id, attempts, last_failed_at < {OLD}
         from tower_inbox.consumer_inbox_failure where consumer_name = $1"
    ))
    .bind(consumer)
    .fetch_all(pool)
    .await
    .expect("failure records");
    for (id, attempts, old) in failures {
        keys[key_index(&id)].failures = Some(FailureFacts { attempts, old });
    }
    type ItemRow = (
        i64,
        String,
        String,
        String,
        String,
        i32,
        Option<String>,
        bool,
        Option<bool>,
    );
    let items: Vec<ItemRow> = sqlx::query_as(&format!(
        "select id, message_id, source, reason_code, payload_sha256, attempts, decision,
                coalesce(decided_at < {OLD}, false), recovered_at < {OLD}
         from tower_inbox.inbox_quarantine where consumer_name = $1 order by id"
    ))
    .bind(consumer)
    .fetch_all(pool)
    .await
    .expect("quarantine items");
    let mut ids = vec![Vec::new(); KEYS];
    for (id, message_id, source, reason_code, sha, attempts, decision, old, recovered) in items {
        let key = key_index(&message_id);
        ids[key].push(id);
        let conflict_sha256 = (source == "identity-conflict").then_some(sha);
        keys[key].items.push(ItemFacts {
            source,
            reason_code,
            conflict_sha256,
            attempts,
            decision,
            decided_old: old,
            recovered,
        });
    }
    (keys, ids)
}

/// The first of `candidates` whose facts are `actual`.
pub fn choose(candidates: Vec<Model>, actual: &Facts) -> Result<Model, String> {
    let first = candidates[0].facts();
    candidates
        .into_iter()
        .find(|m| m.facts() == *actual)
        .ok_or_else(|| differences(&first, actual))
}

fn differences(expected: &Facts, actual: &Facts) -> String {
    let mut out = String::from("the database differs from the model:");
    for (key, (e, a)) in expected.keys.iter().zip(&actual.keys).enumerate() {
        if e != a {
            out += &format!("\n  key k{key}:\n    model:    {e:?}\n    database: {a:?}");
        }
    }
    if (expected.waiting, expected.in_flight) != (actual.waiting, actual.in_flight) {
        out += &format!(
            "\n  waiting, in flight: model {:?}, layer and database {:?}",
            (expected.waiting, expected.in_flight),
            (actual.waiting, actual.in_flight)
        );
    }
    out
}

/// Whether a request got what the model expects.
pub fn answer(expect: &Expect, seen: &Seen) -> Result<(), String> {
    let ok = match (expect, seen) {
        (Expect::Started, Seen::Started) | (Expect::Waiting, Seen::Waiting) => true,
        (Expect::Fresh { status, run }, Seen::Answered(reply)) => {
            reply.status == *status
                && !reply.replayed()
                && content_type(reply) == "application/json"
                && reply.body == response_body(*run, *status)
        }
        (Expect::Replayed(recorded), Seen::Answered(reply)) => {
            reply.status == recorded.status && reply.replayed() && reply.body == recorded.body
        }
        (Expect::Problem { status, kind }, Seen::Answered(reply)) => {
            reply.status == *status
                && !reply.replayed()
                && problem_kind(reply).as_deref() == Some(*kind)
                && (*kind != "in-progress" || reply.headers.contains_key("retry-after"))
        }
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!("expected {expect:?}, got {seen:?}"))
    }
}

pub fn decision(expect: DecisionAnswer, seen: DecisionAnswer) -> Result<(), String> {
    if expect == seen {
        Ok(())
    } else {
        Err(format!("decision: expected {expect:?}, got {seen:?}"))
    }
}

fn content_type(reply: &Reply) -> &str {
    reply
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// The slug of a problem+json answer's type (what follows '#').
fn problem_kind(reply: &Reply) -> Option<String> {
    if content_type(reply) != "application/problem+json" {
        return None;
    }
    let json: serde_json::Value = serde_json::from_slice(&reply.body).ok()?;
    let uri = json["type"].as_str()?;
    Some(uri.rsplit_once('#')?.1.to_owned())
}

/// The runs whose business writes committed, per key: with [`read`]'s recorded bodies, the
/// final check that every committed row was written by exactly one committed run.
pub async fn committed_runs(pool: &PgPool, consumer: &str) -> BTreeMap<usize, Vec<i64>> {
    let runs: Vec<(String, i64)> = sqlx::query_as(
        "select message_id, run from model_effect where consumer_name = $1 order by run",
    )
    .bind(consumer)
    .fetch_all(pool)
    .await
    .expect("effects");
    let mut out = BTreeMap::<usize, Vec<i64>>::new();
    for (id, run) in runs {
        out.entry(key_index(&id)).or_default().push(run);
    }
    out
}
