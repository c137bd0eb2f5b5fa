//! [`InboxLayer`](crate::InboxLayer) and its builder.
//!
//! (Over 400 lines: the builder has one documented method per setting.)

use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::{Method, StatusCode};
use sqlx::PgPool;
use tower::Layer;

use super::cache::ReplayCache;
use super::config::{
    InboxConfig, MakeProblem, DEFAULT_BODY_LIMIT, DEFAULT_RESPONSE_LIMIT, IDEMPOTENCY_KEY,
};
use super::outcome::OutcomePolicy;
use super::replay_headers::ReplayHeaders;
use super::service::InboxService;
use crate::fingerprint::FingerprintStrategy;
use crate::inbox::{ClaimMode, Inbox, IsolationLevel, DEFAULT_IN_FLIGHT_WAIT};
use crate::key::MAX_KEY_LEN;
use crate::metrics::MetricLabels;
use crate::producer::ProducerScope;
use crate::replay::{ConsumerNameError, ReplayPolicy};
use crate::retry::TransientRetry;
use crate::schema::Schema;

/// A Tower layer that makes guarded requests exactly-once commands.
///
/// Build it with [`InboxLayer::builder`]. See the [crate docs](crate) for the protocol.
#[derive(Clone)]
pub struct InboxLayer {
    config: Arc<InboxConfig>,
}

impl InboxLayer {
    /// Starts a layer for the consumer `consumer` (the name of what applies the commands, part
    /// of every message identity) over `pool`.
    ///
    /// The builder has no [`build`](InboxLayerBuilder::build) until a
    /// [`producer`](InboxLayerBuilder::producer) scope is set: there is deliberately no
    /// default, as any default would let one client read another's recorded responses, or
    /// refuse every request.
    ///
    /// ```compile_fail
    /// # fn f(pool: sqlx::PgPool) {
    /// // error[E0599]: no method named `build` found for `InboxLayerBuilder<NeedsProducer>`
    /// let layer = tower_inbox::InboxLayer::builder(pool, "orders").build();
    /// # }
    /// ```
    pub fn builder(pool: PgPool, consumer: impl Into<String>) -> InboxLayerBuilder<NeedsProducer> {
        InboxLayerBuilder {
            pool,
            consumer: consumer.into(),
            producer: NeedsProducer,
            producer_missing_status: ProducerMissingStatus::default(),
            guarded_methods: vec![Method::POST, Method::PATCH],
            key_header: IDEMPOTENCY_KEY,
            key_required: true,
            max_key_len: MAX_KEY_LEN,
            body_limit: DEFAULT_BODY_LIMIT,
            response_limit: DEFAULT_RESPONSE_LIMIT,
            in_flight_wait: DEFAULT_IN_FLIGHT_WAIT,
            retry_after_secs: 1,
            mismatch_status: MismatchStatus::default(),
            outcome: OutcomePolicy::default(),
            handler_version: "1".to_owned(),
            fingerprint: FingerprintStrategy::default(),
            quarantine_after: 3,
            replay_policy: ReplayPolicy::default(),
            isolation: IsolationLevel::default(),
            transient_retry: TransientRetry::default(),
            metric_labels: MetricLabels::default(),
            claim_mode: ClaimMode::default(),
            replay_cache: None,
            replay_headers: ReplayHeaders::default(),
            on_problem: None,
            lookup_before_claim: None,
            schema: Schema::default(),
            waiting_keys_limit: None,
            statement_deadline: None,
        }
    }
}

impl InboxLayer {
    /// The inbox the layer claims in: its pool, schema and settings, and how many claims
    /// wait for an original in flight right now.
    pub fn inbox(&self) -> &Inbox {
        &self.config.inbox
    }
}

impl std::fmt::Debug for InboxLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.config;
        f.debug_struct("InboxLayer")
            .field("consumer", &c.consumer)
            .field("guarded_methods", &c.guarded_methods)
            .field("key_required", &c.key_required)
            .field("handler_version", &c.handler_version)
            .field("fingerprint", &c.fingerprint)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for InboxLayer {
    type Service = InboxService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        InboxService::new(inner, self.config.clone())
    }
}

