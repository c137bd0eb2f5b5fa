//! Deletes what the retention policies no longer require, in small batches.
//!
//! (Over 400 lines: the purger, its builder and its batching loop, which share their settings.)

use std::future::Future;
use std::ops::ControlFlow;
use std::time::Duration;

use sqlx::PgPool;

use crate::connection::{Guarded, OwnedTx};

use crate::schema::Schema;
use time::OffsetDateTime;
use tokio::time::MissedTickBehavior;
use tracing::Instrument;

use super::policy::{check_duration, RetentionError, RetentionPolicy};
use super::report::{PurgeError, PurgeReport, PurgedTable, TablePurge};
use super::sql;
use crate::inbox::InboxError;
use crate::partition::{Layout, PartitionPlan};

mod partitions;

use partitions::Partitioned;

/// One set of purgeable rows: its dry-run count and its batch delete, built from one
/// predicate in `sql.rs`.
#[derive(Debug, Clone, Copy)]
struct Statement {
    count: &'static str,
    delete: &'static str,
}

#[derive(Debug, Clone)]
struct Target {
    table: PurgedTable,
    window: Duration,
    statements: &'static [Statement],
}

const INBOX: &[Statement] = &[Statement {
    count: sql::INBOX_COUNT,
    delete: sql::INBOX_DELETE,
}];
/// The partitioned layout's inbox in batches: its default partition (the others are
/// dropped whole, `purge/partitions.rs`).
const INBOX_DEFAULT_PARTITION: &[Statement] = &[Statement {
    count: sql::DEFAULT_INBOX_COUNT,
    delete: sql::DEFAULT_INBOX_DELETE,
}];
const FAILURES: &[Statement] = &[Statement {
    count: sql::FAILURES_COUNT,
    delete: sql::FAILURES_DELETE,
}];
const OUTBOX: &[Statement] = &[
    Statement {
        count: sql::DELIVERED_COUNT,
        delete: sql::DELIVERED_DELETE,
    },
    Statement {
        count: sql::DISCARDED_COUNT,
        delete: sql::DISCARDED_DELETE,
    },
];
/// The partitioned layout's outbox in batches: its default partition (the others are
/// dropped whole).
const OUTBOX_DEFAULT_PARTITION: &[Statement] = &[
    Statement {
        count: sql::DEFAULT_DELIVERED_COUNT,
        delete: sql::DEFAULT_DELIVERED_DELETE,
    },
    Statement {
        count: sql::DEFAULT_DISCARDED_COUNT,
        delete: sql::DEFAULT_DISCARDED_DELETE,
    },
];
const QUARANTINE: &[Statement] = &[Statement {
    count: sql::DECIDED_COUNT,
    delete: sql::DECIDED_DELETE,
}];

