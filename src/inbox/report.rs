//! What an operator looks at for one key, beyond [`Inbox::lookup`]: when it was claimed and
//! recorded, and the attempts that rolled back.

use sqlx::postgres::PgRow;
use sqlx::Row;
use time::OffsetDateTime;

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

impl Inbox {
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
        bind_identity!(sqlx::query(&sql), identity)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.failed(identity.consumer(), e))
    }
}
