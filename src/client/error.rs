//! The error of a command the client layer could not bring to a final answer.

use std::fmt;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use crate::body::BoxError;

/// Why the layer stopped without a final answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GiveUpReason {
    /// [`max_attempts`](super::RetryPolicy::max_attempts) attempts were made, each with an
    /// answer worth retrying.
    Attempts,
    /// The [total time](super::RetryPolicy::max_total_time) ran out, or the wait the server
    /// asked for (`Retry-After`) would end past it.
    Deadline,
    /// The body could not be sent again: its size was not known up front (a stream).
    BodyStreamed,
    /// The body could not be sent again: it was over the
    /// [`body_limit`](super::RetryPolicy::body_limit).
    BodyOverLimit,
    /// The request body failed while being read for replay; nothing was sent.
    BodyUnreadable,
    /// The caller's `Idempotency-Key` was repeated or not visible ASCII, or the generator's
    /// was not a valid header value; nothing was sent.
    InvalidKey,
    /// The inner service failed on a request the layer does not retry (no key, a method
    /// outside [`key_methods`](super::RetryPolicy::key_methods)), or was not ready.
    NotRetried,
}

impl GiveUpReason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Attempts => "attempts",
            Self::Deadline => "deadline",
            Self::BodyStreamed | Self::BodyOverLimit => "not-replayable",
            Self::BodyUnreadable => "body-unreadable",
            Self::InvalidKey => "invalid-key",
            Self::NotRetried => "not-retried",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Attempts => "the attempts ran out",
            Self::Deadline => "the time budget ran out",
            Self::BodyStreamed => {
                "the request body is a stream (its size was not known up front), so it was sent once and not retried"
            }
            Self::BodyOverLimit => {
                "the request body is over the replay limit, so it was sent once and not retried"
            }
            Self::BodyUnreadable => "the request body could not be read",
            Self::InvalidKey => "the Idempotency-Key is repeated or not a visible ASCII string",
            Self::NotRetried => "the request has no key and is not retried",
        }
    }
}

/// The last answer before the layer gave up.
#[derive(Debug)]
#[non_exhaustive]
pub enum LastAnswer {
    /// A response worth retrying (a 503, a 409 `in-progress`, ...). Its body is the first
    /// 64 KiB at most, empty if it failed or was longer.
    Response {
        /// Its status.
        status: StatusCode,
        /// Its headers.
        headers: HeaderMap,
        /// Its body.
        body: Bytes,
    },
    /// The connection was refused: the attempt never reached the server.
    Refused(BoxError),
    /// The inner service failed without an answer, after the request may have reached the
    /// server (the connection reset, the answer cut off).
    Transport(BoxError),
    /// The attempt timed out.
    TimedOut,
}

/// A command the layer could not bring to a final answer: the key it used, the attempts it
/// made and the last answer, so that the caller can send it again later with the same key.
///
/// Its `Display` is one line without any body.
#[derive(Debug)]
pub struct CommandError(Box<Details>);

/// Boxed: the error travels through every `Result` of the call, mostly as `Ok`.
#[derive(Debug)]
struct Details {
    key: Option<String>,
    attempts: u32,
    reason: GiveUpReason,
    last: Option<LastAnswer>,
    /// Whether any attempt may have reached the server.
    reached: bool,
    /// What failed before any attempt: the request body, the inner service's readiness.
    cause: Option<BoxError>,
}

impl CommandError {
    pub(crate) fn new(
        key: Option<String>,
        attempts: u32,
        reason: GiveUpReason,
        last: Option<LastAnswer>,
        reached: bool,
    ) -> Self {
        Self(Box::new(Details {
            key,
            attempts,
            reason,
            last,
            reached,
            cause: None,
        }))
    }

    pub(crate) fn before_sending(
        key: Option<String>,
        reason: GiveUpReason,
        cause: Option<BoxError>,
    ) -> Self {
        let mut error = Self::new(key, 0, reason, None, false);
        error.0.cause = cause;
        error
    }

    /// The `Idempotency-Key` every attempt carried; `None` when the request had none.
    pub fn key(&self) -> Option<&str> {
        self.0.key.as_deref()
    }

    /// The attempts made (0 when nothing was sent).
    pub fn attempts(&self) -> u32 {
        self.0.attempts
    }

    /// Whether any attempt may have reached the server. `false` when nothing was sent or
    /// every connection was refused: then the command cannot have committed, whatever its
    /// key. `true` says only that it may have; sending it again with the same key finds out.
    pub fn reached_server(&self) -> bool {
        self.0.reached
    }

    /// Why the layer stopped.
    pub fn reason(&self) -> GiveUpReason {
        self.0.reason
    }

    /// The last answer, if an attempt was made.
    pub fn last_answer(&self) -> Option<&LastAnswer> {
        self.0.last.as_ref()
    }

    /// The last answer, taken.
    pub fn into_last_answer(self) -> Option<LastAnswer> {
        self.0.last
    }
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let details = &self.0;
        match &details.key {
            Some(key) => write!(f, "command with key {key:?}")?,
            None => f.write_str("request")?,
        }
        write!(
            f,
            " gave up after {} attempt{}: {}",
            details.attempts,
            if details.attempts == 1 { "" } else { "s" },
            details.reason.describe()
        )?;
        match &details.last {
            Some(LastAnswer::Response { status, .. }) => write!(f, "; last answer: {status}")?,
            Some(LastAnswer::Refused(e)) => {
                write!(f, "; last attempt refused, never reached the server: {e}")?;
            }
            Some(LastAnswer::Transport(e)) => write!(f, "; last attempt failed: {e}")?,
            Some(LastAnswer::TimedOut) => f.write_str("; last attempt timed out")?,
            None => {}
        }
        match &details.cause {
            Some(cause) => write!(f, ": {cause}"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for CommandError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match (&self.0.last, &self.0.cause) {
            (Some(LastAnswer::Transport(e) | LastAnswer::Refused(e)), _) | (_, Some(e)) => {
                Some(e.as_ref())
            }
            _ => None,
        }
    }
}
