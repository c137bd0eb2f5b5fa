//! The periodic stats task: gauges that only the database can answer (sizes and ages).
//! (Over 400 lines: each gauge's statement sits beside the one read that uses it.)

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;
use tracing::Instrument;

use super::{set, MetricLabels};

crate::db::database_error!(
    /// A failed collection of the stats.
    StatsError,
    "the stats"
);

/// [`StatsTask::run`] was given a zero period: it would read the statistics back to back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the stats period must be positive")]
pub struct ZeroPeriod;
use crate::connection::Guarded;
use crate::quarantine::QuarantineSource;
use crate::schema::Schema;

/// Inbox rows per consumer, estimated from the planner's statistics, for each consumer that
/// has rows: the consumers are listed by skipping through the primary key (one index probe
/// per consumer, `c`), the table's row count is `reltuples` (which `VACUUM` and `ANALYZE`
/// keep), and a consumer's share of it is its frequency among the most common values of
/// `consumer_name` (`pg_stats`, which `ANALYZE` keeps), or else an even part of what those
/// leave to the other distinct values, as the planner estimates it. No row outside the
/// consumers' first index entries is read. Nothing when the table has never been analyzed.
const INBOX_ROWS_ESTIMATE: &str = "\
with recursive c as ( \
    (select consumer_name from tower_inbox.consumer_inbox order by consumer_name limit 1) \
    union all \
    select (select i.consumer_name from tower_inbox.consumer_inbox i \
            where i.consumer_name > c.consumer_name order by i.consumer_name limit 1) \
    from c where c.consumer_name is not null \
), t as ( \
    select cl.reltuples, n.nspname, cl.relname \
    from pg_catalog.pg_class cl \
    join pg_catalog.pg_namespace n on n.oid = cl.relnamespace \
    where cl.oid = pg_catalog.to_regclass('tower_inbox.consumer_inbox') and cl.reltuples >= 0 \
), st as ( \
    select coalesce(s.most_common_vals::text::text[], '{}') as vals, \
           coalesce(s.most_common_freqs, '{}') as freqs, \
           case when s.n_distinct < 0 then -s.n_distinct * t.reltuples else s.n_distinct end \
               as distinct_values, \
           t.reltuples \
    from t join pg_catalog.pg_stats s \
        on s.schemaname = t.nspname and s.tablename = t.relname and s.attname = 'consumer_name' \
) \
select c.consumer_name, pg_catalog.round(st.reltuples * coalesce( \
           (select m.freq from rows from (pg_catalog.unnest(st.vals), pg_catalog.unnest(st.freqs)) \
                as m(consumer, freq) \
            where m.consumer = c.consumer_name), \
           (1 - (select coalesce(pg_catalog.sum(f), 0) from pg_catalog.unnest(st.freqs) f)) \
               / greatest(st.distinct_values - pg_catalog.cardinality(st.vals), 1) \
       ))::int8 \
from c cross join st \
where c.consumer_name is not null \
order by c.consumer_name";

/// How many rows [`INBOX_ROWS_COUNTED`] and [`INBOX_OLDEST`] read at most.
const BOUND: i64 = 10_000;

/// Inbox rows per consumer, counted among at most [`BOUND`] rows (`$1`): exact for a table
/// that small, which is what a table no `ANALYZE` has seen yet usually is.
const INBOX_ROWS_COUNTED: &str = "\
select consumer_name, pg_catalog.count(*)::int8 \
from (select consumer_name from tower_inbox.consumer_inbox limit $1) s \
group by consumer_name order by consumer_name";

/// The age of each consumer's oldest row among the [`BOUND`] oldest rows (`$1`, read from
/// the `received_at` index), and the age of the youngest of those rows when there were that
/// many: every row not read is younger than it.
const INBOX_OLDEST: &str = "\
with w as ( \
    select consumer_name, received_at from tower_inbox.consumer_inbox \
    order by received_at limit $1 \
) \
select consumer_name, \
       extract(epoch from pg_catalog.now() - pg_catalog.min(received_at))::float8, \
       case when (select pg_catalog.count(*) from w) >= $1 \
            then extract(epoch from pg_catalog.now() - (select pg_catalog.max(received_at) from w))::float8 \
       end \
from w group by consumer_name";

