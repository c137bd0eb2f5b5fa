//! `outbox list | show | retry`: effects and their delivery.

use clap::{Args, Subcommand};
use serde::Serialize;
use tower_inbox::outbox::{EffectId, EffectStatus, Outbox, OutboxEntry, OutboxFilter};
use tower_inbox::quarantine::Quarantine;

use crate::database::{Database, Failure};
use crate::quarantine::{decide, Decide};
use crate::render::{self, ago, rfc3339, table};

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Effects: pending by default (next due first), or dead, or all (newest first).
    List {
        #[command(flatten)]
        state: State,
        /// Only effects of this name.
        #[arg(long)]
        effect: Option<String>,
        /// At most this many effects.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=100_000))]
        limit: i64,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One effect and its delivery.
    Show {
        id: String,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Sends a dead effect again: repairs its quarantine item, with the same audit trail as
    /// the library's `Quarantine::repair`.
    Retry {
        id: String,
        /// Who decides (kept with the decision).
        #[arg(long = "by", value_name = "WHO")]
        by: String,
        /// Why (kept with the decision).
        #[arg(long = "why", value_name = "TEXT")]
        why: String,
    },
}

/// Which effects `list` shows.
#[derive(Debug, Args)]
#[group(multiple = false)]
pub struct State {
    /// Not delivered yet (the default).
    #[arg(long)]
    pending: bool,
    /// Out of attempts or refused.
    #[arg(long)]
    dead: bool,
    /// Every effect.
    #[arg(long)]
    all: bool,
}

/// An effect as `--json` prints it: the keys are these names (see the README).
#[derive(Debug, Serialize)]
pub struct EffectJson {
    pub effect_id: String,
    pub effect_name: String,
    pub status: &'static str,
    pub destination: String,
    pub attempts: i32,
    pub next_attempt_at: Option<String>,
    pub leased_by: Option<String>,
    pub leased_until: Option<String>,
    pub last_error: Option<String>,
    pub remote_status: Option<i32>,
    pub remote_result: Option<String>,
    pub created_at: String,
    pub delivered_at: Option<String>,
    pub consumer: Option<String>,
    pub producer: Option<String>,
    pub tenant: Option<String>,
    pub message_id: Option<String>,
}

fn status(status: EffectStatus) -> &'static str {
    match status {
        EffectStatus::Pending => "pending",
        EffectStatus::Delivered => "delivered",
        EffectStatus::Dead => "dead",
    }
}

impl From<&OutboxEntry> for EffectJson {
    fn from(e: &OutboxEntry) -> Self {
        let pending = e.status == EffectStatus::Pending;
        Self {
            effect_id: e.effect_id.as_str().to_owned(),
            effect_name: e.effect_name.clone(),
            status: status(e.status),
            destination: e.destination.clone(),
            attempts: e.attempts,
            next_attempt_at: pending.then(|| rfc3339(e.next_attempt_at)),
            leased_by: e.lease.as_ref().map(|(owner, _)| owner.clone()),
            leased_until: e.lease.as_ref().map(|(_, until)| rfc3339(*until)),
            last_error: e.last_error.clone(),
            remote_status: e.remote_status,
            remote_result: e.remote_result.clone(),
            created_at: rfc3339(e.created_at),
            delivered_at: e.delivered_at.map(rfc3339),
            consumer: e.message.as_ref().map(|m| m[0].clone()),
            producer: e.message.as_ref().map(|m| m[1].clone()),
            tenant: e.message.as_ref().map(|m| m[2].clone()),
            message_id: e.message.as_ref().map(|m| m[3].clone()),
        }
    }
}

/// The usage errors `run` would find, without a database.
pub fn check(command: &Command) -> Result<(), Failure> {
    match command {
        Command::Retry { by, why, .. } => crate::quarantine::check_decision(by, why),
        Command::List { .. } | Command::Show { .. } => Ok(()),
    }
}

