use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use futures_util::FutureExt;
use sqlx::postgres::{PgListener, PgRow};
use sqlx::{PgPool, Row};
use tracing::Instrument;

use super::transport::{Delivery, Transport};
use super::{sql, Effect, EffectId};
use crate::inbox::{quarantine_moved, quarantine_recovered, InboxError};
use crate::metrics as m;
use crate::middleware::ConfigError;
use crate::quarantine::{effect_item_key, QuarantineSource};
use crate::schema::Schema;

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

struct Settings {
    schema: Schema,
    instance: String,
    batch_size: i64,
    concurrency: usize,
    lease: Duration,
    delivery_timeout: Duration,
    backoff_base: Duration,
    backoff_cap: Duration,
    max_attempts: i32,
    poll_interval: Duration,
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

/// Configures a [`Dispatcher`].
#[must_use]
pub struct DispatcherBuilder<T> {
    pool: PgPool,
    transport: T,
    settings: Settings,
}

impl<T: Transport> Dispatcher<T> {
    /// Starts a dispatcher over `pool` delivering through `transport`.
    ///
    /// Defaults: batches of 32, 8 deliveries at once, 10 s delivery timeout, 30 s lease,
    /// backoff from 1 s doubling to at most 5 min with jitter, 10 attempts, polling every 5 s
    /// when no notification arrives.
    pub fn builder(pool: PgPool, transport: T) -> DispatcherBuilder<T> {
        DispatcherBuilder {
            pool,
            transport,
            settings: Settings {
                schema: Schema::default(),
                instance: format!(
                    "dispatcher-{}-{:08x}",
                    std::process::id(),
                    fastrand::u32(..)
                ),
                batch_size: 32,
                concurrency: 8,
                lease: Duration::from_secs(30),
                delivery_timeout: Duration::from_secs(10),
                backoff_base: Duration::from_secs(1),
                backoff_cap: Duration::from_secs(300),
                max_attempts: 10,
                poll_interval: Duration::from_secs(5),
            },
        }
    }
}

impl<T: Transport> DispatcherBuilder<T> {
    /// The outbox is in `schema` instead of the default one.
    pub fn schema(mut self, schema: Schema) -> Self {
        self.settings.schema = schema;
        self
    }

    /// A name for this instance, used in lease owners and logs.
    pub fn instance(mut self, name: impl Into<String>) -> Self {
        self.settings.instance = name.into();
        self
    }

    /// How many due rows one round leases.
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.settings.batch_size = i64::from(rows);
        self
    }

    /// How many deliveries this instance runs at once.
    pub fn concurrency(mut self, deliveries: usize) -> Self {
        self.settings.concurrency = deliveries;
        self
    }

    /// How long a lease lasts. Each delivery renews its effect's lease right before its send,
    /// so the lease must outlast one delivery (the delivery timeout) and the recording of its
    /// outcome, which happens only while the lease holds; when the instance dies, its effects
    /// are retried by another after at most this long.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease;
        self
    }

    /// The bound on one delivery; running over is an ambiguous outcome. It must be at least
    /// the transport's own bound ([`Transport::call_timeout`]), so that a transport that has
    /// its answer always returns it before the dispatcher gives up on the call.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.settings.delivery_timeout = timeout;
        self
    }

    /// The first retry delay and the largest one. Each failure doubles the delay up to the
    /// cap; the actual delay is drawn between half and all of it, so failing effects spread
    /// out instead of retrying in lockstep.
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.settings.backoff_base = base;
        self.settings.backoff_cap = cap;
        self
    }

    /// Attempts before an effect is moved to dead letters.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.settings.max_attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
        self
    }

    /// How often [`Dispatcher::run`] looks for due rows without a notification.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// Checks the settings.
    pub fn build(self) -> Result<Dispatcher<T>, ConfigError> {
        let s = &self.settings;
        if s.batch_size == 0 || s.concurrency == 0 || s.max_attempts == 0 {
            return Err(ConfigError::BadLimit(
                "batch size, concurrency and attempts must be positive",
            ));
        }
        if s.lease <= s.delivery_timeout {
            return Err(ConfigError::BadLimit(
                "the lease must be longer than the delivery timeout: each delivery and the \
                 recording of its outcome must end while its lease holds",
            ));
        }
        if self
            .transport
            .call_timeout()
            .is_some_and(|own| own > s.delivery_timeout)
        {
            return Err(ConfigError::BadLimit(
                "the delivery timeout must be at least the transport's own timeout, or it can \
                 cut off a delivery the receiver accepted and have it delivered again",
            ));
        }
        if s.backoff_base.is_zero() || s.backoff_cap < s.backoff_base || s.poll_interval.is_zero() {
            return Err(ConfigError::BadLimit(
                "backoff and poll interval must be positive, cap at least the base",
            ));
        }
        Ok(Dispatcher {
            pool: self.pool,
            transport: Arc::new(self.transport),
            settings: Arc::new(self.settings),
            leases: Arc::new(AtomicU64::new(0)),
        })
    }
}

