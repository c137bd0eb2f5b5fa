use std::future::Future;
use std::time::Duration;

use super::Effect;

/// What one delivery attempt came to.
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
/// delivery timeout; a call that runs over counts as ambiguous.
pub trait Transport: Send + Sync + 'static {
    /// Delivers one effect.
    fn deliver(&self, effect: &Effect) -> impl Future<Output = Delivery> + Send;
}

/// POSTs the payload to the effect's destination URL with `Idempotency-Key: <effect id>`.
///
/// 2xx is delivered, 408 and 429 and 5xx are retried, other 4xx are permanent, and transport
/// errors and timeouts are ambiguous, so retried with the same key. `https` URLs need the
/// crate's `tls` feature.
#[derive(Debug, Clone)]
pub struct HttpTransport {
    client: reqwest::Client,
    headers: Vec<(String, String)>,
    max_result_len: usize,
}

impl HttpTransport {
    /// A transport whose requests time out after `timeout`.
    pub fn new(timeout: Duration) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder().timeout(timeout).build()?;
        Ok(Self::with_client(client))
    }

    /// A transport over a configured client.
    pub fn with_client(client: reqwest::Client) -> Self {
        Self {
            client,
            headers: Vec::new(),
            max_result_len: 4096,
        }
    }

    /// A header sent with every delivery (e.g. an authorization token).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    fn truncate(&self, mut text: String) -> String {
        if text.len() > self.max_result_len {
            let mut end = self.max_result_len;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
        }
        text
    }
}

impl Transport for HttpTransport {
    async fn deliver(&self, effect: &Effect) -> Delivery {
        let mut request = self
            .client
            .post(&effect.destination)
            .header("idempotency-key", effect.effect_id.as_str())
            .body(effect.payload.clone());
        for (name, value) in self.headers.iter().chain(&effect.headers) {
            request = request.header(name.as_str(), value.as_str());
        }
        let response = match request.send().await {
            Ok(response) => response,
            Err(err) => {
                return Delivery::Retry {
                    status: None,
                    error: format!("request failed: {err}"),
                }
            }
        };
        let status = response.status();
        // A body that fails to arrive after the status line still tells the outcome.
        let body = self.truncate(response.text().await.unwrap_or_default());
        let code = Some(status.as_u16());
        if status.is_success() {
            Delivery::Delivered {
                status: code,
                result: body,
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
}