/// A setting the layer cannot work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The consumer name is not 1 to 255 bytes of ASCII letters, digits and `-`, `_`, `.`,
    /// `:`, `/`, `@`.
    #[error("the consumer name must be 1 to 255 bytes of ASCII letters, digits and '-', '_', '.', ':', '/', '@' (with '@' and the version, for a versioned projection)")]
    BadConsumerName,
    /// The handler version is not 1 to 255 visible ASCII characters, or contains `@` under
    /// [`ReplayPolicy::VersionedProjection`].
    #[error("the handler version must be 1 to 255 visible ASCII characters ('!' to '~'), without '@' for a versioned projection")]
    BadHandlerVersion,
    /// A limit is zero, or the key limit is over 255: which setting, and what it must be.
    #[error("bad limit: {0}")]
    BadLimit(&'static str),
    /// The isolation level is one the schema's [layout](crate::partition::Layout) refuses.
    #[error(transparent)]
    Layout(#[from] crate::inbox::LayoutError),
}

/// The [`InboxLayerBuilder`] before a producer scope is set: it has no `build` yet.
#[derive(Debug, Clone, Copy)]
pub struct NeedsProducer;

/// The [`InboxLayerBuilder`] with its producer scope: it can be built.
#[derive(Clone)]
pub struct HasProducer(Arc<dyn ProducerScope>);

impl std::fmt::Debug for HasProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("HasProducer").finish_non_exhaustive()
    }
}

/// The status of a request whose producer scope is not available.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ProducerMissingStatus {
    /// `401 Unauthorized` (the default): the client did not authenticate.
    #[default]
    Unauthorized,
    /// `400 Bad Request`: for scopes that read a header any client may send.
    BadRequest,
}

impl ProducerMissingStatus {
    fn status(self) -> StatusCode {
        match self {
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::BadRequest => StatusCode::BAD_REQUEST,
        }
    }
}

/// The status of a duplicate whose payload differs from the original's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MismatchStatus {
    /// `409 Conflict` (the default).
    #[default]
    Conflict,
    /// `422 Unprocessable Content`, the IETF Idempotency-Key draft's choice.
    UnprocessableContent,
}

impl MismatchStatus {
    fn status(self) -> StatusCode {
        match self {
            Self::Conflict => StatusCode::CONFLICT,
            Self::UnprocessableContent => StatusCode::UNPROCESSABLE_ENTITY,
        }
    }
}

/// Configures an [`InboxLayer`]. Every setting has a safe default except the producer scope.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_inbox::{producer::TrustedHeader, InboxLayer};
///
/// # fn build(pool: sqlx::PgPool) -> Result<InboxLayer, tower_inbox::middleware::ConfigError> {
/// let layer = InboxLayer::builder(pool, "credits")
///     .producer(TrustedHeader::new("x-producer"))
///     .body_limit(64 * 1024)
///     .in_flight_wait(Duration::from_secs(5))
///     .handler_version("2026-12")
///     .build()?;
/// # Ok(layer) }
/// ```
#[must_use]
pub struct InboxLayerBuilder<P = HasProducer> {
    pool: PgPool,
    consumer: String,
    producer: P,
    producer_missing_status: ProducerMissingStatus,
    guarded_methods: Vec<Method>,
    key_header: HeaderName,
    key_required: bool,
    max_key_len: usize,
    body_limit: usize,
    response_limit: usize,
    in_flight_wait: Duration,
    retry_after_secs: u32,
    mismatch_status: MismatchStatus,
    outcome: OutcomePolicy,
    handler_version: String,
    fingerprint: FingerprintStrategy,
    quarantine_after: u32,
    replay_policy: ReplayPolicy,
    isolation: IsolationLevel,
    transient_retry: TransientRetry,
    metric_labels: MetricLabels,
    claim_mode: ClaimMode,
    replay_cache: Option<ReplayCache>,
    replay_headers: ReplayHeaders,
    on_problem: Option<Arc<dyn MakeProblem>>,
    lookup_before_claim: Option<bool>,
    schema: Schema,
    waiting_keys_limit: Option<usize>,
    statement_deadline: Option<Duration>,
}

