//! The broker side of the RabbitMQ tests: the connection, and a work queue of the test's own
//! whose rejected messages are dead-lettered to a queue that the test reads.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

/// How long a test waits for a delivery before it fails (not for its outcome).
pub const PATIENCE: Duration = Duration::from_secs(30);

pub async fn rabbitmq() -> Connection {
    let uri = "amqp://guest:guest@127.0.0.1:5672/%2f";
    Connection::connect(uri, ConnectionProperties::default())
        .await
        .unwrap_or_else(|err| {
            panic!(
                "RabbitMQ on 127.0.0.1:5672 is not running ({err}); \
                 start it with `rabbitmq-server -detached`"
            )
        })
}

pub fn short(text: &str) -> ShortString {
    text.into()
}

fn table(entries: &[(&str, &str)]) -> FieldTable {
    let mut table = FieldTable::default();
    // Queues expire after ten minutes unused: a test that fails leaves nothing for long.
    table.insert(short("x-expires"), AMQPValue::LongInt(600_000));
    for (name, value) in entries {
        table.insert(short(name), AMQPValue::LongString((*value).into()));
    }
    table
}

/// A work queue whose rejected messages are dead-lettered to a queue of their own.
pub struct Broker {
    pub connection: Connection,
    pub channel: Channel,
    pub queue: String,
    dead: lapin::Consumer,
}

impl Broker {
    pub async fn new(test: &str, queue_type: &str) -> Self {
        let connection = rabbitmq().await;
        let channel = connection.create_channel().await.unwrap();
        let confirms = ConfirmSelectOptions::default();
        channel.confirm_select(confirms).await.unwrap();
        let (process, nonce) = (std::process::id(), fastrand::u32(..));
        let queue = format!("tower-inbox.{test}.{process}.{nonce}");
        let (dlx, dead) = (format!("{queue}.dlx"), format!("{queue}.dead"));
        exchange_declare(&channel, &dlx, ExchangeKind::Fanout).await;
        declare(&channel, &dead, table(&[])).await;
        bind(&channel, &dead, &dlx, "").await;
        let arguments = [
            ("x-dead-letter-exchange", dlx.as_str()),
            ("x-queue-type", queue_type),
        ];
        declare(&channel, &queue, table(&arguments)).await;
        let dead = consume(&channel, &dead, true).await;
        Self {
            connection,
            channel,
            queue,
            dead,
        }
    }

    pub async fn channel(&self) -> Channel {
        self.connection.create_channel().await.unwrap()
    }

    /// Publishes to the work queue and waits for the broker's confirm.
    pub async fn publish(&self, message_id: Option<&str>, app_id: Option<&str>, body: &[u8]) {
        let mut properties = BasicProperties::default();
        if let Some(id) = message_id {
            properties = properties.with_message_id(short(id));
        }
        if let Some(app) = app_id {
            properties = properties.with_app_id(short(app));
        }
        let (queue, options) = (short(&self.queue), BasicPublishOptions::default());
        let publish = self
            .channel
            .basic_publish(short(""), queue, options, body, properties);
        assert!(publish.await.unwrap().await.unwrap().is_ack());
    }

    /// Takes the next message from the work queue on `channel`, unacknowledged.
    pub async fn get(&self, channel: &Channel) -> Delivery {
        let options = BasicGetOptions { no_ack: false };
        let got = channel
            .basic_get(short(&self.queue), options)
            .await
            .unwrap();
        got.expect("a message in the queue").delivery
    }

    /// The body of the next dead-lettered message.
    pub async fn dead_letter(&mut self) -> Vec<u8> {
        next(&mut self.dead).await.data
    }

    /// Messages ready in the work queue. On a classic queue, what a channel settled before it
    /// closed has reached the queue, and what it left unsettled is back: close the consuming
    /// channel first. (A quorum queue takes them back asynchronously.)
    pub async fn ready(&self) -> u32 {
        let options = QueueDeclareOptions::default().passive();
        let declared = self
            .channel
            .queue_declare(short(&self.queue), options, table(&[]));
        declared.await.unwrap().message_count()
    }

    /// Deletes the queues; the auto-deleted exchanges go with their last binding.
    pub async fn delete(self) {
        for queue in [self.queue.clone(), format!("{}.dead", self.queue)] {
            let options = QueueDeleteOptions::default();
            self.channel
                .queue_delete(short(&queue), options)
                .await
                .unwrap();
        }
        self.connection.close(200, short("done")).await.unwrap();
    }
}

pub async fn exchange_declare(channel: &Channel, name: &str, kind: ExchangeKind) {
    let options = ExchangeDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    let arguments = FieldTable::default();
    channel
        .exchange_declare(short(name), kind, options, arguments)
        .await
        .unwrap();
}

async fn declare(channel: &Channel, queue: &str, arguments: FieldTable) {
    let options = QueueDeclareOptions::durable();
    channel
        .queue_declare(short(queue), options, arguments)
        .await
        .unwrap();
}

pub async fn bind(channel: &Channel, queue: &str, exchange: &str, key: &str) {
    let (options, arguments) = (QueueBindOptions::default(), FieldTable::default());
    let bound = channel.queue_bind(
        short(queue),
        short(exchange),
        short(key),
        options,
        arguments,
    );
    bound.await.unwrap();
}

pub async fn consume(channel: &Channel, queue: &str, no_ack: bool) -> lapin::Consumer {
    let options = BasicConsumeOptions {
        no_ack,
        ..Default::default()
    };
    let arguments = FieldTable::default();
    channel
        .basic_consume(short(queue), short(""), options, arguments)
        .await
        .unwrap()
}

pub async fn next(deliveries: &mut lapin::Consumer) -> Delivery {
    let next = tokio::time::timeout(PATIENCE, deliveries.next()).await;
    let next = next.expect("a delivery within the patience");
    next.expect("an open consumer").unwrap()
}
