//! RFC 9457 problem details (`application/problem+json`) for every answer the layer gives on
//! its own.
//!
//! Each case has a stable `type` URI pointing at its section below, so a client can tell
//! "payload mismatch" from "in progress" without parsing prose.
//!
//! ### key-missing
//! `400`. A guarded method came without an `Idempotency-Key` while the key is required.
//!
//! ### key-malformed
//! `400`. The key is empty, longer than the limit, not visible ASCII, a bad RFC 8941 string,
//! or the header was repeated.
//!
//! ### producer-missing
//! `401` (or `400`, configurable). The producer scope (who is asking) is not available, so a
//! recorded response could not be tied to its owner.
//!
//! ### body-too-large
//! `413`. The request body is over the configured limit. Nothing was claimed.
//!
//! ### body-unreadable
//! `400`. The request body could not be read to its end.
//!
//! ### payload-mismatch
//! `409` (or `422`, configurable). The key was used before with a different payload. The
//! original command and its recorded response are untouched; use a new key for a new command.
//!
//! ### in-progress
//! `409` with `Retry-After`. The original request with this key is still being processed.
//!
//! ### unavailable
//! `503` with `Retry-After`. The database could not be reached or did not answer in time;
//! nothing was committed, or the outcome of the commit is unknown. Retrying with the same key
//! is safe either way.
//!
//! ### transaction-conflict
//! `503` with `Retry-After`. The transaction kept failing with serialization failures or
//! deadlocks against concurrent transactions, and the configured re-runs ran out. Nothing was
//! committed; retrying with the same key is safe.
//!
//! ### layer-missing
//! `500`. A handler asked for the inbox transaction on a request the inbox layer did not
//! claim: the layer is not installed on this route, the method is not guarded, or the key was
//! optional and absent.
//!
//! ### transaction-in-use
//! `500`. A handler asked for the inbox transaction twice.
//!
//! ### transaction-leaked
//! `500`. The handler answered while still holding the inbox transaction (it moved it into a
//! task or the response). The layer rolled back: nothing was committed.
//!
//! ### response-too-large
//! `500`. The handler's response is over the recorded-response limit, so it could not be
//! recorded; the layer rolled back.
//!
//! ### response-unreadable
//! `500`. The handler's response body failed while being read for recording; rolled back.
//!
//! ### handler-panicked
//! `500`. The handler panicked; everything it wrote was rolled back.
//!
//! ### internal
//! `500`. The inbox's own query failed for a reason other than availability (for example,
//! missing migrations). Nothing was committed.

use std::fmt;

use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::body::Body;
use serde::Serialize;

const TYPE_BASE: &str = "https://docs.rs/tower-inbox/latest/tower_inbox/problem/index.html#";

/// The stable kinds of problem the layer answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// See [the module docs](self#key-missing).
    KeyMissing,
    /// See [the module docs](self#key-malformed).
    KeyMalformed,
    /// See [the module docs](self#producer-missing).
    ProducerMissing,
    /// See [the module docs](self#body-too-large).
    BodyTooLarge,
    /// See [the module docs](self#body-unreadable).
    BodyUnreadable,
    /// See [the module docs](self#payload-mismatch).
    PayloadMismatch,
    /// See [the module docs](self#in-progress).
    InProgress,
    /// See [the module docs](self#unavailable).
    Unavailable,
    /// See [the module docs](self#transaction-conflict).
    TransactionConflict,
    /// See [the module docs](self#layer-missing).
    LayerMissing,
    /// See [the module docs](self#transaction-in-use).
    TransactionInUse,
    /// See [the module docs](self#transaction-leaked).
    TransactionLeaked,
    /// See [the module docs](self#response-too-large).
    ResponseTooLarge,
    /// See [the module docs](self#response-unreadable).
    ResponseUnreadable,
    /// See [the module docs](self#handler-panicked).
    HandlerPanicked,
    /// See [the module docs](self#internal).
    Internal,
}

