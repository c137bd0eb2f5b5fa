//! The credits service consuming commands from a broker: NATS JetStream by default.
//!
//! (Over 400 lines: one runnable example, publisher and consumer for both brokers.)
//!
//! ```sh
//! cargo run --example credits_consumer --features nats
//! # in another terminal: credit account a1 with 10, message ID c-1 (any client will do)
//! cargo run --example credits_consumer --features nats -- publish a1 10 c-1
//! ```
//!
//! Same database and tables as `examples/credits.rs` (`DATABASE_URL`, else the local server,
//! else a throwaway cluster), consumer name `credits-worker`:
//!
//! - `NATS_URL` (default `nats://127.0.0.1:4222`). Stream `CREDITS` (subjects
//!   `credits.commands.>`) and its durable pull consumer `credits-worker`, and stream
//!   `CREDITS_EVENTS` (subjects `credits.events.>`), each created if missing and used as it
//!   is otherwise: operators own their stream settings.
//! - A command is a message on `credits.commands.<account_id>` with body `{"delta": <integer>}`
//!   and headers `Nats-Msg-Id` (the message ID) and `X-Producer` (the producer). It credits the
//!   account and writes one ledger row, as the HTTP service does, and publishes one event
//!   through the outbox to `credits.events.<account_id>`, body
//!   `{"account_id", "delta", "balance"}`, `Nats-Msg-Id` = the effect's ID.
//! - A body that is not such a command fails; after three failed deliveries it is kept in the
//!   quarantine and terminated, without holding up later messages. The same message ID with
//!   another body is a conflict: not applied, terminated, kept in the quarantine.
//! - One log line per message at info; nothing over HTTP. SIGTERM or Ctrl-C stops it after
//!   the message in hand.
//!
//! `publish ACCOUNT DELTA MESSAGE_ID` sends one command as a producer would (producer
//! `CREDITS_PRODUCER`, default `app`), to the broker `CREDITS_BROKER` names, waits for the
//! broker to take it, prints one line and exits: sending the same message ID twice is how a
//! producer's retry looks. The consumer must have run once, to create the stream or queue.
//!
//! `CREDITS_NAMESPACE` (default `credits`) renames the subjects (`<ns>.commands.>`,
//! `<ns>.events.<account_id>`) and streams (`<NS>`, `<NS>_EVENTS`), so that a second
//! instance can run beside the first on one server (the tests do).
//!
//! `CREDITS_BROKER=amqp` consumes from RabbitMQ instead (feature `amqp`): `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`), queue `<ns>.commands` (declared durable if
//! missing), the message ID from the `message_id` property and the producer from `app_id`; a
//! command's body is `{"account_id": "<id>", "delta": <integer>}` (a queue has no subject to
//! carry the account), and its event goes to the topic exchange `<ns>.events` (declared if
//! missing) with routing key `<account_id>`.

// Shared with the HTTP example, which uses the parts this one does not.
#[allow(dead_code)]
#[path = "credits/app.rs"]
mod app;

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use futures_util::{FutureExt, StreamExt};
use serde::Deserialize;
use tower_inbox::consumer::nats::{max_ack_pending, Handled, NatsConsumer};
use tower_inbox::consumer::{Consumer, Processed};
use tower_inbox::inbox::ClaimedMessage;
use tower_inbox::outbox::{Dispatcher, NatsTransport, OutboxMessage, Transport};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The consumer name in every identity, shared by both brokers.
const CONSUMER: &str = "credits-worker";

/// A startup failure is one line naming the culprit, then exit status 1.
#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Publishing prints one line of its own; the client's connection logs would drown it.
    let publishing = std::env::args().nth(1).as_deref() == Some("publish");
    let level = if publishing { "warn" } else { "info" };
    app::main_of("credits_consumer", level, run()).await
}

async fn run() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(("publish", command)) = args.split_first().map(|(a, r)| (a.as_str(), r)) {
        return publish::command(command).await;
    }
    if let Some(unknown) = args.first() {
        return Err(format!("unknown argument {unknown:?}: {}", publish::USAGE).into());
    }
    let pool = app::connect(16).await?;
    app::prepare(&pool).await?;
    let consumer = Consumer::builder(pool.clone(), CONSUMER).build()?;
    match std::env::var("CREDITS_BROKER").as_deref() {
        Ok("nats") | Err(_) => consume_nats(pool, consumer).await,
        #[cfg(feature = "amqp")]
        Ok("amqp") => amqp_mode::consume(pool, consumer).await,
        #[cfg(not(feature = "amqp"))]
        Ok("amqp") => {
            Err("CREDITS_BROKER=amqp needs the amqp feature: --features nats,amqp".into())
        }
        Ok(other) => Err(format!("CREDITS_BROKER is {other:?}: use nats or amqp").into()),
    }
}

