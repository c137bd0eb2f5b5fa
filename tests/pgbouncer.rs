//! The crate through PgBouncer in transaction pooling mode: Debian's PgBouncer (1.18 on the
//! machines CI runs on), which does not keep prepared statements across transactions, so a
//! client's next transaction may run on a server connection that never saw its statements.
//!
//! Every component is given `Schema::default().with_pooling(Pooling::Transaction)`: the layer
//! in both claim modes and with the lookup first, a duplicate waiting for its original, the
//! failure record of a failed attempt, the quarantine, the outbox dispatcher (polling, no
//! `LISTEN`), the purger, the stats task and a broker consumer. The service runs on the test's own role through
//! its own PgBouncer; the tests read the outcome on a direct connection. A control shows the
//! same traffic failing with the default pooling, so the pooler really shares its server
//! connections between clients: were it in session mode, the control would pass and fail
//! the test.

mod common;

use std::time::Duration;

use axum::Router;
use http::StatusCode;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tower_inbox::consumer::{Consumer, Incoming, Processed};
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::ClaimMode;
use tower_inbox::metrics::StatsTask;
use tower_inbox::outbox::{Dispatcher, HttpTransport};
use tower_inbox::quarantine::{Quarantine, QuarantineFilter};
use tower_inbox::retention::{Purger, RetentionPolicy};
use tower_inbox::schema::{Pooling, Schema};
use tower_inbox::{MessageKey, Producer};
use tower_inbox_testdb::{PgBouncer, PoolMode};

use common::{
    credit, credit_acct, credits, gated_router_on, send, spawn_send, wait_until_waiting, TestApp,
};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A test's database, and its service role's pool through a PgBouncer of its own in
/// transaction mode.
struct Bounced {
    /// Direct connections, for the test's own reads and setup.
    app: TestApp,
    /// The service's pool, through PgBouncer.
    pool: PgPool,
    // Dropped after the pool's users; stops PgBouncer.
    _bouncer: PgBouncer,
}

/// PgBouncer in front of a fresh test database with at most `server_connections` server
/// connections, and a service pool of four connections through it.
async fn bounced(server_connections: u32) -> Bounced {
    let app = TestApp::new().await;
    let direct = app.role.connect_options();
    let host = direct.get_host().to_owned();
    assert!(
        host == "127.0.0.1" || host == "localhost",
        "the PgBouncer tests need the test server on 127.0.0.1, not on {host}"
    );
    let bouncer = PgBouncer::start_for(
        direct.get_port(),
        PoolMode::Transaction,
        &[app.role.name()],
        server_connections,
    )
    .expect("PgBouncer");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect_lazy_with(direct.host("127.0.0.1").port(bouncer.port()));
    Bounced {
        app,
        pool,
        _bouncer: bouncer,
    }
}

fn transaction_pooling() -> Schema {
    Schema::default().with_pooling(Pooling::Transaction)
}

/// Two commands from two client connections that take turns on PgBouncer's one server
/// connection: the first holds it (its handler waits) while the second's connection is
/// opened, so each prepares its claim on the same server connection. Returns the statuses
/// of the commands sent: the first alone if it failed before its handler ran (its lookup
/// and its claim can already go out on two client connections).
async fn two_clients_on_one_server_connection(pooling: Pooling) -> Vec<StatusCode> {
    let b = bounced(1).await;
    let (router, gate, _) = gated_router_on(&b.pool, |layer| {
        layer.schema(Schema::default().with_pooling(pooling))
    });
    let mut first = spawn_send(&router, credit("a", Some("first"), Some("p"), 1));
    tokio::select! {
        () = gate.started.notified() => {}
        reply = &mut first => return vec![reply.expect("first").status],
    }
    let second = spawn_send(&router, credit("b", Some("second"), Some("p"), 1));
    // The second request holds a client connection once none is idle (the first may
    // already have used two: its lookup's, whose release was still under way when it
    // claimed, and its claim's); its BEGIN then waits for the server connection the first
    // one holds.
    for _ in 0..1000 {
        if b.pool.size() >= 2 && b.pool.num_idle() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        b.pool.size() >= 2 && b.pool.num_idle() == 0,
        "the second request never took a client connection of its own"
    );
    gate.release.notify_one();
    let first = first.await.expect("first");
    gate.release.notify_one();
    let second = second.await.expect("second");
    vec![first.status, second.status]
}

