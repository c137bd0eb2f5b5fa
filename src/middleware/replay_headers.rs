//! Which of the handler's response headers are recorded, and so replayed to duplicates.

use http::header::{self, HeaderName};
use http::HeaderMap;

/// Headers that describe one connection, not the response: never recorded.
const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Which response headers the layer records with the response and replays to duplicates.
///
/// By default every header is recorded except:
///
/// * **hop-by-hop headers** (`Connection`, `Keep-Alive`, `Transfer-Encoding`, ...): they
///   describe the first answer's connection, not the response; they are never recorded,
///   whatever the policy says;
/// * **`Set-Cookie`**: a session or token handed to the first caller is not handed to whoever
///   retries the key later, and no credential is stored in the inbox;
/// * **`Date`**: a replay is a new message, and the server gives it a fresh date.
///
/// ```
/// use http::header::{HeaderName, SET_COOKIE};
/// use tower_inbox::middleware::ReplayHeaders;
///
/// // Also keep the first answer's request ID out of replays; replay cookies after all.
/// let policy = ReplayHeaders::default()
///     .deny(HeaderName::from_static("x-request-id"))
///     .allow(SET_COOKIE);
/// assert!(!policy.replays(&HeaderName::from_static("x-request-id")));
/// assert!(policy.replays(&SET_COOKIE));
/// assert!(!policy.replays(&http::header::TRANSFER_ENCODING));
///
/// // Or name the only headers that are replayed.
/// let only = ReplayHeaders::only([http::header::CONTENT_TYPE, http::header::LOCATION]);
/// assert!(only.replays(&http::header::LOCATION));
/// assert!(!only.replays(&HeaderName::from_static("x-trace")));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayHeaders {
    denied: Vec<HeaderName>,
    only: Option<Vec<HeaderName>>,
}

impl Default for ReplayHeaders {
    fn default() -> Self {
        Self {
            denied: vec![header::SET_COOKIE, header::DATE],
            only: None,
        }
    }
}

impl ReplayHeaders {
    /// Replays only `names` (hop-by-hop headers never).
    pub fn only(names: impl IntoIterator<Item = HeaderName>) -> Self {
        Self {
            denied: Vec::new(),
            only: Some(names.into_iter().collect()),
        }
    }

    /// Does not replay `name`.
    pub fn deny(mut self, name: HeaderName) -> Self {
        if let Some(only) = &mut self.only {
            only.retain(|n| *n != name);
        }
        if !self.denied.contains(&name) {
            self.denied.push(name);
        }
        self
    }

    /// Replays `name` after all (`Set-Cookie`, `Date`, or one denied before); hop-by-hop
    /// headers stay unreplayed.
    pub fn allow(mut self, name: HeaderName) -> Self {
        self.denied.retain(|n| *n != name);
        if let Some(only) = &mut self.only {
            if !only.contains(&name) {
                only.push(name);
            }
        }
        self
    }

    /// Whether a response header named `name` is recorded and replayed.
    pub fn replays(&self, name: &HeaderName) -> bool {
        !HOP_BY_HOP.contains(&name.as_str())
            && !self.denied.contains(name)
            && self.only.as_ref().is_none_or(|only| only.contains(name))
    }

    /// The headers of `headers` to record, as name and value bytes.
    pub(crate) fn recorded(&self, headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
        headers
            .iter()
            .filter(|(name, _)| self.replays(name))
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect()
    }
}