/// The outbox dispatcher that publishes the events, in a task of its own.
struct EventDispatcher {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), tower_inbox::outbox::OutboxError>>,
}

impl EventDispatcher {
    fn start(pool: &sqlx::PgPool, transport: impl Transport) -> Result<Self, Error> {
        let dispatcher = Dispatcher::builder(pool.clone(), transport)
            .delivery_timeout(Duration::from_secs(5))
            .lease(Duration::from_secs(15))
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(dispatcher.run(async {
            let _ = stopped.await;
        }));
        Ok(Self { stop, task })
    }

    /// Stops after the delivery in hand.
    async fn stop(self) -> Result<(), Error> {
        let _ = self.stop.send(());
        Ok(self.task.await??)
    }
}

/// A URL as it may be printed: without the user and password it may carry.
fn shown(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((_, host)) => format!("{scheme}://***@{host}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// `CREDITS_NAMESPACE`: lowercase letters, digits and `_`, as subject tokens and stream names
/// allow.
fn namespace() -> Result<String, Error> {
    let ns = std::env::var("CREDITS_NAMESPACE").unwrap_or_else(|_| "credits".to_owned());
    let valid = !ns.is_empty()
        && ns.len() <= 32
        && ns
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid {
        Ok(ns)
    } else {
        Err(format!("CREDITS_NAMESPACE {ns:?} is not 1 to 32 of a-z, 0-9 and _").into())
    }
}

/// A command's body; on RabbitMQ it names the account too.
#[derive(Deserialize)]
struct Command {
    delta: i64,
    account_id: Option<String>,
}

/// Why a message is not a command: a handler error, counted toward the quarantine.
#[derive(Debug, thiserror::Error)]
enum BadCommand {
    #[error("the command names no account")]
    NoAccount,
    #[error("the body is not {{\"delta\": <integer>}}")]
    Body,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Outbox(#[from] tower_inbox::inbox::InboxError),
}

/// The command's business writes and its event, on the claimed transaction.
async fn apply(
    message: &mut ClaimedMessage,
    account: Option<&str>,
    body: &[u8],
    event_destination: impl FnOnce(&str) -> String,
) -> Result<i64, BadCommand> {
    let command: Command = serde_json::from_slice(body).map_err(|_| BadCommand::Body)?;
    let account = account
        .or(command.account_id.as_deref())
        .filter(|a| !a.is_empty() && a.len() <= 128)
        .ok_or(BadCommand::NoAccount)?;
    let delta = command.delta;
    let identity = message.identity().clone();
    let balance = app::credit_rows(message, account, delta, &identity).await?;
    let event = serde_json::json!({"account_id": account, "delta": delta, "balance": balance});
    let event = OutboxMessage::new(event_destination(account), event.to_string())
        .header("Content-Type", "application/json");
    message.enqueue("credited", &event).await?;
    Ok(balance)
}

async fn consume_nats(pool: sqlx::PgPool, consumer: Consumer) -> Result<(), Error> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let ns = namespace()?;
    let stream_name = ns.to_uppercase();
    let client = async_nats::connect(&url)
        .await
        .map_err(|e| format!("cannot connect to NATS at {} (NATS_URL): {e}", shown(&url)))?;
    let js = jetstream::new(client);
    let commands = js
        .get_or_create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![format!("{ns}.commands.>")],
            ..Default::default()
        })
        .await
        .map_err(|e| format!("stream {stream_name}: {e}"))?;
    js.get_or_create_stream(stream::Config {
        name: format!("{stream_name}_EVENTS"),
        subjects: vec![format!("{ns}.events.>")],
        ..Default::default()
    })
    .await
    .map_err(|e| format!("stream {stream_name}_EVENTS: {e}"))?;
    let durable = commands
        .get_or_create_consumer(
            CONSUMER,
            pull::Config {
                durable_name: Some(CONSUMER.to_owned()),
                // Each message in hand may hold a pooled connection: no more than the pool.
                max_ack_pending: max_ack_pending(&pool),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| format!("consumer {CONSUMER} on stream {stream_name}: {e}"))?;

    // The events go out through the outbox, after the commit, with their effect IDs.
    let events = EventDispatcher::start(&pool, NatsTransport::new(js.clone()))?;

    let nats = NatsConsumer::new(consumer);
    let mut messages = durable
        .messages()
        .await
        .map_err(|e| format!("consumer {CONSUMER}: {e}"))?;
    tracing::info!(url = %shown(&url), "consuming {ns}.commands.> as {CONSUMER}");
    let commands_prefix = format!("{ns}.commands.");
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        let message = tokio::select! {
            message = messages.next() => message,
            () = &mut shutdown => break,
        };
        let message = match message {
            Some(Ok(message)) => message,
            Some(Err(err)) => {
                // The client reconnects and the pull subscription re-establishes itself; a
                // message in hand whose ack was lost is delivered again after `ack_wait`.
                tracing::warn!(error = %err, "receiving from JetStream failed");
                continue;
            }
            None => {
                // The stream ended without a stop asked for: pull again on the same
                // durable consumer, where every unacknowledged message still waits.
                tracing::warn!("the JetStream pull ended; pulling again");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(500)) => {}
                    () = &mut shutdown => break,
                }
                match durable.messages().await {
                    Ok(again) => messages = again,
                    Err(err) => tracing::warn!(error = %err, "pulling from JetStream failed"),
                }
                continue;
            }
        };
        let account = message
            .subject
            .strip_prefix(&commands_prefix)
            .map(str::to_owned);
        let body = message.payload.clone();
        let handled = nats
            .handle(&message, |claimed| {
                let (account, body, ns) = (account.clone(), body.clone(), ns.clone());
                let events = move |account: &str| format!("{ns}.events.{account}");
                async move { apply(claimed, account.as_deref(), &body, events).await }.boxed()
            })
            .await;
        log_outcome(&message.subject, handled);
    }
    tracing::info!("stopping after the message in hand");
    events.stop().await
}

