//! `quarantine list | show | repair | discard`: the library's guarded operations.

use clap::{Args, Subcommand};
use serde::Serialize;
use tower_inbox::quarantine::{
    DecisionError, Quarantine, QuarantineItem, QuarantineQuery, QuarantineState,
};

use crate::database::{Database, Failure};
use crate::render::{self, ago, rfc3339, table};

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Items, oldest first (newest first with --all or --decided).
    List {
        /// Only items with this reason code (e.g. payload-mismatch, http-404) or source
        /// (identity-conflict, handler-failure, dead-effect, expired-message).
        #[arg(long)]
        reason: Option<String>,
        /// Only items of this consumer.
        #[arg(long)]
        consumer: Option<String>,
        #[command(flatten)]
        state: State,
        /// At most this many items.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=100_000))]
        limit: i64,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One item, whole.
    Show {
        id: i64,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Fix and retry: a dead effect goes back to the outbox; a command waits for its
    /// producer's retry. Refused when the item was decided before.
    Repair(Decide),
    /// Give up on it, knowingly. Refused when the item was decided before.
    Discard(Decide),
}

/// Which items `list` shows; open ones by default.
#[derive(Debug, Args)]
#[group(multiple = false)]
pub struct State {
    /// Items with no decision yet (the default).
    #[arg(long)]
    open: bool,
    /// Items decided, repaired or discarded.
    #[arg(long)]
    decided: bool,
    /// Every item.
    #[arg(long)]
    all: bool,
}

#[derive(Debug, Args)]
pub struct Decide {
    id: i64,
    /// Who decides (kept with the decision).
    #[arg(long = "by", value_name = "WHO")]
    by: String,
    /// Why (kept with the decision).
    #[arg(long = "why", value_name = "TEXT")]
    why: String,
}

impl Decide {
    pub fn new(id: i64, by: String, why: String) -> Self {
        Self { id, by, why }
    }
}

/// An item as `--json` prints it: the keys are these names (see the README).
#[derive(Debug, Serialize)]
pub struct ItemJson {
    pub id: i64,
    pub source: &'static str,
    pub reason_code: String,
    pub consumer: Option<String>,
    pub producer: Option<String>,
    pub tenant: Option<String>,
    pub message_id: Option<String>,
    pub effect_id: Option<String>,
    pub payload_sha256: String,
    pub payload_ref: String,
    pub attempts: i32,
    pub first_failed_at: String,
    pub last_failed_at: String,
    pub handler_version: Option<String>,
    pub decision: Option<&'static str>,
    pub decided_by: Option<String>,
    pub decided_at: Option<String>,
    pub decision_reason: Option<String>,
    pub recovered_at: Option<String>,
}

impl From<&QuarantineItem> for ItemJson {
    fn from(item: &QuarantineItem) -> Self {
        Self {
            id: item.id,
            source: item.source.as_str(),
            reason_code: item.reason_code.clone(),
            consumer: item.consumer_name.clone(),
            producer: item.producer_name.clone(),
            tenant: item.tenant_id.clone(),
            message_id: item.message_id.clone(),
            effect_id: item.effect_id.clone(),
            payload_sha256: item.payload_sha256.clone(),
            payload_ref: item.payload_ref.clone(),
            attempts: item.attempts,
            first_failed_at: rfc3339(item.first_failed_at),
            last_failed_at: rfc3339(item.last_failed_at),
            handler_version: item.handler_version.clone(),
            decision: item.decision.map(|d| d.as_str()),
            decided_by: item.decided_by.clone(),
            decided_at: item.decided_at.map(rfc3339),
            decision_reason: item.decision_reason.clone(),
            recovered_at: item.recovered_at.map(rfc3339),
        }
    }
}

/// Who and why must say something: they are the audit trail.
pub fn check_decision(by: &str, why: &str) -> Result<(), Failure> {
    if by.trim().is_empty() || why.trim().is_empty() {
        return Err(Failure::Usage(
            "--by and --why must not be empty".to_owned(),
        ));
    }
    Ok(())
}

/// The usage errors `run` would find, without a database.
pub fn check(command: &Command) -> Result<(), Failure> {
    match command {
        Command::Repair(d) | Command::Discard(d) => check_decision(&d.by, &d.why),
        Command::List { .. } | Command::Show { .. } => Ok(()),
    }
}

pub async fn run(db: &Database, command: Command) -> Result<(), Failure> {
    let quarantine = Quarantine::new(db.pool.clone()).with_schema(db.schema.clone());
    let failed = |e| db.failure("reading the quarantine from", e);
    match command {
        Command::List {
            reason,
            consumer,
            state,
            limit,
            json,
        } => {
            let query = QuarantineQuery {
                state: if state.decided {
                    QuarantineState::Decided
                } else if state.all {
                    QuarantineState::All
                } else {
                    QuarantineState::Open
                },
                reason,
                consumer,
            };
            let items = quarantine.query(&query, limit).await.map_err(failed)?;
            let items: Vec<&QuarantineItem> = items.iter().collect();
            if json {
                let items: Vec<ItemJson> = items.into_iter().map(ItemJson::from).collect();
                render::line(to_json(&items));
            } else if items.is_empty() {
                render::line("no items");
            } else {
                render::line(list_table(&items));
            }
            Ok(())
        }
        Command::Show { id, json } => {
            let item = quarantine
                .get(id)
                .await
                .map_err(failed)?
                .ok_or_else(|| Failure::Refused(format!("no quarantine item {id}")))?;
            if json {
                render::line(to_json(&ItemJson::from(&item)));
            } else {
                render::emit(&show(&item));
            }
            Ok(())
        }
        Command::Repair(d) => {
            decide(db, &quarantine, d, true).await?;
            Ok(())
        }
        Command::Discard(d) => {
            decide(db, &quarantine, d, false).await?;
            Ok(())
        }
    }
}

/// Repairs or discards item `id`, printing the decision; an item decided before is refused
/// with who decided it, when and why.
pub async fn decide(
    db: &Database,
    quarantine: &Quarantine,
    Decide { id, by, why }: Decide,
    repair: bool,
) -> Result<(), Failure> {
    check_decision(&by, &why)?;
    let outcome = if repair {
        quarantine.repair(id, &by, &why).await
    } else {
        quarantine.discard(id, &by, &why).await
    };
    match outcome {
        Ok(()) => {
            let what = if repair { "repaired" } else { "discarded" };
            render::line(format_args!("quarantine item {id} {what} by {by}"));
            Ok(())
        }
        Err(DecisionError::NotFound(_)) => {
            Err(Failure::Refused(format!("no quarantine item {id}")))
        }
        Err(DecisionError::AlreadyDecided(_)) => {
            // Say who decided it, when and why: that is what the operator needs next.
            let item = quarantine
                .get(id)
                .await
                .map_err(|e| db.failure("reading the quarantine from", e))?;
            let earlier = item
                .map(|i| {
                    format!(
                        ": {} by {} {} ({})",
                        i.decision.map_or("decided", |d| d.as_str()),
                        i.decided_by.as_deref().unwrap_or("?"),
                        i.decided_at
                            .map_or_else(|| "at an unknown time".to_owned(), ago),
                        i.decision_reason.as_deref().unwrap_or("no reason given"),
                    )
                })
                .unwrap_or_default();
            Err(Failure::Refused(format!(
                "quarantine item {id} was already decided{earlier}"
            )))
        }
        Err(DecisionError::Quarantine(e)) => Err(db.failure("deciding in the quarantine of", e)),
    }
}

fn to_json(value: &impl Serialize) -> String {
    serde_json::to_string_pretty(value).expect("quarantine items are JSON")
}

fn list_table(items: &[&QuarantineItem]) -> String {
    let rows = items
        .iter()
        .map(|i| {
            vec![
                i.id.to_string(),
                i.source.as_str().to_owned(),
                i.reason_code.clone(),
                i.consumer_name.clone().unwrap_or_default(),
                i.message_id
                    .clone()
                    .or_else(|| i.effect_id.clone())
                    .unwrap_or_default(),
                i.attempts.to_string(),
                ago(i.last_failed_at),
                i.decision.map_or("open", |d| d.as_str()).to_owned(),
            ]
        })
        .collect();
    table(
        &[
            "id",
            "source",
            "reason",
            "consumer",
            "message / effect",
            "attempts",
            "last failed",
            "decision",
        ],
        rows,
    )
}

fn show(item: &QuarantineItem) -> String {
    let mut lines = vec![
        ("id", item.id.to_string()),
        ("source", item.source.as_str().to_owned()),
        ("reason", item.reason_code.clone()),
    ];
    let optional = [
        ("consumer", &item.consumer_name),
        ("producer", &item.producer_name),
        ("tenant", &item.tenant_id),
        ("message id", &item.message_id),
        ("effect id", &item.effect_id),
        ("handler version", &item.handler_version),
    ];
    for (name, value) in optional {
        if let Some(value) = value.as_ref().filter(|v| !v.is_empty()) {
            lines.push((name, value.clone()));
        }
    }
    lines.push(("payload sha256", item.payload_sha256.clone()));
    lines.push(("payload", item.payload_ref.clone()));
    lines.push(("attempts", item.attempts.to_string()));
    let when = |at| format!("{} ({})", rfc3339(at), ago(at));
    lines.push(("first failed", when(item.first_failed_at)));
    lines.push(("last failed", when(item.last_failed_at)));
    match item.decision {
        None => lines.push(("decision", "open".to_owned())),
        Some(decision) => {
            lines.push(("decision", decision.as_str().to_owned()));
            lines.push(("decided by", item.decided_by.clone().unwrap_or_default()));
            if let Some(at) = item.decided_at {
                lines.push(("decided", when(at)));
            }
            lines.push(("why", item.decision_reason.clone().unwrap_or_default()));
        }
    }
    if let Some(at) = item.recovered_at {
        lines.push(("recovered", when(at)));
    }
    render::fields(&lines)
}
