//! RabbitMQ consumers (feature `amqp`, with lapin): a delivery in, the protocol run, the
//! delivery acknowledged, requeued or rejected once the outcome is durable.
//!
//! | delivery part | what the inbox takes from it |
//! |---|---|
//! | `message_id` property | the message ID (the key the producer's retries share) |
//! | `app_id` property, or [`producer_from`](AmqpConsumer::producer_from) | the producer |
//! | body | the fingerprint ([`Fingerprint::of_bytes`]) |
//! | `timestamp` property (seconds since the epoch), when present and not 0 | the production time, for the retention window |
//! | `x-delivery-count` header (quorum queues), else `redelivered` (1 or 2) | the delivery count, for the backoff after failures |
//!
//! A delivery without a valid message ID or producer cannot be claimed, so nothing keeps it
//! from being applied twice: it is rejected without requeue (to the queue's dead-letter
//! exchange, if it has one) and [`handle`](AmqpConsumer::handle) returns
//! [`Handled::Unidentified`] with the reason.
//!
//! | disposition | sent to the broker |
//! |---|---|
//! | [`Disposition::Ack`] | `basic.ack` |
//! | [`Disposition::Retry`] | a pause of at most [`retry_pause`](AmqpConsumer::retry_pause), then `basic.nack` with requeue |
//! | [`Disposition::Reject`] | `basic.reject` without requeue: dead-lettered if the queue has a dead-letter exchange, else dropped (the quarantine keeps what it needs) |
//!
//! **The retry delay is advisory.** AMQP 0-9-1 has no delay on `basic.nack`: a requeued
//! message is delivered again at once. Without a pause a failing handler or an unreachable
//! database would spin through the message's `quarantine_after` attempts within
//! milliseconds, quarantining it over what may be a blip. So the delivery is held, unacked,
//! for the suggested delay but never longer than the pause (default 1 s) before the nack:
//! long enough to keep a failing message from spinning, short enough that a held delivery
//! does not sit for minutes on one of the channel's prefetch slots (a paused delivery holds
//! no database connection). Longer delays need the broker's help: reject into a retry queue
//! whose `x-message-ttl` dead-letters back to the work queue, mapping the outcome yourself
//! with [`settle`](AmqpConsumer::settle).
//!
//! **Bound the unacknowledged deliveries by the pool.** A delivery being processed may hold
//! a pooled connection from its claim to its commit; a prefetch larger than the pool lets
//! concurrently handled deliveries starve it and each other.
//! [`set_prefetch`](AmqpConsumer::set_prefetch) sets the channel's prefetch to the pool's
//! size before the consumer starts.
//!
//! ```no_run
//! use futures_util::{FutureExt, StreamExt};
//! use lapin::options::BasicConsumeOptions;
//! use lapin::types::FieldTable;
//! use lapin::{Connection, ConnectionProperties};
//! use tower_inbox::consumer::amqp::AmqpConsumer;
//! use tower_inbox::consumer::Consumer;
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let connection =
//!     Connection::connect("amqp://127.0.0.1:5672/%2f", ConnectionProperties::default()).await?;
//! let channel = connection.create_channel().await?;
//! let consumer = AmqpConsumer::new(Consumer::builder(pool, "ledger-projector").build()?);
//! consumer.set_prefetch(&channel).await?; // before basic_consume
//! let mut deliveries = channel
//!     .basic_consume(
//!         "payments".into(),
//!         "ledger-projector".into(),
//!         BasicConsumeOptions::default(),
//!         FieldTable::default(),
//!     )
//!     .await?;
//! while let Some(delivery) = deliveries.next().await {
//!     let delivery = delivery?;
//!     let handled = consumer
//!         .handle(&delivery, |message| {
//!             async move {
//!                 sqlx::query("update account set balance = balance + 10 where id = 'a1'")
//!                     .execute(&mut *message)
//!                     .await
//!             }
//!             .boxed()
//!         })
//!         .await;
//!     if let Err(err) = handled {
//!         // The outcome is durable; the broker redelivers, and the inbox answers a duplicate.
//!         tracing::warn!(error = %err, "could not settle a delivery");
//!     }
//! }
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions};
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Channel};
use time::OffsetDateTime;

