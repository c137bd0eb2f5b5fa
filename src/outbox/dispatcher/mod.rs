mod builder;
mod delivery;

use builder::Settings;
pub use builder::{DispatcherBuilder, DispatcherConfigError};
use delivery::effect_from_row;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use sqlx::postgres::PgListener;

use crate::connection::Guarded;
use sqlx::PgPool;

use super::Transport;
use super::{sql, Effect, OutboxError};
use crate::metrics as m;

/// The channel enqueues notify on commit.
const CHANNEL: &str = "tower_inbox_outbox";

/// What one round of [`Dispatcher::dispatch_due`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DispatchReport {
    /// Rows leased.
    pub leased: usize,
    /// Delivered and recorded.
    pub delivered: usize,
    /// Scheduled for another attempt.
    pub retried: usize,
    /// Moved to dead letters (and the quarantine).
    pub dead: usize,
    /// Dead effects, repaired earlier, now delivered.
    pub recovered: usize,
    /// Leases given back unattempted because the dispatcher is stopping.
    pub released: usize,
    /// Leases lost before the send began: the batch's lease ran out while the effect waited
    /// for its turn and another dispatcher took it. Not attempted here.
    pub lost: usize,
    /// Outcomes not recorded because the lease had expired and another dispatcher took the
    /// effect (it delivers again, with the same key), or the database failed.
    pub unrecorded: usize,
}

impl DispatchReport {
    /// Counts one effect's delivery attempt by outcome (a report of a single effect).
    fn count_deliveries(&self, effect: &str) {
        let outcomes = [
            ("delivered", self.delivered),
            ("retry", self.retried),
            ("dead", self.dead),
            ("released", self.released),
            ("lost", self.lost),
            ("unrecorded", self.unrecorded),
        ];
        for (outcome, n) in outcomes {
            if n > 0 {
                ::metrics::counter!(m::OUTBOX_DELIVERIES, "effect" => effect.to_owned(), "outcome" => outcome)
                    .increment(n as u64);
            }
        }
    }

    fn add(&mut self, other: Self) {
        self.leased += other.leased;
        self.delivered += other.delivered;
        self.retried += other.retried;
        self.dead += other.dead;
        self.recovered += other.recovered;
        self.released += other.released;
        self.lost += other.lost;
        self.unrecorded += other.unrecorded;
    }
}

/// Delivers due outbox effects through a [`Transport`]. Run any number at once, in one
/// process or many: each leases its own rows with `FOR UPDATE SKIP LOCKED`.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_inbox::outbox::{Dispatcher, HttpTransport};
///
/// # async fn start(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let transport = HttpTransport::new(Duration::from_secs(5))?;
/// let dispatcher = Dispatcher::builder(pool, transport)
///     .delivery_timeout(Duration::from_secs(5))
///     .lease(Duration::from_secs(20))
///     .build()?;
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let task = tokio::spawn(dispatcher.run(async { let _ = stopped.await; }));
/// // ... on shutdown:
/// let _ = stop.send(());
/// task.await??;
/// # Ok(()) }
/// ```
pub struct Dispatcher<T> {
    pool: PgPool,
    transport: Arc<T>,
    settings: Arc<Settings>,
    leases: Arc<AtomicU64>,
}

impl<T> Clone for Dispatcher<T> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            transport: self.transport.clone(),
            settings: self.settings.clone(),
            leases: self.leases.clone(),
        }
    }
}

impl<T> std::fmt::Debug for Dispatcher<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("instance", &self.settings.instance)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Dispatcher<T> {
    /// Leases one batch of due effects, delivers them and records each outcome. Each send
    /// renews its effect's lease right before it starts and is skipped if another dispatcher
    /// took the effect meanwhile. Returns what it did; an empty report means nothing was due.
    pub async fn dispatch_due(&self) -> Result<DispatchReport, OutboxError> {
        self.dispatch_batch(&AtomicBool::new(false)).await
    }

