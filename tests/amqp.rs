//! The RabbitMQ adapter (feature `amqp`) against the RabbitMQ on 127.0.0.1:5672 and a real
//! PostgreSQL: what each delivery is settled with, what the broker holds afterwards, and
//! what was applied. Each test has queues and exchanges of its own, deleted at its end (and
//! expiring after ten minutes unused, should it fail first).

#[path = "amqp/broker.rs"]
mod broker;
mod common;

use std::sync::Arc;
use std::time::Duration;

use broker::{bind, consume, exchange_declare, next, rabbitmq, short, Broker, PATIENCE};
use bytes::Bytes;
use common::{credit_acct as credit, TestApp};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, ShortString};
use lapin::ExchangeKind;
use tower_inbox::consumer::amqp::{AmqpConsumer, Handled, Unidentified};
use tower_inbox::consumer::{Consumer, Processed};
use tower_inbox::inbox::ClaimedMessage;
use tower_inbox::outbox::{AmqpTransport, Delivery as Sent, Effect, EffectId, Transport};
use tower_inbox::quarantine::{Quarantine, QuarantineFilter, QuarantineSource};
use tower_inbox::Producer;

fn adapter(app: &TestApp, quarantine_after: u32) -> AmqpConsumer {
    let consumer = Consumer::builder(app.pool.clone(), "worker")
        .quarantine_after(quarantine_after)
        .in_flight_wait(Duration::from_millis(200))
        .build()
        .unwrap();
    AmqpConsumer::new(consumer).retry_pause(Duration::from_millis(50))
}

/// A fresh database, queues of the test's own, and the adapter (quarantine after 3 failures).
async fn setup(test: &str, queue_type: &str) -> (TestApp, Broker, AmqpConsumer) {
    let (app, broker) = (TestApp::new().await, Broker::new(test, queue_type).await);
    let amqp = adapter(&app, 3);
    (app, broker, amqp)
}

fn kind<T, E>(handled: &Handled<T, E>) -> &'static str {
    match handled {
        Handled::Processed(processed) => processed.kind(),
        Handled::Unidentified(_) => "unidentified",
    }
}

/// What [`credit`] on `delivery` came to; the delivery is settled by it.
async fn credited(amqp: &AmqpConsumer, delivery: &Delivery) -> &'static str {
    kind(&amqp.handle(delivery, credit).await.unwrap())
}

#[tokio::test]
async fn a_message_is_applied_once_and_its_republication_is_an_acked_duplicate() {
    let (app, broker, amqp) = setup("once", "classic").await;
    let channel = broker.channel().await;
    let mut deliveries = consume(&channel, &broker.queue, false).await;
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        broker.publish(Some("m1"), Some("payments"), b"+1").await;
        outcomes.push(credited(&amqp, &next(&mut deliveries).await).await);
    }
    assert_eq!(outcomes, ["applied", "duplicate"]);
    channel.close(200, short("done")).await.unwrap();
    assert_eq!(broker.ready().await, 0, "both deliveries were acknowledged");
    assert_eq!(app.balance("acct").await, Some(1));
    assert_eq!(app.inbox_rows().await, 1);
    broker.delete().await;
}

#[tokio::test]
async fn a_redelivery_after_a_lost_ack_is_a_duplicate_and_acked() {
    let (app, broker, amqp) = setup("lost-ack", "classic").await;
    broker.publish(Some("m1"), Some("payments"), b"+1").await;
    let crashing = broker.channel().await;
    let delivery = broker.get(&crashing).await;
    assert!(!delivery.redelivered);
    let incoming = amqp.incoming(&delivery).unwrap();
    let processed = amqp.consumer().process(incoming, credit).await;
    assert!(matches!(processed, Processed::Applied(())), "{processed:?}");
    // The process dies after the commit, before its ack: the broker takes the message back.
    crashing.close(320, short("crashed")).await.unwrap();
    let channel = broker.channel().await;
    let again = broker.get(&channel).await;
    assert!(again.redelivered);
    assert_eq!(credited(&amqp, &again).await, "duplicate");
    channel.close(200, short("done")).await.unwrap();
    assert_eq!(broker.ready().await, 0, "the redelivery was acknowledged");
    assert_eq!(app.balance("acct").await, Some(1));
    broker.delete().await;
}

/// A handler that writes, then fails.
fn fail(message: &mut ClaimedMessage) -> BoxFuture<'_, Result<(), sqlx::Error>> {
    async move {
        credit(message).await?;
        Err(sqlx::Error::Protocol("the body is not a command".into()))
    }
    .boxed()
}

