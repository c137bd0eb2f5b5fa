//! Quarantine and repair of poison messages.
//!
//! Four things land here, each kept with its identity, payload hash, a reference to where
//! the payload lives (the payload itself is not copied), a stable reason code, an attempt
//! count, first and last failure times and the handler version:
//!
//! * **identity conflicts**: the same key arrived with a different payload (the layer);
//! * **repeated handler failures**: one key rolled back
//!   [`quarantine_after`](crate::InboxLayerBuilder::quarantine_after) times (the layer);
//! * **dead effects**: an outbox effect that failed permanently or ran out of attempts (the
//!   dispatcher);
//! * **expired messages**: a first-seen message produced before the retention window,
//!   which the inbox may have forgotten (the [retention guard](crate::retention::RetentionGuard)).
//!
//! A quarantined item is not a success: it changes who owns the problem. A person decides
//! [`repair`](Quarantine::repair) or [`discard`](Quarantine::discard). Repairing a dead
//! effect puts it back in the outbox; its later delivery marks the item recovered. A failing
//! command is recovered when one of its retries commits. Quarantine never blocks other work:
//! the inbox and the outbox go on with every other key.
//!
//! ```no_run
//! use tower_inbox::quarantine::{Quarantine, QuarantineFilter};
//!
//! # async fn triage(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let quarantine = Quarantine::new(pool);
//! for item in quarantine.list(QuarantineFilter::Open, 50).await? {
//!     println!("{} {} {} x{}", item.id, item.source, item.reason_code, item.attempts);
//!     if item.source.is_dead_effect() {
//!         quarantine.repair(item.id, "oncall@example.com", "receiver fixed").await?;
//!     }
//! }
//! # Ok(()) }
//! ```

use std::fmt;

use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};
use time::OffsetDateTime;

use crate::connection::Guarded;
use crate::identity::{bind_identity, MessageIdentity};
use crate::schema::Schema;

mod query;
mod sql;

pub use query::{QuarantineQuery, QuarantineState};

crate::db::database_error!(
    /// A failure of the quarantine's database work.
    QuarantineError,
    "the quarantine"
);

/// Where a quarantined item came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuarantineSource {
    /// The same message ID with a different payload.
    IdentityConflict,
    /// A command whose attempts kept rolling back.
    HandlerFailure,
    /// An outbox effect that could not be delivered.
    DeadEffect,
    /// A first-seen message produced before the retention window: it may have been
    /// processed and forgotten, so it was not processed again.
    ExpiredMessage,
}

impl QuarantineSource {
    /// Every source.
    pub const ALL: &'static [Self] = &[
        Self::IdentityConflict,
        Self::HandlerFailure,
        Self::DeadEffect,
        Self::ExpiredMessage,
    ];

    /// The stored name, also a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::IdentityConflict => "identity-conflict",
            Self::HandlerFailure => "handler-failure",
            Self::DeadEffect => "dead-effect",
            Self::ExpiredMessage => "expired-message",
        }
    }

    /// Whether this is a dead outbox effect.
    pub fn is_dead_effect(self) -> bool {
        self == Self::DeadEffect
    }

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|v| v.as_str() == s)
    }
}

impl fmt::Display for QuarantineSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The decision taken on an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Fix and retry: a dead effect goes back to the outbox; a command is expected to be
    /// retried by its producer.
    Repair,
    /// Give up on it, knowingly.
    Discard,
}

impl Decision {
    /// The stored name: `repair` or `discard`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Repair => "repair",
            Self::Discard => "discard",
        }
    }
}