impl<P> InboxLayerBuilder<P> {
    /// How many in-flight keys the layer waits on at once (default: a quarter of the pool's
    /// connections, at least one). However many duplicates of one in-flight command
    /// arrive, one of them polls the database for it (one pooled connection, only while a
    /// poll runs) and the others wait in memory behind it. Past this many keys a duplicate
    /// of an in-flight command gets `409 in-progress` with `Retry-After` at once, so one
    /// client retrying in a loop cannot hold the pool other clients need.
    pub fn waiting_keys_limit(mut self, keys: usize) -> Self {
        self.waiting_keys_limit = Some(keys);
        self
    }

    /// How long each of the layer's own statements (claim, record, `COMMIT`, reads) may wait
    /// for its answer (default 10 s). Past it the statement fails as on a lost connection:
    /// the transaction is run again on a new connection, or a `COMMIT` is answered 503 with
    /// its outcome unknown and a retry safe; the connection is closed, never returned to
    /// the pool. This is what frees a service from half-open connections. See
    /// [`Inbox::with_statement_deadline`](crate::inbox::Inbox::with_statement_deadline).
    pub fn statement_deadline(mut self, deadline: Duration) -> Self {
        self.statement_deadline = Some(deadline);
        self
    }

    /// The schema the inbox tables are in (default `tower_inbox`); create them there with
    /// [`migrate_schema`](crate::schema::migrate_schema). Every statement names it, so a handler
    /// that changes its session's `search_path` cannot redirect the protocol.
    pub fn schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// When the command's identity is claimed: first, before the handler (the default), or
    /// at commit, after it, with the recorded response in the same statement. See
    /// [`ClaimMode`] for the trade-off.
    pub fn claim_mode(mut self, mode: ClaimMode) -> Self {
        self.claim_mode = mode;
        self
    }

    /// Answers duplicates of commands this process completed from memory (off by default).
    /// The cache may be shared between layers. See [`ReplayCache`].
    pub fn replay_cache(mut self, cache: ReplayCache) -> Self {
        self.replay_cache = Some(cache);
        self
    }

    /// Which response headers are recorded and replayed (default: all but hop-by-hop
    /// headers, `Set-Cookie` and `Date`). See [`ReplayHeaders`].
    pub fn replay_headers(mut self, policy: ReplayHeaders) -> Self {
        self.replay_headers = policy;
        self
    }

    /// Shapes the layer's own error responses (problem+json by default): `make` receives the
    /// [`Problem`](crate::problem::Problem) and the default response, and returns the response to send. The
    /// problem's [`ProblemKind`](crate::problem::ProblemKind) stays in the response's
    /// extensions either way. Answers of the handler, rejections of its extractors included,
    /// are the handler's and do not pass through it.
    ///
    /// ```no_run
    /// use tower_inbox::{producer::TrustedHeader, InboxLayer};
    ///
    /// # fn build(pool: sqlx::PgPool) -> Result<InboxLayer, tower_inbox::middleware::ConfigError> {
    /// // Add the problem's kind as a header for clients that do not read problem+json.
    /// let layer = InboxLayer::builder(pool, "orders")
    ///     .producer(TrustedHeader::new("x-producer"))
    ///     .on_problem(|problem: &tower_inbox::problem::Problem, mut response: http::Response<_>| {
    ///         let kind = http::HeaderValue::from_static(problem.kind().slug());
    ///         response.headers_mut().insert("x-inbox-problem", kind);
    ///         response
    ///     })
    ///     .build()?;
    /// # Ok(layer) }
    /// ```
    pub fn on_problem(mut self, make: impl MakeProblem) -> Self {
        self.on_problem = Some(Arc::new(make));
        self
    }

    /// Whether the key's row is read before a transaction is opened: always (`true`) or
    /// never (`false`). By default the layer decides from the traffic
    /// ([`Inbox::with_lookup_first`]): it reads first while more than a fifth of the recent
    /// requests were duplicates (or conflicts, or retries of commands in flight), and claims
    /// at once otherwise. The read answers a duplicate of a finished command in one round
    /// trip, with no transaction and no write; it costs a first-seen command one round trip
    /// more. Claiming at once, a duplicate costs three (`BEGIN`, the claim, a read).
    pub fn lookup_before_claim(mut self, on: bool) -> Self {
        self.lookup_before_claim = Some(on);
        self
    }

