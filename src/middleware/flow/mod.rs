//! One guarded request, start to end: the protocol table of the crate docs, in order.

mod answer;
mod attempt;
mod command;
mod handler;
mod request;

use std::sync::Arc;

use crate::body::Body;
use ::metrics::Label;
use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use tower::Service;
use tracing::Instrument;

use super::config::InboxConfig;
use crate::fingerprint::Fingerprint;
use crate::identity::MessageIdentity;
use crate::inbox::RetryReason;
use crate::metrics as m;
use crate::problem::{Problem, ProblemKind};
use request::{fingerprint, read_key, read_limited, ReadError};

pub(crate) async fn run<S, ReqBody, ResBody>(
    config: Arc<InboxConfig>,
    inner: S,
    request: Request<ReqBody>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<crate::body::BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<crate::body::BoxError>,
{
    if !config.guarded_methods.contains(request.method()) {
        return pass_through(inner, request).await;
    }
    let (parts, body) = request.into_parts();
    let key = match read_key(&parts.headers, &config) {
        Ok(Some(key)) => key,
        Ok(None) if !config.key_required => {
            // Counted all the same: a producer that stopped sending keys shows up here, not
            // as a silent drop in duplicates.
            key_missing(&config, "passed");
            return pass_through(inner, Request::from_parts(parts, body)).await;
        }
        Ok(None) => {
            key_missing(&config, "refused");
            let detail = format!("this request needs an {} header", config.key_header);
            return Ok(refuse(
                &config,
                Problem::new(ProblemKind::KeyMissing, detail),
            ));
        }
        Err(err) => {
            let detail = format!("the {} header is malformed: {err}", config.key_header);
            return Ok(refuse(
                &config,
                Problem::new(ProblemKind::KeyMalformed, detail),
            ));
        }
    };
    let producer = match config.producer.producer(&parts) {
        Ok(producer) => producer,
        Err(err) => {
            let problem = Problem::new(ProblemKind::ProducerMissing, err.0)
                .with_status(config.producer_missing_status);
            return Ok(refuse(&config, problem));
        }
    };
    let body = match read_limited(body, config.body_limit).await {
        Ok(body) => body,
        Err(ReadError::TooLarge) => {
            let detail = format!("the body is over the {} byte limit", config.body_limit);
            return Ok(refuse(
                &config,
                Problem::new(ProblemKind::BodyTooLarge, detail),
            ));
        }
        Err(ReadError::Failed(err)) => {
            let detail = format!("the body could not be read: {err}");
            return Ok(refuse(
                &config,
                Problem::new(ProblemKind::BodyUnreadable, detail),
            ));
        }
    };
    let fingerprint = fingerprint(&config, &parts, &body);
    let identity = MessageIdentity::new(config.consumer.clone(), producer, key);
    let span = tracing::debug_span!(
        "inbox.command",
        consumer = %identity.consumer(),
        message_id = %identity.message_id(),
        outcome = tracing::field::Empty,
    );
    let command = Command {
        config,
        identity,
        fingerprint,
        parts,
        body,
    };
    command.claim_and_run(inner).instrument(span).await
}

fn consumer_labels(config: &InboxConfig) -> Vec<Label> {
    config
        .inbox
        .metric_labels()
        .of_consumer_shared(&config.consumer)
}

fn key_missing(config: &InboxConfig, action: &'static str) {
    m::count_with(m::KEY_MISSING, &consumer_labels(config), "action", action);
}

/// A guarded request refused before any claim: counted by problem type.
fn refuse(config: &InboxConfig, problem: Problem) -> Response<Body> {
    let reason = problem.kind().slug();
    m::count_with(
        m::REQUESTS_REFUSED,
        &consumer_labels(config),
        "reason",
        reason,
    );
    config.problem(problem)
}

async fn pass_through<S, B, ResBody>(
    mut inner: S,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<crate::body::BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<crate::body::BoxError>,
{
    let response = inner.call(request.map(Body::new)).await?;
    Ok(response.map(Body::new))
}

/// A guarded request whose key, producer and body passed the checks.
pub(super) struct Command {
    pub(super) config: Arc<InboxConfig>,
    pub(super) identity: MessageIdentity,
    pub(super) fingerprint: Fingerprint,
    pub(super) parts: Parts,
    pub(super) body: Bytes,
}

/// Where one attempt at a command ended.
pub(super) enum Step {
    /// The answer for the client, with the outcome for the command's span.
    Answer(&'static str, Response<Body>),
    /// A serialization failure, deadlock, requested re-run or lost connection: everything
    /// rolled back, or (a connection lost during `COMMIT`) for the next claim to find out.
    Rerun {
        reason: RetryReason,
        ran_handler: bool,
        /// The connection was lost while `COMMIT` was in flight.
        commit_in_flight: bool,
    },
}