#[tokio::test]
async fn named_statements_break_through_a_transaction_mode_pooler() {
    // The control: sqlx names each connection's statements sqlx_s_1, sqlx_s_2, ..., so a
    // claim meets another client's sqlx_s_1 on the shared server connection.
    let statuses = two_clients_on_one_server_connection(Pooling::Session).await;
    assert!(
        statuses.iter().any(StatusCode::is_server_error),
        "a claim should fail on a statement name another client left: {statuses:?}"
    );
}

#[tokio::test]
async fn unnamed_statements_share_the_server_connection() {
    let statuses = two_clients_on_one_server_connection(Pooling::Transaction).await;
    assert_eq!(statuses, [StatusCode::CREATED, StatusCode::CREATED]);
}

/// The credits example's route on the bounced pool, its layer configured by `configure`.
fn credits_on(
    b: &Bounced,
    configure: impl FnOnce(tower_inbox::InboxLayerBuilder) -> tower_inbox::InboxLayerBuilder,
) -> Router {
    let layer = configure(credits::inbox_layer(b.pool.clone()).schema(transaction_pooling()))
        .build()
        .expect("layer");
    credits::routes(b.pool.clone(), layer)
}

#[tokio::test]
async fn the_protocol_through_the_pooler() {
    let b = bounced(2).await;
    for (name, router) in [
        ("claim first", credits_on(&b, |l| l)),
        (
            "lookup first",
            credits_on(&b, |l| l.lookup_before_claim(true)),
        ),
        (
            "claim at commit",
            credits_on(&b, |l| l.claim_mode(ClaimMode::AtCommit)),
        ),
    ] {
        let account = name.replace(' ', "-");
        let key = format!("{account}-1");
        let first = send(&router, credit(&account, Some(&key), Some("p"), 5)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{name}: {first:?}");
        let again = send(&router, credit(&account, Some(&key), Some("p"), 5)).await;
        assert_eq!(again.status, StatusCode::CREATED, "{name}");
        assert!(again.replayed(), "{name}: the duplicate was not replayed");
        assert_eq!(again.body, first.body, "{name}");
        let reused = send(&router, credit(&account, Some(&key), Some("p"), 6)).await;
        assert_eq!(reused.problem_type(), "payload-mismatch", "{name}");
        assert_eq!(b.app.ledger_rows(&account).await, 1, "{name}");
        assert_eq!(b.app.balance(&account).await, Some(5), "{name}");
    }
    // Each reused key opened an item, read and decided through the pooler.
    let quarantine = Quarantine::new(b.pool.clone()).with_schema(transaction_pooling());
    let open = quarantine
        .list(QuarantineFilter::Open, 10)
        .await
        .expect("list");
    assert_eq!(open.len(), 3, "{open:?}");
    quarantine
        .discard(open[0].id, "test", "a reused key")
        .await
        .expect("discard");
    let open = quarantine
        .list(QuarantineFilter::Open, 10)
        .await
        .expect("list");
    assert_eq!(open.len(), 2);
}

#[tokio::test]
async fn a_waiting_duplicate_and_a_failed_attempt_through_the_pooler() {
    let b = bounced(2).await;
    let (router, gate, calls) = gated_router_on(&b.pool, |l| l.schema(transaction_pooling()));

    // A duplicate waits for its original in flight, then replays it.
    let original = spawn_send(&router, credit("w", Some("k"), Some("p"), 1));
    gate.started.notified().await;
    let duplicate = spawn_send(&router, credit("w", Some("k"), Some("p"), 1));
    wait_until_waiting(&gate.inbox, 1).await;
    gate.release.notify_one();
    let original = original.await.expect("original");
    let duplicate = duplicate.await.expect("duplicate");
    assert_eq!(original.status, StatusCode::CREATED);
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, original.body);
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);

    // A failed attempt rolls back and is recorded in a transaction of its own; the retry
    // runs the command once.
    *gate.status.lock().unwrap() = StatusCode::INTERNAL_SERVER_ERROR;
    let failing = spawn_send(&router, credit("f", Some("k2"), Some("p"), 1));
    gate.started.notified().await;
    gate.release.notify_one();
    assert_eq!(
        failing.await.expect("failing").status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(b.app.wait_for_failures("p", "k2", 1).await.0, 1);
    assert_eq!(
        b.app.balance("f").await,
        None,
        "the failed attempt committed"
    );
    *gate.status.lock().unwrap() = StatusCode::CREATED;
    let retry = spawn_send(&router, credit("f", Some("k2"), Some("p"), 1));
    gate.started.notified().await;
    gate.release.notify_one();
    assert_eq!(retry.await.expect("retry").status, StatusCode::CREATED);
    assert_eq!(b.app.balance("f").await, Some(1));
}

