//! NATS JetStream consumers (feature `nats`): a JetStream message in, the protocol run, the
//! message acknowledged, retried or terminated once the outcome is durable.
//!
//! | message part | what the inbox takes from it |
//! |---|---|
//! | `Nats-Msg-Id` header | the message ID (the key the producer's retries share) |
//! | `X-Producer` header, or [`producer_from`](NatsConsumer::producer_from) | the producer |
//! | subject, `Content-Type` header, payload | the fingerprint (JSON payloads canonically) |
//! | publish time (`info().published`) | the production time, for the retention window |
//! | delivery count (`info().delivered`) | the backoff after failures |
//!
//! [`Disposition::Ack`] is `ack`, [`Disposition::Retry`] is `nak` with the delay, and
//! [`Disposition::Reject`] is `term`. While a handler runs, the message is kept alive with
//! in-progress acknowledgements (`+WPI`) every [`progress_every`](NatsConsumer::progress_every)
//! (default 10 s, under JetStream's default `ack_wait` of 30 s), so a slow handler is not
//! delivered a second time meanwhile.
//!
//! **Bound the unacknowledged messages by the pool.** Each message in flight may hold a
//! pooled connection from its claim to its commit; give the JetStream consumer a
//! `max_ack_pending` no larger than the pool's size ([`max_ack_pending`] computes it), or
//! waiting messages starve the pool.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};
use futures_util::future::BoxFuture;

use super::{Consumer, Disposition, Incoming, Processed};
use crate::fingerprint::{CommandPayload, FingerprintStrategy};
use crate::identity::Producer;
use crate::inbox::ClaimedMessage;
use crate::key::MessageKey;

/// The header a producer's message ID is read from: JetStream deduplicates on it too.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// The header the producer is read from by default.
pub const PRODUCER_HEADER: &str = "X-Producer";

type ProducerOf = dyn Fn(&Message) -> Option<Producer> + Send + Sync;

/// Runs a [`Consumer`] on JetStream messages; see the [module docs](self).
#[derive(Clone)]
pub struct NatsConsumer {
    consumer: Consumer,
    producer: Arc<ProducerOf>,
    fingerprint: FingerprintStrategy,
    progress_every: Option<Duration>,
}

impl std::fmt::Debug for NatsConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConsumer")
            .field("consumer", &self.consumer.name())
            .field("progress_every", &self.progress_every)
            .finish_non_exhaustive()
    }
}

/// What [`NatsConsumer::handle`] did with a message.
#[derive(Debug)]
pub enum Handled<T, E> {
    /// The protocol ran; the message was settled by the outcome's disposition.
    Processed(Processed<T, E>),
    /// The message carries no usable message ID or producer, so the inbox cannot keep it
    /// from being applied twice: it was not processed, and was terminated.
    Unidentified(Unidentified),
}

/// Why a message cannot be claimed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unidentified {
    /// No `Nats-Msg-Id` header, or one that is not a valid key.
    #[error("the message has no valid Nats-Msg-Id header")]
    MessageId,
    /// No producer: the header is missing or not a valid producer name.
    #[error("the message names no valid producer")]
    Producer,
    /// Not a JetStream message (no reply subject with its delivery information).
    #[error("the message has no JetStream delivery information")]
    NotJetStream,
}

