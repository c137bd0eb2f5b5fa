//! One command, from its key to its final answer or the give-up.

use std::future::poll_fn;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, Limited};
use tokio::time::Instant;
use tower::Service;
use tracing::field::Empty;
use tracing::Instrument;

use super::error::{CommandError, GiveUpReason, LastAnswer};
use super::key::command_key;
use super::policy::{transport_reason, RetryReason, Verdict, REPLAYED};
use super::retry_after::retry_after;
use super::{AttemptBody, CommandReceipt, ResponseBody, RetryPolicy};
use crate::body::BoxError;
use crate::metrics::{CLIENT_ATTEMPTS, CLIENT_GIVE_UPS, CLIENT_RETRIES};

/// The most of an answer's body read to classify it (a problem+json) or keep it in the
/// error: the crate's problems are a few hundred bytes.
const ANSWER_LIMIT: usize = 64 * 1024;

/// The request body: buffered for every attempt, or the caller's own for one attempt.
enum Payload<B> {
    Replayable(Bytes),
    Once(B, GiveUpReason),
}

/// What one attempt came to.
enum Outcome<ResBody> {
    Final(Response<ResponseBody<ResBody>>),
    Retry {
        reason: RetryReason,
        last: LastAnswer,
        retry_after: Option<Duration>,
    },
}

pub(crate) async fn run<S, B, ResBody>(
    inner: S,
    policy: Arc<RetryPolicy>,
    request: Request<B>,
) -> Result<Response<ResponseBody<ResBody>>, CommandError>
where
    S: Service<Request<AttemptBody<B>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let (mut parts, body) = request.into_parts();
    let Some(key) = command_key(&mut parts, &policy)? else {
        return pass_through(inner, parts, body).await;
    };
    // The key is no secret (the server's spans carry it at the same level): it is what an
    // operator searches the server's logs for.
    let span = tracing::debug_span!(
        "tower_inbox.client.command",
        message_id = %key,
        attempts = Empty,
        outcome = Empty,
    );
    command(inner, &policy, parts, body, key)
        .instrument(span)
        .await
}

async fn pass_through<S, B, ResBody>(
    mut inner: S,
    parts: Parts,
    body: B,
) -> Result<Response<ResponseBody<ResBody>>, CommandError>
where
    S: Service<Request<AttemptBody<B>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
{
    match inner
        .call(Request::from_parts(parts, Either::Right(body)))
        .await
    {
        Ok(response) => Ok(response.map(Either::Right)),
        Err(e) => {
            let (reason, last) = transport_failure(e.into());
            Err(CommandError::new(
                None,
                1,
                GiveUpReason::NotRetried,
                Some(last),
                reason != RetryReason::Refused,
            ))
        }
    }
}

async fn command<S, B, ResBody>(
    mut inner: S,
    policy: &RetryPolicy,
    parts: Parts,
    body: B,
    key: String,
) -> Result<Response<ResponseBody<ResBody>>, CommandError>
where
    S: Service<Request<AttemptBody<B>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    // `None`: a budget too large to represent, which is no budget.
    let deadline = Instant::now().checked_add(policy.max_total_time);
    let payload = match prepare(body, policy.body_limit).await {
        Ok(payload) => payload,
        Err(e) => {
            give_up_metric(GiveUpReason::BodyUnreadable);
            return Err(CommandError::before_sending(
                Some(key),
                GiveUpReason::BodyUnreadable,
                Some(e),
            ));
        }
    };
    let bytes = match payload {
        Payload::Replayable(bytes) => bytes,
        Payload::Once(body, why) => {
            let request = Request::from_parts(clone_parts(&parts), Either::Right(body));
            return match attempt(&mut inner, policy, request, 1, deadline).await {
                Outcome::Final(response) => Ok(finish(response, key, 1)),
                Outcome::Retry { reason, last, .. } => {
                    let reached = reason != RetryReason::Refused;
                    Err(give_up(key, (1, reached), why, last))
                }
            };
        }
    };
    let mut attempts = 0;
    // Whether any attempt may have reached the server: every one refused means that the
    // command cannot have committed.
    let mut reached = false;
    loop {
        attempts += 1;
        let request =
            Request::from_parts(clone_parts(&parts), Either::Left(Full::new(bytes.clone())));
        let (reason, last, asked) =
            match attempt(&mut inner, policy, request, attempts, deadline).await {
                Outcome::Final(response) => return Ok(finish(response, key, attempts)),
                Outcome::Retry {
                    reason,
                    last,
                    retry_after,
                } => (reason, last, retry_after),
            };
        reached |= reason != RetryReason::Refused;
        let made = (attempts, reached);
        if attempts >= policy.max_attempts {
            return Err(give_up(key, made, GiveUpReason::Attempts, last));
        }
        let wait = policy
            .jittered_backoff(attempts)
            .max(asked.unwrap_or_default());
        let past_deadline = match (deadline, Instant::now().checked_add(wait)) {
            (None, _) => false,
            (Some(deadline), Some(resume)) => resume >= deadline,
            (Some(_), None) => true,
        };
        if past_deadline {
            return Err(give_up(key, made, GiveUpReason::Deadline, last));
        }
        ::metrics::counter!(CLIENT_RETRIES, "reason" => reason.label()).increment(1);
        tokio::time::sleep(wait).await;
    }
}