pub async fn run(db: &Database, command: Command) -> Result<(), Failure> {
    let outbox = Outbox::new(db.pool.clone()).with_schema(db.schema.clone());
    let failed = |e| db.failure("reading the outbox from", e);
    match command {
        Command::List {
            state,
            effect,
            limit,
            json,
        } => {
            let filter = if state.dead {
                OutboxFilter::Dead
            } else if state.all {
                OutboxFilter::All
            } else {
                OutboxFilter::Pending
            };
            let effects = outbox
                .list(filter, effect.as_deref(), limit)
                .await
                .map_err(failed)?;
            if json {
                let effects: Vec<EffectJson> = effects.iter().map(EffectJson::from).collect();
                render::line(serde_json::to_string_pretty(&effects).expect("effects are JSON"));
            } else if effects.is_empty() {
                render::line("no effects");
            } else {
                render::line(list_table(&effects));
            }
            Ok(())
        }
        Command::Show { id, json } => {
            let effect = outbox
                .entry(&EffectId::new(id.as_str()))
                .await
                .map_err(failed)?
                .ok_or_else(|| Failure::Refused(format!("no outbox effect {id}")))?;
            let effect = EffectJson::from(&effect);
            if json {
                render::line(serde_json::to_string_pretty(&effect).expect("an effect is JSON"));
            } else {
                render::emit(&show(&effect));
            }
            Ok(())
        }
        Command::Retry { id, by, why } => {
            let entry = outbox
                .entry(&EffectId::new(id.as_str()))
                .await
                .map_err(failed)?
                .ok_or_else(|| Failure::Refused(format!("no outbox effect {id}")))?;
            if entry.status != EffectStatus::Dead {
                return Err(Failure::Refused(format!(
                    "outbox effect {id} is {}, not dead: nothing to retry",
                    status(entry.status)
                )));
            }
            let quarantine = Quarantine::new(db.pool.clone()).with_schema(db.schema.clone());
            let item = quarantine
                .latest_for_effect(&id)
                .await
                .map_err(|e| db.failure("reading the quarantine from", e))?
                .ok_or_else(|| {
                    Failure::Refused(format!("outbox effect {id} has no quarantine item"))
                })?;
            // A decided item is refused by `decide`, naming who decided it, when and why.
            decide(db, &quarantine, Decide::new(item.id, by, why), true).await?;
            render::line(format_args!(
                "outbox effect {id} goes back to the dispatcher (quarantine item {})",
                item.id
            ));
            Ok(())
        }
    }
}

fn list_table(effects: &[OutboxEntry]) -> String {
    let rows = effects
        .iter()
        .map(|e| {
            vec![
                e.effect_id.as_str().to_owned(),
                e.effect_name.clone(),
                status(e.status).to_owned(),
                e.attempts.to_string(),
                ago(e.created_at),
                e.last_error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    table(
        &[
            "effect",
            "name",
            "status",
            "attempts",
            "created",
            "last error",
        ],
        rows,
    )
}

fn show(e: &EffectJson) -> String {
    let mut lines: Vec<(&str, String)> = vec![
        ("effect", e.effect_id.clone()),
        ("name", e.effect_name.clone()),
        ("status", e.status.to_owned()),
        ("destination", e.destination.clone()),
        ("attempts", e.attempts.to_string()),
        ("created", e.created_at.clone()),
    ];
    let optional = [
        ("next attempt", &e.next_attempt_at),
        ("leased by", &e.leased_by),
        ("leased until", &e.leased_until),
        ("last error", &e.last_error),
        ("remote result", &e.remote_result),
        ("delivered", &e.delivered_at),
        ("consumer", &e.consumer),
        ("producer", &e.producer),
        ("message id", &e.message_id),
    ];
    for (name, value) in optional {
        if let Some(value) = value {
            lines.push((name, value.clone()));
        }
    }
    if let Some(status) = e.remote_status {
        lines.push(("remote status", status.to_string()));
    }
    render::fields(&lines)
}