/// One quarantined item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantineItem {
    /// Its id.
    pub id: i64,
    /// Where it came from.
    pub source: QuarantineSource,
    /// The consumer, for conflicts and failures.
    pub consumer_name: Option<String>,
    /// The producer, for conflicts and failures.
    pub producer_name: Option<String>,
    /// The tenant (`''` for none), for conflicts and failures.
    pub tenant_id: Option<String>,
    /// The message ID, for conflicts and failures (and effects that came from a message).
    pub message_id: Option<String>,
    /// The effect, for dead effects.
    pub effect_id: Option<String>,
    /// The hash of the payload that was refused or failed.
    pub payload_sha256: String,
    /// Where the payload can be read by someone allowed to (`message_outbox:<effect id>`, or
    /// `sha256:<hash>` when the layer does not keep request bodies).
    pub payload_ref: String,
    /// The stable reason code, e.g. `payload-mismatch`, `handler-panicked`, `http-404`.
    pub reason_code: String,
    /// How many times it happened.
    pub attempts: i32,
    /// When it first happened.
    pub first_failed_at: OffsetDateTime,
    /// When it last happened.
    pub last_failed_at: OffsetDateTime,
    /// The handler version, for conflicts and failures.
    pub handler_version: Option<String>,
    /// The decision, once taken.
    pub decision: Option<Decision>,
    /// Who decided.
    pub decided_by: Option<String>,
    /// When.
    pub decided_at: Option<OffsetDateTime>,
    /// Why.
    pub decision_reason: Option<String>,
    /// When a later success made the item good.
    pub recovered_at: Option<OffsetDateTime>,
}

/// Which items [`Quarantine::list`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuarantineFilter {
    /// Items with no decision yet.
    Open,
    /// Items decided `repair` and not recovered yet.
    AwaitingRecovery,
    /// Everything, newest first.
    All,
}

/// A decision on an item that cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum DecisionError {
    /// No item has this id.
    #[error("no quarantine item {0}")]
    NotFound(i64),
    /// The item was decided before.
    #[error("quarantine item {0} was already decided")]
    AlreadyDecided(i64),
    /// The database failed.
    #[error(transparent)]
    Quarantine(#[from] QuarantineError),
}

/// Lists and decides quarantined items.
#[derive(Debug, Clone)]
pub struct Quarantine {
    pool: PgPool,
    schema: Schema,
}

impl Quarantine {
    /// The quarantine over `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            schema: Schema::default(),
        }
    }

    /// The tables are in `schema` instead of the default one.
    pub fn with_schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// The pool for this component's statements: each within the crate's statement deadline,
    /// sent as the schema's [`Pooling`](crate::schema::Pooling) needs.
    fn db(&self) -> Guarded<'_> {
        Guarded::for_schema(&self.pool, &self.schema)
    }

    /// Up to `limit` items, oldest first (newest first for [`QuarantineFilter::All`]).
    pub async fn list(
        &self,
        filter: QuarantineFilter,
        limit: i64,
    ) -> Result<Vec<QuarantineItem>, QuarantineError> {
        let sql = self.schema.sql(match filter {
            QuarantineFilter::Open => sql::LIST_OPEN,
            QuarantineFilter::AwaitingRecovery => sql::LIST_AWAITING_RECOVERY,
            QuarantineFilter::All => sql::LIST_ALL,
        });
        let rows = sqlx::query(&sql)
            .bind(limit)
            .fetch_all(self.db())
            .await
            .map_err(QuarantineError::from)?;
        rows.iter().map(item_from_row).collect()
    }

    /// One item.
    pub async fn get(&self, id: i64) -> Result<Option<QuarantineItem>, QuarantineError> {
        let sql = self.schema.sql(sql::GET);
        let row = sqlx::query(&sql)
            .bind(id)
            .fetch_optional(self.db())
            .await
            .map_err(QuarantineError::from)?;
        row.as_ref().map(item_from_row).transpose()
    }

    /// The open items about one message identity (conflicts and failures).
    pub async fn for_identity(
        &self,
        identity: &MessageIdentity,
    ) -> Result<Vec<QuarantineItem>, QuarantineError> {
        let sql = self.schema.sql(sql::FOR_IDENTITY);
        let rows = bind_identity!(crate::sql::query(&sql), &identity)
            .fetch_all(self.db())
            .await
            .map_err(QuarantineError::from)?;
        rows.iter().map(item_from_row).collect()
    }

    /// Decides to repair: a dead effect goes back to pending with a fresh attempt budget
    /// and is delivered by the next dispatcher; its delivery then marks the item recovered.
    pub async fn repair(&self, id: i64, who: &str, why: &str) -> Result<(), DecisionError> {
        self.decide(id, Decision::Repair, who, why).await
    }

    /// Decides to discard: the item is closed; a dead effect stays dead.
    pub async fn discard(&self, id: i64, who: &str, why: &str) -> Result<(), DecisionError> {
        self.decide(id, Decision::Discard, who, why).await
    }

    async fn decide(
        &self,
        id: i64,
        decision: Decision,
        who: &str,
        why: &str,
    ) -> Result<(), DecisionError> {
        let classify = |e| DecisionError::Quarantine(QuarantineError::from(e));
        let mut tx = self.db().begin("BEGIN").await.map_err(classify)?;
        let decide = self.schema.sql(sql::DECIDE);
        let decided: Option<(String, Option<String>)> = sqlx::query_as(&decide)
            .bind(id)
            .bind(decision.as_str())
            .bind(who.as_bytes())
            .bind(why.as_bytes())
            .fetch_optional(&mut tx)
            .await
            .map_err(classify)?;
        let Some((source, effect_id)) = decided else {
            let exists_sql = self.schema.sql(sql::EXISTS);
            let exists: Option<i64> = sqlx::query_scalar(&exists_sql)
                .bind(id)
                .fetch_optional(&mut tx)
                .await
                .map_err(classify)?;
            return Err(match exists {
                Some(_) => DecisionError::AlreadyDecided(id),
                None => DecisionError::NotFound(id),
            });
        };
        if decision == Decision::Repair && source == QuarantineSource::DeadEffect.as_str() {
            let requeue = self.schema.sql(sql::REQUEUE_EFFECT);
            sqlx::query(&requeue)
                .bind(effect_id)
                .execute(&mut tx)
                .await
                .map_err(classify)?;
        }
        tx.commit().await.map_err(classify)?;
        tracing::info!(
            id,
            decision = decision.as_str(),
            who,
            "quarantine item decided"
        );
        Ok(())
    }
}

