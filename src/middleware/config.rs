//! What one layer applies to every request, and the headers it speaks.

use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::{Method, Response, StatusCode};

use super::cache::ReplayCache;
use super::outcome::OutcomePolicy;
use super::replay_headers::ReplayHeaders;
use crate::body::Body;
use crate::fingerprint::FingerprintStrategy;
use crate::inbox::{ClaimMode, Inbox};
use crate::problem::Problem;
use crate::producer::ProducerScope;
use crate::retry::TransientRetry;

/// The header the command ID is read from by default.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header marking a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Default request body limit: 1 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;

/// Default limit on a response the layer records: 1 MiB.
pub const DEFAULT_RESPONSE_LIMIT: usize = 1024 * 1024;

/// The settings one layer applies; shared by every service it builds.
pub(crate) struct InboxConfig {
    pub(crate) inbox: Inbox,
    pub(crate) consumer: Arc<str>,
    pub(crate) producer: Arc<dyn ProducerScope>,
    pub(crate) producer_missing_status: StatusCode,
    pub(crate) guarded_methods: Vec<Method>,
    pub(crate) key_header: HeaderName,
    pub(crate) key_required: bool,
    pub(crate) max_key_len: usize,
    pub(crate) body_limit: usize,
    pub(crate) response_limit: usize,
    pub(crate) in_flight_wait: Duration,
    pub(crate) retry_after_secs: u32,
    pub(crate) mismatch_status: StatusCode,
    pub(crate) outcome: OutcomePolicy,
    pub(crate) handler_version: Arc<str>,
    pub(crate) fingerprint: FingerprintStrategy,
    pub(crate) quarantine_after: u32,
    pub(crate) transient_retry: TransientRetry,
    pub(crate) claim_mode: ClaimMode,
    pub(crate) replay_cache: Option<ReplayCache>,
    pub(crate) replay_headers: ReplayHeaders,
    pub(crate) on_problem: Option<Arc<dyn MakeProblem>>,
}

impl InboxConfig {
    /// The response for a problem of the layer's own, shaped by the builder's
    /// [`on_problem`](crate::InboxLayerBuilder::on_problem) hook if there is one.
    pub(crate) fn problem(&self, problem: Problem) -> Response<Body> {
        let kind = problem.kind();
        let Some(make) = &self.on_problem else {
            return problem.response();
        };
        let default = problem.clone().response();
        let mut response = make.make_problem(&problem, default);
        response.extensions_mut().insert(kind);
        response
    }
}

/// Shapes the layer's own error responses; see
/// [`InboxLayerBuilder::on_problem`](crate::InboxLayerBuilder::on_problem). Implemented by
/// every `Fn(&Problem, Response<Body>) -> Response<Body>`.
pub trait MakeProblem: Send + Sync + 'static {
    /// The response to send for `problem`, given the default problem+json `response`.
    fn make_problem(&self, problem: &Problem, response: Response<Body>) -> Response<Body>;
}

impl<F> MakeProblem for F
where
    F: Fn(&Problem, Response<Body>) -> Response<Body> + Send + Sync + 'static,
{
    fn make_problem(&self, problem: &Problem, response: Response<Body>) -> Response<Body> {
        self(problem, response)
    }
}