fn log_outcome(subject: &str, handled: Result<Handled<i64, BadCommand>, impl std::fmt::Display>) {
    match handled {
        Ok(Handled::Processed(processed)) => log_processed(subject, processed),
        Ok(Handled::Unidentified(why)) => {
            tracing::info!(source = subject, outcome = "unidentified", %why, "message terminated")
        }
        Err(err) => {
            tracing::warn!(source = subject, error = %err, "settling the message failed; it will be redelivered")
        }
    }
}

/// One line per message: where it came from and what became of it (never its body).
fn log_processed(source: &str, processed: Processed<i64, BadCommand>) {
    let outcome = processed.kind();
    match processed {
        Processed::Applied(balance) => tracing::info!(source, outcome, balance, "credit applied"),
        Processed::Failed { error, retry_in } => {
            tracing::info!(source, outcome, %error, ?retry_in, "command failed; delivered again later")
        }
        Processed::Quarantined {
            error,
            quarantine_id,
        } => {
            tracing::info!(source, outcome, %error, quarantine_id, "command quarantined and rejected")
        }
        _ => tracing::info!(source, outcome, "command settled"),
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

mod publish {
    //! `publish ACCOUNT DELTA MESSAGE_ID`: one command, as a producer sends it.

    use async_nats::jetstream;
    use async_nats::HeaderMap;

    use super::{namespace, Error};

    pub(super) const USAGE: &str = "usage: credits_consumer [publish ACCOUNT DELTA MESSAGE_ID]";

    pub(super) async fn command(args: &[String]) -> Result<(), Error> {
        let [account, delta, id] = args else {
            return Err(USAGE.into());
        };
        let delta: i64 = delta
            .parse()
            .map_err(|_| format!("DELTA {delta:?} is not an integer"))?;
        let valid_account = !account.is_empty()
            && account.len() <= 128
            && account
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !valid_account {
            return Err(
                format!("ACCOUNT {account:?} is not 1 to 128 of A-Z, a-z, 0-9, - and _").into(),
            );
        }
        let sent = Sent {
            ns: namespace()?,
            account,
            delta,
            id,
            producer: std::env::var("CREDITS_PRODUCER").unwrap_or_else(|_| "app".to_owned()),
        };
        match std::env::var("CREDITS_BROKER").as_deref() {
            Ok("nats") | Err(_) => nats(&sent).await,
            #[cfg(feature = "amqp")]
            Ok("amqp") => super::amqp_mode::publish(&sent).await,
            #[cfg(not(feature = "amqp"))]
            Ok("amqp") => {
                Err("CREDITS_BROKER=amqp needs the amqp feature: --features nats,amqp".into())
            }
            Ok(other) => Err(format!("CREDITS_BROKER is {other:?}: use nats or amqp").into()),
        }
    }

    /// One command to send, and where.
    pub(super) struct Sent<'a> {
        pub(super) ns: String,
        pub(super) account: &'a str,
        pub(super) delta: i64,
        pub(super) id: &'a str,
        pub(super) producer: String,
    }

    async fn nats(sent: &Sent<'_>) -> Result<(), Error> {
        let Sent {
            ns,
            account,
            delta,
            id,
            producer,
        } = sent;
        let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let client = async_nats::connect(&url).await.map_err(|e| {
            format!(
                "cannot connect to NATS at {} (NATS_URL): {e}",
                super::shown(&url)
            )
        })?;
        let subject = format!("{ns}.commands.{account}");
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", *id);
        headers.insert("X-Producer", producer.as_str());
        headers.insert("Content-Type", "application/json");
        let body = serde_json::json!({ "delta": delta }).to_string();
        let ack = jetstream::new(client)
            .publish_with_headers(subject.clone(), headers, body.into())
            .await
            .map_err(|e| format!("publishing to {subject}: {e}"))?
            .await
            .map_err(|e| {
                format!("no stream took {subject} ({e}): has the consumer run once to create it?")
            })?;
        let duplicate = if ack.duplicate {
            ", a duplicate the stream dropped"
        } else {
            ""
        };
        println!(
            "published {id} to {subject}: stream {} sequence {}{duplicate}",
            ack.stream, ack.sequence
        );
        Ok(())
    }
}

#[cfg(feature = "amqp")]
mod amqp_mode {
    //! The RabbitMQ mode: the same commands from a queue, the events to a topic exchange.

    use std::time::Duration;

    use futures_util::{FutureExt, StreamExt};
    use lapin::options::{
        BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
        QueueDeclareOptions,
    };
    use lapin::types::{FieldTable, ShortString};
    use lapin::uri::AMQPUri;
    use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, ExchangeKind};
    use tower_inbox::consumer::amqp::{AmqpConsumer, Handled};
    use tower_inbox::consumer::Consumer;
    use tower_inbox::outbox::AmqpTransport;

    use super::publish::Sent;

    /// The first wait before reconnecting, doubled after each failure up to the last.
    const MIN_BACKOFF: Duration = Duration::from_millis(100);
    const MAX_BACKOFF: Duration = Duration::from_secs(5);
    /// A connect that hangs (a half-open network) is given up and tried again.
    const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
    use super::{
        apply, log_processed, namespace, shutdown_signal, Error, EventDispatcher, CONSUMER,
    };

    /// `AMQP_URL`, parsed once: the parser's errors quote the URL, password and all, so
    /// they are not passed on.
    fn amqp_url() -> Result<(String, AMQPUri), Error> {
        let url = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        let uri = url.parse::<AMQPUri>().map_err(|_| {
            "AMQP_URL is not an AMQP URL (amqp://user:password@host:port/vhost)".to_owned()
        })?;
        Ok((url, uri))
    }

    pub(super) async fn consume(pool: sqlx::PgPool, consumer: Consumer) -> Result<(), Error> {
        let (url, uri) = amqp_url()?;
        let ns = namespace()?;
        let names = Names {
            queue: format!("{ns}.commands"),
            exchange: format!("{ns}.events"),
        };
        let amqp = AmqpConsumer::new(consumer);
        // The first connection failing is a startup error; a later loss is reconnected.
        let (mut _connection, mut deliveries) = open(&uri, &names, &amqp).await?;

        // The transport keeps a connection of its own and reopens it when lost.
        let transport = AmqpTransport::connect(url.as_str(), ConnectionProperties::default())
            .timeout(Duration::from_secs(5));
        let events = EventDispatcher::start(&pool, transport)?;
        tracing::info!("consuming queue {} as {CONSUMER}", names.queue);
        let shutdown = shutdown_signal();
        tokio::pin!(shutdown);
        let mut backoff = MIN_BACKOFF;
        'consuming: loop {
            let delivery = tokio::select! {
                delivery = deliveries.next() => delivery,
                () = &mut shutdown => break,
            };
            let delivery = match delivery {
                Some(Ok(delivery)) => delivery,
                // The connection or channel is gone, and with it every unacknowledged
                // delivery, which the broker requeues: open a new one and go on.
                lost => {
                    let why = match lost {
                        Some(Err(err)) => err.to_string(),
                        _ => "the broker ended the consumer".to_owned(),
                    };
                    tracing::warn!(error = %why, "lost the RabbitMQ connection; reconnecting");
                    loop {
                        // The backoff goes back to its start only once a delivery got
                        // through: a consumer lost again at once does not spin.
                        tokio::select! {
                            () = tokio::time::sleep(backoff) => {}
                            () = &mut shutdown => break 'consuming,
                        }
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        let reopened = tokio::select! {
                            reopened = tokio::time::timeout(CONNECT_TIMEOUT, open(&uri, &names, &amqp)) => reopened,
                            () = &mut shutdown => break 'consuming,
                        };
                        match reopened {
                            Ok(Ok(reopened)) => {
                                (_connection, deliveries) = reopened;
                                tracing::info!("reconnected to RabbitMQ");
                                continue 'consuming;
                            }
                            Ok(Err(err)) => {
                                tracing::warn!(error = %err, "reconnecting to RabbitMQ failed")
                            }
                            Err(_) => tracing::warn!(
                                "reconnecting to RabbitMQ took over {CONNECT_TIMEOUT:?}; trying again"
                            ),
                        }
                    }
                }
            };
            backoff = MIN_BACKOFF;
            let body = delivery.data.clone();
            let handled = amqp
                .handle(&delivery, |claimed| {
                    let (body, exchange) = (body.clone(), names.exchange.clone());
                    let events = move |account: &str| format!("{exchange}/{account}");
                    async move { apply(claimed, None, &body, events).await }.boxed()
                })
                .await;
            match handled {
                Ok(Handled::Processed(processed)) => log_processed(&names.queue, processed),
                Ok(Handled::Unidentified(why)) => {
                    tracing::info!(source = %names.queue, outcome = "unidentified", %why, "message rejected")
                }
                Err(err) => {
                    tracing::warn!(source = %names.queue, error = %err, "settling failed; delivered again later")
                }
            }
        }
        tracing::info!("stopping after the message in hand");
        events.stop().await
    }

    /// Sends one command to the queue, persistent, and waits for the broker's confirm.
    pub(super) async fn publish(sent: &Sent<'_>) -> Result<(), Error> {
        let Sent {
            ns,
            account,
            delta,
            id,
            producer,
        } = sent;
        let (_, uri) = amqp_url()?;
        let queue = format!("{ns}.commands");
        let too_long = |what: &str| format!("{what} is over 255 bytes, too long for AMQP");
        let message_id = ShortString::try_new(*id).map_err(|_| too_long("MESSAGE_ID"))?;
        let app_id =
            ShortString::try_new(producer.as_str()).map_err(|_| too_long("CREDITS_PRODUCER"))?;
        let connection = Connection::connect_uri(uri, ConnectionProperties::default())
            .await
            .map_err(|e| format!("cannot connect to RabbitMQ (AMQP_URL): {e}"))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| format!("opening a channel on RabbitMQ: {e}"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| format!("enabling publisher confirms on RabbitMQ: {e}"))?;
        let body = serde_json::json!({ "account_id": account, "delta": delta }).to_string();
        let properties = BasicProperties::default()
            .with_message_id(message_id)
            .with_app_id(app_id)
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        // Mandatory: a queue that is not there sends the message back rather than drop it.
        let mandatory = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let confirmation = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                mandatory,
                body.as_bytes(),
                properties,
            )
            .await?
            .await?;
        match confirmation {
            Confirmation::Ack(None) => {
                println!("published {id} to queue {queue}");
                Ok(())
            }
            Confirmation::Ack(Some(_)) => {
                Err(format!("no queue {queue}: has the consumer run once to declare it?").into())
            }
            _ => Err(format!("RabbitMQ did not confirm {id} on queue {queue}").into()),
        }
    }

    /// The queue commands come from and the exchange events go to.
    struct Names {
        queue: String,
        exchange: String,
    }

    /// Connects, declares the queue and the exchange if missing, and starts consuming. The
    /// URL holds a password: errors name the variable, not the URL. The connection is
    /// returned to be kept: the consumer lives on it.
    async fn open(
        uri: &AMQPUri,
        names: &Names,
        amqp: &AmqpConsumer,
    ) -> Result<(Connection, lapin::Consumer), Error> {
        let Names { queue, exchange } = names;
        let connection = Connection::connect_uri(uri.clone(), ConnectionProperties::default())
            .await
            .map_err(|e| format!("cannot connect to RabbitMQ (AMQP_URL): {e}"))?;
        let channel = connection.create_channel().await?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(queue.as_str().into(), durable, FieldTable::default())
            .await
            .map_err(|e| format!("queue {queue}: {e}"))?;
        let topic = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                topic,
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("exchange {exchange}: {e}"))?;
        // Each delivery in hand may hold a pooled connection: no more than the pool.
        amqp.set_prefetch(&channel).await?;
        let deliveries = channel
            .basic_consume(
                queue.as_str().into(),
                CONSUMER.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("consuming {queue}: {e}"))?;
        Ok((connection, deliveries))
    }
}
