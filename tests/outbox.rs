//! The outbox and the quarantine against real HTTP receivers on loopback.
//! (Over 400 lines: one suite for the dispatcher's every outcome, sharing its receivers.)

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::{credit, send, until, TestApp};
use tower_inbox::outbox::{
    enqueue, Delivery, Dispatcher, Effect, EffectId, EffectStatus, HttpTransport, Outbox,
    OutboxEntry, OutboxMessage, Transport,
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
    Dispatcher::builder(app.pool.clone(), HttpTransport::new(timeout).unwrap())
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

/// A dispatcher that leases two effects at a time and sends them one after the other.
fn two_one_at_a_time(app: &TestApp) -> Dispatcher<HttpTransport> {
    Dispatcher::builder(
        app.pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .batch_size(2)
    .concurrency(1)
    .build()
    .unwrap()
}

/// Runs `d` in a task until the returned sender fires (or is dropped).
fn spawn_run(
    d: Dispatcher<HttpTransport>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), tower_inbox::outbox::OutboxError>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(d.run(async {
        let _ = stopped.await;
    }));
    (stop, running)
}

/// Runs rounds until nothing is due (bounded); sleeps past short backoffs.
async fn drain<T: Transport>(d: &Dispatcher<T>) {
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
        sqlx::query_scalar::<_, i64>("select count(*) from tower_inbox.message_outbox")
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
    let payloads: Vec<Vec<u8>> =
        sqlx::query_scalar("select payload from tower_inbox.message_outbox")
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
    let d = two_one_at_a_time(&app);
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
    let leased: i64 = sqlx::query_scalar(
        "select count(*) from tower_inbox.message_outbox where lease_owner is not null",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(leased, 0);
}

// ---------------------------------------------------------------------------------------------
// Answers that cannot be stored as they are.

/// A receiver on loopback answering every POST with 200 and `body`; counts calls per
/// `Idempotency-Key`.
async fn answering(body: &'static [u8]) -> (String, Arc<Mutex<HashMap<String, usize>>>) {
    let calls = Arc::new(Mutex::new(HashMap::new()));
    let counted = calls.clone();
    let router = Router::new().route(
        "/hook",
        post(move |headers: HeaderMap| {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            *counted.lock().unwrap().entry(key).or_insert(0) += 1;
            async move { (StatusCode::OK, body).into_response() }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (format!("http://{addr}/hook"), calls)
}

/// Enqueues one effect for the receiver `(url, calls)` and runs rounds until it is no longer
/// pending (bounded), then one more; asserts it was sent once and delivered with a 200, and
/// returns the recorded answer.
async fn delivered_once(
    app: &TestApp,
    (url, calls): (String, Arc<Mutex<HashMap<String, usize>>>),
) -> String {
    let effect = enqueue_one(app, &url, "k1").await;
    let d = Dispatcher::builder(
        app.pool.clone(),
        HttpTransport::new(Duration::from_secs(3)).unwrap(),
    )
    .delivery_timeout(Duration::from_secs(3))
    .lease(Duration::from_millis(3500))
    .backoff(Duration::from_millis(10), Duration::from_millis(20))
    .build()
    .unwrap();
    let outbox = Outbox::new(app.pool.clone());
    // An unrecordable outcome leaves the row pending until its lease runs out, then it is
    // delivered again: rounds go on long enough to see that.
    for _ in 0..40 {
        d.dispatch_due().await.unwrap();
        if outbox.entry(&effect).await.unwrap().unwrap().status != EffectStatus::Pending {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    d.dispatch_due().await.unwrap();
    let entry = outbox.entry(&effect).await.unwrap().unwrap();
    assert_eq!(calls.lock().unwrap().get(effect.as_str()), Some(&1));
    assert_eq!(entry.status, EffectStatus::Delivered);
    assert_eq!(entry.remote_status, Some(200));
    entry.remote_result.expect("a recorded answer")
}

#[tokio::test]
async fn an_answer_with_a_nul_byte_is_delivered_once_and_stored_sanitised() {
    let app = TestApp::new().await;
    let result = delivered_once(&app, answering(b"ok\0done").await).await;
    assert_eq!(result, "ok\u{FFFD}done");
}

#[tokio::test]
async fn an_answer_in_invalid_utf8_is_delivered_once_and_stored_lossily() {
    let app = TestApp::new().await;
    let result = delivered_once(&app, answering(b"\xff\xfeok").await).await;
    assert_eq!(result, "\u{FFFD}\u{FFFD}ok");
}

#[tokio::test]
async fn a_4_mib_answer_is_delivered_once_with_a_64_kib_excerpt() {
    static BODY: [u8; 4 << 20] = [b'a'; 4 << 20];
    let app = TestApp::new().await;
    let result = delivered_once(&app, answering(&BODY).await).await;
    assert_eq!(result.len(), 64 * 1024);
    assert!(result.bytes().all(|b| b == b'a'));
}

/// A receiver that answers `200` with a chunked body that starts with `hello\n` and then
/// never ends (a chunk every 50 ms, for at most 20 s, while the client listens); counts calls
/// per `Idempotency-Key`.
async fn never_ending() -> (String, Arc<Mutex<HashMap<String, usize>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let calls = Arc::new(Mutex::new(HashMap::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counted = calls.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                // The request head and its small body arrive together; no keep-alive.
                let mut request = vec![0; 16 * 1024];
                let mut read = 0;
                while !request[..read].windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut request[read..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read += n,
                    }
                }
                let head = String::from_utf8_lossy(&request[..read]).to_lowercase();
                let key = head
                    .lines()
                    .find_map(|l| l.strip_prefix("idempotency-key:"))
                    .map(|k| k.trim().to_owned())
                    .unwrap_or_default();
                *counted.lock().unwrap().entry(key).or_insert(0) += 1;
                let start = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\
                              transfer-encoding: chunked\r\n\r\n6\r\nhello\n\r\n";
                if socket.write_all(start).await.is_err() {
                    return;
                }
                for _ in 0..400 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    if socket.write_all(b"5\r\ntick\n\r\n").await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}/hook"), calls)
}

#[tokio::test]
async fn an_answer_that_never_ends_is_delivered_once_with_what_arrived() {
    let app = TestApp::new().await;
    let result = delivered_once(&app, never_ending().await).await;
    assert!(result.starts_with("hello\n"), "{result:?}");
    assert!(result.len() <= 64 * 1024);
    assert!(result.lines().skip(1).all(|l| l == "tick"), "{result:?}");
}

/// A transport of the caller's own: `answer` decides each delivery from the effect and how
/// many calls came before; panics inside it happen while the delivery future is polled.
struct FnTransport<F> {
    answer: F,
    calls: Arc<Mutex<Vec<String>>>,
}

impl<F> FnTransport<F>
where
    F: Fn(&Effect, usize) -> Delivery + Send + Sync + 'static,
{
    fn new(answer: F) -> (Self, Arc<Mutex<Vec<String>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let transport = Self {
            answer,
            calls: calls.clone(),
        };
        (transport, calls)
    }
}

impl<F> Transport for FnTransport<F>
where
    F: Fn(&Effect, usize) -> Delivery + Send + Sync + 'static,
{
    async fn deliver(&self, effect: &Effect) -> Delivery {
        tokio::task::yield_now().await;
        let before = {
            let mut calls = self.calls.lock().unwrap();
            calls.push(effect.destination.clone());
            calls.iter().filter(|d| **d == effect.destination).count() - 1
        };
        (self.answer)(effect, before)
    }
}

fn fn_dispatcher<T: Transport>(app: &TestApp, transport: T) -> Dispatcher<T> {
    Dispatcher::builder(app.pool.clone(), transport)
        .delivery_timeout(Duration::from_secs(5))
        .lease(Duration::from_secs(6))
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .max_attempts(3)
        .build()
        .unwrap()
}

#[tokio::test]
async fn texts_a_transport_returns_are_stored_sanitised_and_bounded() {
    let app = TestApp::new().await;
    let huge = format!("{}\0", "é".repeat(50_000));
    let (transport, calls) =
        FnTransport::new(
            move |effect, before| match (effect.destination.as_str(), before) {
                ("retry-then-deliver", 0) => Delivery::Retry {
                    status: Some(503),
                    error: huge.clone(),
                },
                ("retry-then-deliver", _) => Delivery::Delivered {
                    status: Some(200),
                    result: "receipt\0".to_owned(),
                },
                _ => Delivery::Permanent {
                    status: Some(400),
                    reason_code: "bad\0request".to_owned(),
                    error: "refused\0".to_owned(),
                },
            },
        );
    let retried = enqueue_one(&app, "retry-then-deliver", "k1").await;
    let refused = enqueue_one(&app, "refuse", "k2").await;
    let d = fn_dispatcher(&app, transport);
    let outbox = Outbox::new(app.pool.clone());

    let first = d.dispatch_due().await.unwrap();
    assert_eq!((first.retried, first.dead, first.unrecorded), (1, 1, 0));
    let entry = outbox.entry(&retried).await.unwrap().unwrap();
    let error = entry.last_error.unwrap();
    assert!(error.len() <= 64 * 1024 && !error.contains('\0'));
    assert!(error.starts_with("éé"));
    let dead = outbox.entry(&refused).await.unwrap().unwrap();
    assert_eq!(dead.status, EffectStatus::Dead);
    assert_eq!(dead.last_error.as_deref(), Some("refused\u{FFFD}"));
    let open = Quarantine::new(app.pool.clone())
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].reason_code, "bad\u{FFFD}request");

    drain(&d).await;
    let entry = outbox.entry(&retried).await.unwrap().unwrap();
    assert_eq!(entry.status, EffectStatus::Delivered);
    assert_eq!(entry.remote_result.as_deref(), Some("receipt\u{FFFD}"));
    assert_eq!(
        calls.lock().unwrap().len(),
        3,
        "two attempts and one refusal"
    );
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
    let d = two_one_at_a_time(&app);
    let batch = tokio::spawn(async move { d.dispatch_due().await });
    until(|| receiver.calls() == 1).await;
    // While the first send stalls, the second effect's lease passes to another dispatcher (as
    // when the batch's lease runs out and another leases the effect).
    let first = receiver.calls.lock().unwrap()[0].clone();
    let waiting = effects.iter().find(|e| e.as_str() != first).unwrap();
    sqlx::query(
        "update tower_inbox.message_outbox set lease_owner = 'another' where effect_id = $1",
    )
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

#[tokio::test]
async fn a_delivery_timeout_shorter_than_the_transports_own_is_refused() {
    let app = TestApp::new().await;
    let with_delivery_timeout = |secs| {
        Dispatcher::builder(
            app.pool.clone(),
            HttpTransport::new(Duration::from_secs(5)).unwrap(),
        )
        .delivery_timeout(Duration::from_secs(secs))
        .build()
    };
    assert!(with_delivery_timeout(4).is_err());
    assert!(with_delivery_timeout(5).is_ok());
}

// ---------------------------------------------------------------------------------------------
// Panics.

#[tokio::test]
async fn a_panicking_transport_fails_the_attempt_and_the_dispatcher_goes_on() {
    let app = TestApp::new().await;
    let (transport, calls) = FnTransport::new(|effect, _| {
        if effect.destination == "panic" {
            panic!("transport bug");
        }
        Delivery::Delivered {
            status: None,
            result: "ok".to_owned(),
        }
    });
    let panicking = enqueue_one(&app, "panic", "k0").await;
    let fine = [
        enqueue_one(&app, "ok-1", "k1").await,
        enqueue_one(&app, "ok-2", "k2").await,
    ];
    let d = fn_dispatcher(&app, transport);
    let (stop, running) = {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(d.clone().run(async {
            let _ = stopped.await;
        }));
        (stop, running)
    };
    let outbox = Outbox::new(app.pool.clone());
    for _ in 0..400 {
        let entry = outbox.entry(&panicking).await.unwrap().unwrap();
        if entry.status == EffectStatus::Dead {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(!running.is_finished(), "the dispatcher is still running");

    let entry = outbox.entry(&panicking).await.unwrap().unwrap();
    assert_eq!(entry.status, EffectStatus::Dead);
    assert_eq!(entry.attempts, 3);
    assert_eq!(entry.last_error.as_deref(), Some("the transport panicked"));
    for effect in &fine {
        let entry = outbox.entry(effect).await.unwrap().unwrap();
        assert_eq!(entry.status, EffectStatus::Delivered);
    }
    let open = Quarantine::new(app.pool.clone())
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].effect_id.as_deref(), Some(panicking.as_str()));
    assert_eq!(open[0].reason_code, "attempts-exhausted");
    assert_eq!(
        calls.lock().unwrap().len(),
        5,
        "three panics, two deliveries"
    );

    // It still serves effects enqueued after the panics.
    let later = enqueue_one(&app, "ok-3", "k3").await;
    for _ in 0..400 {
        if outbox.entry(&later).await.unwrap().unwrap().status == EffectStatus::Delivered {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        outbox.entry(&later).await.unwrap().unwrap().status,
        EffectStatus::Delivered
    );
    let _ = stop.send(());
    running.await.unwrap().unwrap();
}

// ---------------------------------------------------------------------------------------------
// What HttpTransport refuses.

#[tokio::test]
async fn a_destination_that_is_not_an_absolute_http_url_is_dead_at_once() {
    let app = TestApp::new().await;
    let destinations = ["not a url", "example.com/hook", "ftp://example.com/hook"];
    let mut effects = Vec::new();
    for (i, destination) in destinations.iter().enumerate() {
        effects.push(enqueue_one(&app, destination, &format!("k{i}")).await);
    }
    let d = dispatcher(&app, Duration::from_secs(2));
    let report = d.dispatch_due().await.unwrap();
    assert_eq!((report.dead, report.retried), (3, 0));
    let outbox = Outbox::new(app.pool.clone());
    for effect in &effects {
        let entry = outbox.entry(effect).await.unwrap().unwrap();
        assert_eq!(entry.status, EffectStatus::Dead);
        assert_eq!(entry.attempts, 1);
        assert_eq!(entry.remote_status, None);
    }
    let open = Quarantine::new(app.pool.clone())
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    assert_eq!(open.len(), 3);
    assert!(open.iter().all(|i| i.reason_code == "invalid-destination"));
}

/// A receiver whose `/hook` redirects (`status`, to `/moved`) and whose `/moved` accepts;
/// returns the hook's URL and the calls to `/moved`.
async fn redirecting(status: StatusCode) -> (String, Arc<Mutex<usize>>) {
    let moved = Arc::new(Mutex::new(0));
    let counted = moved.clone();
    let router = Router::new()
        .route(
            "/hook",
            post(move || async move { (status, [("location", "/moved")]).into_response() }),
        )
        .route(
            "/moved",
            axum::routing::any(move || {
                *counted.lock().unwrap() += 1;
                async { (StatusCode::OK, "accepted").into_response() }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (format!("http://{addr}/hook"), moved)
}

async fn dead_reason(app: &TestApp, effect: &EffectId) -> (OutboxEntry, String) {
    let entry = Outbox::new(app.pool.clone())
        .entry(effect)
        .await
        .unwrap()
        .unwrap();
    let open = Quarantine::new(app.pool.clone())
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    let item = open
        .iter()
        .find(|i| i.effect_id.as_deref() == Some(effect.as_str()))
        .expect("a quarantine item for the effect");
    (entry, item.reason_code.clone())
}

#[tokio::test]
async fn a_redirect_is_not_followed_and_is_dead() {
    let app = TestApp::new().await;
    let (url, moved) = redirecting(StatusCode::FOUND).await;
    let effect = enqueue_one(&app, &url, "k1").await;
    let report = dispatcher(&app, Duration::from_secs(2))
        .dispatch_due()
        .await
        .unwrap();
    assert_eq!(report.dead, 1);
    assert_eq!(*moved.lock().unwrap(), 0, "not followed");
    let (entry, reason) = dead_reason(&app, &effect).await;
    assert_eq!(entry.status, EffectStatus::Dead);
    assert_eq!(entry.remote_status, Some(302));
    assert!(entry.last_error.unwrap().contains("/moved"));
    assert_eq!(reason, "http-redirect");
}

#[tokio::test]
async fn a_redirect_followed_by_a_callers_client_is_never_delivered() {
    let app = TestApp::new().await;
    // reqwest's default client follows redirects; 307 keeps the method and the payload.
    let (url, moved) = redirecting(StatusCode::TEMPORARY_REDIRECT).await;
    let effect = enqueue_one(&app, &url, "k1").await;
    let transport = HttpTransport::with_client(reqwest::Client::new());
    let report = fn_dispatcher(&app, transport).dispatch_due().await.unwrap();
    assert_eq!((report.dead, report.delivered), (1, 0));
    assert_eq!(*moved.lock().unwrap(), 1, "the caller's client followed it");
    let (entry, reason) = dead_reason(&app, &effect).await;
    assert_eq!(entry.status, EffectStatus::Dead);
    assert!(entry.last_error.unwrap().contains("/moved"));
    assert_eq!(reason, "http-redirect");
}