const INBOX_BYTES: &str = "\
select coalesce(pg_catalog.pg_total_relation_size( \
           pg_catalog.to_regclass('tower_inbox.consumer_inbox')), 0)::int8";

/// [`INBOX_BYTES`] for the partitioned layout: a partitioned table has no storage of its
/// own, its partitions have it.
const INBOX_BYTES_PARTITIONED: &str = "\
select coalesce(pg_catalog.sum(pg_catalog.pg_total_relation_size(p.relid)), 0)::int8 \
from pg_catalog.pg_partition_tree(pg_catalog.to_regclass('tower_inbox.consumer_inbox')) p \
where p.isleaf";

const OUTBOX: &str = "\
select pg_catalog.count(*)::int8, \
       coalesce(extract(epoch from pg_catalog.now() - pg_catalog.min(created_at)), 0)::float8 \
from tower_inbox.message_outbox where status = 'pending'";

/// Transactions of this database that hold uncommitted writes to the inbox: claims in
/// flight (and purge batches, which last milliseconds). A claim's row is invisible to
/// everyone else until its commit, so its lock on the table is what shows it. Reads only
/// PostgreSQL's in-memory activity and lock tables, not the inbox.
const IN_FLIGHT: &str = "\
select pg_catalog.count(*)::int8, \
       coalesce(extract(epoch from pg_catalog.max( \
           pg_catalog.clock_timestamp() - a.xact_start)), 0)::float8 \
from pg_catalog.pg_stat_activity a \
where a.pid <> pg_catalog.pg_backend_pid() \
  and a.datname = pg_catalog.current_database() \
  and exists (select from pg_catalog.pg_locks l \
              where l.pid = a.pid and l.locktype = 'relation' and l.granted \
                and l.database = a.datid and l.mode = 'RowExclusiveLock' \
                and l.relation = pg_catalog.to_regclass('tower_inbox.consumer_inbox'))";

const QUARANTINE: &str = "\
select source, pg_catalog.count(*)::int8 from tower_inbox.inbox_quarantine \
where decision is null group by source";

/// The inbox rows of one consumer.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerStats {
    /// The consumer name as stored (with `@<version>` under a versioned projection).
    pub consumer: String,
    /// Its rows.
    pub rows: i64,
    /// The age of its oldest row.
    pub oldest_row_age: Duration,
}

/// What one collection read, also set as gauges.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stats {
    /// Inbox rows and oldest age, per consumer.
    pub inbox: Vec<ConsumerStats>,
    /// The inbox table's size on disk with indexes and TOAST, in bytes.
    pub inbox_table_bytes: i64,
    /// Transactions holding uncommitted inbox writes: claims in flight.
    pub claims_in_flight: i64,
    /// How long the oldest of them has been open (zero when none is).
    pub oldest_claim_in_flight_age: Duration,
    /// Effects committed and not yet delivered or dead.
    pub outbox_pending: i64,
    /// The age of the oldest pending effect (zero when none is pending).
    pub outbox_oldest_pending_age: Duration,
    /// Quarantined items without a decision, per source (every source, zeros included).
    pub quarantine_open: Vec<(QuarantineSource, i64)>,
}

