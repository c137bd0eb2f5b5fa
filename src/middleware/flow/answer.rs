//! The layer's own answers: replays, problems, and the end of the re-run budget.

use crate::body::Body;
use http::header::{HeaderName, HeaderValue};
use http::Response;

use super::attempt::{record_failure, Attempt};
use super::Command;
use crate::inbox::{InboxEntry, InboxError, RetryReason};
use crate::middleware::config::InboxConfig;
use crate::middleware::config::IDEMPOTENT_REPLAYED;
use crate::problem::{Problem, ProblemKind};

impl Command {
    /// The answer once every run lost its connection: the database is down, restarting or
    /// unreachable. Whether the last run committed is unknown if its `COMMIT` was in flight.
    pub(super) fn connection_lost(&self, runs: u32, commit_in_flight: bool) -> Response<Body> {
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
        self.config.problem(
            Problem::new(ProblemKind::Unavailable, detail)
                .retry_after(self.config.retry_after_secs),
        )
    }

    /// The answer once every attempt hit a transient failure: nothing committed.
    pub(super) async fn conflicts_exhausted(
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
        let problem = Problem::new(
            ProblemKind::TransactionConflict,
            format!(
                "the transaction conflicted with concurrent ones {attempts} times ({reason}); \
                 nothing was committed, retry with the same key"
            ),
        )
        .retry_after(self.config.retry_after_secs);
        self.config.problem(problem)
    }
}

pub(super) fn database_problem(config: &InboxConfig, err: &InboxError) -> Response<Body> {
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
    config.problem(problem)
}

pub(super) fn replay(config: &InboxConfig, entry: &InboxEntry) -> Response<Body> {
    let Some(recorded) = &entry.response else {
        return config.problem(Problem::new(
            ProblemKind::Internal,
            "this command was processed by a consumer that recorded no response to replay",
        ));
    };
    let mut response = Response::new(Body::from(recorded.body.clone()));
    let Ok(status) = http::StatusCode::from_u16(recorded.status) else {
        return corrupt_record(config);
    };
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in &recorded.headers {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) else {
            return corrupt_record(config);
        };
        // A row can name more headers than a header map holds, where `append` would panic.
        if headers.try_append(name, value).is_err() {
            return corrupt_record(config);
        }
    }
    if headers
        .try_insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"))
        .is_err()
    {
        return corrupt_record(config);
    }
    response
}

pub(super) fn corrupt_record(config: &InboxConfig) -> Response<Body> {
    tracing::error!("recorded response in the inbox is not a valid HTTP response");
    config.problem(Problem::new(
        ProblemKind::Internal,
        "the recorded response for this key cannot be replayed",
    ))
}

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