#[tokio::test]
async fn a_poison_message_is_requeued_until_quarantined_then_rejected_and_others_go_on() {
    // A quorum queue: the delivery count comes from its x-delivery-count header.
    let (app, mut broker) = (TestApp::new().await, Broker::new("poison", "quorum").await);
    let amqp = adapter(&app, 4);
    let channel = broker.channel().await;
    assert_eq!(amqp.set_prefetch(&channel).await.unwrap(), 10, "the pool's");
    let mut deliveries = consume(&channel, &broker.queue, false).await;
    broker.publish(Some("bad"), Some("payments"), b"bad").await;
    broker.publish(Some("fine"), Some("payments"), b"+1").await;
    let (mut bad, mut fine, mut backoffs) = (Vec::new(), Vec::new(), Vec::new());
    while bad.last() != Some(&"quarantined") || fine.is_empty() {
        assert!(bad.len() + fine.len() < 10, "{bad:?} {fine:?}");
        let delivery = next(&mut deliveries).await;
        let poison = delivery.data == b"bad";
        let handled = amqp.handle(&delivery, |m| if poison { fail(m) } else { credit(m) });
        let handled = handled.await.unwrap();
        if let Handled::Processed(Processed::Failed { retry_in, .. }) = handled {
            backoffs.push(retry_in);
        }
        let outcomes = if poison { &mut bad } else { &mut fine };
        outcomes.push(kind(&handled));
    }
    assert_eq!(bad, ["failed", "failed", "failed", "quarantined"]);
    assert_eq!(fine, ["applied"]);
    // The third delivery's backoff (1 s doubled twice, jittered down to half) comes from the
    // header: the redelivered flag alone says "second" (at most 2 s).
    assert!(backoffs[2] >= Duration::from_secs(2), "{backoffs:?}");
    assert_eq!(broker.dead_letter().await, b"bad", "rejected, not requeued");
    assert_eq!(
        app.balance("acct").await,
        Some(1),
        "bad's writes rolled back"
    );
    assert_eq!(app.failures("payments", "bad").await.map(|f| f.0), Some(4));
    broker.delete().await;
}

#[tokio::test]
async fn the_same_id_with_another_body_is_rejected_and_quarantined() {
    let (app, mut broker, amqp) = setup("conflict", "classic").await;
    let channel = broker.channel().await;
    let mut outcomes = Vec::new();
    for body in [&b"+1"[..], b"+2"] {
        broker.publish(Some("m1"), Some("payments"), body).await;
        outcomes.push(credited(&amqp, &broker.get(&channel).await).await);
    }
    assert_eq!(outcomes, ["applied", "conflict"]);
    assert_eq!(broker.dead_letter().await, b"+2");
    assert_eq!(app.balance("acct").await, Some(1));
    let quarantine = Quarantine::new(app.pool.clone());
    let items = quarantine.list(QuarantineFilter::Open, 10).await.unwrap();
    let sources: Vec<_> = items.iter().map(|item| item.source).collect();
    assert_eq!(sources, [QuarantineSource::IdentityConflict]);
    broker.delete().await;
}