/// Buffers a body whose size is known and within `limit`; any other is sent once.
async fn prepare<B>(body: B, limit: usize) -> Result<Payload<B>, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let limit_u64 = u64::try_from(limit).unwrap_or(u64::MAX);
    match body.size_hint().exact() {
        Some(size) if size <= limit_u64 => {
            let collected = Limited::new(body, limit).collect().await?;
            Ok(Payload::Replayable(collected.to_bytes()))
        }
        Some(_) => Ok(Payload::Once(body, GiveUpReason::BodyOverLimit)),
        None => Ok(Payload::Once(body, GiveUpReason::BodyStreamed)),
    }
}

/// The method, URI, version, headers and extensions of every attempt: those of the
/// caller's request, the key included.
fn clone_parts(parts: &Parts) -> Parts {
    let mut request = Request::new(());
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    *request.extensions_mut() = parts.extensions.clone();
    request.into_parts().0
}

async fn attempt<S, B, ResBody>(
    inner: &mut S,
    policy: &RetryPolicy,
    request: Request<AttemptBody<B>>,
    number: u32,
    deadline: Option<Instant>,
) -> Outcome<ResBody>
where
    S: Service<Request<AttemptBody<B>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let span = tracing::debug_span!(
        "tower_inbox.client.attempt",
        attempt = number,
        outcome = Empty
    );
    let outcome = async {
        ::metrics::counter!(CLIENT_ATTEMPTS).increment(1);
        let timeout_at = match policy
            .attempt_timeout
            .and_then(|t| Instant::now().checked_add(t))
        {
            Some(at) => Some(deadline.map_or(at, |d| d.min(at))),
            None => deadline,
        };
        let limited = bounded(timeout_at, answer(inner, policy, request)).await;
        let outcome = limited.unwrap_or(Outcome::Retry {
            reason: RetryReason::Timeout,
            last: LastAnswer::TimedOut,
            retry_after: None,
        });
        let label = match &outcome {
            Outcome::Final(_) => "final".to_owned(),
            Outcome::Retry { reason, .. } => reason.label(),
        };
        tracing::Span::current().record("outcome", label.as_str());
        outcome
    };
    outcome.instrument(span).await
}

/// `future`, or `None` if `at` comes first.
async fn bounded<F: std::future::Future>(at: Option<Instant>, future: F) -> Option<F::Output> {
    match at {
        Some(at) => tokio::time::timeout_at(at, future).await.ok(),
        None => Some(future.await),
    }
}

/// Sends one attempt and classifies its answer, reading the body where that takes it.
async fn answer<S, B, ResBody>(
    inner: &mut S,
    policy: &RetryPolicy,
    request: Request<AttemptBody<B>>,
) -> Outcome<ResBody>
where
    S: Service<Request<AttemptBody<B>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let transport = |e: BoxError| {
        let (reason, last) = transport_failure(e);
        Outcome::Retry {
            reason,
            last,
            retry_after: None,
        }
    };
    if let Err(e) = poll_fn(|cx| inner.poll_ready(cx)).await {
        return transport(e.into());
    }
    let response = match inner.call(request).await {
        Ok(response) => response,
        Err(e) => return transport(e.into()),
    };
    let retry = |reason, parts: http::response::Parts, body| Outcome::Retry {
        reason,
        retry_after: retry_after(&parts.headers, SystemTime::now()),
        last: LastAnswer::Response {
            status: parts.status,
            headers: parts.headers,
            body,
        },
    };
    match policy.verdict(response.status(), response.headers()) {
        Verdict::Final => Outcome::Final(response.map(Either::Right)),
        Verdict::Retry(reason) => {
            let (parts, body) = response.into_parts();
            // Read to its end so that the connection can serve the next attempt.
            let body = read(body).await.unwrap_or_default();
            retry(reason, parts, body)
        }
        Verdict::ReadProblem => {
            let (parts, body) = response.into_parts();
            let body = match read(body).await {
                Ok(body) => body,
                Err(e) => return transport(e),
            };
            match policy.problem(&body) {
                Some(reason) => retry(reason, parts, body),
                None => Outcome::Final(Response::from_parts(parts, Either::Left(Full::new(body)))),
            }
        }
    }
}

async fn read<ResBody>(body: ResBody) -> Result<Bytes, BoxError>
where
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    Ok(Limited::new(body, ANSWER_LIMIT).collect().await?.to_bytes())
}

fn finish<ResBody>(
    mut response: Response<ResponseBody<ResBody>>,
    key: String,
    attempts: u32,
) -> Response<ResponseBody<ResBody>> {
    let replayed = response
        .headers()
        .get(REPLAYED)
        .is_some_and(|v| v == "true");
    let span = tracing::Span::current();
    span.record("attempts", attempts);
    span.record("outcome", if replayed { "replayed" } else { "answered" });
    response.extensions_mut().insert(CommandReceipt {
        key,
        attempts,
        replayed,
    });
    response
}

/// A failed attempt's reason to retry and its last answer: refused, or any other failure.
fn transport_failure(error: BoxError) -> (RetryReason, LastAnswer) {
    match transport_reason(error.as_ref()) {
        RetryReason::Refused => (RetryReason::Refused, LastAnswer::Refused(error)),
        reason => (reason, LastAnswer::Transport(error)),
    }
}

/// Gives up after `(attempts, reached)`: the attempts made and whether any may have
/// reached the server.
fn give_up(
    key: String,
    (attempts, reached): (u32, bool),
    reason: GiveUpReason,
    last: LastAnswer,
) -> CommandError {
    give_up_metric(reason);
    let span = tracing::Span::current();
    span.record("attempts", attempts);
    span.record("outcome", reason.label());
    CommandError::new(Some(key), attempts, reason, Some(last), reached)
}

fn give_up_metric(reason: GiveUpReason) {
    ::metrics::counter!(CLIENT_GIVE_UPS, "reason" => reason.label()).increment(1);
}
