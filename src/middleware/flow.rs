//! One guarded request, start to end: the protocol table of the crate docs, in order.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use ::metrics::Label;
use axum::body::Body;
use axum::response::IntoResponse;
use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower::Service;
use tracing::Instrument;

use super::layer::{InboxConfig, IDEMPOTENT_REPLAYED};
use crate::extract::TxSlot;
use crate::fingerprint::{CommandPayload, Fingerprint};
use crate::identity::MessageIdentity;
use crate::inbox::{
    headers_len, Claim, ClaimMode, ClaimedMessage, Finished, Inbox, InboxEntry, InboxError,
    RecordedResponse, RetryReason,
};
use crate::key::{KeyError, MessageKey};
use crate::metrics as m;
use crate::outcome::Outcome;
use crate::problem::{Problem, ProblemKind};

pub(crate) async fn run<S, ReqBody, ResBody>(
    config: Arc<InboxConfig>,
    inner: S,
    request: Request<ReqBody>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<axum::BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
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
    config.inbox.metric_labels().of_consumer(&config.consumer)
}

fn key_missing(config: &InboxConfig, action: &str) {
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
    problem.into_response()
}

async fn pass_through<S, B, ResBody>(
    mut inner: S,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    let response = inner.call(request.map(Body::new)).await?;
    Ok(response.map(Body::new))
}

fn read_key(headers: &HeaderMap, config: &InboxConfig) -> Result<Option<MessageKey>, KeyError> {
    let mut values = headers.get_all(&config.key_header).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    MessageKey::parse(value.as_bytes(), config.max_key_len).map(Some)
}

fn fingerprint(config: &InboxConfig, parts: &Parts, body: &[u8]) -> Fingerprint {
    let payload = CommandPayload {
        method: parts.method.as_str(),
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path(), |pq| pq.as_str()),
        content_type: parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
        body,
    };
    config.fingerprint.fingerprint(&payload)
}

enum ReadError {
    TooLarge,
    Failed(axum::BoxError),
}

/// Buffers a body up to `limit` bytes; a declared length over it is refused unread.
async fn read_limited<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<axum::BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => Err(ReadError::TooLarge),
        Err(err) => Err(ReadError::Failed(err)),
    }
}

/// A guarded request whose key, producer and body passed the checks.
struct Command {
    config: Arc<InboxConfig>,
    identity: MessageIdentity,
    fingerprint: Fingerprint,
    parts: Parts,
    body: Bytes,
}

