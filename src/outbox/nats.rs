//! [`NatsTransport`]: effects published to NATS JetStream (feature `nats`).

use async_nats::jetstream::context::Context;
use async_nats::HeaderMap;

use super::transport::{Delivery, Transport};
use super::Effect;

/// Publishes each effect to JetStream, on the subject its `destination` names, with
/// `Nats-Msg-Id` set to the effect's ID, and waits for the stream's acknowledgement.
///
/// The ID makes the stream keep one copy of an effect published twice within its duplicate
/// window (`duplicate_window`, 2 minutes by default): a publish whose acknowledgement was
/// lost is published again by the dispatcher, with the same ID. Past the window a copy is
/// stored again, and the consumer's inbox (same ID) drops it. The effect's headers are sent
/// as message headers.
///
/// | outcome | delivery |
/// |---|---|
/// | the stream acknowledged it (a duplicate included) | delivered, the stream and sequence recorded |
/// | no stream takes the subject, a timeout, a lost connection | retried later with the same ID |
/// | the destination is empty or not a valid subject | permanent (`invalid-destination`) |
#[derive(Clone)]
pub struct NatsTransport {
    jetstream: Context,
}

impl std::fmt::Debug for NatsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsTransport").finish_non_exhaustive()
    }
}

impl NatsTransport {
    /// Publishes through `jetstream` (`async_nats::jetstream::new(client)`).
    pub fn new(jetstream: Context) -> Self {
        Self { jetstream }
    }
}

impl Transport for NatsTransport {
    async fn deliver(&self, effect: &Effect) -> Delivery {
        let subject = effect.destination.as_str();
        if !is_subject(subject) {
            return Delivery::Permanent {
                status: None,
                reason_code: "invalid-destination".to_owned(),
                error: "the destination is not a NATS subject to publish to".to_owned(),
            };
        }
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", effect.effect_id.as_str());
        for (name, value) in &effect.headers {
            headers.append(name.as_str(), value.as_str());
        }
        let published = self
            .jetstream
            .publish_with_headers(subject.to_owned(), headers, effect.payload.clone())
            .await;
        let acked = match published {
            Ok(ack) => ack.await,
            Err(err) => {
                return Delivery::Retry {
                    status: None,
                    error: format!("publish failed: {err}"),
                }
            }
        };
        match acked {
            Ok(ack) => Delivery::Delivered {
                status: None,
                result: format!(
                    "stream {} sequence {}{}",
                    ack.stream,
                    ack.sequence,
                    if ack.duplicate { " (duplicate)" } else { "" }
                ),
            },
            Err(err) => Delivery::Retry {
                status: None,
                error: format!("no acknowledgement from the stream: {err}"),
            },
        }
    }
}

/// A subject a message can be published to: dot-separated non-empty tokens, no spaces and no
/// wildcards.
fn is_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|token| {
            !token.is_empty()
                && token != "*"
                && token != ">"
                && !token.chars().any(|c| c.is_whitespace() || c.is_control())
        })
}

#[cfg(test)]
mod tests {
    use super::is_subject;

    #[test]
    fn subjects_to_publish_to() {
        assert!(is_subject("credits.events.a1"));
        for bad in ["", "a..b", "a.*", "a.>", "a b", ".a", "a."] {
            assert!(!is_subject(bad), "{bad:?}");
        }
    }
}
