//! The periodic stats task: gauges that only the database can answer (sizes and ages).

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;
use tracing::Instrument;

use super::{set, MetricLabels};
use crate::inbox::InboxError;
use crate::middleware::ConfigError;
use crate::quarantine::QuarantineSource;
use crate::schema::Schema;

const INBOX: &str = "\
select consumer_name, pg_catalog.count(*)::int8, \
       extract(epoch from pg_catalog.now() - pg_catalog.min(received_at))::float8 \
from tower_inbox.consumer_inbox group by consumer_name order by consumer_name";

const INBOX_BYTES: &str = "\
select coalesce(pg_catalog.pg_total_relation_size( \
           pg_catalog.to_regclass('tower_inbox.consumer_inbox')), 0)::int8";

const OUTBOX: &str = "\
select pg_catalog.count(*)::int8, \
       coalesce(extract(epoch from pg_catalog.now() - pg_catalog.min(created_at)), 0)::float8 \
from tower_inbox.message_outbox where status = 'pending'";

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
    /// Effects committed and not yet delivered or dead.
    pub outbox_pending: i64,
    /// The age of the oldest pending effect (zero when none is pending).
    pub outbox_oldest_pending_age: Duration,
    /// Quarantined items without a decision, per source (every source, zeros included).
    pub quarantine_open: Vec<(QuarantineSource, i64)>,
}

/// Reads sizes and ages from the database and sets the gauges [`INBOX_ROWS`](super::INBOX_ROWS),
/// [`INBOX_OLDEST_AGE`](super::INBOX_OLDEST_AGE), [`INBOX_TABLE_BYTES`](super::INBOX_TABLE_BYTES),
/// [`OUTBOX_PENDING`](super::OUTBOX_PENDING),
/// [`OUTBOX_OLDEST_PENDING_AGE`](super::OUTBOX_OLDEST_PENDING_AGE) and
/// [`QUARANTINE_OPEN`](super::QUARANTINE_OPEN).
///
/// Counting inbox rows per consumer scans the table: on a very large inbox run it rarely
/// (minutes, not seconds).
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

    /// Reads the stats once and sets the gauges.
    pub async fn collect(&mut self) -> Result<Stats, InboxError> {
        let stats = self
            .read()
            .instrument(tracing::info_span!("inbox.stats"))
            .await?;
        self.publish(&stats);
        Ok(stats)
    }

    async fn read(&self) -> Result<Stats, InboxError> {
        let classify = InboxError::classify;
        let inbox: Vec<(String, i64, f64)> = sqlx::query_as(&self.schema.sql(INBOX))
            .fetch_all(&self.pool)
            .await
            .map_err(classify)?;
        let inbox_table_bytes: i64 = sqlx::query_scalar(&self.schema.sql(INBOX_BYTES))
            .fetch_one(&self.pool)
            .await
            .map_err(classify)?;
        let (outbox_pending, outbox_age): (i64, f64) = sqlx::query_as(&self.schema.sql(OUTBOX))
            .fetch_one(&self.pool)
            .await
            .map_err(classify)?;
        let quarantine: Vec<(String, i64)> = sqlx::query_as(&self.schema.sql(QUARANTINE))
            .fetch_all(&self.pool)
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
    ) -> Result<(), ConfigError> {
        if period.is_zero() {
            return Err(ConfigError::BadLimit("the stats period must be positive"));
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