use super::{Consumer, Disposition, Incoming, Processed};
use crate::fingerprint::Fingerprint;
use crate::identity::Producer;
use crate::inbox::ClaimedMessage;
use crate::key::MessageKey;

/// The header a quorum queue counts a message's earlier deliveries in.
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// The longest [`AmqpConsumer`] holds a delivery before requeueing it, by default.
pub const DEFAULT_RETRY_PAUSE: Duration = Duration::from_secs(1);

type ProducerOf = dyn Fn(&Delivery) -> Option<Producer> + Send + Sync;

/// Runs a [`Consumer`] on RabbitMQ deliveries; see the [module docs](self).
#[derive(Clone)]
pub struct AmqpConsumer {
    consumer: Consumer,
    producer: Arc<ProducerOf>,
    retry_pause: Duration,
}

impl std::fmt::Debug for AmqpConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConsumer")
            .field("consumer", &self.consumer.name())
            .field("retry_pause", &self.retry_pause)
            .finish_non_exhaustive()
    }
}

/// What [`AmqpConsumer::handle`] did with a delivery.
#[derive(Debug)]
pub enum Handled<T, E> {
    /// The protocol ran; the delivery was settled by the outcome's disposition.
    Processed(Processed<T, E>),
    /// The delivery carries no valid message ID or producer, so the inbox cannot keep it
    /// from being applied twice: it was not processed, and was rejected without requeue.
    Unidentified(Unidentified),
}

/// Why a delivery cannot be claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unidentified {
    /// No `message_id` property, or one that is not a valid [`MessageKey`].
    #[error("the delivery has no valid message_id property")]
    MessageId,
    /// No producer: no valid `app_id` property, or the caller's closure found none.
    #[error("the delivery names no valid producer")]
    Producer,
}

/// Settling a delivery failed. The outcome is durable all the same: the broker requeues an
/// unsettled delivery when its channel closes, and the inbox answers the redelivery as a
/// duplicate (or runs it, when nothing committed).
#[derive(Debug, thiserror::Error)]
pub enum SettleError {
    /// The delivery's channel closed before it was settled; the broker requeues it.
    #[error("the delivery's channel is closed")]
    ChannelClosed,
    /// The delivery was settled before, by other code.
    #[error("the delivery was settled before")]
    AlreadySettled,
    /// The broker refused the settlement or the connection failed.
    #[error("could not settle the delivery: {0}")]
    Broker(#[source] lapin::Error),
}

impl AmqpConsumer {
    /// Runs `consumer` on RabbitMQ deliveries, the producer read from the `app_id` property.
    pub fn new(consumer: Consumer) -> Self {
        Self {
            consumer,
            producer: Arc::new(app_id_producer),
            retry_pause: DEFAULT_RETRY_PAUSE,
        }
    }

    /// Finds the producer with `f` instead of the `app_id` property (from the routing key,
    /// a header set by an authenticating shovel, ...). `None` makes the delivery
    /// [`Unidentified::Producer`].
    pub fn producer_from(
        mut self,
        f: impl Fn(&Delivery) -> Option<Producer> + Send + Sync + 'static,
    ) -> Self {
        self.producer = Arc::new(f);
        self
    }

    /// Holds a delivery to be retried for its suggested delay, but at most `pause`, before
    /// requeueing it (default [`DEFAULT_RETRY_PAUSE`]); zero requeues at once. See the
    /// [module docs](self) for why.
    pub fn retry_pause(mut self, pause: Duration) -> Self {
        self.retry_pause = pause;
        self
    }

    /// The consumer it runs.
    pub fn consumer(&self) -> &Consumer {
        &self.consumer
    }

