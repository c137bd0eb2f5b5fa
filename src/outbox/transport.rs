use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::Effect;

/// The most of a receiver's answer (or of an error text) kept with an effect: 64 KiB.
const EXCERPT_LIMIT: usize = 64 * 1024;

/// How long [`HttpTransport`] goes on reading an answer's excerpt once its status is known.
const EXCERPT_WINDOW: Duration = Duration::from_secs(1);

/// What one delivery attempt came to.
///
/// The texts are recorded with the effect as excerpts: the dispatcher replaces NUL characters
/// (PostgreSQL `text` cannot hold them) and keeps at most 64 KiB of each, so a transport may
/// put anything there without making the outcome unrecordable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// The receiver accepted the effect.
    Delivered {
        /// Its status code, where the transport has one.
        status: Option<u16>,
        /// What it answered, recorded with the effect.
        result: String,
    },
    /// Failed or ambiguous (a timeout, a 5xx, a refused connection): the receiver may or may
    /// not have applied it, so try again later with the same key.
    Retry {
        /// The receiver's status code, if it answered.
        status: Option<u16>,
        /// What went wrong.
        error: String,
    },
    /// The receiver refused the effect for good: move it to dead letters.
    Permanent {
        /// The receiver's status code, if it answered.
        status: Option<u16>,
        /// A stable reason code for the quarantine, e.g. `http-404`; also the `reason` label
        /// of [`outbox_dead_letters_total`](crate::metrics::OUTBOX_DEAD_LETTERS), so it must
        /// come from a small fixed set, never from the receiver's answer text.
        reason_code: String,
        /// What went wrong.
        error: String,
    },
}

/// Delivers effects. Implementations must send [`Effect::effect_id`] as the idempotency key
/// so the receiver can deduplicate deliveries that are repeated after ambiguous outcomes.
///
/// The dispatcher calls it outside any database transaction and bounds each call with its
/// delivery timeout; a call that runs over counts as ambiguous. A call that panics counts as
/// a failed attempt, like [`Delivery::Retry`].
pub trait Transport: Send + Sync + 'static {
    /// Delivers one effect.
    fn deliver(&self, effect: &Effect) -> impl Future<Output = Delivery> + Send;

    /// The bound the transport itself puts on one [`deliver`](Self::deliver) call, if any.
    ///
    /// A transport that knows the outcome before its call ends (a status received while the
    /// answer is still being read) declares its bound here, and the dispatcher refuses a
    /// delivery timeout shorter than it: the dispatcher's timeout could otherwise cut off an
    /// accepted delivery and have it delivered again.
    fn call_timeout(&self) -> Option<Duration> {
        None
    }
}

/// POSTs the payload to the effect's destination URL with `Idempotency-Key: <effect id>`.
///
/// * 2xx is delivered, with an excerpt of the answer recorded: at most 64 KiB, read until the
///   body ends, the cap is reached, or a short window (a second, or a quarter of the timeout
///   when that is shorter) has passed since the status arrived. The status decides the
///   outcome; a body that is slow or never ends only shortens the excerpt.
/// * 3xx is a permanent failure (`http-redirect`): redirects are not followed, because a
///   redirected POST may arrive as a GET without its payload, or somewhere else entirely.
/// * 408, 429 and 5xx are retried; any other 4xx is permanent (`http-<status>`).
/// * A destination that is not an absolute `http` or `https` URL is permanent
///   (`invalid-destination`).
/// * Transport errors and timeouts are ambiguous, so retried with the same key.
///
/// `https` URLs need the crate's `tls` feature.
#[derive(Debug, Clone)]
pub struct HttpTransport {
    client: reqwest::Client,
    headers: Vec<(String, String)>,
    timeout: Option<Duration>,
}