#[tokio::test]
async fn the_outbox_purge_and_stats_through_the_pooler() {
    let b = bounced(2).await;
    let hook = common::receiver([]).await;
    let layer = credits::inbox_layer(b.pool.clone())
        .schema(transaction_pooling())
        .build()
        .expect("layer");
    let router = credits::routes_with_webhook(b.pool.clone(), layer, Some(hook));

    // The dispatcher runs without LISTEN and finds the effects by polling.
    let dispatcher = Dispatcher::builder(
        b.pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).expect("transport"),
    )
    .schema(transaction_pooling())
    .poll_interval(Duration::from_millis(50))
    .build()
    .expect("dispatcher");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(dispatcher.run(async {
        let _ = stopped.await;
    }));
    for n in 0..3 {
        let key = format!("o{n}");
        let reply = send(&router, credit("o", Some(&key), Some("p"), 1)).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    let mut delivered = 0;
    for _ in 0..600 {
        delivered = delivered_effects(&b.app).await;
        if delivered == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        delivered, 3,
        "the polling dispatcher did not deliver every effect"
    );
    let _ = stop.send(());
    running.await.expect("dispatcher task").expect("dispatcher");

    let mut stats = StatsTask::new(b.pool.clone()).with_schema(transaction_pooling());
    let read = stats.collect().await.expect("stats");
    assert_eq!(read.outbox_pending, 0);

    // Two of the three commands age past the window; the purge takes exactly those.
    sqlx::query(
        "update tower_inbox.consumer_inbox
         set received_at = now() - interval '10 days', processed_at = now() - interval '10 days'
         where message_id in ('o0', 'o1')",
    )
    .execute(&b.app.owner)
    .await
    .expect("age rows");
    let purger = Purger::builder(b.pool.clone())
        .schema(transaction_pooling())
        .inbox(
            RetentionPolicy::builder()
                .retry_horizon(DAY)
                .safety_margin(DAY)
                .build()
                .expect("policy"),
        )
        .build()
        .expect("purger");
    assert_eq!(purger.dry_run().await.expect("dry run").total_rows(), 2);
    assert_eq!(purger.purge().await.expect("purge").total_rows(), 2);
    assert_eq!(b.app.inbox_rows().await, 1);
}

async fn delivered_effects(app: &TestApp) -> i64 {
    sqlx::query_scalar("select count(*) from tower_inbox.message_outbox where status = 'delivered'")
        .fetch_one(&app.owner)
        .await
        .expect("outbox count")
}

#[tokio::test]
async fn a_broker_consumer_through_the_pooler() {
    let b = bounced(2).await;
    let consumer = Consumer::builder(b.pool.clone(), "worker")
        .schema(transaction_pooling())
        .statement_deadline(Duration::from_secs(5))
        .build()
        .expect("consumer");
    assert_eq!(
        consumer.inbox().statement_deadline(),
        Duration::from_secs(5)
    );
    let incoming = || {
        Incoming::new(
            Producer::new("payments").expect("producer"),
            MessageKey::new("m1").expect("key"),
            Fingerprint::of_bytes(b"+1"),
        )
    };
    let first = consumer.process(incoming(), credit_acct).await;
    assert!(matches!(first, Processed::Applied(())), "{first:?}");
    // Redelivered after a lost ack: a duplicate, applied once.
    let again = consumer.process(incoming(), credit_acct).await;
    assert!(matches!(again, Processed::Duplicate(_)), "{again:?}");
    assert_eq!(b.app.balance("acct").await, Some(1));
}
