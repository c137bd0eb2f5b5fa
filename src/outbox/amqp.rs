//! [`AmqpTransport`]: effects published to RabbitMQ with publisher confirms (feature `amqp`).

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::uri::AMQPUri;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ConnectionState,
    ErrorKind,
};
use tokio::sync::Mutex;

use super::transport::{Delivery, Transport};
use super::Effect;

/// AMQP's persistent delivery mode: the broker writes the message to disk in a durable queue.
const PERSISTENT: u8 = 2;

/// Publishes each effect to the exchange its `destination` names and waits for the broker's
/// publisher confirm.
///
/// **Destination format:** `exchange/routing-key`, split at the first `/`: `credits/credited`
/// publishes to the exchange `credits` with the routing key `credited`; `/work` publishes
/// to the default exchange, which routes to the queue `work`. The routing key may contain
/// further slashes and may be empty (for fanout exchanges); the exchange may not contain
/// whitespace or control characters; each part is at most 255 bytes.
///
/// Each message is persistent (`delivery_mode` 2) and carries the effect's ID as its
/// `message_id`, the key a consumer's inbox deduplicates on ([`AmqpConsumer`] reads it): a
/// publish whose confirm was lost is published again by the dispatcher, with the same ID.
/// A `content-type` header of the effect (in any case) becomes the `content_type` property;
/// its other headers are sent as message headers. [`app_id`](Self::app_id) sets the property
/// the consumer reads the producer from.
///
/// Messages are published as mandatory, so one that no queue takes comes back instead of
/// being dropped and confirmed.
///
/// | outcome | delivery |
/// |---|---|
/// | confirmed (`basic.ack`) and routed to a queue | delivered |
/// | confirmed but returned unroutable (no queue bound for the routing key) | retried later |
/// | refused (`basic.nack`), no confirm within the [timeout](Self::timeout), the exchange missing, a closed channel or connection | retried later with the same ID |
/// | the destination is not `exchange/routing-key` | permanent (`invalid-destination`) |
/// | the effect ID or a header does not fit an AMQP short string (255 bytes) | permanent (`invalid-message`) |
///
/// The transport publishes on a channel of its own with confirms enabled, opened on the
/// first delivery and again after the broker closes it (a missing exchange closes the
/// channel it was published on). Publishes share the channel concurrently.
///
/// **A lost connection.** Built with [`connect`](Self::connect), the transport owns its
/// connection: it opens it on the first delivery and opens a new one on the next delivery
/// after it is lost (a broker restart, a cut network), so the dispatcher's retries go out
/// again once the broker is back, with nobody restarting anything. Built with
/// [`new`](Self::new), the connection is the caller's and the transport never reopens it:
/// while it is lost every delivery is retried later, until the caller replaces it.
///
/// [`AmqpConsumer`]: crate::consumer::amqp::AmqpConsumer
pub struct AmqpTransport {
    source: Source,
    link: Mutex<Link>,
    app_id: Option<ShortString>,
    timeout: Option<Duration>,
}

/// Where the transport's connection comes from.
enum Source {
    /// The caller's connection, used as it is.
    Shared(Arc<Connection>),
    /// A connection of its own, opened again when lost. The URI may hold a password: it
    /// is parsed once, here, so that no later error can echo it, and never printed.
    Own {
        uri: Box<Result<AMQPUri, InvalidUri>>,
        properties: ConnectionProperties,
    },
}

/// The URI given to [`AmqpTransport::connect`] does not parse. The parser's own message
/// quotes the URI, password and all, so it is not kept.
#[derive(Debug, Clone, Copy)]
struct InvalidUri;

/// The connection and channel in use, replaced when they fail.
#[derive(Default)]
struct Link {
    connection: Option<Arc<Connection>>,
    channel: Option<Channel>,
}