    /// Runs until `shutdown` completes: wakes on every committed enqueue (`LISTEN`), when the
    /// next retry is due, and at least every poll interval. Through a transaction-mode pooler
    /// ([`Pooling::Transaction`](crate::schema::Pooling::Transaction)) it does not `LISTEN`
    /// and finds new effects by polling alone. On shutdown it finishes the
    /// deliveries in flight (each bounded by the delivery timeout) and gives back the leases
    /// it has not started on.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), OutboxError> {
        let stopping = AtomicBool::new(false);
        let mut listener = self.listen().await;
        tokio::pin!(shutdown);
        loop {
            let batch = self.dispatch_batch(&stopping);
            tokio::pin!(batch);
            let report = tokio::select! {
                report = &mut batch => report,
                () = &mut shutdown => {
                    stopping.store(true, Ordering::SeqCst);
                    let report = batch.await;
                    if let Err(err) = &report {
                        tracing::warn!(error = %err, "outbox batch failed while stopping");
                    }
                    return Ok(());
                }
            };
            let full = match report {
                Ok(report) => report.leased as i64 == self.settings.batch_size,
                Err(err) => {
                    tracing::warn!(error = %err, "outbox dispatch failed; retrying after the poll interval");
                    false
                }
            };
            if full {
                continue;
            }
            // Never spin: rows can be due yet locked by another dispatcher's lease.
            let wait = self.until_next_due().await.max(Duration::from_millis(10));
            let woken = async {
                match listener.as_mut() {
                    Some(l) => {
                        if let Err(err) = l.recv().await {
                            tracing::warn!(error = %err, "outbox listener failed; polling");
                            tokio::time::sleep(wait).await;
                        }
                    }
                    None => tokio::time::sleep(wait).await,
                }
            };
            tokio::select! {
                () = woken => {}
                () = tokio::time::sleep(wait) => {}
                () = &mut shutdown => return Ok(()),
            }
        }
    }

    /// The pool for the dispatcher's own statements: each within the crate's statement
    /// deadline (10 s), on a connection closed rather than returned if it misses it, so a
    /// half-open connection cannot stop the deliveries for good.
    fn db(&self) -> Guarded<'_> {
        Guarded::for_schema(&self.pool, &self.settings.schema)
    }

    async fn listen(&self) -> Option<PgListener> {
        // A transaction-mode pooler hands the listening session's server connection to other
        // clients between statements: the notifications would reach them, not this one.
        if self.settings.schema.pooling().per_transaction() {
            return None;
        }
        let result = async {
            let mut listener = PgListener::connect_with(&self.pool).await?;
            listener.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        }
        .await;
        match result {
            Ok(listener) => Some(listener),
            Err(err) => {
                tracing::warn!(error = %err, "cannot LISTEN for outbox wake-ups; polling only");
                None
            }
        }
    }

    async fn until_next_due(&self) -> Duration {
        let poll = self.settings.poll_interval;
        let next: Result<Option<f64>, _> =
            sqlx::query_scalar(&self.settings.schema.sql(sql::NEXT_DUE))
                .fetch_one(self.db())
                .await;
        match next {
            Ok(Some(secs)) if secs.is_finite() => {
                Duration::try_from_secs_f64(secs.max(0.0)).map_or(poll, |d| d.min(poll))
            }
            _ => poll,
        }
    }

    async fn dispatch_batch(&self, stopping: &AtomicBool) -> Result<DispatchReport, OutboxError> {
        if stopping.load(Ordering::SeqCst) {
            return Ok(DispatchReport::default());
        }
        let token = format!(
            "{}/{}",
            self.settings.instance,
            self.leases.fetch_add(1, Ordering::Relaxed)
        );
        let rows = sqlx::query(&self.settings.schema.sql(sql::LEASE))
            .bind(self.settings.batch_size)
            .bind(&token)
            .bind(self.settings.lease.as_secs_f64())
            .fetch_all(self.db())
            .await
            .map_err(OutboxError::from)?;
        let mut report = DispatchReport {
            leased: rows.len(),
            ..DispatchReport::default()
        };
        let effects: Vec<Effect> = rows.iter().map(effect_from_row).collect::<Result<_, _>>()?;
        let outcomes: Vec<DispatchReport> = stream::iter(effects)
            .map(|effect| self.deliver_one(effect, &token, stopping))
            .buffer_unordered(self.settings.concurrency)
            .collect()
            .await;
        for outcome in outcomes {
            report.add(outcome);
        }
        Ok(report)
    }
}