impl ProblemKind {
    /// The short stable name, also the anchor of the `type` URI and a metric label.
    pub fn slug(self) -> &'static str {
        match self {
            Self::KeyMissing => "key-missing",
            Self::KeyMalformed => "key-malformed",
            Self::ProducerMissing => "producer-missing",
            Self::BodyTooLarge => "body-too-large",
            Self::BodyUnreadable => "body-unreadable",
            Self::PayloadMismatch => "payload-mismatch",
            Self::InProgress => "in-progress",
            Self::Unavailable => "unavailable",
            Self::TransactionConflict => "transaction-conflict",
            Self::LayerMissing => "layer-missing",
            Self::TransactionInUse => "transaction-in-use",
            Self::TransactionLeaked => "transaction-leaked",
            Self::ResponseTooLarge => "response-too-large",
            Self::ResponseUnreadable => "response-unreadable",
            Self::HandlerPanicked => "handler-panicked",
            Self::Internal => "internal",
        }
    }

    /// The RFC 9457 `type` member.
    pub fn type_uri(self) -> String {
        format!("{TYPE_BASE}{}", self.slug())
    }

    fn title(self) -> &'static str {
        match self {
            Self::KeyMissing => "Idempotency key missing",
            Self::KeyMalformed => "Idempotency key malformed",
            Self::ProducerMissing => "Producer scope not available",
            Self::BodyTooLarge => "Request body too large",
            Self::BodyUnreadable => "Request body unreadable",
            Self::PayloadMismatch => "Idempotency key reused with a different payload",
            Self::InProgress => "Original request still in progress",
            Self::Unavailable => "Service temporarily unavailable",
            Self::TransactionConflict => "Transaction conflicted with concurrent ones",
            Self::LayerMissing => "Inbox transaction not available",
            Self::TransactionInUse => "Inbox transaction already taken",
            Self::TransactionLeaked => "Inbox transaction outlived the handler",
            Self::ResponseTooLarge => "Response too large to record",
            Self::ResponseUnreadable => "Response body failed",
            Self::HandlerPanicked => "Handler panicked",
            Self::Internal => "Inbox error",
        }
    }

    fn default_status(self) -> StatusCode {
        match self {
            Self::KeyMissing | Self::KeyMalformed | Self::BodyUnreadable => StatusCode::BAD_REQUEST,
            Self::ProducerMissing => StatusCode::UNAUTHORIZED,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::PayloadMismatch | Self::InProgress => StatusCode::CONFLICT,
            Self::Unavailable | Self::TransactionConflict => StatusCode::SERVICE_UNAVAILABLE,
            Self::LayerMissing
            | Self::TransactionInUse
            | Self::TransactionLeaked
            | Self::ResponseTooLarge
            | Self::ResponseUnreadable
            | Self::HandlerPanicked
            | Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl fmt::Display for ProblemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.slug())
    }
}

/// An RFC 9457 problem response.
///
/// ```
/// use tower_inbox::problem::{Problem, ProblemKind};
///
/// let response = Problem::new(ProblemKind::InProgress, "try again shortly")
///     .retry_after(1)
///     .response();
/// assert_eq!(response.status(), 409);
/// assert_eq!(response.extensions().get(), Some(&ProblemKind::InProgress));
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// assert_eq!(response.headers()["retry-after"], "1");
/// ```
#[derive(Debug, Clone)]
pub struct Problem {
    kind: ProblemKind,
    status: StatusCode,
    detail: String,
    retry_after: Option<u32>,
}

#[derive(Serialize)]
struct ProblemBody<'a> {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
}

impl Problem {
    /// A problem of `kind` with its usual status and a human-readable `detail`.
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            status: kind.default_status(),
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Overrides the status (the configurable cases: 409/422 mismatch, 401/400 producer).
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// Adds `Retry-After: <seconds>`.
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// The kind of problem.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The status it answers with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The detail text.
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.kind.title(),
            self.status,
            self.detail
        )
    }
}

impl std::error::Error for Problem {}

impl Problem {
    /// The problem+json response, with its [`ProblemKind`] in the response's extensions for
    /// logging middleware.
    pub fn response(self) -> Response<Body> {
        let body = ProblemBody {
            type_uri: self.kind.type_uri(),
            title: self.kind.title(),
            status: self.status.as_u16(),
            detail: &self.detail,
        };
        // Serialising a struct of strings and an integer cannot fail; an empty object keeps
        // the function total all the same.
        let json = serde_json::to_vec(&body).unwrap_or_else(|_| b"{}".to_vec());
        let mut response = Response::new(Body::from(json));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response.extensions_mut().insert(self.kind);
        response
    }
}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for Problem {
    fn into_response(self) -> axum::response::Response {
        self.response().map(axum::body::Body::new)
    }
}