impl std::fmt::Debug for AmqpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the app_id: it names a producer, and a Debug print may reach a log.
        f.debug_struct("AmqpTransport")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl AmqpTransport {
    /// Publishes on channels of `connection`, without a bound of its own on the wait for a
    /// confirm (see [`timeout`](Self::timeout)).
    pub fn new(connection: Arc<Connection>) -> Self {
        Self::from_source(Source::Shared(connection))
    }

    /// Publishes on a connection of its own to `uri` (`amqp://user:password@host:5672/%2f`),
    /// opened on the first delivery and again whenever it is lost; see the
    /// [type docs](Self). Nothing connects here: a broker that is down makes deliveries
    /// retry, not this call fail. The URI is parsed here and never printed, neither by
    /// `Debug` nor in delivery errors; one that does not parse makes every delivery retry
    /// with an error saying so. Set a [`timeout`](Self::timeout): it also bounds the
    /// connect, which otherwise waits as long as the network does. Leave lapin's
    /// `enable_auto_recover` off in `properties`: the transport replaces a lost connection
    /// itself.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_inbox::outbox::{AmqpTransport, Dispatcher};
    ///
    /// # fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let transport = AmqpTransport::connect(
    ///     "amqp://guest:guest@127.0.0.1:5672/%2f",
    ///     lapin::ConnectionProperties::default(),
    /// )
    /// .timeout(Duration::from_secs(5));
    /// let dispatcher = Dispatcher::builder(pool, transport)
    ///     .delivery_timeout(Duration::from_secs(10))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn connect(uri: impl Into<String>, properties: ConnectionProperties) -> Self {
        let uri: String = uri.into();
        Self::from_source(Source::Own {
            uri: Box::new(uri.parse::<AMQPUri>().map_err(|_| InvalidUri)),
            properties,
        })
    }

    fn from_source(source: Source) -> Self {
        Self {
            source,
            link: Mutex::new(Link::default()),
            app_id: None,
            timeout: None,
        }
    }

    /// Sets the `app_id` property of every message: the producer name the consuming inbox
    /// claims under ([`AmqpConsumer`](crate::consumer::amqp::AmqpConsumer) reads it). A
    /// name over 255 bytes is not a producer name: it is ignored.
    pub fn app_id(mut self, producer: impl Into<String>) -> Self {
        self.app_id = ShortString::try_new(producer).ok();
        self
    }

    /// Bounds every call, opening the channel, publishing and waiting for the confirm, by
    /// `timeout`; a call that runs over is retried later with the same ID. Give the
    /// dispatcher a delivery timeout at least this long.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The channel to publish on, opened with confirms enabled when there is none that is
    /// open.
    async fn channel(&self) -> lapin::Result<Channel> {
        let mut link = self.link.lock().await;
        if let Some(channel) = link.channel.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let connection = match (&self.source, &link.connection) {
            (Source::Shared(connection), _) => connection.clone(),
            (Source::Own { .. }, Some(open)) if open.status().connected() => open.clone(),
            (Source::Own { uri, properties }, _) => {
                // The lost one (if any) goes first: a failed connect leaves none cached.
                link.connection = None;
                let Ok(uri) = uri.as_ref() else {
                    // Refused in `deliver` before any channel is asked for.
                    return Err(ErrorKind::InvalidConnectionState(ConnectionState::Error).into());
                };
                let opened =
                    Arc::new(Connection::connect_uri(uri.clone(), properties.clone()).await?);
                link.connection = Some(opened.clone());
                opened
            }
        };
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        link.channel = Some(channel.clone());
        Ok(channel)
    }

    async fn publish(
        &self,
        (exchange, routing_key): (ShortString, ShortString),
        effect: &Effect,
        properties: BasicProperties,
    ) -> lapin::Result<Confirmation> {
        let mandatory = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        self.channel()
            .await?
            .basic_publish(
                exchange,
                routing_key,
                mandatory,
                &effect.payload,
                properties,
            )
            .await?
            .await
    }

    /// The message's properties, or the header that does not fit one.
    fn properties(&self, effect: &Effect) -> Result<BasicProperties, &'static str> {
        let message_id = ShortString::try_new(effect.effect_id.as_str())
            .map_err(|_| "the effect ID is over 255 bytes, too long for a message_id")?;
        let mut properties = BasicProperties::default()
            .with_message_id(message_id)
            .with_delivery_mode(PERSISTENT);
        if let Some(app_id) = &self.app_id {
            properties = properties.with_app_id(app_id.clone());
        }
        let mut headers = FieldTable::default();
        for (name, value) in &effect.headers {
            if name.eq_ignore_ascii_case("content-type") {
                let content_type = ShortString::try_new(value.as_str())
                    .map_err(|_| "the content-type is over 255 bytes")?;
                properties = properties.with_content_type(content_type);
            } else {
                let name = ShortString::try_new(name.as_str())
                    .map_err(|_| "a header name is over 255 bytes")?;
                headers.insert(name, AMQPValue::LongString(value.as_str().into()));
            }
        }
        if !headers.inner().is_empty() {
            properties = properties.with_headers(headers);
        }
        Ok(properties)
    }
}

