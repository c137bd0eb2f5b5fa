//! Reading the outbox back: one effect, a listing, the effects of one message; for
//! operators and tests.

use sqlx::Row;
use time::OffsetDateTime;

use super::{sql, EffectId, Outbox, OutboxError};
use crate::connection::Guarded;
use crate::identity::{bind_identity, MessageIdentity};

/// Where an effect stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EffectStatus {
    /// Not delivered yet (possibly leased by a dispatcher right now).
    Pending,
    /// Delivered; the receiver's result is recorded.
    Delivered,
    /// Out of attempts or permanently refused: moved to the quarantine.
    Dead,
}

/// An outbox row, for operators and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEntry {
    /// The effect's ID.
    pub effect_id: EffectId,
    /// Its name.
    pub effect_name: String,
    /// Where it stands.
    pub status: EffectStatus,
    /// Delivery attempts started so far.
    pub attempts: i32,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// The receiver's last status code, if it answered.
    pub remote_status: Option<i32>,
    /// The receiver's answer to the delivery that succeeded.
    pub remote_result: Option<String>,
    /// When it was enqueued.
    pub created_at: OffsetDateTime,
    /// When it was delivered.
    pub delivered_at: Option<OffsetDateTime>,
    /// Where it goes (a URL, a subject, `exchange/routing-key`).
    pub destination: String,
    /// The message that wrote it, for an effect written while processing one: consumer,
    /// producer, tenant (`''` for none) and message ID.
    pub message: Option<[String; 4]>,
    /// When it is due next (for a leased effect, when its lease runs out).
    pub next_attempt_at: OffsetDateTime,
    /// The dispatcher holding it now, and until when; none when not leased.
    pub lease: Option<(String, OffsetDateTime)>,
}

/// Which effects [`Outbox::list`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxFilter {
    /// Not delivered yet, next due first.
    Pending,
    /// Out of attempts or refused, oldest first.
    Dead,
    /// Every effect, newest first.
    All,
}

impl Outbox {
    /// The pool for this component's statements: each within the crate's statement deadline,
    /// sent as the schema's [`Pooling`](crate::schema::Pooling) needs.
    fn db(&self) -> Guarded<'_> {
        Guarded::for_schema(&self.pool, &self.schema)
    }

    /// One effect's row.
    pub async fn entry(&self, effect_id: &EffectId) -> Result<Option<OutboxEntry>, OutboxError> {
        let sql = self.schema.sql(sql::ENTRY);
        let row = sqlx::query(&sql)
            .bind(effect_id.as_str())
            .fetch_optional(self.db())
            .await
            .map_err(OutboxError::from)?;
        row.as_ref().map(entry_from_row).transpose()
    }

    /// Up to `limit` effects of `filter`, of the effect `effect_name` only when given.
    pub async fn list(
        &self,
        filter: OutboxFilter,
        effect_name: Option<&str>,
        limit: i64,
    ) -> Result<Vec<OutboxEntry>, OutboxError> {
        let sql = self.schema.sql(match filter {
            OutboxFilter::Pending => sql::LIST_PENDING,
            OutboxFilter::Dead => sql::LIST_DEAD,
            OutboxFilter::All => sql::LIST_ALL,
        });
        let rows = sqlx::query(&sql)
            .bind(effect_name)
            .bind(limit)
            .fetch_all(self.db())
            .await
            .map_err(OutboxError::from)?;
        rows.iter().map(entry_from_row).collect()
    }

    /// The effects written while processing the message `identity`. It reads the outbox
    /// table (no index leads with the identity): for an operator's look at one key, not
    /// for a request's path.
    pub async fn for_message(
        &self,
        identity: &MessageIdentity,
    ) -> Result<Vec<OutboxEntry>, OutboxError> {
        let sql = self.schema.sql(sql::FOR_MESSAGE);
        let rows = bind_identity!(crate::sql::query(&sql), identity)
            .fetch_all(self.db())
            .await
            .map_err(OutboxError::from)?;
        rows.iter().map(entry_from_row).collect()
    }
}

fn entry_from_row(row: &sqlx::postgres::PgRow) -> Result<OutboxEntry, OutboxError> {
    let get = OutboxError::Database;
    let status: String = row.try_get("status").map_err(get)?;
    let message = match (
        row.try_get::<Option<String>, _>("consumer_name")
            .map_err(get)?,
        row.try_get::<Option<String>, _>("producer_name")
            .map_err(get)?,
        row.try_get::<Option<String>, _>("tenant_id").map_err(get)?,
        row.try_get::<Option<String>, _>("message_id")
            .map_err(get)?,
    ) {
        (Some(consumer), Some(producer), tenant, Some(message_id)) => {
            Some([consumer, producer, tenant.unwrap_or_default(), message_id])
        }
        _ => None,
    };
    let lease = match (
        row.try_get::<Option<String>, _>("lease_owner")
            .map_err(get)?,
        row.try_get::<Option<OffsetDateTime>, _>("lease_until")
            .map_err(get)?,
    ) {
        (Some(owner), Some(until)) => Some((owner, until)),
        _ => None,
    };
    Ok(OutboxEntry {
        effect_id: EffectId(row.try_get("effect_id").map_err(get)?),
        effect_name: row.try_get("effect_name").map_err(get)?,
        status: match status.as_str() {
            "delivered" => EffectStatus::Delivered,
            "dead" => EffectStatus::Dead,
            _ => EffectStatus::Pending,
        },
        attempts: row.try_get("attempts").map_err(get)?,
        last_error: row.try_get("last_error").map_err(get)?,
        remote_status: row.try_get("remote_status").map_err(get)?,
        remote_result: row.try_get("remote_result").map_err(get)?,
        created_at: row.try_get("created_at").map_err(get)?,
        delivered_at: row.try_get("delivered_at").map_err(get)?,
        destination: row.try_get("destination").map_err(get)?,
        message,
        next_attempt_at: row.try_get("next_attempt_at").map_err(get)?,
        lease,
    })
}
