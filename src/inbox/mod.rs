//! The protocol core: claim, look up, record and commit. Nothing here knows about HTTP, so a
//! message-broker consumer uses the same calls as the Tower layer.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_inbox::{MessageIdentity, MessageKey, Producer};
//! use tower_inbox::inbox::{Claim, Inbox};
//! use tower_inbox::fingerprint::{Fingerprint};
//!
//! # async fn consume(pool: sqlx::PgPool, body: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = Inbox::new(pool);
//! let identity = MessageIdentity::new(
//!     "ledger-projector",
//!     Producer::new("payments")?,
//!     MessageKey::new("evt-0042")?,
//! );
//! match inbox
//!     .claim(identity, Fingerprint::of_bytes(body), "v3", Duration::from_secs(1))
//!     .await?
//! {
//!     Claim::Claimed(mut message) => {
//!         sqlx::query("update account set balance = balance + 10 where id = 'a1'")
//!             .execute(&mut message)
//!             .await?;
//!         message.commit(None).await?; // claim and business change become durable together
//!     }
//!     Claim::Duplicate(_) => { /* already applied: just acknowledge */ }
//!     Claim::Conflict(_) => { /* same ID, different payload: quarantine */ }
//!     Claim::InProgress => { /* another worker holds it: redeliver later */ }
//! }
//! # Ok(()) }
//! ```
//!
//! **Waiting for an original in flight.** Every claim holds its key's advisory lock
//! (`pg_try_advisory_xact_lock`) until its transaction ends. A claim that finds the lock held
//! waits in this process, not in the database: it polls with a short backoff, one
//! primary-key read at a time, and holds no connection between polls. So a duplicate never
//! blocks a pooled connection for long, and a wait that runs out raises nothing on the server
//! (a `lock_timeout` would log an `ERROR` for every such retry).

mod claim;
mod entry;
mod error;
mod executor;
mod failure;
mod layout;
mod lock;
mod lookup;
mod message;
mod report;
mod reruns;
mod settings;
pub(crate) mod sql;
mod waiters;

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPool;

use crate::connection::{Guarded, DEFAULT_STATEMENT_DEADLINE};
use crate::identity::{bind_identity, MessageIdentity};
use crate::metrics::MetricLabels;
use crate::schema::Schema;

pub use crate::db::RetryReason;
pub use crate::retry::TransientRetry;
pub(crate) use claim::count_claim;
pub(crate) use entry::{headers_len, seen};
pub use entry::{Claim, InboxEntry, RecordedResponse};
pub use error::InboxError;
pub(crate) use layout::check_isolation;
pub use layout::LayoutError;
pub(crate) use lock::ClaimLock;
use lookup::{LookupFirst, TakenShare};
pub use message::ClaimedMessage;
pub(crate) use message::Finished;
pub use report::{FailureRecord, InFlight, KeyTimes};
pub(crate) use reruns::Reruns;
pub use settings::{ClaimMode, IsolationLevel, DEFAULT_IN_FLIGHT_WAIT};
pub(crate) use waiters::Settled;
use waiters::Waiters;

/// How many times a claim tries again when the row that held its key vanished before it
/// could be read (a purge racing it) before it gives up like a serialization failure.
const VANISHED_ATTEMPTS: u32 = 3;

/// The inbox: claims messages in a transaction of their own pool.
#[derive(Clone, Debug)]
pub struct Inbox {
    pool: PgPool,
    schema: Schema,
    isolation: IsolationLevel,
    labels: MetricLabels,
    lookup: LookupFirst,
    /// How often keys were found taken lately, for [`LookupFirst::Adaptive`].
    taken: Arc<TakenShare>,
    waiters: Arc<Waiters>,
    /// How long each of the inbox's own statements may take (see
    /// [`with_statement_deadline`](Self::with_statement_deadline)).
    deadline: Duration,
    /// Set once the database was found to have the schema's layout (the first claim asks).
    layout_checked: Arc<tokio::sync::OnceCell<()>>,
}

impl Inbox {
    /// An inbox over a pool whose database has the [`migrate`](crate::migrate) migrations
    /// applied, in the default schema; claims run at the database's default isolation level
    /// ([`IsolationLevel::DatabaseDefault`]), look a key up before
    /// opening a transaction for it while duplicates are common (see
    /// [`with_lookup_first`](Self::with_lookup_first)), and metrics carry the consumer label.
    pub fn new(pool: PgPool) -> Self {
        // A quarter of the pool: enough for a few keys in flight, never the whole pool.
        let limit = usize::try_from(pool.options().get_max_connections() / 4).unwrap_or(1);
        Self {
            pool,
            schema: Schema::default(),
            isolation: IsolationLevel::default(),
            labels: MetricLabels::default(),
            lookup: LookupFirst::default(),
            taken: Arc::new(TakenShare::new()),
            waiters: Arc::new(Waiters::new(limit)),
            deadline: DEFAULT_STATEMENT_DEADLINE,
            layout_checked: Arc::default(),
        }
    }

    /// How many keys this inbox waits on at once (default: a quarter of the pool's
    /// connections, at least one). One claim polls each such key for all its duplicates,
    /// holding a pooled connection only while a poll runs; past the limit a duplicate of
    /// an in-flight command is answered [`Claim::InProgress`] at once, so retry storms
    /// cannot take the pool from other work.
    pub fn with_waiting_keys_limit(mut self, keys: usize) -> Self {
        self.waiters = Arc::new(Waiters::new(keys));
        self
    }