    /// The isolation level of the claimed transaction (default
    /// [`DatabaseDefault`](IsolationLevel::DatabaseDefault): a plain `BEGIN`, at the
    /// database's `default_transaction_isolation`, `READ COMMITTED` unless configured
    /// otherwise). The claim stays correct at every level; stricter levels turn more
    /// contention into serialization failures, which are re-run. Name a level to keep the
    /// database's default from changing it.
    pub fn isolation_level(mut self, level: IsolationLevel) -> Self {
        self.isolation = level;
        self
    }

    /// How a transaction that hit a serialization failure or deadlock (in the claim, the
    /// handler's watched statements, the record or the commit), or whose handler asked for
    /// it, is rolled back and re-run (default: 3 attempts in all, 5–20 ms apart). When the
    /// attempts run out the client gets `503`
    /// [`transaction-conflict`](crate::problem#transaction-conflict).
    pub fn transient_retry(mut self, retry: TransientRetry) -> Self {
        self.transient_retry = retry;
        self
    }

    /// Which identity labels the per-command [metrics](crate::metrics) carry (default: the
    /// consumer only).
    pub fn metric_labels(mut self, labels: MetricLabels) -> Self {
        self.metric_labels = labels;
        self
    }

    /// What a new handler version does with messages an older one processed (default
    /// [`ReplayPolicy::NoReapplication`]). See [`crate::replay`].
    pub fn replay_policy(mut self, policy: ReplayPolicy) -> Self {
        self.replay_policy = policy;
        self
    }

    /// After how many rolled-back attempts (5xx, panic, client gone) a command also gets an
    /// open [quarantine](crate::quarantine) item (default 3). Every attempt is counted in
    /// `consumer_inbox_failure` regardless.
    pub fn quarantine_after(mut self, attempts: u32) -> Self {
        self.quarantine_after = attempts;
        self
    }

    /// Where the producer scope comes from (required). See [`crate::producer`].
    pub fn producer(self, scope: impl ProducerScope) -> InboxLayerBuilder<HasProducer> {
        let producer = HasProducer(Arc::new(scope));
        InboxLayerBuilder {
            pool: self.pool,
            consumer: self.consumer,
            producer,
            producer_missing_status: self.producer_missing_status,
            guarded_methods: self.guarded_methods,
            key_header: self.key_header,
            key_required: self.key_required,
            max_key_len: self.max_key_len,
            body_limit: self.body_limit,
            response_limit: self.response_limit,
            in_flight_wait: self.in_flight_wait,
            retry_after_secs: self.retry_after_secs,
            mismatch_status: self.mismatch_status,
            outcome: self.outcome,
            handler_version: self.handler_version,
            fingerprint: self.fingerprint,
            quarantine_after: self.quarantine_after,
            replay_policy: self.replay_policy,
            isolation: self.isolation,
            transient_retry: self.transient_retry,
            metric_labels: self.metric_labels,
            claim_mode: self.claim_mode,
            replay_cache: self.replay_cache,
            replay_headers: self.replay_headers,
            on_problem: self.on_problem,
            lookup_before_claim: self.lookup_before_claim,
            schema: self.schema,
            waiting_keys_limit: self.waiting_keys_limit,
            statement_deadline: self.statement_deadline,
        }
    }

    /// The status when the producer scope is not available: `401` (default) or `400`.
    pub fn producer_missing_status(mut self, status: ProducerMissingStatus) -> Self {
        self.producer_missing_status = status;
        self
    }

