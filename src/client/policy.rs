//! The retry policy: what is retried, how long to wait, and the budget.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, CONTENT_TYPE};
use http::{Method, StatusCode};

use crate::problem::ProblemKind;

/// The header the server replays with (see the crate's protocol table).
pub(crate) const REPLAYED: &str = "idempotent-replayed";

/// Why an attempt was retried: a metric label and a tracing field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryReason {
    /// The connection was refused: the attempt never reached the server, so it cannot
    /// have committed anything.
    Refused,
    /// The inner service failed without an answer after the request may have reached the
    /// server: the connection reset, the response cut off, or a timeout of the caller's own.
    Transport,
    /// The attempt timed out ([`RetryPolicy::attempt_timeout`]).
    Timeout,
    /// A status the policy retries (429, 500, 502, 503, 504 by default).
    Status(StatusCode),
    /// A problem+json answer of a kind the policy retries (`in-progress`,
    /// `transaction-conflict` by default).
    Problem(ProblemKind),
}

impl RetryReason {
    /// The metric label: `refused`, `transport`, `timeout`, `status-<code>`, or the
    /// problem's slug.
    pub fn label(self) -> String {
        match self {
            Self::Refused => "refused".to_owned(),
            Self::Transport => "transport".to_owned(),
            Self::Timeout => "timeout".to_owned(),
            Self::Status(status) => format!("status-{}", status.as_u16()),
            Self::Problem(kind) => kind.slug().to_owned(),
        }
    }
}

impl fmt::Display for RetryReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// What the policy makes of an answer's status and headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Return it to the caller.
    Final,
    /// Retry it.
    Retry(RetryReason),
    /// A problem+json answer: its `type` decides (read the body, then [`RetryPolicy::problem`]).
    ReadProblem,
}

type KeyGenerator = Arc<dyn Fn() -> String + Send + Sync>;

/// What the client layer retries, how long it waits in between, and when it gives up; shared
/// by every client adapter.
///
/// The defaults, and the table they make, are in [the module docs](super#what-is-retried).
///
/// ```
/// use std::time::Duration;
/// use tower_inbox::client::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .max_attempts(5)
///     .max_total_time(Duration::from_secs(10))
///     .retry_500(false);
/// assert_eq!(policy.get_max_attempts(), 5);
/// ```
#[derive(Clone)]
pub struct RetryPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) max_total_time: Duration,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_cap: Duration,
    pub(crate) retried_statuses: Vec<StatusCode>,
    pub(crate) retried_problems: Vec<ProblemKind>,
    pub(crate) key_methods: Vec<Method>,
    pub(crate) body_limit: usize,
    pub(crate) key_generator: KeyGenerator,
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("max_attempts", &self.max_attempts)
            .field("max_total_time", &self.max_total_time)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("backoff_base", &self.backoff_base)
            .field("backoff_cap", &self.backoff_cap)
            .field("retried_statuses", &self.retried_statuses)
            .field("retried_problems", &self.retried_problems)
            .field("key_methods", &self.key_methods)
            .field("body_limit", &self.body_limit)
            .finish_non_exhaustive()
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 10,
            max_total_time: Duration::from_secs(30),
            attempt_timeout: Some(Duration::from_secs(10)),
            backoff_base: Duration::from_millis(100),
            backoff_cap: Duration::from_secs(5),
            retried_statuses: vec![
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::INTERNAL_SERVER_ERROR,
                StatusCode::BAD_GATEWAY,
                StatusCode::SERVICE_UNAVAILABLE,
                StatusCode::GATEWAY_TIMEOUT,
            ],
            retried_problems: vec![ProblemKind::InProgress, ProblemKind::TransactionConflict],
            key_methods: vec![Method::POST, Method::PUT, Method::PATCH, Method::DELETE],
            body_limit: 1024 * 1024,
            key_generator: Arc::new(|| uuid::Uuid::new_v4().to_string()),
        }
    }
}

impl RetryPolicy {
    /// The attempts made at most, the first included (default 10; at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The time from the first attempt after which no attempt starts and a running one is
    /// abandoned (default 30 s). A wait that would end past it is not begun: the layer gives
    /// up at once.
    pub fn max_total_time(mut self, time: Duration) -> Self {
        self.max_total_time = time;
        self
    }