    /// The most keys waited on at once.
    pub fn waiting_keys_limit(&self) -> usize {
        self.waiters.limit()
    }

    /// How many claims of this inbox (and its clones) are waiting for an original in flight
    /// right now.
    pub fn waiting_claims(&self) -> usize {
        self.waiters.waiting()
    }

    /// The tables are in `schema` (migrated there with
    /// [`migrate_schema`](crate::schema::migrate_schema)).
    ///
    /// The first claim checks that the database's inbox table has the schema's
    /// [layout](crate::partition::Layout), and fails with [`InboxError::Layout`] otherwise.
    pub fn with_schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self.layout_checked = Arc::default();
        self
    }

    /// Claims run at `level`. With the [partitioned layout](crate::partition), only `READ
    /// COMMITTED` is correct: claims at another level fail with [`InboxError::Layout`].
    pub fn with_isolation(mut self, level: IsolationLevel) -> Self {
        self.isolation = level;
        self
    }

    /// Which identity labels this inbox's [metrics](crate::metrics) carry.
    pub fn with_metric_labels(mut self, labels: MetricLabels) -> Self {
        self.labels = labels;
        self
    }

    /// Whether a claim first reads the key's row outside any transaction: always (`true`) or
    /// never (`false`). The default decides from the traffic.
    ///
    /// The read answers a duplicate of a finished command from one primary-key read, with no
    /// transaction and no write, and lets one of an in-flight command wait without opening
    /// one; it costs a first-seen message one round trip more. Without it a duplicate learns
    /// it is one from the claim: `BEGIN`, the claim, a read in the same transaction (three
    /// round trips). By default the inbox reads first while more than a fifth of the recent
    /// messages (about the last 32) found their key taken, and claims at once otherwise: a
    /// steady stream of new commands costs the protocol's own round trips, and a retry storm
    /// turns the read on within a message or two.
    pub fn with_lookup_first(mut self, on: bool) -> Self {
        self.lookup = if on {
            LookupFirst::Always
        } else {
            LookupFirst::Never
        };
        self
    }

    /// How long each statement the inbox sends may wait for its answer (default 10 s): its
    /// claim, record and `COMMIT`, its reads and its failure records. A statement past it
    /// fails as on a lost connection (a re-run is safe; a `COMMIT`'s outcome is unknown,
    /// [`InboxError::OutcomeUnknown`]), and its connection is closed rather than returned to
    /// the pool. This is what frees a service from a half-open connection (a network
    /// partition, a vanished database host) whose statements would otherwise never end and
    /// whose return to the pool would never complete. Statements a handler runs on the
    /// transaction are its own; if its future is dropped (the client gave up), the
    /// transaction is rolled back within this deadline, or its connection closed.
    ///
    /// Keep it well above the slowest statement of a healthy database (a `COMMIT` waiting
    /// for a synchronous standby included) and below the time clients wait for an answer.
    /// A zero deadline is taken as one millisecond.
    pub fn with_statement_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline.max(Duration::from_millis(1));
        self
    }

    /// How long each statement the inbox sends may wait for its answer.
    pub fn statement_deadline(&self) -> Duration {
        self.deadline
    }

    /// The pool as an executor whose statements run within the deadline.
    pub(crate) fn guarded(&self) -> Guarded<'_> {
        Guarded::new(&self.pool, self.deadline, self.schema.pooling())
    }

    /// Counts a message whose key was (or was not) found taken, for the default lookup
    /// decision.
    pub(crate) fn observe_taken(&self, taken: bool) {
        self.taken.observe(taken);
    }

    /// The pool claims are made from.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema the tables are in.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// The isolation level claims run at.
    pub fn isolation(&self) -> IsolationLevel {
        self.isolation
    }

    /// The identity labels metrics carry.
    pub fn metric_labels(&self) -> MetricLabels {
        self.labels
    }

    /// Refuses a claim the schema's layout cannot make correctly: an isolation level it does
    /// not allow, or (asked once) a database laid out otherwise.
    pub(crate) async fn check_layout(&self, consumer: &str) -> Result<(), InboxError> {
        check_isolation(&self.schema, self.isolation)?;
        self.layout_checked
            .get_or_try_init(|| layout::check_layout(self))
            .await
            .inspect_err(|err| err.count(&self.labels.of_consumer(consumer)))?;
        Ok(())
    }

    /// Classifies an error of the inbox's own database work and counts it.
    fn failed(&self, consumer: &str, err: sqlx::Error) -> InboxError {
        let err = InboxError::classify(err);
        err.count(&self.labels.of_consumer(consumer));
        err
    }

    /// Reads what the inbox holds for `identity`, outside any transaction: the committed
    /// state only.
    pub async fn lookup(
        &self,
        identity: &MessageIdentity,
    ) -> Result<Option<InboxEntry>, InboxError> {
        let sql = self.schema.sql(sql::LOOKUP);
        let row = bind_identity!(crate::sql::query(&sql), identity)
            .fetch_optional(self.guarded())
            .await
            .map_err(|e| self.failed(identity.consumer(), e))?;
        match row {
            Some(row) => entry::entry_from_row(&row),
            None => Ok(None),
        }
    }
}