/// Where one attempt at a command ended.
enum Step {
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

impl Command {
    /// Claims and runs the command, re-running the whole transaction after transient
    /// failures within the configured bound.
    async fn claim_and_run<S, ResBody>(self, inner: S) -> Result<Response<Body>, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Clone,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<axum::BoxError>,
    {
        if let Some(Step::Answer(outcome, response)) = self.answer_cached().await {
            tracing::Span::current().record("outcome", outcome);
            return Ok(response);
        }
        let retry = self.config.transient_retry;
        // A lost connection reruns on another one. After a restart every idle connection of
        // the pool is dead, and each fails (and is closed) once, however many a run meets in
        // a row: such reruns get the pool's size on top of the bound.
        let connection_budget = retry
            .max_attempts()
            .saturating_add(self.config.inbox.pool().options().get_max_connections());
        let mut services = Services::new(inner);
        let (mut attempt, mut conflicts, mut lost) = (1, 0, 0);
        loop {
            let (reason, ran_handler, commit_in_flight) =
                match self.attempt(&mut services, attempt).await? {
                    Step::Answer(outcome, response) => {
                        tracing::Span::current().record("outcome", outcome);
                        return Ok(response);
                    }
                    Step::Rerun {
                        reason,
                        ran_handler,
                        commit_in_flight,
                    } => (reason, ran_handler, commit_in_flight),
                };
            if reason == RetryReason::ConnectionLost {
                lost += 1;
                if lost >= connection_budget {
                    return Ok(self.connection_lost(lost, commit_in_flight));
                }
            } else {
                conflicts += 1;
                if conflicts >= retry.max_attempts() {
                    return Ok(self
                        .conflicts_exhausted(reason, conflicts, ran_handler)
                        .await);
                }
            }
            m::count_with(
                m::TRANSACTION_RETRIES,
                &consumer_labels(&self.config),
                "reason",
                reason.as_str(),
            );
            let delay = retry.delay(if reason == RetryReason::ConnectionLost {
                lost.min(retry.max_attempts())
            } else {
                conflicts
            });
            tracing::info!(%reason, attempt, ?delay, "transaction rolled back; running it again");
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    async fn attempt<S, ResBody>(
        &self,
        services: &mut Services<S>,
        attempt: u32,
    ) -> Result<Step, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Clone,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<axum::BoxError>,
    {
        let config = &self.config;
        // A re-run waits for the inner service to be ready before it claims, so that a
        // concurrency limit or load shedder inside does not hold a claim (a pooled connection
        // and the key's lock) while it waits. The first run's service is ready already.
        let mut ready = if attempt > 1 {
            Some(services.ready().await?)
        } else {
            None
        };
        let claim = match config.claim_mode {
            ClaimMode::First => {
                config
                    .inbox
                    .claim(
                        self.identity.clone(),
                        self.fingerprint,
                        &config.handler_version,
                        config.in_flight_wait,
                    )
                    .await
            }
            // Nothing is claimed yet: the claim is the commit's last statement. A finished
            // (or in-flight) duplicate is still answered before the handler runs.
            ClaimMode::AtCommit => {
                let inbox = &config.inbox;
                let started = std::time::Instant::now();
                let mut waited = false;
                match inbox
                    .answer_before_claim(
                        &self.identity,
                        &self.fingerprint,
                        started + config.in_flight_wait,
                        &mut waited,
                    )
                    .await
                {
                    Ok(Some(answer)) => {
                        inbox.observe_taken(true);
                        let labels = inbox.metric_labels().of(&self.identity);
                        crate::inbox::count_claim(&answer, &labels);
                        if waited {
                            m::observe_seconds(
                                m::CLAIM_WAIT,
                                &consumer_labels(config),
                                started.elapsed().as_secs_f64(),
                            );
                        }
                        Ok(answer)
                    }
                    Ok(None) => inbox
                        .begin_at_commit(
                            self.identity.clone(),
                            self.fingerprint,
                            &config.handler_version,
                            config.in_flight_wait,
                        )
                        .await
                        .map(Claim::Claimed),
                    Err(err) => Err(err),
                }
            }
        };
        let step = match claim {
            Ok(Claim::Claimed(message)) => {
                let service = match ready.take() {
                    Some(service) => service,
                    None => services.ready().await?,
                };
                return self.run_handler(service, TxSlot::new(message)).await;
            }
            Ok(seen) => self.answer_seen(seen).await,
            Err(err) => match err.retry_reason() {
                Some(reason) => Step::Rerun {
                    reason,
                    ran_handler: false,
                    commit_in_flight: false,
                },
                None => Step::Answer("database-error", database_problem(config, &err)),
            },
        };
        Ok(step)
    }

    /// The answer when the key was claimed before: by the claim, or (claim at commit) by the
    /// commit, after this transaction rolled back.
    async fn answer_seen(&self, claim: Claim) -> Step {
        match claim {
            Claim::Duplicate(entry) => {
                let step = self.replayed(&entry);
                if let Some(cache) = &self.config.replay_cache {
                    cache.insert(&self.identity, self.fingerprint, entry);
                }
                step
            }
            Claim::Conflict(entry) => self.conflict(&entry).await,
            Claim::InProgress => {
                let problem = Problem::new(
                    ProblemKind::InProgress,
                    "a request with this key is still being processed; retry later",
                )
                .retry_after(self.config.retry_after_secs);
                Step::Answer("in-progress", problem.into_response())
            }
            Claim::Claimed(message) => {
                // Only a claim that found the key taken gets here; never commit this one.
                tracing::error!("a claimed message reached the answer for a taken key");
                discard(message).await;
                let problem = Problem::new(
                    ProblemKind::Internal,
                    "the inbox could not process the request; nothing was committed",
                );
                Step::Answer("internal", problem.into_response())
            }
        }
    }

    /// Replays the recorded response of a finished command.
    fn replayed(&self, entry: &InboxEntry) -> Step {
        let span = tracing::debug_span!(
            "inbox.replay",
            consumer = %self.identity.consumer(),
            message_id = %self.identity.message_id(),
            status = entry.response.as_ref().map(|r| r.status),
        );
        Step::Answer("replayed", span.in_scope(|| replay(entry)))
    }

    /// Refuses a key reused with a different payload, and quarantines the conflict.
    async fn conflict(&self, entry: &InboxEntry) -> Step {
        let config = &self.config;
        tracing::warn!(
            recorded_sha256 = %entry.payload_sha256,
            sha256 = %self.fingerprint,
            "idempotency key reused with a different payload"
        );
        // The answer does not depend on keeping the record; a failure is logged.
        if let Err(err) = config
            .inbox
            .record_conflict(&self.identity, self.fingerprint, &config.handler_version)
            .await
        {
            tracing::error!(error = %err, "could not quarantine the identity conflict");
        }
        let detail = format!(
            "this {} was already used for a different request; use a new key for a new command",
            config.key_header
        );
        let problem =
            Problem::new(ProblemKind::PayloadMismatch, detail).with_status(config.mismatch_status);
        Step::Answer("conflict", problem.into_response())
    }

    /// Answers a command this process finished from the replay cache, if it holds it: the
    /// recorded response, or the conflict if the payload differs; `None` to claim.
    async fn answer_cached(&self) -> Option<Step> {
        let config = &self.config;
        let hit = config.replay_cache.as_ref()?.get(&self.identity)?;
        let labels = config.inbox.metric_labels();
        m::count(m::CACHE_HITS, &labels.of_consumer(&config.consumer), 1);
        if hit.fingerprint != self.fingerprint {
            m::count(m::IDENTITY_CONFLICTS, &labels.of(&self.identity), 1);
            return Some(self.conflict(&hit.entry).await);
        }
        m::count(m::DUPLICATES, &labels.of(&self.identity), 1);
        Some(self.replayed(&hit.entry))
    }

    async fn run_handler<S, ResBody>(&self, mut service: S, slot: TxSlot) -> Result<Step, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>>,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<axum::BoxError>,
    {
        let config = &self.config;
        // The buffered request is cloned for each attempt (the body is reference-counted),
        // so a re-run sees exactly what the first run saw.
        let mut parts = self.parts.clone();
        parts.extensions.insert(slot.clone());
        let request = Request::from_parts(parts, Body::from(self.body.clone()));
        let attempt = Attempt::new(self);
        let handler_span = tracing::debug_span!(
            "inbox.handler",
            consumer = %self.identity.consumer(),
            message_id = %self.identity.message_id(),
            status = tracing::field::Empty,
        );
        // `call` runs inside the caught future, so a panic while building the handler's
        // future is caught as well as one while polling it.
        let result = AssertUnwindSafe(async { service.call(request).await })
            .catch_unwind()
            .instrument(handler_span.clone())
            .await;
        let response = match result {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => {
                roll_back(&slot).await;
                attempt.failed("service-error").await;
                tracing::Span::current().record("outcome", "service-error");
                return Err(err);
            }
            Err(panic) => {
                let message = panic_message(panic.as_ref());
                tracing::error!(panic = %message, "handler panicked; rolled back");
                roll_back(&slot).await;
                attempt.failed("handler-panicked").await;
                let problem = Problem::new(
                    ProblemKind::HandlerPanicked,
                    "the handler failed; nothing was committed and the request may be retried",
                );
                return Ok(Step::Answer("handler-panicked", problem.into_response()));
            }
        };
        handler_span.record("status", response.status().as_u16());
        // A watched statement failed with 40001/40P01 (the transaction is aborted whatever
        // the handler made of it), or the handler asked for a re-run.
        if let Some(reason) = slot.retry_reason() {
            roll_back(&slot).await;
            attempt.finish();
            return Ok(Step::Rerun {
                reason,
                ran_handler: true,
                commit_in_flight: false,
            });
        }
        match config.outcome.decide(response.status()) {
            Outcome::Reject => {
                roll_back(&slot).await;
                attempt.finish();
                return Ok(Step::Answer("rejected", response.map(Body::new)));
            }
            Outcome::Fail => {
                roll_back(&slot).await;
                attempt.failed("handler-error-status").await;
                return Ok(Step::Answer("handler-failed", response.map(Body::new)));
            }
            Outcome::Commit => {}
        }
        // Taken back before the body is read: a body that holds the transaction (a stream
        // that owns the InboxTx) is a leak too, and must not get to make more writes, or
        // ask for a re-run, after the decision to commit.
        let Some(message) = slot.take() else {
            // A handle to the transaction is still alive somewhere: committing now could
            // race with writes the handler is still making. It rolls back when dropped.
            tracing::error!("handler kept the inbox transaction past its response; not committed");
            attempt.failed("transaction-leaked").await;
            let problem = Problem::new(
                ProblemKind::TransactionLeaked,
                "the handler kept the inbox transaction after answering; nothing was committed",
            );
            return Ok(Step::Answer("transaction-leaked", problem.into_response()));
        };
        let (response_parts, response_body) = response.into_parts();
        let headers = recordable_headers(&response_parts.headers);
        // Headers count against the recording limit like the body: both are stored and
        // replayed. The body gets what the headers leave.
        let body_limit = config.response_limit.checked_sub(headers_len(&headers));
        let read = match body_limit {
            Some(limit) => read_limited(response_body, limit).await,
            None => Err(ReadError::TooLarge),
        };
        let body = match read {
            Ok(body) => body,
            Err(err) => {
                discard(message).await;
                let (kind, reason, detail) = match err {
                    ReadError::TooLarge => (
                        ProblemKind::ResponseTooLarge,
                        "response-too-large",
                        format!(
                            "the response (headers and body) is over the {} byte recording limit; \
                             nothing was committed",
                            config.response_limit
                        ),
                    ),
                    ReadError::Failed(err) => (
                        ProblemKind::ResponseUnreadable,
                        "response-unreadable",
                        format!("the response body failed ({err}); nothing was committed"),
                    ),
                };
                attempt.failed(reason).await;
                return Ok(Step::Answer(
                    reason,
                    Problem::new(kind, detail).into_response(),
                ));
            }
        };
        let recorded = RecordedResponse {
            status: response_parts.status.as_u16(),
            headers,
            body: body.clone(),
        };
        // From here the outcome is the database's, not the handler's.
        attempt.finish();
        Ok(match message.finish(Some(&recorded)).await {
            Ok(Finished::Committed) => {
                if let Some(cache) = &config.replay_cache {
                    let entry = InboxEntry {
                        payload_sha256: self.fingerprint.to_hex(),
                        handler_version: config.handler_version.to_string(),
                        processed: true,
                        response: Some(recorded),
                    };
                    cache.insert(&self.identity, self.fingerprint, entry);
                }
                Step::Answer(
                    "committed",
                    Response::from_parts(response_parts, Body::from(body)),
                )
            }
            // Claim at commit: the key was taken meanwhile and everything rolled back.
            Ok(Finished::ClaimedElsewhere(seen)) => self.answer_seen(*seen).await,
            Err(err) => match err.retry_reason() {
                Some(reason) => Step::Rerun {
                    reason,
                    ran_handler: true,
                    commit_in_flight: err.may_have_committed(),
                },
                None => Step::Answer("commit-failed", database_problem(config, &err)),
            },
        })
    }

    /// The answer once every run lost its connection: the database is down, restarting or
    /// unreachable. Whether the last run committed is unknown if its `COMMIT` was in flight.
    fn connection_lost(&self, runs: u32, commit_in_flight: bool) -> Response<Body> {
        tracing::error!(runs, "every run lost its database connection; giving up");
        tracing::Span::current().record("outcome", "connection-lost");
        let detail = if commit_in_flight {
            format!(
                "the connection to the database failed {runs} times, the last time while the \
                 command was committing, so whether it committed is unknown; a retry with the \
                 same key is safe: it replays the response if the command committed, or runs it \
                 if it did not"
            )
        } else {
            format!(
                "the connection to the database failed {runs} times; nothing was committed, \
                 retry with the same key"
            )
        };
        Problem::new(ProblemKind::Unavailable, detail)
            .retry_after(self.config.retry_after_secs)
            .into_response()
    }

    /// The answer once every attempt hit a transient failure: nothing committed.
    async fn conflicts_exhausted(
        &self,
        reason: RetryReason,
        attempts: u32,
        ran_handler: bool,
    ) -> Response<Body> {
        tracing::warn!(%reason, attempts, "transaction kept conflicting; giving up");
        if ran_handler {
            record_failure(Attempt::new(self).disarm(), "transaction-conflict").await;
        }
        tracing::Span::current().record("outcome", "transaction-conflict");
        Problem::new(
            ProblemKind::TransactionConflict,
            format!(
                "the transaction conflicted with concurrent ones {attempts} times ({reason}); \
                 nothing was committed, retry with the same key"
            ),
        )
        .retry_after(self.config.retry_after_secs)
        .into_response()
    }
}

/// The inner service for each run of the handler: the one the caller drove to readiness
/// first, then fresh clones of it, each driven to readiness in turn.
struct Services<S> {
    service: S,
    fresh: bool,
}

impl<S: Service<Request<Body>> + Clone> Services<S> {
    fn new(ready: S) -> Self {
        Self {
            service: ready,
            fresh: true,
        }
    }

    async fn ready(&mut self) -> Result<S, S::Error> {
        // Cloned only once a claim needs the handler: replays never pay for it.
        let mut next = self.service.clone();
        if std::mem::take(&mut self.fresh) {
            // Hand out the service the caller made ready; keep the clone for re-runs.
            return Ok(std::mem::replace(&mut self.service, next));
        }
        std::future::poll_fn(|cx| next.poll_ready(cx)).await?;
        Ok(next)
    }
}

/// Counts a failed attempt unless it is finished normally; dropped unfinished (the client
/// went away mid-handler), it counts one from a spawned task.
struct Attempt {
    inbox: Inbox,
    identity: MessageIdentity,
    fingerprint: Fingerprint,
    handler_version: Arc<str>,
    quarantine_after: u32,
    armed: bool,
}

impl Attempt {
    fn new(command: &Command) -> Self {
        Self {
            inbox: command.config.inbox.clone(),
            identity: command.identity.clone(),
            fingerprint: command.fingerprint,
            handler_version: command.config.handler_version.clone(),
            quarantine_after: command.config.quarantine_after,
            armed: true,
        }
    }

    fn finish(mut self) {
        self.armed = false;
    }

    /// What a failure of this attempt is recorded with, without counting one on drop.
    fn disarm(mut self) -> FailedAttempt {
        self.armed = false;
        self.failure()
    }

    async fn failed(mut self, reason: &'static str) {
        self.armed = false;
        record_failure(self.failure(), reason).await;
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let failure = self.failure();
        runtime.spawn(record_failure(failure, "client-gone"));
    }
}

/// What a failed attempt is recorded with; owned, so a spawned task can take it.
struct FailedAttempt {
    inbox: Inbox,
    identity: MessageIdentity,
    fingerprint: Fingerprint,
    handler_version: Arc<str>,
    quarantine_after: u32,
}

impl Attempt {
    fn failure(&self) -> FailedAttempt {
        FailedAttempt {
            inbox: self.inbox.clone(),
            identity: self.identity.clone(),
            fingerprint: self.fingerprint,
            handler_version: self.handler_version.clone(),
            quarantine_after: self.quarantine_after,
        }
    }
}

async fn record_failure(f: FailedAttempt, reason: &'static str) {
    let (consumer, message_id) = (f.identity.consumer(), f.identity.message_id());
    tracing::warn!(consumer, %message_id, reason, "attempt rolled back");
    let recorded = f
        .inbox
        .record_failure(
            &f.identity,
            f.fingerprint,
            &f.handler_version,
            reason,
            f.quarantine_after,
        )
        .await;
    match recorded {
        Ok(Some(item)) => {
            tracing::warn!(consumer, %message_id, item, "command quarantined after repeated failures");
        }
        Ok(None) => {}
        Err(err) => {
            tracing::error!(consumer, %message_id, error = %err, "could not count the failed attempt");
        }
    }
}

async fn roll_back(slot: &TxSlot) {
    // None means a leaked handle still holds the transaction; it rolls back when dropped.
    if let Some(message) = slot.take() {
        discard(message).await;
    }
}

async fn discard(message: ClaimedMessage) {
    if let Err(err) = message.rollback().await {
        // The connection is discarded by the pool; the server rolls back on its own.
        tracing::warn!(error = %err, "rollback failed");
    }
}

fn database_problem(config: &InboxConfig, err: &InboxError) -> Response<Body> {
    tracing::error!(error = %err, "inbox database error");
    let problem = if err.may_have_committed() {
        Problem::new(
            ProblemKind::Unavailable,
            "the connection to the database failed while the command was committing, so \
             whether it committed is unknown; a retry with the same key is safe: it replays \
             the response if the command committed, or runs it if it did not",
        )
        .retry_after(config.retry_after_secs)
    } else if err.is_retryable() {
        Problem::new(
            ProblemKind::Unavailable,
            "the service cannot reach its database; nothing was committed, retry with the same key",
        )
        .retry_after(config.retry_after_secs)
    } else {
        Problem::new(
            ProblemKind::Internal,
            "the inbox could not process the request; nothing was committed",
        )
    };
    problem.into_response()
}

/// Hop-by-hop headers describe one connection, not the response; they are not replayed.
fn recordable_headers(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    const HOP_BY_HOP: [&str; 7] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    headers
        .iter()
        .filter(|(name, _)| !HOP_BY_HOP.contains(&name.as_str()))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect()
}

fn replay(entry: &InboxEntry) -> Response<Body> {
    let Some(recorded) = &entry.response else {
        return Problem::new(
            ProblemKind::Internal,
            "this command was processed by a consumer that recorded no response to replay",
        )
        .into_response();
    };
    let mut response = Response::new(Body::from(recorded.body.clone()));
    let Ok(status) = http::StatusCode::from_u16(recorded.status) else {
        return corrupt_record();
    };
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in &recorded.headers {
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            (Ok(name), Ok(value)) => {
                headers.append(name, value);
            }
            _ => return corrupt_record(),
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

fn corrupt_record() -> Response<Body> {
    tracing::error!("recorded response in the inbox is not a valid HTTP response");
    Problem::new(
        ProblemKind::Internal,
        "the recorded response for this key cannot be replayed",
    )
    .into_response()
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
