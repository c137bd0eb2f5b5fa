//! The NATS JetStream adapter against the NATS server on 127.0.0.1:4222 and PostgreSQL: lost
//! acknowledgements, republishes past the stream's duplicate window, conflicts, poison
//! messages, unidentifiable messages, in-progress acknowledgements and the outbox transport.
//! Each test uses a stream of its own, deleted at the end.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, PullConsumer};
use async_nats::jetstream::{self, stream, Context, Message};
use async_nats::HeaderMap;
use bytes::Bytes;
use common::{credit_acct as credit, TestApp};
use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::Notify;
use tower_inbox::consumer::nats::{Handled, NatsConsumer, Unidentified};
use tower_inbox::consumer::{Consumer, Processed};
use tower_inbox::inbox::ClaimedMessage;
use tower_inbox::outbox::{Delivery, Effect, EffectId, NatsTransport, Transport};
use tower_inbox::quarantine::{Quarantine, QuarantineFilter};

const NATS: &str = "127.0.0.1:4222";

/// A stream of the test's own (subjects `<name>.>`) with a durable pull consumer.
struct TestStream {
    js: Context,
    name: String,
    consumer: PullConsumer,
}

impl TestStream {
    async fn new(tag: &str, duplicate_window: Duration, ack_wait: Duration) -> Self {
        let client = async_nats::connect(NATS).await.unwrap_or_else(|e| {
            panic!(
                "NATS with JetStream is not running on {NATS} ({e}); start it with \
                 `start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server \
                 -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server`"
            )
        });
        let js = jetstream::new(client);
        let name = format!("T_{tag}_{}", std::process::id());
        let _ = js.delete_stream(&name).await;
        let stream = js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.>")],
                duplicate_window,
                ..Default::default()
            })
            .await
            .expect("create the test stream (is JetStream on? -js)");
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some("worker".to_owned()),
                ack_wait,
                ..Default::default()
            })
            .await
            .expect("create the test consumer");
        Self { js, name, consumer }
    }

    async fn publish(&self, id: Option<&str>, body: &str) -> bool {
        let mut headers = HeaderMap::new();
        if let Some(id) = id {
            headers.insert("Nats-Msg-Id", id);
        }
        headers.insert("X-Producer", "app");
        headers.insert("Content-Type", "application/json");
        let subject = format!("{}.acct", self.name);
        let ack = self
            .js
            .publish_with_headers(subject, headers, Bytes::from(body.to_owned()))
            .await
            .expect("publish")
            .await
            .expect("publish ack");
        ack.duplicate
    }

    /// The next message, waiting up to `wait` for one.
    async fn next(&self, wait: Duration) -> Option<Message> {
        let mut batch = self
            .consumer
            .fetch()
            .max_messages(1)
            .expires(wait)
            .messages()
            .await
            .expect("fetch");
        batch.next().await.map(|m| m.expect("message"))
    }

    async fn delete(self) {
        let _ = self.js.delete_stream(&self.name).await;
    }
}

/// A handler that fails.
fn fail(_: &mut ClaimedMessage) -> BoxFuture<'_, Result<(), &'static str>> {
    async { Err("not a command") }.boxed()
}

/// A handler that takes longer than the test consumer's ack_wait, then credits.
fn slow(message: &mut ClaimedMessage) -> BoxFuture<'_, Result<(), sqlx::Error>> {
    async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        credit(message).await
    }
    .boxed()
}

fn adapter(app: &TestApp) -> NatsConsumer {
    let consumer = Consumer::builder(app.pool.clone(), "worker")
        .quarantine_after(2)
        .failure_backoff(Duration::from_millis(50), Duration::from_millis(100))
        .build()
        .unwrap();
    NatsConsumer::new(consumer)
}

const SOON: Duration = Duration::from_secs(5);