impl<T: Transport> Dispatcher<T> {
    /// Leases one batch of due effects, delivers them and records each outcome. Each send
    /// renews its effect's lease right before it starts and is skipped if another dispatcher
    /// took the effect meanwhile. Returns what it did; an empty report means nothing was due.
    pub async fn dispatch_due(&self) -> Result<DispatchReport, InboxError> {
        self.dispatch_batch(&AtomicBool::new(false)).await
    }

    /// Runs until `shutdown` completes: wakes on every committed enqueue (`LISTEN`), when the
    /// next retry is due, and at least every poll interval. On shutdown it finishes the
    /// deliveries in flight (each bounded by the delivery timeout) and gives back the leases
    /// it has not started on.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), InboxError> {
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

    async fn listen(&self) -> Option<PgListener> {
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
                .fetch_one(&self.pool)
                .await;
        match next {
            Ok(Some(secs)) if secs.is_finite() => {
                Duration::try_from_secs_f64(secs.max(0.0)).map_or(poll, |d| d.min(poll))
            }
            _ => poll,
        }
    }

    async fn dispatch_batch(&self, stopping: &AtomicBool) -> Result<DispatchReport, InboxError> {
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
            .fetch_all(&self.pool)
            .await
            .map_err(InboxError::classify)?;
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

    async fn deliver_one(
        &self,
        mut effect: Effect,
        token: &str,
        stopping: &AtomicBool,
    ) -> DispatchReport {
        let mut report = DispatchReport::default();
        if stopping.load(Ordering::SeqCst) {
            match self
                .record(
                    &self.settings.schema.sql(sql::RELEASE),
                    &effect.effect_id,
                    token,
                    |q| q,
                )
                .await
            {
                Ok(1) => report.released = 1,
                _ => report.unrecorded = 1,
            }
            report.count_deliveries(&effect.effect_name);
            return report;
        }
        // The batch was leased before the deliveries queued ahead of this one: renew the lease
        // now so that it covers this send and its recording, unless another dispatcher took the
        // effect in the meantime.
        let started: Result<Option<i32>, _> =
            sqlx::query_scalar(&self.settings.schema.sql(sql::START))
                .bind(effect.effect_id.as_str())
                .bind(token)
                .bind(self.settings.lease.as_secs_f64())
                .fetch_optional(&self.pool)
                .await;
        match started {
            Ok(Some(attempt)) => effect.attempt = attempt,
            Ok(None) => {
                tracing::debug!(effect_id = %effect.effect_id, "lease lost before the send; another dispatcher delivers the effect");
                report.lost = 1;
            }
            Err(err) => {
                tracing::warn!(effect_id = %effect.effect_id, error = %err, "could not begin the delivery; the effect is due again when its lease runs out");
                report.unrecorded = 1;
            }
        }
        if report.lost + report.unrecorded > 0 {
            report.count_deliveries(&effect.effect_name);
            return report;
        }
        let span = tracing::debug_span!(
            "outbox.deliver",
            effect_id = %effect.effect_id,
            effect = %effect.effect_name,
            attempt = effect.attempt,
            outcome = tracing::field::Empty,
        );
        self.attempt(effect, token, report).instrument(span).await
    }

    async fn attempt(
        &self,
        effect: Effect,
        token: &str,
        mut report: DispatchReport,
    ) -> DispatchReport {
        let span = tracing::Span::current();
        // The call is made inside the guarded future so that a transport panicking before it
        // returns its future is caught too.
        let call = AssertUnwindSafe(async { self.transport.deliver(&effect).await }).catch_unwind();
        let delivery = match tokio::time::timeout(self.settings.delivery_timeout, call).await {
            Ok(Ok(delivery)) => delivery.storable(),
            // The payload is not logged: a panic message can hold anything the transport had.
            Ok(Err(_panic)) => {
                tracing::warn!(effect_id = %effect.effect_id, "the transport panicked; counted as a failed attempt");
                Delivery::Retry {
                    status: None,
                    error: "the transport panicked".to_owned(),
                }
            }
            Err(_) => Delivery::Retry {
                status: None,
                error: format!(
                    "no answer within {:?}; the outcome is unknown",
                    self.settings.delivery_timeout
                ),
            },
        };
        let id = &effect.effect_id;
        // Quarantine items this delivery recovered: more than one when an earlier repair's
        // redelivery died again and opened a second item before this one succeeded.
        let mut recovered_items = 0;
        let recorded = match delivery {
            Delivery::Delivered { status, result } => {
                span.record("outcome", "delivered");
                let row = sqlx::query(&self.settings.schema.sql(sql::DELIVERED))
                    .bind(id.as_str())
                    .bind(token)
                    .bind(status.map(i32::from))
                    .bind(result)
                    .bind(effect_item_key(id.as_str()))
                    .fetch_one(&self.pool)
                    .await;
                match row {
                    Ok(row) => {
                        let delivered: i64 = row.try_get("delivered").unwrap_or(0);
                        let recovered: i64 = row.try_get("recovered").unwrap_or(0);
                        report.delivered = usize::from(delivered == 1);
                        report.recovered = usize::from(recovered > 0);
                        recovered_items = recovered.unsigned_abs();
                        Ok(delivered)
                    }
                    Err(err) => Err(err),
                }
            }
            Delivery::Retry { status, error } if effect.attempt < self.settings.max_attempts => {
                span.record("outcome", "retry");
                let delay = self.backoff(effect.attempt);
                tracing::info!(effect_id = %id, attempt = effect.attempt, ?delay, status, error = loggable(status, &error), "delivery failed; retrying");
                let done = self
                    .record(&self.settings.schema.sql(sql::RETRY), id, token, |q| {
                        q.bind(delay.as_secs_f64())
                            .bind(error)
                            .bind(status.map(i32::from))
                    })
                    .await;
                report.retried = usize::from(matches!(done, Ok(1)));
                done.map(|n| n as i64)
            }
            Delivery::Retry { status, error } => {
                span.record("outcome", "dead");
                let reason = "attempts-exhausted".to_owned();
                self.dead(&effect, token, status, error, reason, &mut report)
                    .await
            }
            Delivery::Permanent {
                status,
                reason_code,
                error,
            } => {
                span.record("outcome", "dead");
                self.dead(&effect, token, status, error, reason_code, &mut report)
                    .await
            }
        };
        match recorded {
            Ok(0) => {
                tracing::warn!(effect_id = %id, "lease expired before the outcome was recorded; another attempt follows");
                report.unrecorded = 1;
            }
            Ok(_) => {}
            Err(err) => {
                tracing::error!(effect_id = %id, error = %err, "could not record the delivery outcome; the lease will expire and it is retried");
                report.unrecorded = 1;
            }
        }
        report.count_deliveries(&effect.effect_name);
        quarantine_recovered(QuarantineSource::DeadEffect, recovered_items);
        report
    }

    async fn dead(
        &self,
        effect: &Effect,
        token: &str,
        status: Option<u16>,
        error: String,
        reason_code: String,
        report: &mut DispatchReport,
    ) -> Result<i64, sqlx::Error> {
        let id = &effect.effect_id;
        tracing::warn!(effect_id = %id, %reason_code, status, error = loggable(status, &error), "effect moved to dead letters");
        let item: Option<(i64, bool)> = sqlx::query_as(&self.settings.schema.sql(sql::DEAD))
            .bind(id.as_str())
            .bind(token)
            .bind(error)
            .bind(status.map(i32::from))
            .bind(effect_item_key(id.as_str()))
            .bind(&reason_code)
            .fetch_optional(&self.pool)
            .await?;
        if let Some((_, opened)) = item {
            ::metrics::counter!(m::OUTBOX_DEAD_LETTERS, "effect" => effect.effect_name.clone(), "reason" => reason_code)
                .increment(1);
            if opened {
                quarantine_moved(QuarantineSource::DeadEffect);
            }
        }
        report.dead = usize::from(item.is_some());
        Ok(i64::from(item.is_some()))
    }

    /// Runs an outcome statement guarded by the lease (`$1` effect, `$2` lease owner).
    async fn record<'q, F>(
        &self,
        statement: &'q str,
        id: &'q EffectId,
        token: &'q str,
        bind: F,
    ) -> Result<u64, sqlx::Error>
    where
        F: FnOnce(
            sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    {
        let query = bind(sqlx::query(statement).bind(id.as_str()).bind(token));
        Ok(query.execute(&self.pool).await?.rows_affected())
    }

    fn backoff(&self, attempt: i32) -> Duration {
        let doublings = u32::try_from(attempt.saturating_sub(1))
            .unwrap_or(0)
            .min(30);
        let full = self
            .settings
            .backoff_base
            .saturating_mul(1u32 << doublings)
            .min(self.settings.backoff_cap);
        full.mul_f64(0.5 + fastrand::f64() * 0.5)
    }
}

/// What a log line may say about a failure. With a status the error text carries the
/// receiver's answer, which is recorded with the effect but never logged.
fn loggable(status: Option<u16>, error: &str) -> &str {
    match status {
        Some(_) => "see the effect's last_error",
        None => error,
    }
}

fn effect_from_row(row: &PgRow) -> Result<Effect, InboxError> {
    let get = InboxError::Database;
    let names: Vec<String> = row.try_get("header_names").map_err(get)?;
    let values: Vec<String> = row.try_get("header_values").map_err(get)?;
    let payload: Vec<u8> = row.try_get("payload").map_err(get)?;
    Ok(Effect {
        effect_id: EffectId(row.try_get("effect_id").map_err(get)?),
        effect_name: row.try_get("effect_name").map_err(get)?,
        destination: row.try_get("destination").map_err(get)?,
        payload: payload.into(),
        headers: names.into_iter().zip(values).collect(),
        attempt: row.try_get("attempts").map_err(get)?,
    })
}