    /// The delivery as the protocol takes it, or why it cannot be claimed.
    pub fn incoming(&self, delivery: &Delivery) -> Result<Incoming, Unidentified> {
        let properties = &delivery.properties;
        let message_id = properties
            .message_id()
            .as_ref()
            .and_then(|id| MessageKey::new(id.as_str()).ok())
            .ok_or(Unidentified::MessageId)?;
        let producer = (self.producer)(delivery).ok_or(Unidentified::Producer)?;
        let incoming = Incoming::new(producer, message_id, Fingerprint::of_bytes(&delivery.data))
            .delivery(delivery_count(delivery));
        Ok(match produced_at(properties) {
            Some(at) => incoming.produced_at(at),
            None => incoming,
        })
    }

    /// Runs the protocol for `delivery` with `handler` (see [`Consumer::process`]), then
    /// settles it by the outcome's [disposition](Processed::disposition): after the commit,
    /// never before.
    ///
    /// On a [`SettleError`] the outcome is durable but not returned; callers that need it
    /// whatever happens, or that map outcomes themselves, use [`incoming`](Self::incoming),
    /// [`Consumer::process`] and [`settle`](Self::settle) instead.
    pub async fn handle<T, E, F>(
        &self,
        delivery: &Delivery,
        handler: F,
    ) -> Result<Handled<T, E>, SettleError>
    where
        F: for<'m> FnMut(&'m mut ClaimedMessage) -> BoxFuture<'m, Result<T, E>>,
    {
        let incoming = match self.incoming(delivery) {
            Ok(incoming) => incoming,
            Err(why) => {
                // Neither the body nor the properties: they may name the producer.
                tracing::warn!(
                    consumer = %self.consumer.name(),
                    reason = %why,
                    "rejecting a delivery the inbox cannot identify"
                );
                self.settle(delivery, Disposition::Reject).await?;
                return Ok(Handled::Unidentified(why));
            }
        };
        let processed = self.consumer.process(incoming, handler).await;
        self.settle(delivery, processed.disposition()).await?;
        Ok(Handled::Processed(processed))
    }

    /// Tells the broker what became of `delivery`: `basic.ack`, `basic.nack` with requeue
    /// (after the [pause](Self::retry_pause)), or `basic.reject` without requeue. Call it
    /// only once the outcome is durable.
    pub async fn settle(
        &self,
        delivery: &Delivery,
        disposition: Disposition,
    ) -> Result<(), SettleError> {
        let settled = match disposition {
            Disposition::Ack => delivery.ack(BasicAckOptions::default()).await,
            Disposition::Retry(delay) => {
                let pause = delay.min(self.retry_pause);
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                delivery.nack(requeue).await
            }
            Disposition::Reject => delivery.reject(BasicRejectOptions { requeue: false }).await,
        };
        match settled {
            Ok(true) => Ok(()),
            Ok(false) if delivery.acker.poisoned() => Err(SettleError::ChannelClosed),
            Ok(false) => Err(SettleError::AlreadySettled),
            Err(err) => Err(SettleError::Broker(err)),
        }
    }

    /// Sets `channel`'s prefetch (`basic.qos`, per consumer) to [`prefetch_limit`] of the
    /// consumer's pool and returns it. Call it before `basic_consume`: the limit applies to
    /// consumers started on the channel afterwards. A caller wanting fewer unacknowledged
    /// deliveries calls `basic_qos` itself with a smaller count.
    pub async fn set_prefetch(&self, channel: &Channel) -> Result<u16, lapin::Error> {
        let prefetch = prefetch_limit(self.consumer.inbox().pool());
        channel
            .basic_qos(prefetch, BasicQosOptions { global: false })
            .await?;
        Ok(prefetch)
    }
}

/// The prefetch that keeps unacknowledged deliveries from starving `pool`: its size (at
/// least 1, since a prefetch of 0 means no limit; at most `u16::MAX`, AMQP's largest).
pub fn prefetch_limit(pool: &sqlx::PgPool) -> u16 {
    let size = pool.options().get_max_connections();
    u16::try_from(size).unwrap_or(u16::MAX).max(1)
}