#[tokio::test]
async fn a_lost_ack_gives_a_redelivery_that_is_acked_as_a_duplicate() {
    let app = TestApp::new().await;
    let stream = TestStream::new("lost_ack", Duration::from_secs(60), Duration::from_secs(1)).await;
    let nats = adapter(&app);
    stream.publish(Some("m1"), r#"{"delta":1}"#).await;
    let first = stream.next(SOON).await.expect("delivered");
    // Processed and committed, then the process dies before its ack.
    let incoming = nats.incoming(&first).unwrap();
    let processed = nats.consumer().process(incoming, credit).await;
    assert!(matches!(processed, Processed::Applied(())), "{processed:?}");
    drop(first);
    // The server redelivers once ack_wait passes.
    let again = stream.next(SOON).await.expect("redelivered after ack_wait");
    assert_eq!(again.info().unwrap().delivered, 2);
    let handled = nats.handle(&again, credit).await.unwrap();
    assert!(
        matches!(handled, Handled::Processed(Processed::Duplicate(_))),
        "{handled:?}"
    );
    assert!(stream.next(Duration::from_secs(2)).await.is_none(), "acked");
    assert_eq!(app.balance("acct").await, Some(1));
    stream.delete().await;
}

#[tokio::test]
async fn a_republish_after_the_duplicate_window_is_applied_once() {
    let app = TestApp::new().await;
    let window = Duration::from_millis(500);
    let stream = TestStream::new("republish", window, Duration::from_secs(30)).await;
    let nats = adapter(&app);
    assert!(!stream.publish(Some("m1"), r#"{"delta":1}"#).await);
    let first = stream.next(SOON).await.unwrap();
    assert!(matches!(
        nats.handle(&first, credit).await.unwrap(),
        Handled::Processed(Processed::Applied(()))
    ));
    tokio::time::sleep(window * 3).await;
    // Past the window the stream stores the copy: only the inbox stands in the way.
    assert!(
        !stream.publish(Some("m1"), r#"{"delta":1}"#).await,
        "stored again"
    );
    let copy = stream.next(SOON).await.unwrap();
    assert!(matches!(
        nats.handle(&copy, credit).await.unwrap(),
        Handled::Processed(Processed::Duplicate(_))
    ));
    assert_eq!(app.balance("acct").await, Some(1));
    stream.delete().await;
}

/// Two workers on one durable consumer hold two copies of one command (republished past
/// the duplicate window) at once. The first applies it; the second meets the claim in
/// flight, gives up after its in-flight wait and naks the copy with a delay instead of
/// holding a connection; delivered again, the copy is acked as a duplicate. One credit.
#[tokio::test(flavor = "multi_thread")]
async fn two_workers_with_copies_of_one_command_at_once_apply_it_once() {
    let app = TestApp::new().await;
    let window = Duration::from_millis(500);
    let stream = TestStream::new("two_workers", window, Duration::from_secs(30)).await;
    let worker = |wait| {
        let consumer = Consumer::builder(app.pool.clone(), "worker")
            .in_flight_wait(wait)
            .build()
            .unwrap();
        NatsConsumer::new(consumer)
    };
    let (first_worker, second_worker) = (worker(SOON), worker(Duration::from_millis(100)));
    stream.publish(Some("m1"), r#"{"delta":1}"#).await;
    tokio::time::sleep(window * 3).await;
    assert!(
        !stream.publish(Some("m1"), r#"{"delta":1}"#).await,
        "stored again"
    );
    let first = stream.next(SOON).await.expect("the first copy");
    let second = stream.next(SOON).await.expect("the second copy");
    assert_ne!(
        first.info().unwrap().stream_sequence,
        second.info().unwrap().stream_sequence
    );

    // The first worker claims and holds the claim until told to go on.
    let (claimed, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let holder = {
        let (claimed, release) = (claimed.clone(), release.clone());
        tokio::spawn(async move {
            let handled = first_worker
                .handle(&first, |message| {
                    let (claimed, release) = (claimed.clone(), release.clone());
                    async move {
                        claimed.notify_one();
                        release.notified().await;
                        credit(message).await
                    }
                    .boxed()
                })
                .await;
            handled.unwrap()
        })
    };
    claimed.notified().await;
    let met = second_worker.handle(&second, credit).await.unwrap();
    assert!(
        matches!(met, Handled::Processed(Processed::InProgress)),
        "the second copy meets the claim in flight: {met:?}"
    );
    release.notify_one();
    let held = holder.await.unwrap();
    assert!(
        matches!(held, Handled::Processed(Processed::Applied(()))),
        "{held:?}"
    );

    // The nak's delay passes and the second copy comes back: now a duplicate, acked.
    let again = stream
        .next(Duration::from_secs(10))
        .await
        .expect("naked, so delivered again");
    assert_eq!(again.info().unwrap().delivered, 2);
    let replayed = second_worker.handle(&again, credit).await.unwrap();
    assert!(
        matches!(replayed, Handled::Processed(Processed::Duplicate(_))),
        "{replayed:?}"
    );
    // Both copies settled: nothing waits for an ack, nothing is left to deliver. An ack is
    // a publish the server applies on its own time, so the count is polled (bounded).
    let mut consumer = stream.consumer.clone();
    let mut outstanding = (usize::MAX, u64::MAX);
    for _ in 0..50 {
        let info = consumer.info().await.expect("consumer info");
        outstanding = (info.num_ack_pending, info.num_pending);
        if outstanding == (0, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(outstanding, (0, 0), "both acked");
    assert_eq!(app.balance("acct").await, Some(1));
    stream.delete().await;
}

#[tokio::test]
async fn conflicts_and_poison_messages_are_terminated_and_kept_and_hold_nothing_up() {
    let app = TestApp::new().await;
    let window = Duration::from_millis(500);
    let stream = TestStream::new("poison", window, Duration::from_secs(30)).await;
    let nats = adapter(&app);
    stream.publish(Some("poison"), "not json").await;
    let first = stream.next(SOON).await.unwrap();
    let handled = nats.handle(&first, fail).await.unwrap();
    assert!(
        matches!(handled, Handled::Processed(Processed::Failed { .. })),
        "{handled:?}"
    );
    // Nak'd with a delay: delivered again, and quarantined on the second failure.
    let second = stream.next(SOON).await.expect("nak'd, so delivered again");
    let handled = nats.handle(&second, fail).await.unwrap();
    assert!(
        matches!(handled, Handled::Processed(Processed::Quarantined { .. })),
        "{handled:?}"
    );
    // A command after it is applied; the same ID with another body is a conflict.
    stream.publish(Some("m1"), r#"{"delta":1}"#).await;
    let ok = stream.next(SOON).await.unwrap();
    assert!(matches!(
        nats.handle(&ok, credit).await.unwrap(),
        Handled::Processed(Processed::Applied(()))
    ));
    tokio::time::sleep(window * 3).await;
    stream.publish(Some("m1"), r#"{"delta":2}"#).await;
    let reused = stream.next(SOON).await.unwrap();
    assert!(matches!(
        nats.handle(&reused, credit).await.unwrap(),
        Handled::Processed(Processed::Conflict(_))
    ));
    // Terminated: neither comes back.
    assert!(stream.next(Duration::from_secs(2)).await.is_none());
    let open = Quarantine::new(app.pool.clone())
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    assert_eq!(open.len(), 2, "{open:?}");
    assert_eq!(app.balance("acct").await, Some(1));
    stream.delete().await;
}

#[tokio::test]
async fn a_message_without_an_id_is_terminated_unprocessed() {
    let app = TestApp::new().await;
    let stream = TestStream::new("no_id", Duration::from_secs(60), Duration::from_secs(30)).await;
    let nats = adapter(&app);
    stream.publish(None, r#"{"delta":1}"#).await;
    let message = stream.next(SOON).await.unwrap();
    let handled = nats.handle(&message, credit).await.unwrap();
    assert!(matches!(
        handled,
        Handled::Unidentified(Unidentified::MessageId)
    ));
    assert!(
        stream.next(Duration::from_secs(2)).await.is_none(),
        "terminated"
    );
    assert_eq!(app.balance("acct").await, None);
    stream.delete().await;
}

#[tokio::test]
async fn a_long_handler_keeps_its_message_with_progress_acks() {
    let app = TestApp::new().await;
    let stream = TestStream::new("long", Duration::from_secs(60), Duration::from_secs(2)).await;
    let nats = adapter(&app).progress_every(Some(Duration::from_millis(300)));
    stream.publish(Some("slow"), r#"{"delta":1}"#).await;
    let message = stream.next(SOON).await.unwrap();
    let handled = nats.handle(&message, slow).await.unwrap();
    assert!(matches!(
        handled,
        Handled::Processed(Processed::Applied(()))
    ));
    assert!(
        stream.next(Duration::from_secs(3)).await.is_none(),
        "redelivered while its handler ran"
    );
    stream.delete().await;
}

#[tokio::test]
async fn the_outbox_transport_publishes_each_effect_once_by_its_id() {
    let stream = TestStream::new("outbox", Duration::from_secs(60), Duration::from_secs(30)).await;
    let transport = NatsTransport::new(stream.js.clone());
    let effect = Effect {
        effect_id: EffectId::new("effect-1"),
        effect_name: "credited".to_owned(),
        destination: format!("{}.events", stream.name),
        payload: Bytes::from_static(b"{}"),
        headers: vec![("Content-Type".to_owned(), "application/json".to_owned())],
        attempt: 1,
    };
    // The first publish's ack is lost, so the dispatcher publishes again: one copy.
    for _ in 0..2 {
        let delivery = transport.deliver(&effect).await;
        assert!(
            matches!(delivery, Delivery::Delivered { .. }),
            "{delivery:?}"
        );
    }
    let mut info = stream.js.get_stream(&stream.name).await.unwrap();
    assert_eq!(info.info().await.unwrap().state.messages, 1);
    let message = stream.next(SOON).await.unwrap();
    let headers = message.headers.as_ref().unwrap();
    assert_eq!(headers.get("Nats-Msg-Id").unwrap().as_str(), "effect-1");
    let bad = Effect {
        destination: "not a subject".to_owned(),
        ..effect
    };
    assert!(matches!(
        transport.deliver(&bad).await,
        Delivery::Permanent { ref reason_code, .. } if reason_code == "invalid-destination"
    ));
    stream.delete().await;
}