/// Reads sizes and ages from the database and sets the gauges [`INBOX_ROWS`](super::INBOX_ROWS),
/// [`INBOX_OLDEST_AGE`](super::INBOX_OLDEST_AGE), [`INBOX_TABLE_BYTES`](super::INBOX_TABLE_BYTES),
/// [`CLAIMS_IN_FLIGHT`](super::CLAIMS_IN_FLIGHT),
/// [`OLDEST_CLAIM_IN_FLIGHT_AGE`](super::OLDEST_CLAIM_IN_FLIGHT_AGE),
/// [`OUTBOX_PENDING`](super::OUTBOX_PENDING),
/// [`OUTBOX_OLDEST_PENDING_AGE`](super::OUTBOX_OLDEST_PENDING_AGE) and
/// [`QUARANTINE_OPEN`](super::QUARANTINE_OPEN).
///
/// No gauge reads more than a bounded number of rows, however large the inbox grows:
///
/// * **inbox rows** per consumer are an estimate from the planner's statistics: the table's
///   row count as of its last `VACUUM` or `ANALYZE`, times the consumer's share of
///   `consumer_name` as of its last `ANALYZE` (its frequency when it is among the 100 most
///   common values, `default_statistics_target`; else an even part of the rest). Autovacuum
///   analyzes the table after about a tenth of it changed
///   (`autovacuum_analyze_scale_factor`), so the estimate is within about that of the truth.
///   The consumers themselves are listed exactly, one primary-key probe each. A table never
///   analyzed is counted exactly among its first 10 000 rows instead;
/// * the **oldest row age** per consumer is exact for every consumer with a row among the
///   10 000 oldest rows (read from the `received_at` index); any other consumer's oldest row
///   is younger than the youngest of those, whose age it is given: an upper bound;
/// * **claims in flight** and the oldest one's age are read from PostgreSQL's activity and
///   lock views (`pg_stat_activity`, `pg_locks`), not from the inbox: a claim's row is not
///   visible before its commit, its transaction's lock on the table is. They count the
///   transactions of this database holding uncommitted inbox writes (a purge batch too,
///   for its few milliseconds), for every consumer together, and their age is the
///   transaction's. Another role's transactions are counted, but their start time shows
///   only to a member of `pg_read_all_stats` (or a superuser): without it their age is
///   missing from the oldest one's. Run the stats task as the role the service uses, or
///   give its role that membership;
/// * **outbox pending** and its oldest age, and **open quarantine items**, are exact: they
///   read only pending effects and undecided items, through their partial indexes, so they
///   cost as much as the backlog, not the table;
/// * the inbox table's size is the relation's size, read without scanning.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_inbox::metrics::StatsTask;
///
/// # async fn start(pool: sqlx::PgPool) {
/// let stats = StatsTask::new(pool);
/// tokio::spawn(stats.run(Duration::from_secs(60), std::future::pending::<()>()));
/// # }
/// ```
#[derive(Debug)]
pub struct StatsTask {
    pool: PgPool,
    schema: Schema,
    labels: MetricLabels,
    /// Consumers reported before: a consumer whose rows are all gone is set to zero
    /// rather than left at its last value.
    seen: BTreeSet<String>,
}

