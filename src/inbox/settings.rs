//! How claimed transactions run: their isolation level, and when the claim is made.

use crate::schema::Layout;

/// The isolation level claimed transactions run at.
///
/// The claim is correct at every level: under `RepeatableRead` and `Serializable` a claim
/// that meets a concurrently committed original fails with a serialization failure instead of
/// reading it, and the re-run (a new transaction, a new snapshot) sees it as a duplicate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IsolationLevel {
    /// The database's default for new transactions (the session's
    /// `default_transaction_isolation`: `READ COMMITTED` unless the server, the database or
    /// the role sets another), the default here: the transaction starts with a plain
    /// `BEGIN`, as sqlx's `Pool::begin` starts one. Naming the level costs PostgreSQL work
    /// on every transaction (it sets the level as a setting, and at commit walks every
    /// setting to undo it): about 7 000 instructions, 1.2 to 1.4% of what the layer's
    /// statements for a first-seen command cost it (BENCHMARKS.md). With the [partitioned
    /// layout](crate::partition), whose claim is correct under `READ COMMITTED` only, the
    /// level is named: `READ COMMITTED`.
    #[default]
    DatabaseDefault,
    /// `READ COMMITTED`, PostgreSQL's own default, named in `BEGIN` so that no
    /// `default_transaction_isolation` changes it.
    ReadCommitted,
    /// `REPEATABLE READ`: one snapshot for the whole handler.
    RepeatableRead,
    /// `SERIALIZABLE`: as if the transactions ran one at a time; expect serialization
    /// failures under contention, which are re-run.
    Serializable,
}

impl IsolationLevel {
    /// The `BEGIN` statement: plain for the database's default, unless the schema's `layout`
    /// needs `READ COMMITTED`; otherwise the level is named, so a database's
    /// `default_transaction_isolation` does not change it.
    pub(crate) fn begin(self, layout: Layout) -> &'static str {
        match self {
            Self::DatabaseDefault if layout == Layout::Plain => "BEGIN",
            Self::DatabaseDefault | Self::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Self::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Self::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }
}

/// When the layer claims a command's identity in its transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClaimMode {
    /// The claim is the transaction's first statement (the default). A duplicate of an
    /// in-flight command waits for it before the handler runs. Costs one statement more than
    /// the handler alone, plus the record.
    #[default]
    First,
    /// The handler's statements run first; the inbox row, with the recorded response, is
    /// inserted last with `ON CONFLICT DO NOTHING`, one statement fewer per command. If the
    /// key was claimed meanwhile, the whole transaction rolls back and the recorded response
    /// is replayed (or the conflict or in-progress answer given): at most one transition
    /// still commits. The trade-off: **a duplicate that arrives while the original is in
    /// flight runs the handler before it is rolled back**, so use it only for handlers whose
    /// every effect is in the transaction (outbox effects included). Duplicates of finished
    /// commands are answered before the handler, by the lookup, as in the default mode.
    AtCommit,
}

/// Default time a duplicate waits for an original in flight: 2 s.
pub const DEFAULT_IN_FLIGHT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