/// Settling a message with the server failed. The outcome is durable all the same; the
/// server delivers the message again after its `ack_wait`, and the inbox answers that
/// delivery as a duplicate.
#[derive(Debug, thiserror::Error)]
#[error("could not settle the JetStream message: {0}")]
pub struct SettleError(#[source] async_nats::Error);

impl NatsConsumer {
    /// Runs `consumer` on JetStream messages, the producer read from `X-Producer`.
    pub fn new(consumer: Consumer) -> Self {
        Self {
            consumer,
            producer: Arc::new(|message: &Message| header_producer(message, PRODUCER_HEADER)),
            fingerprint: FingerprintStrategy::default(),
            progress_every: Some(Duration::from_secs(10)),
        }
    }

    /// Reads the producer from the header `name` instead of `X-Producer`.
    pub fn producer_header(mut self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.producer = Arc::new(move |message: &Message| header_producer(message, &name));
        self
    }

    /// Finds the producer with `f` (from the subject, an authenticated header, ...).
    pub fn producer_from(
        mut self,
        f: impl Fn(&Message) -> Option<Producer> + Send + Sync + 'static,
    ) -> Self {
        self.producer = Arc::new(f);
        self
    }

    /// How the fingerprint is computed from the subject, content type and payload (default
    /// [`FingerprintStrategy::Canonical`]).
    pub fn fingerprint(mut self, strategy: FingerprintStrategy) -> Self {
        self.fingerprint = strategy;
        self
    }

    /// Sends an in-progress acknowledgement every `period` while a handler runs (default
    /// 10 s); `None` sends none. Keep it under the JetStream consumer's `ack_wait`.
    pub fn progress_every(mut self, period: Option<Duration>) -> Self {
        self.progress_every = period.filter(|p| !p.is_zero());
        self
    }

    /// The consumer it runs.
    pub fn consumer(&self) -> &Consumer {
        &self.consumer
    }

    /// The message as the protocol takes it, or why it cannot be claimed.
    pub fn incoming(&self, message: &Message) -> Result<Incoming, Unidentified> {
        let info = message.info().map_err(|_| Unidentified::NotJetStream)?;
        let message_id = header(message, MSG_ID_HEADER)
            .and_then(|id| MessageKey::new(id).ok())
            .ok_or(Unidentified::MessageId)?;
        let producer = (self.producer)(message).ok_or(Unidentified::Producer)?;
        let fingerprint = self.fingerprint.fingerprint(&CommandPayload {
            method: "PUBLISH",
            path_and_query: message.subject.as_str(),
            content_type: header(message, "Content-Type"),
            body: &message.payload,
        });
        Ok(Incoming::new(producer, message_id, fingerprint)
            .produced_at(info.published)
            .delivery(u32::try_from(info.delivered).unwrap_or(u32::MAX)))
    }

    /// Runs the protocol for `message` with `handler` (see
    /// [`Consumer::process`](super::Consumer::process)), then settles it by the outcome's
    /// [disposition](Processed::disposition): after the commit, never before. Callers that
    /// map outcomes themselves use [`incoming`](Self::incoming),
    /// [`Consumer::process`](super::Consumer::process) and [`settle`] instead.
    pub async fn handle<T, E, F>(
        &self,
        message: &Message,
        handler: F,
    ) -> Result<Handled<T, E>, SettleError>
    where
        F: for<'m> FnMut(&'m mut ClaimedMessage) -> BoxFuture<'m, Result<T, E>>,
    {
        let incoming = match self.incoming(message) {
            Ok(incoming) => incoming,
            Err(why) => {
                tracing::warn!(subject = %message.subject, reason = %why, "terminating a message the inbox cannot identify");
                settle(message, Disposition::Reject).await?;
                return Ok(Handled::Unidentified(why));
            }
        };
        let processed = self.process_alive(message, incoming, handler).await;
        settle(message, processed.disposition()).await?;
        Ok(Handled::Processed(processed))
    }

    /// Processes while in-progress acknowledgements keep the message from being redelivered.
    async fn process_alive<T, E, F>(
        &self,
        message: &Message,
        incoming: Incoming,
        handler: F,
    ) -> Processed<T, E>
    where
        F: for<'m> FnMut(&'m mut ClaimedMessage) -> BoxFuture<'m, Result<T, E>>,
    {
        let processing = self.consumer.process(incoming, handler);
        let Some(period) = self.progress_every else {
            return processing.await;
        };
        tokio::pin!(processing);
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            tokio::select! {
                processed = &mut processing => return processed,
                _ = ticks.tick() => {
                    // A lost progress ack only risks a redelivery, which the claim answers.
                    if let Err(err) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(error = %err, "in-progress acknowledgement failed");
                    }
                }
            }
        }
    }
}

/// Tells the server what became of `message`: `ack`, `nak` with the delay, or `term`.
pub async fn settle(message: &Message, disposition: Disposition) -> Result<(), SettleError> {
    let kind = match disposition {
        Disposition::Ack => AckKind::Ack,
        Disposition::Retry(delay) => AckKind::Nak(Some(delay)),
        Disposition::Reject => AckKind::Term,
    };
    message.ack_with(kind).await.map_err(SettleError)
}

/// The `max_ack_pending` that keeps unacknowledged messages from starving `pool`: its size.
pub fn max_ack_pending(pool: &sqlx::PgPool) -> i64 {
    i64::from(pool.options().get_max_connections())
}

fn header<'m>(message: &'m Message, name: &str) -> Option<&'m str> {
    message
        .headers
        .as_ref()?
        .get(name)
        .map(|value| value.as_str())
}

fn header_producer(message: &Message, name: &str) -> Option<Producer> {
    Producer::new(header(message, name)?).ok()
}
