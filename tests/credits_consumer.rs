//! `examples/credits_consumer.rs` as an operator runs it, against the NATS server on
//! 127.0.0.1:4222 and RabbitMQ on 127.0.0.1:5672: killed (SIGKILL) again and again under a
//! steady publisher that also retries, then left to finish. Every command is applied once
//! and published as an event; a poison message ends in the quarantine. Then every broker
//! connection cut under load: the same process reconnects and loses nothing. (Conflicts
//! and the other outcomes are driven one by one in tests/nats.rs and tests/amqp.rs.)
//! (Over 400 lines: the example run as a process, with its kill loop and broker cuts.)

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, Context};
use async_nats::HeaderMap;
use bytes::Bytes;
use common::proxy::Proxy;
use tower_inbox_testdb::TestDatabase;

const COMMANDS: usize = 120;
const KILLS: usize = 8;

struct Service {
    binary: std::path::PathBuf,
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl Service {
    /// The example on the database `db`, in namespace `ns`, with `more` settings.
    fn new(db: &TestDatabase, ns: &str, more: &[(&str, String)]) -> Self {
        let mut env = vec![
            ("DATABASE_URL".to_owned(), db.url().to_owned()),
            ("CREDITS_NAMESPACE".to_owned(), ns.to_owned()),
        ];
        env.extend(more.iter().map(|(n, v)| ((*n).to_owned(), v.clone())));
        Self {
            binary: common::example::binary("credits_consumer"),
            env,
            child: None,
        }
    }

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

    /// Runs the example's `publish ACCOUNT DELTA MESSAGE_ID` with this service's settings,
    /// and returns the line it printed.
    fn publish(&self, account: &str, delta: &str, id: &str) -> String {
        let output = Command::new(&self.binary)
            .args(["publish", account, delta, id])
            .envs(self.env.iter().map(|(n, v)| (n, v)))
            .env_remove("RUST_LOG")
            .output()
            .expect("run the example's publish");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
        assert!(output.status.success(), "publish failed: {stderr}");
        stdout.trim().to_owned()
    }

    /// Whether the process is still running (it has not exited by itself).
    fn running(&mut self) -> bool {
        let child = self.child.as_mut().expect("started");
        matches!(child.try_wait(), Ok(None))
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

async fn nats() -> Context {
    let client = async_nats::connect("127.0.0.1:4222")
        .await
        .unwrap_or_else(|e| {
            panic!("NATS with JetStream is not running on 127.0.0.1:4222 ({e}); see .ci/run")
        });
    jetstream::new(client)
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_again_and_again_it_applies_every_command_once_and_publishes_one_event_each() {
    let js = nats().await;
    let ns = format!("kill{}", std::process::id());
    let (stream, events) = (ns.to_uppercase(), format!("{}_EVENTS", ns.to_uppercase()));
    let db = TestDatabase::create().await.expect("test database");
    let mut service = Service::new(&db, &ns, &[]);
    service.start();
    // The streams exist once the first instance is up.
    stream_created(&js, &stream).await;

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

/// Waits until the example pulls from `stream` (a pull request is waiting): its startup,
/// which gives up on a broker connection lost half way, is over.
async fn pulling(js: &Context, stream: &str) {
    eventually(Duration::from_secs(60), || async {
        let waiting = match js.get_stream(stream).await {
            Ok(stream) => stream
                .consumer_info("credits-worker")
                .await
                .map_or(0, |info| info.num_waiting),
            Err(_) => 0,
        };
        (waiting > 0)
            .then_some(())
            .ok_or(format!("the consumer never pulled from {stream}"))
    })
    .await;
}

/// Waits until the consumer has created `stream`.
async fn stream_created(js: &Context, stream: &str) {
    eventually(Duration::from_secs(30), || async {
        let created = js.get_stream(stream).await.is_ok();
        created
            .then_some(())
            .ok_or(format!("the consumer never created {stream}"))
    })
    .await;
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

async fn rows_of(pool: &sqlx::PgPool, message_id: &str) -> i64 {
    sqlx::query_scalar("select count(*) from credit_ledger where message_id = $1")
        .bind(message_id)
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

/// The RabbitMQ side of the example's tests: the queue and exchange it would declare, and a
/// queue bound to the exchange that counts the events.
#[cfg(feature = "amqp")]
struct Rabbit {
    channel: lapin::Channel,
    queue: String,
    exchange: String,
    events: String,
    _connection: lapin::Connection,
}

#[cfg(feature = "amqp")]
impl Rabbit {
    async fn new(ns: &str) -> Self {
        use lapin::options::{
            ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
        };
        use lapin::types::FieldTable;
        use lapin::{Connection, ConnectionProperties, ExchangeKind};

        let connection = Connection::connect(AMQP_URI, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| {
                panic!("RabbitMQ is not running on 127.0.0.1:5672 ({e}); start it with `rabbitmq-server -detached`")
            });
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let (queue, exchange, events) = (
            format!("{ns}.commands"),
            format!("{ns}.events"),
            format!("{ns}.events.seen"),
        );
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
        Self {
            channel,
            queue,
            exchange,
            events,
            _connection: connection,
        }
    }

    /// Publishes command `id` to the queue, persistent, and waits for the broker's confirm.
    async fn publish(&self, id: &str, body: &str) {
        use lapin::options::BasicPublishOptions;
        use lapin::BasicProperties;

        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_app_id("app".into())
            .with_delivery_mode(2);
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
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

    /// Waits until the example consumes the queue: its startup, which gives up on a broker
    /// connection lost half way, is over.
    async fn consumed(&self) {
        use lapin::options::QueueDeclareOptions;
        use lapin::types::FieldTable;

        eventually(Duration::from_secs(60), || async {
            let passive = QueueDeclareOptions::default().passive();
            let consumers = self
                .channel
                .queue_declare(self.queue.as_str().into(), passive, FieldTable::default())
                .await
                .map_or(0, |q| q.consumer_count());
            (consumers > 0)
                .then_some(())
                .ok_or(format!("nothing consumes {}", self.queue))
        })
        .await;
    }

    /// The events published so far (at least once each; repeats carry the same message_id).
    async fn event_count(&self) -> u32 {
        use lapin::options::QueueDeclareOptions;
        use lapin::types::FieldTable;

        let passive = QueueDeclareOptions::default().passive();
        self.channel
            .queue_declare(self.events.as_str().into(), passive, FieldTable::default())
            .await
            .map(|q| q.message_count())
            .unwrap_or(0)
    }

    async fn delete(self) {
        use lapin::options::QueueDeleteOptions;

        for name in [&self.queue, &self.events] {
            let _ = self
                .channel
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = self
            .channel
            .exchange_delete(self.exchange.as_str().into(), Default::default())
            .await;
    }
}

#[cfg(feature = "amqp")]
const AMQP_URI: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Waits until `commands` commands are in the ledger and as many events were seen, then
/// checks that none was applied twice.
async fn all_applied_once<F, Fut>(pool: &sqlx::PgPool, commands: usize, what: &str, events: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    eventually(Duration::from_secs(90), || async {
        let (rows, seen) = (ledger_rows(pool).await, events().await);
        let done = rows >= commands as i64 && seen >= commands as u64;
        done.then_some(()).ok_or(format!(
            "after {what}: {rows} ledger rows and {seen} events of {commands}"
        ))
    })
    .await;
    let per_id: Vec<(String, i64)> =
        sqlx::query_as("select message_id, count(*) from credit_ledger group by message_id")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(per_id.len(), commands, "every command applied");
    assert!(per_id.iter().all(|(_, n)| *n == 1), "none applied twice");
}

/// The RabbitMQ mode (`CREDITS_BROKER=amqp`): killed under a publisher that sends every
/// command twice, then left to finish: each applied once, and at least one event each on the
/// topic exchange (publisher confirms are at least once; repeats carry the same message_id).
#[cfg(feature = "amqp")]
#[tokio::test(flavor = "multi_thread")]
async fn in_rabbitmq_mode_too_every_command_is_applied_once_and_has_its_event() {
    const AMQP_COMMANDS: usize = 60;
    let ns = format!("amqp{}", std::process::id());
    let rabbit = Rabbit::new(&ns).await;
    let db = TestDatabase::create().await.expect("test database");
    let mut service = Service::new(&db, &ns, &[("CREDITS_BROKER", "amqp".to_owned())]);
    service.start();
    let mut kills = 0;
    for i in 0..AMQP_COMMANDS {
        let body = format!(r#"{{"account_id": "a{}", "delta": 1}}"#, i % 5);
        rabbit.publish(&format!("c-{i}"), &body).await;
        rabbit.publish(&format!("c-{i}"), &body).await;
        if i % 20 == 10 {
            tokio::time::sleep(Duration::from_millis(100 + fastrand::u64(0..300))).await;
            service.kill();
            kills += 1;
            service.start();
        }
    }
    println!("{kills} SIGKILLs of the consumer under {AMQP_COMMANDS} commands published twice");

    // Publisher confirms make delivery at least once: a kill between a confirm and its mark
    // republishes, with the same message_id, which the consumers of the events drop.
    let pool = db.pool(2).await;
    all_applied_once(&pool, AMQP_COMMANDS, "the kills", || async {
        u64::from(rabbit.event_count().await)
    })
    .await;
    assert!(service.terminate().success(), "SIGTERM is a clean stop");
    rabbit.delete().await;
}

/// Every connection between the RabbitMQ mode and the broker (the consumer's and the outbox
/// transport's) cut three times while commands arrive: the same process reconnects both,
/// and every command is applied once with its event.
#[cfg(feature = "amqp")]
#[tokio::test(flavor = "multi_thread")]
async fn in_rabbitmq_mode_a_cut_connection_is_reopened_and_nothing_is_lost() {
    const CUT_COMMANDS: usize = 60;
    let ns = format!("amqpcut{}", std::process::id());
    let rabbit = Rabbit::new(&ns).await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let db = TestDatabase::create().await.expect("test database");
    let mut service = Service::new(
        &db,
        &ns,
        &[
            ("CREDITS_BROKER", "amqp".to_owned()),
            (
                "AMQP_URL",
                format!("amqp://guest:guest@{}/%2f", proxy.addr()),
            ),
        ],
    );
    service.start();
    rabbit.consumed().await;
    let cut = publish_with_cuts(&proxy, CUT_COMMANDS, |i| {
        let body = format!(r#"{{"account_id": "a{}", "delta": 1}}"#, i % 5);
        let rabbit = &rabbit;
        async move { rabbit.publish(&format!("c-{i}"), &body).await }
    })
    .await;
    let pool = db.pool(2).await;
    all_applied_once(&pool, CUT_COMMANDS, "the cuts", || async {
        u64::from(rabbit.event_count().await)
    })
    .await;
    assert!(
        service.running(),
        "the consumer reconnected rather than exit"
    );
    println!(
        "3 cuts ended {cut} broker connections; {} connections made through the proxy",
        proxy.connections()
    );
    assert!(
        proxy.connections() > cut,
        "a new connection after each one cut, besides the first"
    );

    // The example's own publisher, twice with one ID and then another command: the queue
    // is taken in order, so once the last is applied the copy was answered as a duplicate.
    for id in ["by-hand", "by-hand", "by-hand-2"] {
        let line = service.publish("a9", "5", id);
        assert_eq!(line, format!("published {id} to queue {ns}.commands"));
    }
    eventually(Duration::from_secs(30), || async {
        let applied = (
            rows_of(&pool, "by-hand").await,
            rows_of(&pool, "by-hand-2").await,
        );
        (applied == (1, 1))
            .then_some(())
            .ok_or(format!("{applied:?} rows for by-hand, by-hand-2"))
    })
    .await;
    assert!(service.terminate().success(), "SIGTERM is a clean stop");
    rabbit.delete().await;
}

/// The NATS mode with every connection to the server cut three times while commands
/// arrive: the client reconnects, the pull goes on, and every command is applied once with
/// exactly one event (a message whose ack was cut off is delivered again after `ack_wait`
/// and acked as a duplicate).
#[tokio::test(flavor = "multi_thread")]
async fn a_cut_nats_connection_is_reopened_and_nothing_is_lost() {
    const CUT_COMMANDS: usize = 60;
    let js = nats().await;
    let ns = format!("cut{}", std::process::id());
    let (stream, events) = (ns.to_uppercase(), format!("{}_EVENTS", ns.to_uppercase()));
    let proxy = Proxy::start("127.0.0.1:4222".parse().unwrap()).await;
    let db = TestDatabase::create().await.expect("test database");
    let mut service = Service::new(
        &db,
        &ns,
        &[("NATS_URL", format!("nats://{}", proxy.addr()))],
    );
    service.start();
    pulling(&js, &stream).await;
    let cut = publish_with_cuts(&proxy, CUT_COMMANDS, |i| {
        let (js, subject) = (&js, format!("{ns}.commands.a{}", i % 5));
        async move { publish(js, subject, &format!("c-{i}"), r#"{"delta": 1}"#).await }
    })
    .await;
    let pool = db.pool(2).await;
    all_applied_once(&pool, CUT_COMMANDS, "the cuts", || {
        event_count(&js, &events)
    })
    .await;
    assert!(
        service.running(),
        "the consumer reconnected rather than exit"
    );
    println!(
        "3 cuts ended {cut} NATS connections; {} connections made through the proxy",
        proxy.connections()
    );
    assert!(
        proxy.connections() > cut,
        "a new connection after each one cut, besides the first"
    );
    assert_eq!(event_count(&js, &events).await, CUT_COMMANDS as u64);

    // The example's own publisher, twice with one ID: the stream drops the copy.
    let first = service.publish("a9", "5", "by-hand");
    assert!(first.starts_with("published by-hand to"), "{first}");
    let again = service.publish("a9", "5", "by-hand");
    assert!(again.ends_with("a duplicate the stream dropped"), "{again}");
    eventually(Duration::from_secs(30), || async {
        let applied = rows_of(&pool, "by-hand").await;
        (applied == 1)
            .then_some(())
            .ok_or(format!("{applied} rows for by-hand"))
    })
    .await;
    assert!(service.terminate().success(), "SIGTERM is a clean stop");
    let _ = js.delete_stream(&stream).await;
    let _ = js.delete_stream(&events).await;
}

/// Publishes `commands` commands with `publish`, 20 ms apart, cutting every connection
/// through `proxy` after the 10th, 30th and 50th; returns how many connections the cuts
/// ended: at least as many new ones must follow for the client to have reconnected.
async fn publish_with_cuts<F, Fut>(proxy: &Proxy, commands: usize, publish: F) -> usize
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut cut = 0;
    for i in 0..commands {
        publish(i).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if i % 20 == 10 {
            cut += proxy.cut_all();
        }
    }
    cut
}
