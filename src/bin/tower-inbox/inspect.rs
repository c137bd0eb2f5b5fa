//! `inspect --consumer C --producer P KEY`: one key's state, with its quarantine item and its
//! outbox effects.

use clap::Args;
use serde::Serialize;
use tower_inbox::inbox::Inbox;
use tower_inbox::outbox::Outbox;
use tower_inbox::quarantine::Quarantine;
use tower_inbox::{MessageIdentity, MessageKey, Producer};

use crate::database::{Database, Failure};
use crate::outbox::EffectJson;
use crate::quarantine::ItemJson;
use crate::render::{self, ago, rfc3339};

/// How many bytes of a recorded body are shown without `--body`.
const EXCERPT: usize = 200;

#[derive(Debug, Args)]
pub struct Inspect {
    /// The consumer (the layer's or the broker consumer's name).
    #[arg(long)]
    consumer: String,
    /// The producer.
    #[arg(long)]
    producer: String,
    /// The producer's tenant, when it has one.
    #[arg(long)]
    tenant: Option<String>,
    /// The key (the Idempotency-Key, or the message ID).
    key: String,
    /// JSON instead of text.
    #[arg(long)]
    json: bool,
    /// The whole recorded body, not an excerpt.
    #[arg(long)]
    body: bool,
}

/// `inspect --json`: the keys are these names (see the README).
#[derive(Debug, Serialize)]
struct KeyJson {
    state: &'static str,
    payload_sha256: Option<String>,
    handler_version: Option<String>,
    received_at: Option<String>,
    processed_at: Option<String>,
    response_status: Option<u16>,
    response_headers: Vec<(String, String)>,
    response_body: Option<String>,
    response_body_bytes: Option<usize>,
    failed_attempts: i32,
    last_failure: Option<String>,
    quarantine: Vec<ItemJson>,
    effects: Vec<EffectJson>,
}

/// The identity the arguments name, or why they name none.
fn identity(args: &Inspect) -> Result<MessageIdentity, Failure> {
    let mut producer = Producer::new(args.producer.as_str())
        .map_err(|e| Failure::Usage(format!("--producer: {e}")))?;
    if let Some(tenant) = &args.tenant {
        producer = producer
            .with_tenant(tenant.as_str())
            .map_err(|e| Failure::Usage(format!("--tenant: {e}")))?;
    }
    let key =
        MessageKey::new(args.key.as_str()).map_err(|e| Failure::Usage(format!("KEY: {e}")))?;
    Ok(MessageIdentity::new(args.consumer.as_str(), producer, key))
}

/// The usage errors `run` would find, without a database.
pub fn check(args: &Inspect) -> Result<(), Failure> {
    identity(args).map(|_| ())
}

pub async fn run(db: &Database, args: Inspect) -> Result<(), Failure> {
    let identity = identity(&args)?;
    let failed = |e: &dyn std::fmt::Display| db.failure("reading the key from", e);

    let inbox = Inbox::new(db.pool.clone()).with_schema(db.schema.clone());
    let entry = inbox.lookup(&identity).await.map_err(|e| failed(&e))?;
    let times = inbox.times(&identity).await.map_err(|e| failed(&e))?;
    let failures = inbox
        .failure_record(&identity)
        .await
        .map_err(|e| failed(&e))?;
    let quarantine = Quarantine::new(db.pool.clone())
        .with_schema(db.schema.clone())
        .for_identity(&identity)
        .await
        .map_err(|e| failed(&e))?;
    let effects = Outbox::new(db.pool.clone())
        .with_schema(db.schema.clone())
        .for_message(&identity)
        .await
        .map_err(|e| failed(&e))?;
    if entry.is_none() && failures.is_none() && quarantine.is_empty() {
        return Err(Failure::Refused(format!(
            "no key {:?} of producer {:?} for consumer {:?}",
            args.key, args.producer, args.consumer
        )));
    }

    let response = entry.as_ref().and_then(|e| e.response.as_ref());
    let body = response.map(|r| {
        let shown = if args.body {
            &r.body[..]
        } else {
            &r.body[..r.body.len().min(EXCERPT)]
        };
        String::from_utf8_lossy(shown).into_owned()
    });
    let report = KeyJson {
        state: match &entry {
            Some(e) if e.processed => "completed",
            Some(_) => "claimed",
            None => "not claimed",
        },
        payload_sha256: entry.as_ref().map(|e| e.payload_sha256.clone()),
        handler_version: entry.as_ref().map(|e| e.handler_version.clone()),
        received_at: times.map(|t| rfc3339(t.received_at)),
        processed_at: times.and_then(|t| t.processed_at).map(rfc3339),
        response_status: response.map(|r| r.status),
        response_headers: response
            .map(|r| {
                r.headers
                    .iter()
                    .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
                    .collect()
            })
            .unwrap_or_default(),
        response_body: body,
        response_body_bytes: response.map(|r| r.body.len()),
        failed_attempts: failures.as_ref().map_or(0, |f| f.attempts),
        last_failure: failures.as_ref().map(|f| f.last_reason.clone()),
        quarantine: quarantine.iter().map(ItemJson::from).collect(),
        effects: effects.iter().map(EffectJson::from).collect(),
    };
    if args.json {
        render::line(serde_json::to_string_pretty(&report).expect("the report is JSON"));
        return Ok(());
    }
    let mut lines: Vec<(&str, String)> = vec![("state", report.state.to_owned())];
    if let Some(fingerprint) = &report.payload_sha256 {
        lines.push(("payload sha256", fingerprint.clone()));
    }
    if let Some(version) = &report.handler_version {
        lines.push(("handler version", version.clone()));
    }
    if let Some(t) = times {
        lines.push((
            "first seen",
            format!("{} ({})", rfc3339(t.received_at), ago(t.received_at)),
        ));
        if let Some(at) = t.processed_at {
            lines.push(("recorded", format!("{} ({})", rfc3339(at), ago(at))));
        }
    }
    if let Some(status) = report.response_status {
        lines.push(("status", status.to_string()));
    }
    for (name, value) in &report.response_headers {
        lines.push(("header", format!("{name}: {value}")));
    }
    if let (Some(body), Some(bytes)) = (&report.response_body, report.response_body_bytes) {
        let note = if !args.body && bytes > EXCERPT {
            format!(" ({bytes} bytes; --body for all)")
        } else {
            String::new()
        };
        lines.push(("body", format!("{body}{note}")));
    }
    match &failures {
        Some(f) => lines.push((
            "failed attempts",
            format!(
                "{} (last {}, {})",
                f.attempts,
                f.last_reason,
                ago(f.last_failed_at)
            ),
        )),
        None => lines.push(("failed attempts", "0".to_owned())),
    }
    for item in &quarantine {
        let decision = item.decision.map_or("open", |d| d.as_str());
        lines.push((
            "quarantine",
            format!(
                "item {} {} {} ({decision})",
                item.id, item.source, item.reason_code
            ),
        ));
    }
    for effect in &report.effects {
        lines.push((
            "effect",
            format!(
                "{} {} {} after {} attempt(s)",
                effect.effect_id, effect.effect_name, effect.status, effect.attempts
            ),
        ));
    }
    render::emit(&render::fields(&lines));
    Ok(())
}