fn app_id_producer(delivery: &Delivery) -> Option<Producer> {
    let app_id = delivery.properties.app_id().as_ref()?;
    Producer::new(app_id.as_str()).ok()
}

/// Which delivery this is, from 1: the quorum queue's count of earlier deliveries plus one
/// when it keeps one, else 2 for anything redelivered (a classic queue says no more).
fn delivery_count(delivery: &Delivery) -> u32 {
    let flagged = if delivery.redelivered { 2 } else { 1 };
    let counted = delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get(DELIVERY_COUNT_HEADER))
        .and_then(earlier_deliveries)
        .map(|earlier| earlier.saturating_add(1));
    counted.map_or(flagged, |count| count.max(flagged))
}

/// A delivery count as RabbitMQ encodes it (a signed long, but any integer is taken).
fn earlier_deliveries(value: &AMQPValue) -> Option<u32> {
    let count = match *value {
        AMQPValue::ShortShortInt(n) => i64::from(n),
        AMQPValue::ShortShortUInt(n) => i64::from(n),
        AMQPValue::ShortInt(n) => i64::from(n),
        AMQPValue::ShortUInt(n) => i64::from(n),
        AMQPValue::LongInt(n) => i64::from(n),
        AMQPValue::LongUInt(n) => i64::from(n),
        AMQPValue::LongLongInt(n) => n,
        _ => return None,
    };
    (count >= 0).then(|| u32::try_from(count).unwrap_or(u32::MAX))
}

/// The `timestamp` property as a time. Some clients send 0 for "unset": taken at its word
/// it would make every message decades old and expire it.
fn produced_at(properties: &BasicProperties) -> Option<OffsetDateTime> {
    let seconds = (*properties.timestamp()).filter(|&seconds| seconds > 0)?;
    OffsetDateTime::from_unix_timestamp(i64::try_from(seconds).ok()?).ok()
}

#[cfg(test)]
mod tests {
    use lapin::types::FieldTable;

    use super::*;

    fn delivery(redelivered: bool, properties: BasicProperties) -> Delivery {
        let mut delivery = Delivery::mock(1, "".into(), "work".into(), redelivered, b"{}".to_vec());
        delivery.properties = properties;
        delivery
    }

    fn counted(count: AMQPValue) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert(DELIVERY_COUNT_HEADER.into(), count);
        BasicProperties::default().with_headers(headers)
    }

    #[test]
    fn the_delivery_count_comes_from_the_header_else_the_flag() {
        let plain = BasicProperties::default();
        assert_eq!(delivery_count(&delivery(false, plain.clone())), 1);
        assert_eq!(delivery_count(&delivery(true, plain)), 2);
        let third = counted(AMQPValue::LongLongInt(2));
        assert_eq!(delivery_count(&delivery(true, third)), 3);
        let odd = counted(AMQPValue::ShortUInt(4));
        assert_eq!(delivery_count(&delivery(true, odd)), 5);
        // A count that cannot be one falls back to the flag.
        for bad in [AMQPValue::LongLongInt(-3), AMQPValue::Boolean(true)] {
            assert_eq!(delivery_count(&delivery(true, counted(bad))), 2);
        }
        let huge = counted(AMQPValue::LongLongInt(i64::MAX));
        assert_eq!(delivery_count(&delivery(true, huge)), u32::MAX);
    }

    #[test]
    fn the_timestamp_is_the_production_time_unless_unset_or_out_of_range() {
        let at = |seconds| produced_at(&BasicProperties::default().with_timestamp(seconds));
        assert_eq!(
            at(1_700_000_000).map(|t| t.unix_timestamp()),
            Some(1_700_000_000)
        );
        assert_eq!(at(0), None);
        // Milliseconds sent as seconds: past year 9999.
        assert_eq!(at(1_700_000_000_000), None);
        assert_eq!(at(u64::MAX), None);
        assert_eq!(produced_at(&BasicProperties::default()), None);
    }
}
