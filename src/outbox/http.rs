//! [`HttpTransport`]: effects delivered as HTTP `POST`s with reqwest (feature `outbox-http`).

use std::time::Duration;

use tokio::time::Instant;

use super::transport::{Delivery, Transport, EXCERPT_LIMIT};
use super::Effect;

/// How long [`HttpTransport`] goes on reading an answer's excerpt once its status is known.
const EXCERPT_WINDOW: Duration = Duration::from_secs(1);

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
