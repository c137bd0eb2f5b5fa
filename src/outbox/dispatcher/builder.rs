//! The dispatcher's settings, checked once when it is built.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::Dispatcher;
use crate::outbox::Transport;
use crate::schema::Schema;

/// Dispatcher settings that cannot work together, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid outbox dispatcher settings: {0}")]
pub struct DispatcherConfigError(&'static str);

pub(super) struct Settings {
    pub(super) schema: Schema,
    pub(super) instance: String,
    pub(super) batch_size: i64,
    pub(super) concurrency: usize,
    pub(super) lease: Duration,
    pub(super) delivery_timeout: Duration,
    pub(super) backoff_base: Duration,
    pub(super) backoff_cap: Duration,
    pub(super) max_attempts: i32,
    pub(super) poll_interval: Duration,
}

/// Configures a [`Dispatcher`].
#[must_use]
pub struct DispatcherBuilder<T> {
    pool: PgPool,
    transport: T,
    settings: Settings,
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
    pub fn build(self) -> Result<Dispatcher<T>, DispatcherConfigError> {
        let s = &self.settings;
        if s.batch_size == 0 || s.concurrency == 0 || s.max_attempts == 0 {
            return Err(DispatcherConfigError(
                "batch size, concurrency and attempts must be positive",
            ));
        }
        if s.lease <= s.delivery_timeout {
            return Err(DispatcherConfigError(
                "the lease must be longer than the delivery timeout: each delivery and the \
                 recording of its outcome must end while its lease holds",
            ));
        }
        if self
            .transport
            .call_timeout()
            .is_some_and(|own| own > s.delivery_timeout)
        {
            return Err(DispatcherConfigError(
                "the delivery timeout must be at least the transport's own timeout, or it can \
                 cut off a delivery the receiver accepted and have it delivered again",
            ));
        }
        if s.backoff_base.is_zero() || s.backoff_cap < s.backoff_base || s.poll_interval.is_zero() {
            return Err(DispatcherConfigError(
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
