//! `examples/credits_consumer.rs` as an operator runs it, against the NATS server on
//! 127.0.0.1:4222: killed (SIGKILL) again and again under a steady publisher that also
//! retries, then left to finish. Every command is applied once and published once as an
//! event; a poison message ends in the quarantine. (Conflicts and the other outcomes are
//! driven one by one in tests/nats.rs.)

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, Context};
use async_nats::HeaderMap;
use bytes::Bytes;
use tower_inbox_testdb::TestDatabase;

const COMMANDS: usize = 120;
const KILLS: usize = 8;

struct Service {
    binary: std::path::PathBuf,
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl Service {
    fn start(&mut self) {
        let mut command = Command::new(&self.binary);
        command
            .env_remove("DATABASE_URL")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (name, value) in &self.env {
            command.env(name, value);
        }
        self.child = Some(command.spawn().expect("start the consumer example"));
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill(); // SIGKILL: no chance to finish anything
            let _ = child.wait();
        }
    }

    /// SIGTERM, then its exit status: it stops after the message in hand.
    fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let pid = child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        child.wait().expect("wait for the consumer")
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn publish(js: &Context, subject: String, id: &str, body: &'static str) {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", id);
    headers.insert("X-Producer", "app");
    js.publish_with_headers(subject, headers, Bytes::from_static(body.as_bytes()))
        .await
        .expect("publish")
        .await
        .expect("publish ack");
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_again_and_again_it_applies_every_command_once_and_publishes_one_event_each() {
    let client = async_nats::connect("127.0.0.1:4222")
        .await
        .unwrap_or_else(|e| {
            panic!("NATS with JetStream is not running on 127.0.0.1:4222 ({e}); see .ci/run")
        });
    let js = jetstream::new(client);
    let ns = format!("kill{}", std::process::id());
    let (stream, events) = (ns.to_uppercase(), format!("{}_EVENTS", ns.to_uppercase()));
    let db = TestDatabase::create().await.expect("test database");
    let mut service = Service {
        binary: common::example::binary("credits_consumer"),
        env: vec![
            ("DATABASE_URL".to_owned(), db.url().to_owned()),
            ("CREDITS_NAMESPACE".to_owned(), ns.clone()),
        ],
        child: None,
    };
    service.start();
    // The streams exist once the first instance is up.
    eventually(Duration::from_secs(30), || async {
        let created = js.get_stream(&stream).await.is_ok();
        created
            .then_some(())
            .ok_or(format!("the consumer never created {stream}"))
    })
    .await;

    // A steady publisher: each command twice (the producer retries), over a few seconds.
    let publisher = {
        let (js, ns) = (js.clone(), ns.clone());
        tokio::spawn(async move {
            for i in 0..COMMANDS {
                let subject = format!("{ns}.commands.a{}", i % 7);
                let id = format!("c-{i}");
                publish(&js, subject.clone(), &id, r#"{"delta": 1}"#).await;
                tokio::time::sleep(Duration::from_millis(25)).await;
                publish(&js, subject, &id, r#"{"delta": 1}"#).await;
            }
            publish(&js, format!("{ns}.commands.a0"), "poison", "not json").await;
        })
    };
    let mut kills = 0;
    while kills < KILLS {
        tokio::time::sleep(Duration::from_millis(200 + fastrand::u64(0..600))).await;
        service.kill();
        kills += 1;
        service.start();
    }
    publisher.await.expect("publisher");
    println!("{kills} SIGKILLs of the consumer under {COMMANDS} commands published twice");

    // Left alone, it finishes: every command applied, every event published.
    let pool = db.pool(2).await;
    eventually(Duration::from_secs(90), || async {
        let (rows, event_count) = (ledger_rows(&pool).await, event_count(&js, &events).await);
        let done = rows >= COMMANDS as i64 && event_count >= COMMANDS as u64;
        done.then_some(()).ok_or(format!(
            "after the kills: {rows} ledger rows and {event_count} events of {COMMANDS}"
        ))
    })
    .await;
    // The poison message fails three deliveries, then sits in the quarantine.
    eventually(Duration::from_secs(60), || async {
        let done = quarantined(&pool).await >= 1;
        done.then_some(())
            .ok_or("the poison message was not quarantined".to_owned())
    })
    .await;
    assert!(service.terminate().success(), "SIGTERM is a clean stop");

    let per_id: Vec<(String, i64)> = sqlx::query_as(
        "select message_id, count(*) from credit_ledger
          where consumer_name = 'credits-worker' group by message_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(per_id.len(), COMMANDS, "every command applied");
    assert!(per_id.iter().all(|(_, n)| *n == 1), "none applied twice");
    let balance: i64 = sqlx::query_scalar("select sum(balance)::bigint from credit_account")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(balance, COMMANDS as i64);
    assert_eq!(
        event_count(&js, &events).await,
        COMMANDS as u64,
        "one event each"
    );
    let undelivered: i64 = sqlx::query_scalar(
        "select count(*) from tower_inbox.message_outbox where status <> 'delivered'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(undelivered, 0);
    let _ = js.delete_stream(&stream).await;
    let _ = js.delete_stream(&events).await;
}

/// Polls `check` until it answers `Ok`; past `limit` the test fails with its last answer.
async fn eventually<F, Fut>(limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match check().await {
            Ok(()) => return,
            Err(why) => assert!(Instant::now() < deadline, "{why}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn ledger_rows(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from credit_ledger")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

async fn event_count(js: &Context, events: &str) -> u64 {
    match js.get_stream(events).await {
        Ok(mut stream) => stream.info().await.map(|i| i.state.messages).unwrap_or(0),
        Err(_) => 0,
    }
}

async fn quarantined(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from tower_inbox.inbox_quarantine where source = 'handler-failure'",
    )
    .fetch_one(pool)
    .await
    .unwrap_or(0)
}

/// The RabbitMQ mode (`CREDITS_BROKER=amqp`): killed under a publisher that sends every
/// command twice, then left to finish: each applied once, and at least one event each on the
/// topic exchange (publisher confirms are at least once; repeats carry the same message_id).
#[cfg(feature = "amqp")]
#[tokio::test(flavor = "multi_thread")]
async fn in_rabbitmq_mode_too_every_command_is_applied_once_and_has_its_event() {
    use lapin::options::{
        BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
        QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};

    const AMQP_COMMANDS: usize = 60;
    let uri = "amqp://guest:guest@127.0.0.1:5672/%2f";
    let connection = Connection::connect(uri, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!("RabbitMQ is not running on 127.0.0.1:5672 ({e}); start it with `rabbitmq-server -detached`")
        });
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let ns = format!("amqp{}", std::process::id());
    let (queue, exchange, events) = (
        format!("{ns}.commands"),
        format!("{ns}.events"),
        format!("{ns}.events.seen"),
    );
    // The queue and exchange the example would declare, and a queue that counts the events.
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.as_str().into(), durable, FieldTable::default())
        .await
        .unwrap();
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
        .unwrap();
    channel
        .queue_declare(
            events.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            events.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    let db = TestDatabase::create().await.expect("test database");
    let mut service = Service {
        binary: common::example::binary("credits_consumer"),
        env: vec![
            ("DATABASE_URL".to_owned(), db.url().to_owned()),
            ("CREDITS_NAMESPACE".to_owned(), ns.clone()),
            ("CREDITS_BROKER".to_owned(), "amqp".to_owned()),
        ],
        child: None,
    };
    service.start();
    let publish = |id: String, body: String| {
        let (channel, queue) = (channel.clone(), queue.clone());
        async move {
            let properties = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_app_id("app".into())
                .with_delivery_mode(2);
            let confirm = channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(confirm.is_ack());
        }
    };
    let mut kills = 0;
    for i in 0..AMQP_COMMANDS {
        let body = format!(r#"{{"account_id": "a{}", "delta": 1}}"#, i % 5);
        publish(format!("c-{i}"), body.clone()).await;
        publish(format!("c-{i}"), body).await;
        if i % 20 == 10 {
            tokio::time::sleep(Duration::from_millis(100 + fastrand::u64(0..300))).await;
            service.kill();
            kills += 1;
            service.start();
        }
    }
    println!("{kills} SIGKILLs of the consumer under {AMQP_COMMANDS} commands published twice");

    let pool = db.pool(2).await;
    let event_count = || async {
        let passive = QueueDeclareOptions::default().passive();
        channel
            .queue_declare(events.as_str().into(), passive, FieldTable::default())
            .await
            .map(|q| q.message_count())
            .unwrap_or(0)
    };
    eventually(Duration::from_secs(90), || async {
        let (rows, seen) = (ledger_rows(&pool).await, event_count().await);
        let done = rows >= AMQP_COMMANDS as i64 && seen >= AMQP_COMMANDS as u32;
        done.then_some(()).ok_or(format!(
            "after the kills: {rows} ledger rows and {seen} events of {AMQP_COMMANDS}"
        ))
    })
    .await;
    assert!(service.terminate().success(), "SIGTERM is a clean stop");
    let per_id: Vec<(String, i64)> =
        sqlx::query_as("select message_id, count(*) from credit_ledger group by message_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(per_id.len(), AMQP_COMMANDS);
    assert!(per_id.iter().all(|(_, n)| *n == 1), "none applied twice");
    // Publisher confirms make delivery at least once: a kill between a confirm and its mark
    // republishes, with the same message_id, which the consumers of the events drop. Each
    // applied command has its event, and no event is of a command not applied.
    let seen = event_count().await;
    assert!(seen >= AMQP_COMMANDS as u32, "{seen} events");
    for name in [&queue, &events] {
        let _ = channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = channel
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;
}