/// The key of the open item about a failing or conflicting command.
pub(crate) fn identity_item_key(
    source: QuarantineSource,
    identity: &MessageIdentity,
    payload_sha256: &str,
) -> String {
    // Names and keys hold no control characters, so the unit separator is unambiguous.
    let mut key = format!(
        "{}:{}\u{1f}{}\u{1f}{}\u{1f}{}",
        source.as_str(),
        identity.consumer(),
        identity.producer().name(),
        identity.tenant_column(),
        identity.message_id()
    );
    if source == QuarantineSource::IdentityConflict {
        key.push('\u{1f}');
        key.push_str(payload_sha256);
    }
    key
}

/// The key of the open item about a dead effect.
pub(crate) fn effect_item_key(effect_id: &str) -> String {
    format!("{}:{effect_id}", QuarantineSource::DeadEffect.as_str())
}

fn item_from_row(row: &PgRow) -> Result<QuarantineItem, QuarantineError> {
    let get = QuarantineError::Database;
    let source: String = row.try_get("source").map_err(get)?;
    let decision: Option<String> = row.try_get("decision").map_err(get)?;
    Ok(QuarantineItem {
        id: row.try_get("id").map_err(get)?,
        source: QuarantineSource::parse(&source).ok_or_else(|| {
            QuarantineError::Database(sqlx::Error::Decode(
                format!("unknown quarantine source {source}").into(),
            ))
        })?,
        consumer_name: row.try_get("consumer_name").map_err(get)?,
        producer_name: row.try_get("producer_name").map_err(get)?,
        tenant_id: row.try_get("tenant_id").map_err(get)?,
        message_id: row.try_get("message_id").map_err(get)?,
        effect_id: row.try_get("effect_id").map_err(get)?,
        payload_sha256: row.try_get("payload_sha256").map_err(get)?,
        payload_ref: row.try_get("payload_ref").map_err(get)?,
        reason_code: row.try_get("reason_code").map_err(get)?,
        attempts: row.try_get("attempts").map_err(get)?,
        first_failed_at: row.try_get("first_failed_at").map_err(get)?,
        last_failed_at: row.try_get("last_failed_at").map_err(get)?,
        handler_version: row.try_get("handler_version").map_err(get)?,
        decision: match decision.as_deref() {
            Some("repair") => Some(Decision::Repair),
            Some("discard") => Some(Decision::Discard),
            _ => None,
        },
        decided_by: row.try_get("decided_by").map_err(get)?,
        decided_at: row.try_get("decided_at").map_err(get)?,
        decision_reason: row.try_get("decision_reason").map_err(get)?,
        recovered_at: row.try_get("recovered_at").map_err(get)?,
    })
}