impl HttpTransport {
    /// A transport whose every call, sending the request and reading the answer's excerpt,
    /// ends within `timeout`. Give the dispatcher a delivery timeout at least this long.
    pub fn new(timeout: Duration) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Self::with_client(client).timeout(timeout))
    }

    /// A transport over a configured client, without a bound of its own (see
    /// [`timeout`](Self::timeout)).
    ///
    /// Build the client with `reqwest::redirect::Policy::none()`: a redirect the client
    /// follows anyway makes the delivery a permanent `http-redirect` failure whatever the
    /// final answer, since the transport cannot tell what arrived where.
    pub fn with_client(client: reqwest::Client) -> Self {
        Self {
            client,
            headers: Vec::new(),
            timeout: None,
        }
    }

    /// Bounds every call, sending the request and reading the answer's excerpt, by `timeout`
    /// (set by [`new`](Self::new)). Without it only the client's own timeouts and the
    /// dispatcher's delivery timeout apply, and the latter can cut off an accepted delivery
    /// while its excerpt is read, which delivers it again.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// A header sent with every delivery (e.g. an authorization token).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

impl Transport for HttpTransport {
    async fn deliver(&self, effect: &Effect) -> Delivery {
        let started = Instant::now();
        let url = match reqwest::Url::parse(&effect.destination) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => url,
            // The destination is never echoed (here or in request errors): it may carry a
            // token in its query.
            Ok(url) => return invalid_destination(&format!("unsupported scheme {}", url.scheme())),
            Err(err) => return invalid_destination(&err.to_string()),
        };
        let mut request = self
            .client
            .post(url.clone())
            .header("idempotency-key", effect.effect_id.as_str())
            .body(effect.payload.clone());
        for (name, value) in self.headers.iter().chain(&effect.headers) {
            request = request.header(name.as_str(), value.as_str());
        }
        let sent = match self.timeout {
            Some(timeout) => tokio::time::timeout_at(started + timeout, request.send()).await,
            None => Ok(request.send().await),
        };
        let mut response = match sent {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => {
                return Delivery::Retry {
                    status: None,
                    error: format!("request failed: {}", err.without_url()),
                }
            }
            Err(_) => {
                return Delivery::Retry {
                    status: None,
                    error: format!(
                        "no answer within {:?}; the outcome is unknown",
                        self.timeout.unwrap_or_default()
                    ),
                }
            }
        };
        let status = response.status();
        let code = Some(status.as_u16());
        // A client of the caller's own may have followed a redirect: what arrived where is
        // unknown, so it is not a delivery.
        let redirected = (response.url() != &url).then(|| response.url().to_string());
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .map(|l| String::from_utf8_lossy(l.as_bytes()).into_owned());
        let body = read_excerpt(&mut response, self.excerpt_deadline(started)).await;
        if let Some(to) = redirected {
            return Delivery::Permanent {
                status: code,
                reason_code: "http-redirect".to_owned(),
                error: format!("the client followed a redirect to {to} and got {status}: {body}"),
            };
        }
        if status.is_success() {
            Delivery::Delivered {
                status: code,
                result: body,
            }
        } else if status.is_redirection() {
            Delivery::Permanent {
                status: code,
                reason_code: "http-redirect".to_owned(),
                error: format!(
                    "{status} to {}; redirects are not followed: {body}",
                    location.as_deref().unwrap_or("no Location")
                ),
            }
        } else if status.is_client_error()
            && status != reqwest::StatusCode::REQUEST_TIMEOUT
            && status != reqwest::StatusCode::TOO_MANY_REQUESTS
        {
            Delivery::Permanent {
                status: code,
                reason_code: format!("http-{}", status.as_u16()),
                error: format!("{status}: {body}"),
            }
        } else {
            Delivery::Retry {
                status: code,
                error: format!("{status}: {body}"),
            }
        }
    }

    fn call_timeout(&self) -> Option<Duration> {
        self.timeout
    }
}

