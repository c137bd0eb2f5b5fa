//! The checks that keep claims to what the schema's [layout](crate::partition) allows.

use super::{sql, ClaimLock, Inbox, InboxError, IsolationLevel};
use crate::connection::{within, OwnedTx};
use crate::schema::{Layout, Schema};

impl Inbox {
    /// With the partitioned layout, takes the key's claim lock in a statement of its own
    /// before the claim ([`sql::CLAIM_PARTITIONED`] says why); whether it was free. The plain
    /// layout's claim takes it itself: `true`, and no statement sent.
    pub(crate) async fn lock_before_claim(
        &self,
        tx: &mut OwnedTx,
        lock: ClaimLock,
    ) -> Result<bool, sqlx::Error> {
        if self.schema.layout() == Layout::Plain {
            return Ok(true);
        }
        let try_lock = sqlx::query_scalar(sql::TRY_CLAIM_LOCK)
            .bind(lock.0)
            .bind(lock.1)
            .fetch_one(tx);
        within(self.deadline, try_lock).await
    }
}

/// A layout the settings or the database do not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Claims of the partitioned layout are correct under `READ COMMITTED` only.
    #[error(
        "the inbox schema {schema} is partitioned: claims must run at READ COMMITTED, not \
         {level:?} (a partitioned claim checks for a committed duplicate with a snapshot \
         taken after its lock, which only READ COMMITTED gives)"
    )]
    Isolation {
        /// The schema.
        schema: String,
        /// The level asked for.
        level: IsolationLevel,
    },
    /// The schema's inbox table is not laid out as configured (or is missing).
    #[error(
        "the inbox schema {schema} is configured {configured} but its consumer_inbox is \
         {found} in the database: migrate it with the same layout (schema::migrate_schema), \
         or configure the layout it has"
    )]
    Mismatch {
        /// The schema.
        schema: String,
        /// The layout the settings name.
        configured: &'static str,
        /// What the database has: `plain`, `partitioned` or `missing`.
        found: &'static str,
    },
}

/// Refuses an isolation level the schema's layout cannot claim correctly at.
pub(crate) fn check_isolation(schema: &Schema, level: IsolationLevel) -> Result<(), LayoutError> {
    match (schema.layout(), level) {
        (Layout::Partitioned, IsolationLevel::RepeatableRead | IsolationLevel::Serializable) => {
            Err(LayoutError::Isolation {
                schema: schema.name().to_owned(),
                level,
            })
        }
        _ => Ok(()),
    }
}

/// Checks that the database's inbox table in the inbox's schema has the schema's layout: a
/// plain claim on a partitioned table would not see a duplicate in another partition. Within
/// the inbox's statement deadline, like its other statements.
pub(crate) async fn check_layout(inbox: &Inbox) -> Result<(), InboxError> {
    let schema = &inbox.schema;
    let relkind: Option<String> = sqlx::query_scalar(sql::RELKIND)
        .bind(schema.name())
        .fetch_optional(inbox.guarded())
        .await
        .map_err(InboxError::classify)?;
    let found = relkind
        .as_deref()
        .map_or("missing", |kind| Layout::of_relkind(kind).as_str());
    if found == schema.layout().as_str() {
        return Ok(());
    }
    Err(InboxError::Layout(LayoutError::Mismatch {
        schema: schema.name().to_owned(),
        configured: schema.layout().as_str(),
        found,
    }))
}