#[tokio::test]
async fn a_delivery_without_message_id_or_producer_is_rejected_unidentified() {
    let (app, mut broker, amqp) = setup("unknown", "classic").await;
    let channel = broker.channel().await;
    broker.publish(None, Some("payments"), b"no id").await;
    broker.publish(Some("m1"), None, b"no producer").await;
    let mut reasons = Vec::new();
    for _ in 0..2 {
        match amqp.handle(&broker.get(&channel).await, credit).await {
            Ok(Handled::Unidentified(why)) => reasons.push(why),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(reasons, [Unidentified::MessageId, Unidentified::Producer]);
    assert_eq!(broker.dead_letter().await, b"no id");
    assert_eq!(broker.dead_letter().await, b"no producer");
    assert_eq!(app.inbox_rows().await, 0);
    // A caller who knows the producer otherwise says so.
    let named = amqp.producer_from(|_| Producer::new("payments").ok());
    broker.publish(Some("m1"), None, b"+1").await;
    assert_eq!(
        credited(&named, &broker.get(&channel).await).await,
        "applied"
    );
    broker.delete().await;
}

fn effect(id: &str, destination: String) -> Effect {
    let header = |name: &str, value: &str| (name.to_owned(), value.to_owned());
    Effect {
        effect_id: EffectId::new(id),
        effect_name: "credited".to_owned(),
        destination,
        payload: Bytes::from_static(b"+1"),
        headers: vec![
            header("Content-Type", "application/json"),
            header("x-trace", "t-1"),
        ],
        attempt: 1,
    }
}

fn text(value: &Option<ShortString>) -> Option<&str> {
    value.as_ref().map(ShortString::as_str)
}

#[tokio::test]
async fn the_transport_publishes_confirmed_persistent_messages_keyed_by_the_effect() {
    let (_app, broker, amqp) = setup("transport", "classic").await;
    let exchange = format!("{}.events", broker.queue);
    exchange_declare(&broker.channel, &exchange, ExchangeKind::Direct).await;
    bind(&broker.channel, &broker.queue, &exchange, "credited").await;
    let transport = AmqpTransport::new(Arc::new(rabbitmq().await))
        .app_id("payments")
        .timeout(PATIENCE);
    assert_eq!(transport.call_timeout(), Some(PATIENCE));
    let to = |key: &str| format!("{exchange}/{key}");

    let sent = transport.deliver(&effect("eff-1", to("credited"))).await;
    assert!(matches!(sent, Sent::Delivered { .. }), "{sent:?}");
    let channel = broker.channel().await;
    let delivery = broker.get(&channel).await;
    let properties = &delivery.properties;
    assert_eq!(text(properties.message_id()), Some("eff-1"));
    assert_eq!(*properties.delivery_mode(), Some(2), "persistent");
    assert_eq!(text(properties.content_type()), Some("application/json"));
    let headers = properties.headers().clone().unwrap_or_default();
    let trace = headers.inner().get("x-trace");
    assert_eq!(trace, Some(&AMQPValue::LongString("t-1".into())));
    assert_eq!(delivery.data, b"+1");
    // The consuming inbox claims it under the effect ID and the transport's app_id.
    assert_eq!(credited(&amqp, &delivery).await, "applied");

    let sent = transport
        .deliver(&effect("eff-2", "no-slash".to_owned()))
        .await;
    let Sent::Permanent { reason_code, .. } = sent else {
        panic!("{sent:?}")
    };
    assert_eq!(reason_code, "invalid-destination");
    let sent = transport.deliver(&effect("eff-3", to("unbound"))).await;
    assert!(matches!(sent, Sent::Retry { .. }), "unroutable: {sent:?}");
    // A missing exchange closes the transport's channel; the next delivery opens another.
    let missing = format!("{exchange}.missing/credited");
    let sent = transport.deliver(&effect("eff-4", missing)).await;
    assert!(
        matches!(sent, Sent::Retry { .. }),
        "missing exchange: {sent:?}"
    );
    let sent = transport.deliver(&effect("eff-5", to("credited"))).await;
    assert!(matches!(sent, Sent::Delivered { .. }), "{sent:?}");
    let delivery = broker.get(&channel).await;
    assert_eq!(text(delivery.properties.message_id()), Some("eff-5"));
    broker.delete().await;
}

/// Publishes `id` until the transport reports it delivered (at most `tries` times, a short
/// pause apart), and returns the outcomes that were not.
async fn deliver_until_delivered(
    transport: &AmqpTransport,
    id: &str,
    to: &str,
    tries: usize,
) -> (bool, Vec<Sent>) {
    let mut failed = Vec::new();
    for _ in 0..tries {
        match transport.deliver(&effect(id, to.to_owned())).await {
            Sent::Delivered { .. } => return (true, failed),
            other => failed.push(other),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (false, failed)
}

/// The broker connection cut under the transport: one that owns its connection
/// ([`AmqpTransport::connect`]) opens a new one and delivers again; one on the caller's
/// connection ([`AmqpTransport::new`]) retries until the caller replaces it, as documented.
#[tokio::test]
async fn the_transport_reopens_its_own_connection_after_a_cut_and_not_the_callers() {
    let (_app, broker, _amqp) = setup("transport_cut", "classic").await;
    let exchange = format!("{}.events", broker.queue);
    exchange_declare(&broker.channel, &exchange, ExchangeKind::Direct).await;
    bind(&broker.channel, &broker.queue, &exchange, "credited").await;
    let to = format!("{exchange}/credited");
    let proxy = common::proxy::Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let uri = format!("amqp://guest:guest@{}/%2f", proxy.addr());

    let own = AmqpTransport::connect(uri.as_str(), lapin::ConnectionProperties::default())
        .timeout(PATIENCE);
    assert!(
        !format!("{own:?}").contains("guest"),
        "the URI is not printed"
    );
    let (delivered, _) = deliver_until_delivered(&own, "own-1", &to, 1).await;
    assert!(delivered, "before the cut");
    assert_eq!(proxy.connections(), 1);
    proxy.cut_all();
    let (delivered, failed) = deliver_until_delivered(&own, "own-2", &to, 20).await;
    assert!(delivered, "after the cut: {failed:?}");
    assert_eq!(
        proxy.connections(),
        2,
        "one new connection, opened by the transport"
    );
    let channel = broker.channel().await;
    for id in ["own-1", "own-2"] {
        let delivery = broker.get(&channel).await;
        assert_eq!(text(delivery.properties.message_id()), Some(id));
    }

    let callers = lapin::Connection::connect(&uri, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let shared = AmqpTransport::new(Arc::new(callers)).timeout(PATIENCE);
    let (delivered, _) = deliver_until_delivered(&shared, "shared-1", &to, 1).await;
    assert!(delivered, "before the cut");
    let before = proxy.connections();
    proxy.cut_all();
    let (delivered, failed) = deliver_until_delivered(&shared, "shared-2", &to, 5).await;
    assert!(!delivered, "the caller's connection is not reopened");
    assert!(
        failed.iter().all(|f| matches!(f, Sent::Retry { .. })),
        "{failed:?}"
    );
    assert_eq!(proxy.connections(), before, "nothing connected");

    // A URI that does not parse: every delivery is retried, and the error (kept as the
    // effect's last error, and logged) does not quote the URI and its password.
    let garbled = AmqpTransport::connect("amqp:guest:s3cret@host", Default::default());
    let sent = garbled.deliver(&effect("bad-uri", to.clone())).await;
    let Sent::Retry { error, .. } = sent else {
        panic!("{sent:?}")
    };
    assert!(
        error.contains("does not parse") && !error.contains("s3cret"),
        "{error}"
    );
    broker.delete().await;
}
