//! Which handler answers commit (and are recorded for replay) and which roll back.

use http::StatusCode;

/// What the layer does with the handler's transaction after seeing its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Record the response and commit with the business writes: the command happened, and a
    /// retry gets this same answer.
    Commit,
    /// Roll back without counting a failure: the handler rejected the request's shape, so
    /// the client may correct it and reuse the key.
    Reject,
    /// Roll back and count a failed attempt: a retry runs the handler again.
    Fail,
}

/// The request-shape rejections that roll back by default.
pub const DEFAULT_REJECTIONS: [StatusCode; 10] = [
    StatusCode::BAD_REQUEST,
    StatusCode::UNAUTHORIZED,
    StatusCode::FORBIDDEN,
    StatusCode::NOT_FOUND,
    StatusCode::METHOD_NOT_ALLOWED,
    StatusCode::REQUEST_TIMEOUT,
    StatusCode::PAYLOAD_TOO_LARGE,
    StatusCode::UNSUPPORTED_MEDIA_TYPE,
    StatusCode::UNPROCESSABLE_ENTITY,
    StatusCode::TOO_MANY_REQUESTS,
];

/// Maps a handler's status to an [`Outcome`].
///
/// By default 5xx fail, the [`DEFAULT_REJECTIONS`] reject, and everything else (2xx, 3xx and
/// business 4xx such as `409 insufficient funds`) commits.
///
/// ```
/// use http::StatusCode;
/// use tower_inbox::middleware::{Outcome, OutcomePolicy};
///
/// let policy = OutcomePolicy::default()
///     // our 404 means "account closed", a business answer worth recording
///     .with(StatusCode::NOT_FOUND, Outcome::Commit)
///     .with(StatusCode::CONFLICT, Outcome::Reject);
/// assert_eq!(policy.decide(StatusCode::CREATED), Outcome::Commit);
/// assert_eq!(policy.decide(StatusCode::NOT_FOUND), Outcome::Commit);
/// assert_eq!(policy.decide(StatusCode::CONFLICT), Outcome::Reject);
/// assert_eq!(policy.decide(StatusCode::UNPROCESSABLE_ENTITY), Outcome::Reject);
/// assert_eq!(policy.decide(StatusCode::BAD_GATEWAY), Outcome::Fail);
/// ```
#[derive(Debug, Clone, Default)]
pub struct OutcomePolicy {
    overrides: Vec<(StatusCode, Outcome)>,
}

impl OutcomePolicy {
    /// Overrides the outcome for one status; a later call for the same status wins.
    pub fn with(mut self, status: StatusCode, outcome: Outcome) -> Self {
        self.overrides.retain(|(s, _)| *s != status);
        self.overrides.push((status, outcome));
        self
    }

    /// The outcome for `status`.
    pub fn decide(&self, status: StatusCode) -> Outcome {
        if let Some((_, outcome)) = self.overrides.iter().find(|(s, _)| *s == status) {
            return *outcome;
        }
        if status.is_server_error() {
            Outcome::Fail
        } else if DEFAULT_REJECTIONS.contains(&status) {
            Outcome::Reject
        } else {
            Outcome::Commit
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_protocol_table() {
        let p = OutcomePolicy::default();
        for s in [200, 201, 202, 204, 301, 303, 402, 409, 410, 412] {
            assert_eq!(
                p.decide(StatusCode::from_u16(s).unwrap()),
                Outcome::Commit,
                "{s}"
            );
        }
        for s in [400, 401, 403, 404, 405, 408, 413, 415, 422, 429] {
            assert_eq!(
                p.decide(StatusCode::from_u16(s).unwrap()),
                Outcome::Reject,
                "{s}"
            );
        }
        for s in [500, 502, 503, 504] {
            assert_eq!(
                p.decide(StatusCode::from_u16(s).unwrap()),
                Outcome::Fail,
                "{s}"
            );
        }
    }

    #[test]
    fn later_override_wins() {
        let p = OutcomePolicy::default()
            .with(StatusCode::OK, Outcome::Reject)
            .with(StatusCode::OK, Outcome::Fail);
        assert_eq!(p.decide(StatusCode::OK), Outcome::Fail);
    }
}