impl Transport for AmqpTransport {
    async fn deliver(&self, effect: &Effect) -> Delivery {
        if matches!(&self.source, Source::Own { uri, .. } if uri.is_err()) {
            // Retried, not permanent: the effect is fine, the configuration is not.
            return Delivery::Retry {
                status: None,
                error: "the AMQP URI given to AmqpTransport::connect does not parse \
                        (not shown: it may hold a password)"
                    .to_owned(),
            };
        }
        // The destination is not echoed: its routing key may name a customer.
        let Some(destination) = destination(&effect.destination) else {
            return permanent(
                "invalid-destination",
                "the destination is not `exchange/routing-key`",
            );
        };
        let properties = match self.properties(effect) {
            Ok(properties) => properties,
            Err(why) => return permanent("invalid-message", why),
        };
        let publish = self.publish(destination, effect, properties);
        let confirmed = match self.timeout {
            Some(timeout) => tokio::time::timeout(timeout, publish).await.ok(),
            None => Some(publish.await),
        };
        // A channel that failed or went quiet is not trusted with the next publish.
        let (error, suspect) = match confirmed {
            Some(Ok(Confirmation::Ack(None))) => {
                return Delivery::Delivered {
                    status: None,
                    result: "confirmed by the broker".to_owned(),
                }
            }
            Some(Ok(Confirmation::Ack(Some(returned)))) => {
                let why = format!(
                    "returned by the broker ({} {}): no queue is bound for the routing key",
                    returned.reply_code, returned.reply_text
                );
                (why, false)
            }
            Some(Ok(Confirmation::Nack(_))) => ("the broker refused the message".to_owned(), false),
            Some(Ok(Confirmation::NotRequested)) => {
                ("publisher confirms are off on the channel".to_owned(), true)
            }
            Some(Err(err)) => (format!("publish failed: {err}"), true),
            None => {
                let timeout = self.timeout.unwrap_or_default();
                (
                    format!("no confirm within {timeout:?}; the outcome is unknown"),
                    true,
                )
            }
        };
        if suspect {
            let mut link = self.link.lock().await;
            link.channel = None;
            // A connection of its own goes too: one gone half-open still says it is
            // connected until its heartbeat notices, and every delivery would wait on it.
            if matches!(self.source, Source::Own { .. }) {
                link.connection = None;
            }
        }
        Delivery::Retry {
            status: None,
            error,
        }
    }

    fn call_timeout(&self) -> Option<Duration> {
        self.timeout
    }
}

fn permanent(reason_code: &str, error: &str) -> Delivery {
    Delivery::Permanent {
        status: None,
        reason_code: reason_code.to_owned(),
        error: error.to_owned(),
    }
}

/// `exchange/routing-key` as the exchange and the routing key; `None` when it is not one.
fn destination(text: &str) -> Option<(ShortString, ShortString)> {
    let (exchange, routing_key) = text.split_once('/')?;
    let unusable = |c: char| c.is_whitespace() || c.is_control();
    // The default exchange routes by queue name: without one nothing can receive it.
    if (exchange.is_empty() && routing_key.is_empty()) || exchange.contains(unusable) {
        return None;
    }
    Some((
        ShortString::try_new(exchange).ok()?,
        ShortString::try_new(routing_key).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::destination;

    #[test]
    fn destinations_are_exchange_slash_routing_key() {
        let parts = |text| destination(text).map(|(e, r)| (e.to_string(), r.to_string()));
        let pair = |e: &str, r: &str| Some((e.to_owned(), r.to_owned()));
        assert_eq!(parts("credits/credited"), pair("credits", "credited"));
        assert_eq!(parts("/work"), pair("", "work"));
        assert_eq!(parts("fanout/"), pair("fanout", ""));
        assert_eq!(parts("events/a/b"), pair("events", "a/b"));
        let long = format!("x/{}", "k".repeat(256));
        for bad in ["credits", "", "/", "a b/k", "a\n/k", long.as_str()] {
            assert_eq!(parts(bad), None, "{bad:?}");
        }
    }
}
