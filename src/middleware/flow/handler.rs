//! The handler's run on the claimed transaction, and the recording of what it answered.

use std::panic::AssertUnwindSafe;

use crate::body::Body;
use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use tower::Service;
use tracing::Instrument;

use super::answer::{database_problem, panic_message};
use super::attempt::{discard, roll_back, Attempt};
use super::request::{read_limited, ReadError};
use super::{Command, Step};
use crate::extract::TxSlot;
use crate::inbox::{headers_len, Finished, InboxEntry, RecordedResponse};
use crate::middleware::outcome::Outcome;
use crate::problem::{Problem, ProblemKind};

impl Command {
    pub(super) async fn run_handler<S, ResBody>(
        &self,
        service: &mut S,
        slot: TxSlot,
    ) -> Result<Step, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>>,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<crate::body::BoxError>,
    {
        let config = &self.config;
        // The buffered request is cloned for each attempt (the body is reference-counted),
        // so a re-run sees exactly what the first run saw.
        let mut parts = self.parts.clone();
        parts.extensions.insert(slot.clone());
        let request = Request::from_parts(parts, Body::from(self.body.clone()));
        let attempt = Attempt::new(self).on(&slot);
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
                return Ok(Step::Answer(
                    "handler-panicked",
                    self.config.problem(problem),
                ));
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
            return Ok(Step::Answer(
                "transaction-leaked",
                self.config.problem(problem),
            ));
        };
        let (response_parts, response_body) = response.into_parts();
        let headers = config.replay_headers.recorded(&response_parts.headers);
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
                    self.config.problem(Problem::new(kind, detail)),
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
}

/// The inner service for each run of the handler: the one the caller drove to readiness
/// first, then a fresh clone of it for each re-run, driven to readiness in turn.
pub(super) struct Services<S> {
    service: S,
    ready: bool,
}

impl<S: Service<Request<Body>> + Clone> Services<S> {
    pub(super) fn new(ready: S) -> Self {
        Self {
            service: ready,
            ready: true,
        }
    }

    /// Drives the service for the next run to readiness; a no-op until it has been called.
    pub(super) async fn ready(&mut self) -> Result<(), S::Error> {
        if self.ready {
            return Ok(());
        }
        // Cloned only when a run follows another: the first run calls the caller's service
        // itself, so a command that runs once pays for no clone.
        let mut next = self.service.clone();
        std::future::poll_fn(|cx| next.poll_ready(cx)).await?;
        self.service = next;
        self.ready = true;
        Ok(())
    }

    /// The ready service, for one call: the run after it needs [`ready`](Self::ready) again.
    pub(super) fn for_call(&mut self) -> &mut S {
        debug_assert!(self.ready, "Services::ready must come before each call");
        self.ready = false;
        &mut self.service
    }
}