    /// How long one attempt may take, until its response's headers arrive (default 10 s;
    /// `None`: only the total time bounds it). A timed-out attempt is retried.
    pub fn attempt_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// The exponential backoff: before retry `n` the layer waits a random time between zero
    /// and `min(cap, base * 2^(n-1))` ("full jitter"), and at least the answer's
    /// `Retry-After` (defaults: 100 ms, 5 s).
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_cap = cap.max(base);
        self
    }

    /// Retries answers with `status` (`true`) or returns them (`false`). Success and
    /// informational statuses and replayed answers are final whatever this says.
    pub fn retry_status(mut self, status: StatusCode, retry: bool) -> Self {
        self.retried_statuses.retain(|s| *s != status);
        if retry {
            self.retried_statuses.push(status);
        }
        self
    }

    /// Whether a 500 is retried (default: yes, the crate's server rolls back on a 5xx, so
    /// nothing was committed). Shorthand for [`retry_status`](Self::retry_status).
    pub fn retry_500(self, retry: bool) -> Self {
        self.retry_status(StatusCode::INTERNAL_SERVER_ERROR, retry)
    }

    /// Retries problem+json answers of `kind` (`true`) or returns them (`false`), whatever
    /// their status. `payload-mismatch` cannot become retried: the same key and body would
    /// get the same answer.
    pub fn retry_problem(mut self, kind: ProblemKind, retry: bool) -> Self {
        self.retried_problems.retain(|k| *k != kind);
        if retry && kind != ProblemKind::PayloadMismatch {
            self.retried_problems.push(kind);
        }
        self
    }

    /// The largest request body kept for replay (default 1 MiB). A bigger body, or one
    /// whose size is not known up front (a stream), is sent once and not retried.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.body_limit = bytes;
        self
    }

    /// The methods that get a generated key when they come without one (default `POST`,
    /// `PUT`, `PATCH`, `DELETE`). A request with neither such a method nor a key passes
    /// through once, untouched: retrying reads is the job of a general retry layer.
    pub fn key_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.key_methods = methods.into_iter().collect();
        self
    }

    /// Generates the keys of requests that come without one (default: a random v4 UUID).
    /// Each call must return a new key; one that is not a valid header value makes the
    /// request fail before it is sent.
    pub fn key_generator(mut self, generate: impl Fn() -> String + Send + Sync + 'static) -> Self {
        self.key_generator = Arc::new(generate);
        self
    }

    /// The attempts made at most.
    pub fn get_max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The total time budget.
    pub fn get_max_total_time(&self) -> Duration {
        self.max_total_time
    }

    /// The verdict on an answer from its status and headers.
    pub(crate) fn verdict(&self, status: StatusCode, headers: &HeaderMap) -> Verdict {
        let replayed = headers.get(REPLAYED).is_some_and(|v| v == "true");
        if replayed || !(status.is_client_error() || status.is_server_error()) {
            return Verdict::Final;
        }
        if self.retried_statuses.contains(&status) {
            return Verdict::Retry(RetryReason::Status(status));
        }
        let problem_json = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("application/problem+json"));
        if problem_json && !self.retried_problems.is_empty() {
            Verdict::ReadProblem
        } else {
            Verdict::Final
        }
    }

    /// The retried kind a problem+json body names in its `type`, if any. The crate's types
    /// end in `#<slug>`; the part before may name another version of the docs.
    pub(crate) fn problem(&self, body: &[u8]) -> Option<RetryReason> {
        #[derive(serde::Deserialize)]
        struct Typed<'a> {
            #[serde(rename = "type", borrow)]
            type_uri: std::borrow::Cow<'a, str>,
        }
        let typed: Typed<'_> = serde_json::from_slice(body).ok()?;
        let (_, slug) = typed.type_uri.rsplit_once('#')?;
        self.retried_problems
            .iter()
            .find(|kind| kind.slug() == slug)
            .map(|kind| RetryReason::Problem(*kind))
    }

    /// The random wait before retry `retry` (1 for the first retry): full jitter.
    pub(crate) fn jittered_backoff(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(31);
        let ceiling = self
            .backoff_base
            .checked_mul(1u32 << doublings)
            .unwrap_or(self.backoff_cap)
            .min(self.backoff_cap);
        ceiling.mul_f64(fastrand::f64())
    }
}

/// The reason to retry an attempt whose inner service failed: [`RetryReason::Refused`] when
/// an error in its chain of sources is a refused connection, else [`RetryReason::Transport`].
pub(crate) fn transport_reason(error: &(dyn std::error::Error + 'static)) -> RetryReason {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return RetryReason::Refused;
        }
        cause = e.source();
    }
    RetryReason::Transport
}