    /// The methods the layer guards (default `POST` and `PATCH`); others pass through.
    pub fn guarded_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.guarded_methods = methods.into_iter().collect();
        self
    }

    /// The header that carries the command ID (default `Idempotency-Key`).
    pub fn key_header(mut self, name: HeaderName) -> Self {
        self.key_header = name;
        self
    }

    /// Whether a guarded request without a key is refused with `400` (default `true`). When
    /// `false`, such requests pass through unprotected.
    pub fn key_required(mut self, required: bool) -> Self {
        self.key_required = required;
        self
    }

    /// The longest key accepted, 1 to 255 characters (default 255).
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.max_key_len = len;
        self
    }

    /// The largest request body the layer buffers for fingerprinting (default 1 MiB);
    /// larger bodies get `413`.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.body_limit = bytes;
        self
    }

    /// The largest response the layer records (default 1 MiB). A larger committed response
    /// cannot be replayed, so the layer rolls back and answers `500` instead.
    pub fn recorded_response_limit(mut self, bytes: usize) -> Self {
        self.response_limit = bytes;
        self
    }

    /// How long a duplicate waits for an in-flight original before `409 in-progress`
    /// (default 2 s). It waits in this process, polling the key, and holds no pooled
    /// connection between polls.
    pub fn in_flight_wait(mut self, wait: Duration) -> Self {
        self.in_flight_wait = wait;
        self
    }

    /// The `Retry-After` seconds on `409 in-progress` and `503` (default 1).
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after_secs = seconds;
        self
    }

    /// The status for a key reused with a different payload: `409` (default) or `422` (the
    /// IETF draft's choice).
    pub fn mismatch_status(mut self, status: MismatchStatus) -> Self {
        self.mismatch_status = status;
        self
    }

    /// Which handler statuses commit (see [`OutcomePolicy`]).
    pub fn outcome_policy(mut self, policy: OutcomePolicy) -> Self {
        self.outcome = policy;
        self
    }

    /// The handler version stored with each claim (default `"1"`).
    pub fn handler_version(mut self, version: impl Into<String>) -> Self {
        self.handler_version = version.into();
        self
    }

    /// How payloads are fingerprinted (default canonical JSON).
    pub fn fingerprint(mut self, strategy: FingerprintStrategy) -> Self {
        self.fingerprint = strategy;
        self
    }
}

impl InboxLayerBuilder<HasProducer> {
    /// Checks the settings and builds the layer: the consumer name, the handler version and
    /// the limits are checked here, and an error names the setting.
    pub fn build(self) -> Result<InboxLayer, ConfigError> {
        let producer = self.producer.0;
        let consumer = self
            .replay_policy
            .consumer_name(&self.consumer, &self.handler_version)
            .map_err(|err| match err {
                ConsumerNameError::BadConsumerName => ConfigError::BadConsumerName,
                ConsumerNameError::BadHandlerVersion => ConfigError::BadHandlerVersion,
            })?;
        if self.max_key_len == 0 || self.max_key_len > MAX_KEY_LEN {
            return Err(ConfigError::BadLimit("max_key_len must be 1 to 255"));
        }
        crate::inbox::check_isolation(&self.schema, self.isolation)?;
        if self.quarantine_after == 0 {
            return Err(ConfigError::BadLimit("quarantine_after must be positive"));
        }
        if self.body_limit == 0 {
            return Err(ConfigError::BadLimit("body_limit must be positive"));
        }
        if self.response_limit == 0 {
            return Err(ConfigError::BadLimit(
                "recorded_response_limit must be positive",
            ));
        }
        if self.waiting_keys_limit == Some(0) {
            return Err(ConfigError::BadLimit("waiting_keys_limit must be positive"));
        }
        let mut inbox = Inbox::new(self.pool)
            .with_schema(self.schema)
            .with_isolation(self.isolation)
            .with_metric_labels(self.metric_labels);
        if let Some(on) = self.lookup_before_claim {
            inbox = inbox.with_lookup_first(on);
        }
        if let Some(keys) = self.waiting_keys_limit {
            inbox = inbox.with_waiting_keys_limit(keys);
        }
        if let Some(deadline) = self.statement_deadline {
            inbox = inbox.with_statement_deadline(deadline);
        }
        Ok(InboxLayer {
            config: Arc::new(InboxConfig {
                inbox,
                consumer: consumer.into(),
                producer,
                producer_missing_status: self.producer_missing_status.status(),
                guarded_methods: self.guarded_methods,
                key_header: self.key_header,
                key_required: self.key_required,
                max_key_len: self.max_key_len,
                body_limit: self.body_limit,
                response_limit: self.response_limit,
                in_flight_wait: self.in_flight_wait,
                retry_after_secs: self.retry_after_secs,
                mismatch_status: self.mismatch_status.status(),
                outcome: self.outcome,
                handler_version: self.handler_version.into(),
                fingerprint: self.fingerprint,
                quarantine_after: self.quarantine_after,
                transient_retry: self.transient_retry,
                claim_mode: self.claim_mode,
                replay_cache: self.replay_cache,
                replay_headers: self.replay_headers,
                on_problem: self.on_problem,
            }),
        })
    }
}