/// Deletes what the retention policies no longer require: processed inbox rows and old
/// failure records ([`inbox`](PurgerBuilder::inbox)), delivered and discarded outbox effects
/// ([`outbox`](PurgerBuilder::outbox)), decided quarantine items
/// ([`quarantine`](PurgerBuilder::quarantine)); each table only if its policy is set.
///
/// Each batch is its own short transaction: it selects up to
/// [`batch_size`](PurgerBuilder::batch_size) eligible rows oldest first with `FOR UPDATE
/// SKIP LOCKED` and deletes them, under a bounded `lock_timeout`. It never waits on a row a
/// claim holds, and it never holds many rows for long. Several purgers (one per instance)
/// may run at once: they skip each other's rows.
///
/// What it never deletes:
/// * an inbox row that is in flight (`processed_at is null`), or processed or received
///   within the window;
/// * an inbox or failure row that an open quarantine item refers to;
/// * a pending effect, a dead one that is not discarded, or one whose item is open;
/// * an open quarantine item; a failing command decided `repair` that has not recovered;
///   an item about an effect still in the outbox and not delivered.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_inbox::retention::{Purger, RetentionPolicy};
///
/// # async fn start(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// const DAY: Duration = Duration::from_secs(24 * 3600);
/// let inbox = RetentionPolicy::builder()
///     .retry_horizon(DAY)
///     .dead_letter_redrive(14 * DAY)
///     .safety_margin(DAY)
///     .build()?;
/// let purger = Purger::builder(pool)
///     .inbox(inbox)
///     .pause_between_batches(Duration::from_millis(100)) // gentler than the 50 ms default
///     .build()?;
/// println!("{}", purger.dry_run().await?); // what it would delete, per table
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let task = tokio::spawn(purger.run(Duration::from_secs(600), async {
///     let _ = stopped.await;
/// }));
/// // ... on shutdown:
/// let _ = stop.send(());
/// task.await??;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Purger {
    pool: PgPool,
    schema: Schema,
    targets: Vec<Target>,
    batch_size: i64,
    lock_timeout: String,
    pause: Duration,
    /// The partitions created ahead; `None` when something else creates them.
    partitions: Option<PartitionPlan>,
}

/// Configures a [`Purger`].
#[derive(Debug)]
#[must_use]
pub struct PurgerBuilder {
    pool: PgPool,
    schema: Schema,
    inbox: Option<Duration>,
    outbox: Option<Duration>,
    quarantine: Option<Duration>,
    batch_size: u32,
    lock_timeout: Duration,
    pause: Duration,
    partitions: Option<PartitionPlan>,
}

/// The largest batch accepted: batches must stay short.
const MAX_BATCH: u32 = 10_000;
/// The longest lock wait accepted.
const MAX_LOCK_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest pause between batches accepted.
const MAX_PAUSE: Duration = Duration::from_secs(60);
/// The default pause between batches.
const DEFAULT_PAUSE: Duration = Duration::from_millis(50);

impl Purger {
    /// A purger over `pool` with no policy yet. Defaults: batches of 200 rows, a lock
    /// timeout of one second, a pause of 50 ms between batches.
    pub fn builder(pool: PgPool) -> PurgerBuilder {
        PurgerBuilder {
            pool,
            schema: Schema::default(),
            inbox: None,
            outbox: None,
            quarantine: None,
            batch_size: 200,
            lock_timeout: Duration::from_secs(1),
            pause: DEFAULT_PAUSE,
            partitions: Some(PartitionPlan::default()),
        }
    }
}

impl PurgerBuilder {
    /// The tables are in `schema` instead of the default one.
    pub fn schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// Purge `consumer_inbox` (processed rows received and processed before the window) and
    /// `consumer_inbox_failure` (last failure before the window). Both keep what an open
    /// quarantine item refers to; a failure record also stays while its command's failure
    /// item is decided `repair` and not recovered, since the retry that commits finds the
    /// item through it.
    pub fn inbox(mut self, policy: RetentionPolicy) -> Self {
        self.inbox = Some(policy.window());
        self
    }

    /// Purge `message_outbox`: effects delivered before the window, and dead effects
    /// discarded before it.
    ///
    /// The outbox row is the record of what was sent and what the receiver answered; size
    /// this window for how long that evidence is needed (audits, the receiver's own
    /// deduplication window).
    pub fn outbox(mut self, policy: RetentionPolicy) -> Self {
        self.outbox = Some(policy.window());
        self
    }

    /// Purge `inbox_quarantine`: items decided (and recovered, if they were) before the
    /// window.
    pub fn quarantine(mut self, policy: RetentionPolicy) -> Self {
        self.quarantine = Some(policy.window());
        self
    }

    /// Rows per batch, 1 to 10 000 (default 200). Each batch holds its rows' locks only for
    /// its own short transaction.
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows;
        self
    }

    /// The longest a batch waits for a lock (default 1 s, at most 60 s); past it the batch
    /// fails and the purge reports an error instead of queueing behind, say, a migration.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// How long to wait after a full batch before the next one (default 50 ms, at most
    /// 60 s; zero for none). The pause holds no connection and no lock: it leaves the
    /// database to the requests. A backlog (the first purge of a large inbox, or one after
    /// an outage) is then deleted at a bounded rate instead of as fast as the server can,
    /// which on a small server shows in every request's latency. The rate is at most
    /// `batch_size` rows per (pause + one batch's time), about 3 400 rows/s with the
    /// defaults on the 2-core machine of BENCHMARKS.md, 2 million per ten minutes; a steady
    /// purge has to keep up with the rows arriving, so raise the batch size, or lower the
    /// pause, for high rates.
    pub fn pause_between_batches(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// With the [partitioned layout](crate::partition): the partitions each purge of the
    /// inbox creates ahead before it drops the expired ones (default: one a day, two days
    /// ahead). The purge skips a range that an existing partition overlaps.
    pub fn partitions(mut self, plan: PartitionPlan) -> Self {
        self.partitions = Some(plan);
        self
    }

    /// With the partitioned layout: create no partitions, something else does (pg_partman's
    /// maintenance, see `docs/scaling.md`); the purge still drops the expired ones.
    pub fn partitions_created_elsewhere(mut self) -> Self {
        self.partitions = None;
        self
    }

    /// Checks the settings.
    pub fn build(self) -> Result<Purger, RetentionError> {
        if self.batch_size == 0 || self.batch_size > MAX_BATCH {
            return Err(RetentionError::BadLimit("batch size must be 1 to 10000"));
        }
        // Zero would mean "wait forever" to PostgreSQL.
        check_duration("the lock timeout", self.lock_timeout)?;
        if self.lock_timeout > MAX_LOCK_TIMEOUT {
            return Err(RetentionError::BadLimit(
                "the lock timeout must be at most 60 s",
            ));
        }
        if self.pause > MAX_PAUSE {
            return Err(RetentionError::BadLimit(
                "the pause between batches must be at most 60 s",
            ));
        }
        let mut targets = Vec::new();
        if let Some(window) = self.inbox {
            targets.push(Target {
                table: PurgedTable::ConsumerInbox,
                window,
                statements: match self.schema.layout() {
                    Layout::Plain => INBOX,
                    Layout::Partitioned => INBOX_DEFAULT_PARTITION,
                },
            });
            targets.push(Target {
                table: PurgedTable::ConsumerInboxFailure,
                window,
                statements: FAILURES,
            });
        }
        // The outbox before the quarantine: a discard decision is what lets a dead effect
        // go, and the item is kept while its effect is still there.
        if let Some(window) = self.outbox {
            targets.push(Target {
                table: PurgedTable::MessageOutbox,
                window,
                statements: match self.schema.layout() {
                    Layout::Plain => OUTBOX,
                    Layout::Partitioned => OUTBOX_DEFAULT_PARTITION,
                },
            });
        }
        if let Some(window) = self.quarantine {
            targets.push(Target {
                table: PurgedTable::InboxQuarantine,
                window,
                statements: QUARANTINE,
            });
        }
        if targets.is_empty() {
            return Err(RetentionError::NothingToPurge);
        }
        Ok(Purger {
            pool: self.pool,
            schema: self.schema,
            targets,
            batch_size: i64::from(self.batch_size),
            lock_timeout: format!("{}ms", self.lock_timeout.as_millis().max(1)),
            pause: self.pause,
            partitions: self.partitions,
        })
    }
}

impl Purger {
    /// Deletes every eligible row, batch by batch, table by table. Rows that become
    /// eligible while it runs are left for the next run: each table's cutoff is fixed when
    /// its pass starts.
    pub async fn purge(&self) -> Result<PurgeReport, PurgeError> {
        self.pass(false, &mut |_| ControlFlow::Continue(())).await
    }

    /// As [`purge`](Self::purge), calling `observe` after each batch with the running
    /// totals of the table being purged, and again after each pause between batches (with
    /// the same totals). [`ControlFlow::Break`] stops the purge there, before another batch:
    /// every batch so far is committed, none is half done, and the report says it
    /// [stopped](PurgeReport::stopped). An operator's tool draws its progress and stops on
    /// Ctrl-C with it.
    ///
    /// ```no_run
    /// use std::ops::ControlFlow;
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// use tower_inbox::retention::Purger;
    ///
    /// # async fn run(purger: Purger, interrupted: &AtomicBool) -> Result<(), Box<dyn std::error::Error>> {
    /// let report = purger
    ///     .purge_observed(|table| {
    ///         eprintln!("{}: {} rows", table.table, table.rows);
    ///         if interrupted.load(Ordering::Relaxed) {
    ///             ControlFlow::Break(())
    ///         } else {
    ///             ControlFlow::Continue(())
    ///         }
    ///     })
    ///     .await?;
    /// println!("{report}");
    /// # Ok(()) }
    /// ```
    pub async fn purge_observed(
        &self,
        mut observe: impl FnMut(&TablePurge) -> ControlFlow<()> + Send,
    ) -> Result<PurgeReport, PurgeError> {
        self.pass(false, &mut observe).await
    }

    /// Counts what [`purge`](Self::purge) would delete now, per table, with the cutoffs;
    /// deletes nothing and takes no row locks. Its lock waits are bounded like the purge's.
    pub async fn dry_run(&self) -> Result<PurgeReport, PurgeError> {
        self.pass(true, &mut |_| ControlFlow::Continue(())).await
    }

    /// Purges now and then every `period` until `shutdown` completes, like a session
    /// store's expired-session deletion task.
    ///
    /// A failed run is logged and the next one comes a period later: a database outage
    /// neither ends the task nor makes it spin. A run that takes longer than the period
    /// delays the next one rather than bunching runs up. On shutdown it stops at once; a
    /// batch in flight rolls back (each batch is its own transaction, so nothing is left
    /// half done). The only error is a zero `period`.
    pub async fn run(
        self,
        period: Duration,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), RetentionError> {
        check_duration("the purge period", period)?;
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                _ = ticks.tick() => {}
            }
            let result = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                result = self.purge() => result,
            };
            match result {
                Ok(report) if report.total_rows() > 0 => {
                    tracing::info!(rows = report.total_rows(), "retention purge deleted rows");
                }
                Ok(_) => tracing::debug!("retention purge found nothing to delete"),
                Err(err) => tracing::warn!(
                    error = %err,
                    table = %err.table,
                    ?period,
                    "retention purge failed; trying again next period"
                ),
            }
        }
    }

    async fn pass(
        &self,
        dry_run: bool,
        observe: &mut (dyn FnMut(&TablePurge) -> ControlFlow<()> + Send),
    ) -> Result<PurgeReport, PurgeError> {
        let mut report = PurgeReport {
            dry_run,
            tables: Vec::with_capacity(self.targets.len()),
            stopped: false,
        };
        for target in &self.targets {
            let span = tracing::info_span!(
                "retention.purge",
                table = target.table.as_str(),
                cutoff = tracing::field::Empty,
                rows = tracing::field::Empty,
                dry_run,
            );
            let (purged, stopped) = self
                .purge_table(target, dry_run, observe)
                .instrument(span)
                .await
                .map_err(|(source, rows)| PurgeError {
                    table: target.table,
                    deleted: report.total_rows() + rows,
                    source,
                })?;
            report.tables.push(purged);
            if stopped {
                report.stopped = true;
                break;
            }
        }
        Ok(report)
    }

    /// One table, in the current `retention.purge` span, and whether `observe` stopped it.
    /// On failure, also the rows it had deleted.
    async fn purge_table(
        &self,
        target: &Target,
        dry_run: bool,
        observe: &mut (dyn FnMut(&TablePurge) -> ControlFlow<()> + Send),
    ) -> Result<(TablePurge, bool), (InboxError, u64)> {
        let span = tracing::Span::current();
        let cutoff: OffsetDateTime = sqlx::query_scalar(sql::CUTOFF)
            .bind(target.window.as_secs_f64())
            .fetch_one(self.db())
            .await
            .map_err(|e| (InboxError::classify(e), 0))?;
        span.record("cutoff", tracing::field::display(cutoff));
        let mut purged = TablePurge {
            table: target.table,
            cutoff,
            rows: 0,
            batches: 0,
        };
        let partitioned = match self.schema.layout() {
            Layout::Plain => None,
            Layout::Partitioned => Partitioned::of(target.table),
        };
        if let Some(table) = partitioned {
            let flow = self
                .drop_partitions(table, cutoff, dry_run, &mut purged, observe)
                .await
                .map_err(|e| (e, purged.rows))?;
            if flow.is_break() {
                span.record("rows", purged.rows);
                return Ok((purged, true));
            }
        }
        for statement in target.statements {
            if dry_run {
                let rows = self
                    .count_rows(statement.count, cutoff)
                    .await
                    .map_err(|e| (e, 0))?;
                purged.rows += rows;
                continue;
            }
            loop {
                let rows = self
                    .delete_batch(statement.delete, cutoff)
                    .await
                    .map_err(|e| (e, purged.rows))?;
                target.table.count_purged(rows);
                purged.rows += rows;
                purged.batches += 1;
                if observe(&purged).is_break() {
                    span.record("rows", purged.rows);
                    return Ok((purged, true));
                }
                // A short batch means the set is exhausted, or what is left is locked by
                // someone else right now: either way, the next run takes it.
                if rows < self.batch_size.unsigned_abs() {
                    break;
                }
                if !self.pause.is_zero() {
                    tokio::time::sleep(self.pause).await;
                    // Asked again after the pause: a stop that came during it is honoured
                    // before another batch starts.
                    if observe(&purged).is_break() {
                        span.record("rows", purged.rows);
                        return Ok((purged, true));
                    }
                }
            }
        }
        span.record("rows", purged.rows);
        Ok((purged, false))
    }

    /// The pool for this component's statements: each within the crate's statement deadline,
    /// sent as the schema's [`Pooling`](crate::schema::Pooling) needs.
    fn db(&self) -> Guarded<'_> {
        Guarded::for_schema(&self.pool, &self.schema)
    }

    /// A transaction whose lock waits are bounded by the lock timeout.
    async fn begin(&self) -> Result<OwnedTx, InboxError> {
        let mut tx = self
            .db()
            .begin("BEGIN")
            .await
            .map_err(InboxError::classify)?;
        sqlx::query(sql::LOCK_TIMEOUT)
            .bind(&self.lock_timeout)
            .execute(&mut tx)
            .await
            .map_err(InboxError::classify)?;
        Ok(tx)
    }

    /// Counts without locking rows.
    async fn count_rows(
        &self,
        statement: &'static str,
        cutoff: OffsetDateTime,
    ) -> Result<u64, InboxError> {
        let mut tx = self.begin().await?;
        let statement = self.schema.sql(statement);
        let rows: i64 = sqlx::query_scalar(&statement)
            .bind(cutoff)
            .fetch_one(&mut tx)
            .await
            .map_err(InboxError::classify)?;
        tx.rollback().await.map_err(InboxError::classify)?;
        Ok(u64::try_from(rows).unwrap_or(0))
    }

    async fn delete_batch(
        &self,
        statement: &'static str,
        cutoff: OffsetDateTime,
    ) -> Result<u64, InboxError> {
        let mut tx = self.begin().await?;
        let statement = self.schema.sql(statement);
        let deleted = sqlx::query(&statement)
            .bind(cutoff)
            .bind(self.batch_size)
            .execute(&mut tx)
            .await
            .map_err(InboxError::classify)?
            .rows_affected();
        tx.commit().await.map_err(InboxError::classify)?;
        Ok(deleted)
    }
}
