//! What an operator looks at for one key, beyond [`Inbox::lookup`]: when it was claimed and
//! recorded, and the attempts that rolled back.

use sqlx::postgres::PgRow;
use sqlx::Row;
use time::OffsetDateTime;

use super::lock::consumer_class;
use super::{sql, Inbox, InboxError};
use crate::identity::{bind_identity, MessageIdentity};

/// When a key's row was claimed and recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyTimes {
    /// When the claim was made (the claiming transaction's start).
    pub received_at: OffsetDateTime,
    /// When the outcome was recorded; a committed row always has it.
    pub processed_at: Option<OffsetDateTime>,
}

/// The attempts of a key that rolled back (handler failures, panics, clients gone), kept
/// in a transaction of their own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureRecord {
    /// How many attempts failed.
    pub attempts: i32,
    /// When the first failed.
    pub first_failed_at: OffsetDateTime,
    /// When the last failed.
    pub last_failed_at: OffsetDateTime,
    /// The last failure's stable reason code.
    pub last_reason: String,
    /// The fingerprint of the payload that failed, in hex.
    pub payload_sha256: String,
    /// The handler version that failed.
    pub handler_version: String,
}

/// A consumer's claims in flight: made, not committed or rolled back yet.
#[derive(Debug, Clone, PartialEq)]
pub struct InFlight {
    /// The consumer.
    pub consumer: String,
    /// How many of its claims are in flight.
    pub claims: i64,
    /// How long the oldest one's transaction has been open (zero when none is).
    pub oldest: std::time::Duration,
}

impl Inbox {
    /// The claims in flight of each of `consumers`, from the advisory locks their
    /// transactions hold (`pg_locks`): a claim's row is invisible until its commit, its
    /// lock is not. Every claim takes one, in both claim modes (at commit, only for the
    /// commit's last moments). The age is its transaction's (`pg_stat_activity`); another
    /// role's transactions are counted, but show their start only to a member of
    /// `pg_read_all_stats`. A consumer with none is reported with zero.
    pub async fn claims_in_flight(&self, consumers: &[&str]) -> Result<Vec<InFlight>, InboxError> {
        let rows: Vec<(i64, i64, f64)> = sqlx::query_as(sql::CLAIMS_IN_FLIGHT)
            .fetch_all(self.guarded())
            .await
            .map_err(InboxError::classify)?;
        Ok(consumers
            .iter()
            .map(|&consumer| {
                // pg_locks shows the int4 key as an unsigned oid.
                let class = i64::from(consumer_class(&self.schema, consumer) as u32);
                let (claims, oldest) = rows
                    .iter()
                    .find(|(c, _, _)| *c == class)
                    .map_or((0, 0.0), |(_, n, age)| (*n, *age));
                InFlight {
                    consumer: consumer.to_owned(),
                    claims,
                    oldest: std::time::Duration::from_secs_f64(oldest.max(0.0)),
                }
            })
            .collect())
    }

    /// When `identity` was claimed and recorded; `None` when the inbox holds no committed
    /// row for it.
    pub async fn times(&self, identity: &MessageIdentity) -> Result<Option<KeyTimes>, InboxError> {
        let Some(row) = self.key_row(sql::TIMES, identity).await? else {
            return Ok(None);
        };
        let get = |e| self.failed(identity.consumer(), e);
        Ok(Some(KeyTimes {
            received_at: row.try_get("received_at").map_err(get)?,
            processed_at: row.try_get("processed_at").map_err(get)?,
        }))
    }

    /// The record of `identity`'s attempts that rolled back, if any failed.
    pub async fn failure_record(
        &self,
        identity: &MessageIdentity,
    ) -> Result<Option<FailureRecord>, InboxError> {
        let Some(row) = self.key_row(sql::FAILURE_RECORD, identity).await? else {
            return Ok(None);
        };
        let get = |e| self.failed(identity.consumer(), e);
        Ok(Some(FailureRecord {
            attempts: row.try_get("attempts").map_err(get)?,
            first_failed_at: row.try_get("first_failed_at").map_err(get)?,
            last_failed_at: row.try_get("last_failed_at").map_err(get)?,
            last_reason: row.try_get("last_reason").map_err(get)?,
            payload_sha256: row.try_get("payload_sha256").map_err(get)?,
            handler_version: row.try_get("handler_version").map_err(get)?,
        }))
    }

    /// The row `template` selects for `identity`, if any.
    async fn key_row(
        &self,
        template: &'static str,
        identity: &MessageIdentity,
    ) -> Result<Option<PgRow>, InboxError> {
        let sql = self.schema.sql(template);
        bind_identity!(crate::sql::query(&sql), identity)
            .fetch_optional(self.guarded())
            .await
            .map_err(|e| self.failed(identity.consumer(), e))
    }
}
