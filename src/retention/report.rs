//! What a purge did, per table, and how it failed.

use std::fmt;

use ::metrics::Label;
use time::OffsetDateTime;

use crate::inbox::InboxError;
use crate::metrics::{count, INBOX_PURGED, OUTBOX_PURGED, QUARANTINE_PURGED};

/// A table the purge deletes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PurgedTable {
    /// Processed inbox rows (the [inbox policy](crate::retention::PurgerBuilder::inbox)).
    ConsumerInbox,
    /// Records of attempts that rolled back (the inbox policy).
    ConsumerInboxFailure,
    /// Delivered effects, and dead ones that were discarded (the
    /// [outbox policy](crate::retention::PurgerBuilder::outbox)).
    MessageOutbox,
    /// Decided quarantine items (the [quarantine policy](crate::retention::PurgerBuilder::quarantine)).
    InboxQuarantine,
}

impl PurgedTable {
    /// The table's name, also the `table` label of [`INBOX_PURGED`].
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConsumerInbox => "consumer_inbox",
            Self::ConsumerInboxFailure => "consumer_inbox_failure",
            Self::MessageOutbox => "message_outbox",
            Self::InboxQuarantine => "inbox_quarantine",
        }
    }

    pub(super) fn count_purged(self, rows: u64) {
        match self {
            Self::ConsumerInbox | Self::ConsumerInboxFailure => {
                count(INBOX_PURGED, &[Label::new("table", self.as_str())], rows);
            }
            Self::MessageOutbox => count(OUTBOX_PURGED, &[], rows),
            Self::InboxQuarantine => count(QUARANTINE_PURGED, &[], rows),
        }
    }
}

impl fmt::Display for PurgedTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one purge (or dry run) did to one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TablePurge {
    /// The table.
    pub table: PurgedTable,
    /// Rows older than this (on the database's clock) were eligible: now minus the window.
    pub cutoff: OffsetDateTime,
    /// Rows deleted, or that a dry run would delete.
    pub rows: u64,
    /// Delete statements run (none in a dry run).
    pub batches: u64,
}

/// What one purge (or dry run) did, per table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PurgeReport {
    /// Whether this was a dry run: counted, nothing deleted.
    pub dry_run: bool,
    /// One entry per table, in the order purged.
    pub tables: Vec<TablePurge>,
    /// Whether the purge was stopped before the end
    /// ([`Purger::purge_observed`](crate::retention::Purger::purge_observed)); the tables
    /// after the one it stopped in were not purged.
    pub stopped: bool,
}

impl PurgeReport {
    /// The entry for `table`, if its policy was set.
    pub fn table(&self, table: PurgedTable) -> Option<&TablePurge> {
        self.tables.iter().find(|t| t.table == table)
    }

    /// Rows deleted (or that would be) from `table`; 0 when it was not purged.
    pub fn rows(&self, table: PurgedTable) -> u64 {
        self.table(table).map_or(0, |t| t.rows)
    }

    /// Rows deleted (or that would be) from all tables.
    pub fn total_rows(&self) -> u64 {
        self.tables.iter().map(|t| t.rows).sum()
    }
}

impl fmt::Display for PurgeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = if self.dry_run {
            "would delete"
        } else {
            "deleted"
        };
        let mut first = true;
        for t in &self.tables {
            if !first {
                writeln!(f)?;
            }
            first = false;
            write!(
                f,
                "{}: {verb} {} rows older than {}",
                t.table, t.rows, t.cutoff
            )?;
        }
        if self.stopped {
            write!(
                f,
                "\nstopped before the end: what is left goes in the next run"
            )?;
        }
        Ok(())
    }
}

/// A purge that failed part way. The batches before the failure are committed (and
/// counted in the metrics); nothing else was touched.
#[derive(Debug, thiserror::Error)]
#[error(
    "retention purge of {table} failed after {deleted} rows were deleted in this run: {source}"
)]
pub struct PurgeError {
    /// The table being purged when it failed.
    pub table: PurgedTable,
    /// Rows this run had deleted before the failure, all tables together.
    pub deleted: u64,
    /// What failed.
    #[source]
    pub source: InboxError,
}
