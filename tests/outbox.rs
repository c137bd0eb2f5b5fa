//! The outbox and the quarantine against real HTTP receivers on loopback.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::{credit, send, TestApp};
use tower_inbox::outbox::{
    enqueue, Dispatcher, EffectId, EffectStatus, HttpTransport, Outbox, OutboxMessage,
};
use tower_inbox::producer::TrustedHeader;
use tower_inbox::quarantine::{Quarantine, QuarantineFilter, QuarantineSource};
use tower_inbox::{InboxLayer, InboxTx, MessageIdentity, MessageKey, Producer};

/// A receiver that deduplicates by `Idempotency-Key`, answering with the scripted statuses
/// in turn (then 200), and optionally stalling after applying.
#[derive(Clone, Default)]
struct Receiver {
    applied: Arc<Mutex<HashMap<String, usize>>>,
    calls: Arc<Mutex<Vec<String>>>,
    script: Arc<Mutex<Vec<(u16, Duration)>>>,
}

impl Receiver {
    /// A receiver that answers `steps` in turn (status, stall after applying), then 200.
    fn scripted(steps: impl IntoIterator<Item = (u16, Duration)>) -> Self {
        let receiver = Self::default();
        receiver.script.lock().unwrap().extend(steps);
        receiver
    }

    async fn serve(&self) -> String {
        let receiver = self.clone();
        let router = Router::new().route(
            "/hook",
            post(move |headers: HeaderMap| {
                let receiver = receiver.clone();
                async move {
                    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                    receiver.calls.lock().unwrap().push(key.clone());
                    let (status, stall) = {
                        let mut script = receiver.script.lock().unwrap();
                        if script.is_empty() {
                            (200, Duration::ZERO)
                        } else {
                            script.remove(0)
                        }
                    };
                    if status < 300 {
                        // The receiver's own dedup by key: a repeat is acknowledged, not applied.
                        receiver.applied.lock().unwrap().entry(key).or_insert(1);
                    }
                    tokio::time::sleep(stall).await;
                    (StatusCode::from_u16(status).unwrap(), "receipt-1").into_response()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        format!("http://{addr}/hook")
    }

    fn calls(&self) -> usize {
        self.calls.lock().unwrap().len()
    }
}

fn dispatcher(app: &TestApp, timeout: Duration) -> Dispatcher<HttpTransport> {
    Dispatcher::builder(
        app.pool.clone(),
        HttpTransport::new(Duration::from_secs(30)).unwrap(),
    )
    .delivery_timeout(timeout)
    .lease(timeout + Duration::from_secs(1))
    .backoff(Duration::from_millis(10), Duration::from_millis(20))
    .max_attempts(3)
    .build()
    .unwrap()
}

async fn enqueue_one(app: &TestApp, url: &str, key: &str) -> EffectId {
    let identity = MessageIdentity::new(
        "credits",
        Producer::new("app").unwrap(),
        MessageKey::new(key).unwrap(),
    );
    let mut tx = app.pool.begin().await.unwrap();
    let enqueued = enqueue(
        &mut *tx,
        &identity,
        "webhook",
        &OutboxMessage::new(url, "{}"),
    )
    .await
    .unwrap();
    let again = enqueue(
        &mut *tx,
        &identity,
        "webhook",
        &OutboxMessage::new(url, "{}"),
    )
    .await
    .unwrap();
    assert!(
        enqueued.inserted && !again.inserted,
        "one effect per command"
    );
    tx.commit().await.unwrap();
    enqueued.effect_id
}

/// Runs `d` in a task until the returned sender fires (or is dropped).
fn spawn_run(
    d: Dispatcher<HttpTransport>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), tower_inbox::InboxError>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(d.run(async {
        let _ = stopped.await;
    }));
    (stop, running)
}

/// Runs rounds until nothing is due (bounded); sleeps past short backoffs.
async fn drain(d: &Dispatcher<HttpTransport>) {
    for _ in 0..50 {
        let report = d.dispatch_due().await.unwrap();
        if report.leased == 0 {
            tokio::time::sleep(Duration::from_millis(30)).await;
            if d.dispatch_due().await.unwrap().leased == 0 {
                return;
            }
        }
    }
}

#[tokio::test]
async fn an_ambiguous_timeout_is_retried_with_the_same_key_and_applied_once() {
    let app = TestApp::new().await;
    // Applies the effect, then answers too late.
    let receiver = Receiver::scripted([(200, Duration::from_secs(2))]);
    let url = receiver.serve().await;
    let effect = enqueue_one(&app, &url, "k1").await;
    let d = dispatcher(&app, Duration::from_millis(300));

    let first = d.dispatch_due().await.unwrap();
    assert_eq!((first.leased, first.retried), (1, 1));
    drain(&d).await;

    let calls = receiver.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 2);
    assert!(
        calls.iter().all(|k| k == effect.as_str()),
        "same idempotency key"
    );
    assert_eq!(
        receiver.applied.lock().unwrap().len(),
        1,
        "one remote effect"
    );
    let entry = Outbox::new(app.pool.clone())
        .entry(&effect)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(entry.status, EffectStatus::Delivered);
    assert_eq!(entry.attempts, 2);
    assert_eq!(entry.remote_status, Some(200));
    assert_eq!(entry.remote_result.as_deref(), Some("receipt-1"));
}

#[tokio::test]
async fn a_5xx_then_success_is_delivered() {
    let app = TestApp::new().await;
    // 5xx and 429 are worth retrying; 429 must not count as a permanent 4xx.
    let receiver = Receiver::scripted([(503, Duration::ZERO), (429, Duration::ZERO)]);
    let url = receiver.serve().await;
    let effect = enqueue_one(&app, &url, "k1").await;
    let d = dispatcher(&app, Duration::from_secs(5));
    drain(&d).await;
    assert_eq!(receiver.calls(), 3);
    let entry = Outbox::new(app.pool.clone())
        .entry(&effect)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(entry.status, EffectStatus::Delivered);
}

#[tokio::test]
async fn a_permanent_4xx_goes_dead_then_repair_delivers_and_counts_recovered() {
    let app = TestApp::new().await;
    let receiver = Receiver::scripted([(404, Duration::ZERO)]);
    let url = receiver.serve().await;
    let effect = enqueue_one(&app, &url, "k1").await;
    let d = dispatcher(&app, Duration::from_secs(5));
    let report = d.dispatch_due().await.unwrap();
    assert_eq!(report.dead, 1);
    let outbox = Outbox::new(app.pool.clone());
    assert_eq!(
        outbox.entry(&effect).await.unwrap().unwrap().status,
        EffectStatus::Dead
    );

    let quarantine = Quarantine::new(app.pool.clone());
    let open = quarantine.list(QuarantineFilter::Open, 10).await.unwrap();
    assert_eq!(open.len(), 1);
    let item = &open[0];
    assert_eq!(item.source, QuarantineSource::DeadEffect);
    assert_eq!(item.reason_code, "http-404");
    assert_eq!(item.effect_id.as_deref(), Some(effect.as_str()));
    assert_eq!(item.payload_ref, format!("message_outbox:{effect}"));

    quarantine
        .repair(item.id, "oncall", "receiver fixed")
        .await
        .unwrap();
    assert!(quarantine.repair(item.id, "oncall", "again").await.is_err());
    let report = d.dispatch_due().await.unwrap();
    assert_eq!((report.delivered, report.recovered), (1, 1));
    let item = quarantine.get(item.id).await.unwrap().unwrap();
    assert!(item.recovered_at.is_some());
    assert_eq!(
        outbox.entry(&effect).await.unwrap().unwrap().status,
        EffectStatus::Delivered
    );
}

#[tokio::test]
async fn racing_dispatchers_deliver_every_effect_once() {
    let app = TestApp::with_pool_size(20).await;
    let receiver = Receiver::default();
    let url = receiver.serve().await;
    let mut effects = Vec::new();
    for i in 0..60 {
        effects.push(enqueue_one(&app, &url, &format!("k{i}")).await);
    }
    let dispatchers: Vec<_> = (0..3)
        .map(|_| {
            let d = dispatcher(&app, Duration::from_secs(10));
            tokio::spawn(async move { drain(&d).await })
        })
        .collect();
    for d in dispatchers {
        d.await.unwrap();
    }
    let applied = receiver.applied.lock().unwrap().clone();
    assert_eq!(applied.len(), 60);
    assert_eq!(receiver.calls(), 60, "no effect delivered twice");
    let outbox = Outbox::new(app.pool.clone());
    for effect in &effects {
        assert_eq!(
            outbox.entry(effect).await.unwrap().unwrap().status,
            EffectStatus::Delivered
        );
    }
}

#[tokio::test]
async fn a_rolled_back_handler_leaves_no_outbox_row_and_conflicts_are_quarantined() {
    let app = TestApp::new().await;
    let router = Router::new()
        .route(
            "/accounts/{account}/credits",
            post(|mut tx: InboxTx, body: String| async move {
                let identity = tx.identity().clone();
                enqueue(
                    &mut *tx,
                    &identity,
                    "webhook",
                    &OutboxMessage::new("http://127.0.0.1:9/x", "{}"),
                )
                .await
                .unwrap();
                if body.contains("-1") {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::CREATED
                }
            }),
        )
        .layer(
            InboxLayer::builder(app.pool.clone(), "credits")
                .producer(TrustedHeader::new("x-producer"))
                .quarantine_after(2)
                .build()
                .unwrap(),
        );
    let count = || async {
        sqlx::query_scalar::<_, i64>("select count(*) from message_outbox")
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };
    for _ in 0..2 {
        let failed = send(&router, credit("a1", Some("bad"), Some("app"), -1)).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(count().await, 0);
    let quarantine = Quarantine::new(app.pool.clone());
    let open = quarantine.list(QuarantineFilter::Open, 10).await.unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].source, QuarantineSource::HandlerFailure);
    assert_eq!(open[0].attempts, 2);
    assert!(open[0].first_failed_at <= open[0].last_failed_at);

    assert_eq!(
        send(&router, credit("a1", Some("ok"), Some("app"), 5))
            .await
            .status,
        StatusCode::CREATED
    );
    assert_eq!(count().await, 1);
    for _ in 0..2 {
        let conflict = send(&router, credit("a1", Some("ok"), Some("app"), 6)).await;
        assert_eq!(conflict.problem_type(), "payload-mismatch");
    }
    assert_eq!(count().await, 1, "duplicates and conflicts enqueue nothing");
    let conflicts: Vec<_> = quarantine
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap()
        .into_iter()
        .filter(|i| i.source == QuarantineSource::IdentityConflict)
        .collect();
    assert_eq!(conflicts.len(), 1);
    assert_eq!(conflicts[0].attempts, 2);
    assert_eq!(conflicts[0].reason_code, "payload-mismatch");
    assert_eq!(conflicts[0].message_id.as_deref(), Some("ok"));

    // A person discards the conflict; it leaves the open list with the decision kept.
    quarantine
        .discard(conflicts[0].id, "oncall", "client bug, told them")
        .await
        .unwrap();
    let decided = quarantine.get(conflicts[0].id).await.unwrap().unwrap();
    assert_eq!(
        decided.decision,
        Some(tower_inbox::quarantine::Decision::Discard)
    );
    assert_eq!(decided.decided_by.as_deref(), Some("oncall"));
    assert!(decided.decided_at.is_some() && decided.recovered_at.is_none());

    // The failing command finally commits: its quarantine item counts as recovered.
    let failing = open[0].id;
    assert_eq!(
        send(&router, credit("a1", Some("bad"), Some("app"), 7))
            .await
            .status,
        StatusCode::CREATED
    );
    let recovered = quarantine.get(failing).await.unwrap().unwrap();
    assert!(recovered.recovered_at.is_some());
    assert_eq!(
        recovered.decision,
        Some(tower_inbox::quarantine::Decision::Repair)
    );
    assert!(quarantine
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn the_credits_example_enqueues_one_webhook_per_command() {
    let app = TestApp::new().await;
    let receiver = Receiver::default();
    let url = receiver.serve().await;
    let layer = common::credits::inbox_layer(app.pool.clone())
        .build()
        .unwrap();
    let router = common::credits::routes_with_webhook(app.pool.clone(), layer, Some(url));
    // A dispatcher that polls once an hour: only the commit's NOTIFY can wake it in time.
    let d = Dispatcher::builder(
        app.pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .poll_interval(Duration::from_secs(3600))
    .build()
    .unwrap();
    let (stop, running) = spawn_run(d);
    // Let it run its first (empty) round and go to sleep on LISTEN.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        send(&router, credit("a1", Some("k1"), Some("app"), 5))
            .await
            .status,
        StatusCode::CREATED
    );
    assert!(send(&router, credit("a1", Some("k1"), Some("app"), 5))
        .await
        .replayed());
    assert_eq!(
        send(&router, credit("a1", Some("k1"), Some("app"), 6))
            .await
            .status,
        StatusCode::CONFLICT
    );
    let payloads: Vec<Vec<u8>> = sqlx::query_scalar("select payload from message_outbox")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        payloads.len(),
        1,
        "duplicates and conflicts enqueue nothing"
    );
    let payload: serde_json::Value = serde_json::from_slice(&payloads[0]).unwrap();
    assert_eq!(
        payload,
        serde_json::json!({"account_id": "a1", "balance": 5, "delta": 5})
    );

    for _ in 0..400 {
        if receiver.calls() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(receiver.calls(), 1);
    let _ = stop.send(());
    running.await.unwrap().unwrap();
}

async fn until(mut done: impl FnMut() -> bool) {
    for _ in 0..400 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("condition not reached in 10 s");
}

#[tokio::test]
async fn a_dispatcher_killed_mid_delivery_leaves_a_lease_another_takes_over() {
    let app = TestApp::new().await;
    let receiver = Receiver::scripted([(200, Duration::from_secs(30))]);
    let url = receiver.serve().await;
    let effect = enqueue_one(&app, &url, "k1").await;
    let a = dispatcher(&app, Duration::from_secs(1));
    let killed = tokio::spawn(async move { a.dispatch_due().await });
    until(|| receiver.calls() == 1).await;
    killed.abort();
    let _ = killed.await;

    let b = dispatcher(&app, Duration::from_secs(1));
    assert_eq!(
        b.dispatch_due().await.unwrap().leased,
        0,
        "the lease still holds"
    );
    for _ in 0..400 {
        if b.dispatch_due().await.unwrap().delivered == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let entry = Outbox::new(app.pool.clone())
        .entry(&effect)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(entry.status, EffectStatus::Delivered);
    assert_eq!(entry.attempts, 2);
    assert_eq!(receiver.calls(), 2);
    assert_eq!(receiver.applied.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn shutdown_finishes_the_delivery_in_flight_and_releases_the_rest() {
    let app = TestApp::new().await;
    let receiver = Receiver::scripted([(200, Duration::from_millis(500))]);
    let url = receiver.serve().await;
    let first = enqueue_one(&app, &url, "k1").await;
    let second = enqueue_one(&app, &url, "k2").await;
    let d = Dispatcher::builder(
        app.pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .batch_size(2)
    .concurrency(1)
    .build()
    .unwrap();
    let (stop, running) = spawn_run(d);
    until(|| receiver.calls() == 1).await;
    let _ = stop.send(());
    running.await.unwrap().unwrap();

    assert_eq!(receiver.calls(), 1);
    let outbox = Outbox::new(app.pool.clone());
    let delivered: Vec<_> = [&first, &second]
        .into_iter()
        .filter(|e| receiver.calls.lock().unwrap().contains(&e.to_string()))
        .collect();
    assert_eq!(delivered.len(), 1);
    for effect in [&first, &second] {
        let entry = outbox.entry(effect).await.unwrap().unwrap();
        if delivered.contains(&effect) {
            assert_eq!(entry.status, EffectStatus::Delivered);
        } else {
            assert_eq!(entry.status, EffectStatus::Pending);
            assert_eq!(entry.attempts, 0, "released unattempted");
        }
    }
    let leased: i64 =
        sqlx::query_scalar("select count(*) from message_outbox where lease_owner is not null")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(leased, 0);
}

// ---------------------------------------------------------------------------------------------
// Leases.

/// Two dispatchers, one of which leases more effects than it can send before its lease runs
/// out: the other takes those over. Every effect must still be sent once.
#[tokio::test]
async fn a_lease_covers_each_send_even_late_in_a_batch() {
    let app = TestApp::with_pool_size(20).await;
    let receiver = Receiver::scripted(std::iter::repeat_n((200, Duration::from_secs(1)), 64));
    let url = receiver.serve().await;
    let mut effects = Vec::new();
    for i in 0..24 {
        effects.push(enqueue_one(&app, &url, &format!("k{i}")).await);
    }
    // A batch of 16 at 4 at once takes four 1 s rounds, well past the 2.5 s lease.
    let slow = |batch| {
        Dispatcher::builder(
            app.pool.clone(),
            HttpTransport::new(Duration::from_secs(2)).unwrap(),
        )
        .delivery_timeout(Duration::from_secs(2))
        .lease(Duration::from_millis(2500))
        .batch_size(batch)
        .concurrency(4)
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap()
    };
    let (stop_a, a) = spawn_run(slow(16));
    // B starts once A holds its 16, so B leases the other 8 and then comes back for A's.
    until(|| receiver.calls() >= 1).await;
    let (stop_b, b) = spawn_run(slow(8));

    let outbox = Outbox::new(app.pool.clone());
    for _ in 0..300 {
        let mut pending = 0;
        for effect in &effects {
            if outbox.entry(effect).await.unwrap().unwrap().status != EffectStatus::Delivered {
                pending += 1;
            }
        }
        if pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Stopping finishes the sends in flight, so every call either made is counted below.
    let _ = stop_a.send(());
    let _ = stop_b.send(());
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();

    let mut per_key: HashMap<String, usize> = HashMap::new();
    for key in receiver.calls.lock().unwrap().iter() {
        *per_key.entry(key.clone()).or_insert(0) += 1;
    }
    let repeated: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "sent more than once: {repeated:?}");
    assert_eq!(per_key.len(), 24);
    for effect in &effects {
        let entry = outbox.entry(effect).await.unwrap().unwrap();
        assert_eq!(entry.status, EffectStatus::Delivered);
        assert_eq!(entry.attempts, 1);
    }
}

#[tokio::test]
async fn a_send_whose_lease_another_dispatcher_took_is_skipped() {
    let app = TestApp::new().await;
    let receiver = Receiver::scripted([(200, Duration::from_millis(500))]);
    let url = receiver.serve().await;
    let effects = [
        enqueue_one(&app, &url, "k1").await,
        enqueue_one(&app, &url, "k2").await,
    ];
    let d = Dispatcher::builder(
        app.pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .batch_size(2)
    .concurrency(1)
    .build()
    .unwrap();
    let batch = tokio::spawn(async move { d.dispatch_due().await });
    until(|| receiver.calls() == 1).await;
    // While the first send stalls, the second effect's lease passes to another dispatcher (as
    // when the batch's lease runs out and another leases the effect).
    let first = receiver.calls.lock().unwrap()[0].clone();
    let waiting = effects.iter().find(|e| e.as_str() != first).unwrap();
    sqlx::query("update message_outbox set lease_owner = 'another' where effect_id = $1")
        .bind(waiting.as_str())
        .execute(&app.pool)
        .await
        .unwrap();
    let report = batch.await.unwrap().unwrap();
    assert_eq!((report.delivered, report.lost), (1, 1));
    assert_eq!(receiver.calls(), 1, "the second send did not happen");
    let entry = Outbox::new(app.pool.clone())
        .entry(waiting)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(entry.status, EffectStatus::Pending);
    assert_eq!(entry.attempts, 0, "not attempted here");
}