impl HttpTransport {
    /// When reading the excerpt stops, given when the call started: a window after the
    /// status, and never into the last such window of the timeout, so the call ends within
    /// its timeout even when the status arrives at its very end and the dispatcher's own
    /// timeout (started a moment earlier) has not fired yet.
    fn excerpt_deadline(&self, started: Instant) -> Instant {
        let now = Instant::now();
        match self.timeout {
            Some(timeout) => {
                let window = EXCERPT_WINDOW.min(timeout / 4);
                (now + window).min(started + timeout.saturating_sub(window))
            }
            None => now + EXCERPT_WINDOW,
        }
    }
}

/// The most of a reason code kept: it is a metric label and a quarantine column.
const REASON_CODE_LIMIT: usize = 128;

impl Delivery {
    /// The outcome with every text made [`storable`]: an answer the database cannot hold
    /// must not turn a finished delivery into an unrecorded one, which is delivered again.
    pub(crate) fn storable(self) -> Self {
        match self {
            Self::Delivered { status, result } => Self::Delivered {
                status,
                result: storable(result),
            },
            Self::Retry { status, error } => Self::Retry {
                status,
                error: storable(error),
            },
            Self::Permanent {
                status,
                reason_code,
                error,
            } => Self::Permanent {
                status,
                reason_code: storable_within(reason_code, REASON_CODE_LIMIT),
                error: storable(error),
            },
        }
    }
}

fn invalid_destination(why: &str) -> Delivery {
    Delivery::Permanent {
        status: None,
        reason_code: "invalid-destination".to_owned(),
        error: format!("the destination is not an absolute http or https URL: {why}"),
    }
}

/// Reads at most [`EXCERPT_LIMIT`] bytes of the body until `deadline`, as text (invalid UTF-8
/// replaced). A failing or unfinished body ends the excerpt: the status already tells the
/// outcome.
async fn read_excerpt(response: &mut reqwest::Response, deadline: Instant) -> String {
    let mut excerpt = Vec::new();
    while excerpt.len() < EXCERPT_LIMIT && Instant::now() < deadline {
        match tokio::time::timeout_at(deadline, response.chunk()).await {
            Ok(Ok(Some(chunk))) => {
                let room = EXCERPT_LIMIT - excerpt.len();
                excerpt.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(Ok(None) | Err(_)) | Err(_) => break,
        }
    }
    String::from_utf8_lossy(&excerpt).into_owned()
}

/// `text` as it can be stored: NUL characters replaced and at most [`EXCERPT_LIMIT`] bytes,
/// cut on a character boundary.
fn storable(text: String) -> String {
    storable_within(text, EXCERPT_LIMIT)
}

/// Like [`storable`], at most `limit` bytes.
fn storable_within(mut text: String, limit: usize) -> String {
    // Cut first so the replacement below never works on more than the limit.
    truncate(&mut text, limit);
    if text.contains('\0') {
        text = text.replace('\0', "\u{FFFD}");
        truncate(&mut text, limit);
    }
    text
}

fn truncate(text: &mut String, limit: usize) {
    if text.len() > limit {
        let mut end = limit;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_is_replaced_and_the_text_kept() {
        assert_eq!(storable("a\0b".to_owned()), "a\u{FFFD}b");
        assert_eq!(storable("plain".to_owned()), "plain");
    }

    #[test]
    fn long_text_is_cut_on_a_char_boundary() {
        // 'é' is two bytes: a cut at an odd limit falls inside one.
        let text = "é".repeat(EXCERPT_LIMIT);
        let kept = storable(text);
        assert_eq!(kept.len(), EXCERPT_LIMIT);
        assert_eq!(storable_within("éé".to_owned(), 3), "é");
        assert_eq!(storable_within("abc".to_owned(), 0), "");
    }

    #[test]
    fn replacing_nul_never_grows_past_the_limit() {
        // Each NUL becomes three bytes.
        let kept = storable_within("\0\0\0\0".to_owned(), 7);
        assert_eq!(kept, "\u{FFFD}\u{FFFD}");
        assert!(storable("\0".repeat(EXCERPT_LIMIT + 5)).len() <= EXCERPT_LIMIT);
    }
}
