//! Attempts that did not commit: counted per key, and quarantined past the limit.

use super::{sql, ClaimLock, Inbox, InboxError};
use crate::connection::within;
use crate::fingerprint::Fingerprint;
use crate::identity::{bind_identity, MessageIdentity};
use crate::metrics::{self as m, quarantine_moved};
use crate::quarantine::{identity_item_key, QuarantineSource};

impl Inbox {
    /// Counts an attempt at `identity` that rolled back, with a stable reason code, in a
    /// transaction of its own. From the `quarantine_after`th failure on, the command also has
    /// an open [quarantine](crate::quarantine) item; its id is returned.
    ///
    /// Call it after the attempt's transaction has ended: while it is open, it holds the
    /// key's claim lock. If another attempt at the command has claimed it since (it holds
    /// the claim, or has committed), the failure is counted and an item already open counts
    /// it too, but no item is opened: that attempt did not see this failure, so its success
    /// could not mark a new item recovered, and if it fails too, its own record opens the
    /// item with both failures counted.
    ///
    /// `reason` is also the `reason` label of
    /// [`inbox_handler_failures_total`](crate::metrics::HANDLER_FAILURES): use a code from a
    /// small fixed set (`handler-error`, `validation-failed`, ...), never text from the
    /// message, or the metric grows a series per message.
    pub async fn record_failure(
        &self,
        identity: &MessageIdentity,
        fingerprint: Fingerprint,
        handler_version: &str,
        reason: &str,
        quarantine_after: u32,
    ) -> Result<Option<i64>, InboxError> {
        m::count_with(
            m::HANDLER_FAILURES,
            &self.labels.of_consumer_shared(identity.consumer_shared()),
            "reason",
            reason.to_owned(),
        );
        let item_key = identity_item_key(QuarantineSource::HandlerFailure, identity, "");
        let lock = ClaimLock::of(&self.schema, identity);
        let failed = |e| self.failed(identity.consumer(), e);
        let mut tx = self.guarded().begin("BEGIN").await.map_err(failed)?;
        // Two statements, so that the record's snapshot sees every commit made before the
        // lock was granted: a retry that claimed the key after this attempt rolled back holds
        // the lock until it ends, and once it has committed, it has committed visibly.
        let try_lock = sqlx::query_scalar(sql::TRY_CLAIM_LOCK)
            .bind(lock.0)
            .bind(lock.1)
            .fetch_one(&mut tx);
        let holds_lock: bool = within(self.deadline, try_lock).await.map_err(failed)?;
        let sql = self.schema.sql(sql::RECORD_FAILURE);
        let record = bind_identity!(sqlx::query_as(&sql), identity)
            .bind(fingerprint.to_hex())
            .bind(handler_version.as_bytes())
            .bind(reason.as_bytes())
            .bind(i32::try_from(quarantine_after.max(1)).unwrap_or(i32::MAX))
            .bind(item_key.as_bytes())
            .bind(holds_lock)
            .fetch_optional(&mut tx);
        let item: Option<(i64, bool)> = within(self.deadline, record).await.map_err(failed)?;
        tx.commit().await.map_err(failed)?;
        if let Some((_, true)) = item {
            quarantine_moved(QuarantineSource::HandlerFailure);
        }
        Ok(item.map(|(id, _)| id))
    }

    /// Keeps an identity conflict (`identity` claimed before with another payload) in the
    /// [quarantine](crate::quarantine): one open item per conflicting payload, counted.
    pub async fn record_conflict(
        &self,
        identity: &MessageIdentity,
        conflicting: Fingerprint,
        handler_version: &str,
    ) -> Result<(), InboxError> {
        self.quarantine_message(
            QuarantineSource::IdentityConflict,
            "payload-mismatch",
            identity,
            conflicting,
            handler_version,
        )
        .await
        .map(|_| ())
    }

    /// Opens (or counts again) the quarantine item of `source` about a message, with the
    /// fingerprint of the payload concerned. Returns the item and how many times it has
    /// happened.
    pub(crate) async fn quarantine_message(
        &self,
        source: QuarantineSource,
        reason_code: &str,
        identity: &MessageIdentity,
        fingerprint: Fingerprint,
        handler_version: &str,
    ) -> Result<(i64, i32), InboxError> {
        let sha = fingerprint.to_hex();
        let item_key = identity_item_key(source, identity, &sha);
        let sql = self.schema.sql(sql::QUARANTINE_MESSAGE);
        let (id, attempts): (i64, i32) = bind_identity!(sqlx::query_as(&sql), identity)
            .bind(source.as_str())
            .bind(item_key.as_bytes())
            .bind(&sha)
            .bind(reason_code.as_bytes())
            .bind(handler_version.as_bytes())
            .fetch_one(self.guarded())
            .await
            .map_err(|e| self.failed(identity.consumer(), e))?;
        if attempts == 1 {
            quarantine_moved(source);
        }
        Ok((id, attempts))
    }
}