impl StatsTask {
    /// Stats over `pool`, with the consumer label on the per-consumer gauges.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            schema: Schema::default(),
            labels: MetricLabels::default(),
            seen: BTreeSet::new(),
        }
    }

    /// The tables are in `schema` instead of the default one.
    pub fn with_schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// Without the consumer label ([`MetricLabels::none`]) the per-consumer gauges are
    /// summed into one series (the oldest age is the oldest of all).
    pub fn with_metric_labels(mut self, labels: MetricLabels) -> Self {
        self.labels = labels;
        self
    }

    /// The pool for this component's statements: each within the crate's statement deadline,
    /// sent as the schema's [`Pooling`](crate::schema::Pooling) needs.
    fn db(&self) -> Guarded<'_> {
        Guarded::for_schema(&self.pool, &self.schema)
    }

    /// Reads the stats once and sets the gauges.
    pub async fn collect(&mut self) -> Result<Stats, StatsError> {
        let stats = self
            .read()
            .instrument(tracing::info_span!("inbox.stats"))
            .await?;
        self.publish(&stats);
        Ok(stats)
    }

    async fn read(&self) -> Result<Stats, StatsError> {
        let classify = StatsError::from;
        let mut rows: Vec<(String, i64)> = sqlx::query_as(&self.schema.sql(INBOX_ROWS_ESTIMATE))
            .fetch_all(self.db())
            .await
            .map_err(classify)?;
        if rows.is_empty() {
            rows = sqlx::query_as(&self.schema.sql(INBOX_ROWS_COUNTED))
                .bind(BOUND)
                .fetch_all(self.db())
                .await
                .map_err(classify)?;
        }
        let oldest: Vec<(String, f64, Option<f64>)> =
            sqlx::query_as(&self.schema.sql(INBOX_OLDEST))
                .bind(BOUND)
                .fetch_all(self.db())
                .await
                .map_err(classify)?;
        // A consumer with no row among the oldest read is younger than the youngest of them.
        let bound = oldest
            .first()
            .and_then(|(_, _, bound)| *bound)
            .unwrap_or(0.0);
        let inbox = rows
            .into_iter()
            .map(|(consumer, rows)| {
                let age = oldest
                    .iter()
                    .find(|(c, _, _)| *c == consumer)
                    .map_or(bound, |(_, age, _)| *age);
                (consumer, rows, age)
            })
            .collect::<Vec<_>>();
        let inbox_table_bytes: i64 =
            sqlx::query_scalar(&self.schema.sql_for(INBOX_BYTES, INBOX_BYTES_PARTITIONED))
                .fetch_one(self.db())
                .await
                .map_err(classify)?;
        let (claims_in_flight, in_flight_age): (i64, f64) =
            sqlx::query_as(&self.schema.sql(IN_FLIGHT))
                .fetch_one(self.db())
                .await
                .map_err(classify)?;
        let (outbox_pending, outbox_age): (i64, f64) = sqlx::query_as(&self.schema.sql(OUTBOX))
            .fetch_one(self.db())
            .await
            .map_err(classify)?;
        let quarantine: Vec<(String, i64)> = sqlx::query_as(&self.schema.sql(QUARANTINE))
            .fetch_all(self.db())
            .await
            .map_err(classify)?;

        let stats = Stats {
            inbox: inbox
                .into_iter()
                .map(|(consumer, rows, age)| ConsumerStats {
                    consumer,
                    rows,
                    oldest_row_age: seconds(age),
                })
                .collect(),
            inbox_table_bytes,
            claims_in_flight,
            oldest_claim_in_flight_age: seconds(in_flight_age),
            outbox_pending,
            outbox_oldest_pending_age: seconds(outbox_age),
            quarantine_open: QuarantineSource::ALL
                .iter()
                .map(|&source| {
                    let open = quarantine
                        .iter()
                        .find(|(s, _)| s == source.as_str())
                        .map_or(0, |(_, n)| *n);
                    (source, open)
                })
                .collect(),
        };
        Ok(stats)
    }

    fn publish(&mut self, stats: &Stats) {
        if self.labels.has_consumer() {
            let now: BTreeSet<String> = stats.inbox.iter().map(|c| c.consumer.clone()).collect();
            for gone in self.seen.difference(&now) {
                let labels = self.labels.of_consumer(gone);
                set(super::INBOX_ROWS, &labels, 0.0);
                set(super::INBOX_OLDEST_AGE, &labels, 0.0);
            }
            for c in &stats.inbox {
                let labels = self.labels.of_consumer(&c.consumer);
                set(super::INBOX_ROWS, &labels, c.rows as f64);
                set(
                    super::INBOX_OLDEST_AGE,
                    &labels,
                    c.oldest_row_age.as_secs_f64(),
                );
            }
            self.seen = now;
        } else {
            let rows: i64 = stats.inbox.iter().map(|c| c.rows).sum();
            let oldest = stats.inbox.iter().map(|c| c.oldest_row_age).max();
            set(super::INBOX_ROWS, &[], rows as f64);
            set(
                super::INBOX_OLDEST_AGE,
                &[],
                oldest.unwrap_or_default().as_secs_f64(),
            );
        }
        set(
            super::INBOX_TABLE_BYTES,
            &[],
            stats.inbox_table_bytes as f64,
        );
        set(super::CLAIMS_IN_FLIGHT, &[], stats.claims_in_flight as f64);
        set(
            super::OLDEST_CLAIM_IN_FLIGHT_AGE,
            &[],
            stats.oldest_claim_in_flight_age.as_secs_f64(),
        );
        set(super::OUTBOX_PENDING, &[], stats.outbox_pending as f64);
        set(
            super::OUTBOX_OLDEST_PENDING_AGE,
            &[],
            stats.outbox_oldest_pending_age.as_secs_f64(),
        );
        for (source, open) in &stats.quarantine_open {
            ::metrics::gauge!(super::QUARANTINE_OPEN, "source" => source.as_str())
                .set(*open as f64);
        }
    }

    /// Collects every `period` until `shutdown` completes. A failed collection is logged
    /// and the gauges keep their last values until the next one succeeds. A zero `period`
    /// is refused at once: it would scan the inbox back to back.
    pub async fn run(
        mut self,
        period: Duration,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ZeroPeriod> {
        if period.is_zero() {
            return Err(ZeroPeriod);
        }
        tokio::pin!(shutdown);
        loop {
            if let Err(err) = self.collect().await {
                tracing::warn!(error = %err, "inbox stats collection failed; trying again next period");
            }
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                () = &mut shutdown => return Ok(()),
            }
        }
    }
}

fn seconds(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or_default()
}
