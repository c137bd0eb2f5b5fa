//! The partitioned layout's outbox (`Layout::Partitioned`): enqueue and delivery, the
//! NOTIFY triggers on a partitioned table, one row per effect ID and the race its enqueue
//! must win, the isolation check, the purge dropping whole partitions and keeping what it
//! must, the partitions created ahead, the service role's grants.
//! (Over 400 lines: one test per rule of the layout's outbox, over shared helpers.)

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use sqlx::{Connection, PgConnection, PgPool};
use time::OffsetDateTime;
use tower_inbox::outbox::{
    Dispatcher, EffectId, EffectStatus, HttpTransport, Outbox, OutboxError, OutboxMessage,
};
use tower_inbox::partition::PartitionPlan;
use tower_inbox::quarantine::{Quarantine, QuarantineFilter};
use tower_inbox::retention::{PurgedTable, Purger, RetentionPolicy};
use tower_inbox::schema::{migrate_schema, Access, Layout, Schema};

use common::{until, wait_until_a_lock_is_awaited, TestApp};

const DAY: Duration = Duration::from_secs(24 * 3600);

fn schema() -> Schema {
    Schema::new("part_outbox")
        .expect("schema name")
        .with_layout(Layout::Partitioned)
}

/// Runs the grants `access` needs in the partitioned schema for `role`, as the owner.
async fn grant(app: &TestApp, role: &str, access: Access) {
    common::grant_in(&app.owner, &schema(), role, access).await;
}

/// A test app with the partitioned layout in `part_outbox`, migrated by the owner, with the
/// service role's grants (purge included) and today's partitions.
async fn partitioned_app() -> TestApp {
    let app = TestApp::new().await;
    migrate_schema(&app.owner, &schema())
        .await
        .expect("partitioned migrations");
    grant(&app, app.role.name(), Access::ServiceAndPurge).await;
    PartitionPlan::default()
        .create(&app.pool, &schema())
        .await
        .expect("partitions");
    app
}

fn outbox(pool: &PgPool) -> Outbox {
    Outbox::new(pool.clone()).with_schema(schema())
}

fn message() -> OutboxMessage {
    OutboxMessage::new("http://127.0.0.1:9/hook", "{}")
}

async fn rows_of(pool: &PgPool, effect: &str) -> i64 {
    sqlx::query_scalar("select count(*) from part_outbox.message_outbox where effect_id = $1")
        .bind(effect)
        .fetch_one(pool)
        .await
        .expect("count")
}

/// A receiver that answers the scripted statuses in turn (then 200) and counts the calls
/// per `Idempotency-Key`.
async fn counting_receiver(script: Vec<u16>) -> (String, Arc<Mutex<HashMap<String, usize>>>) {
    let calls = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let script = Arc::new(Mutex::new(script));
    let counted = calls.clone();
    let router = Router::new().route(
        "/hook",
        post(move |headers: HeaderMap| {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            *counted.lock().unwrap().entry(key).or_insert(0) += 1;
            let mut script = script.lock().unwrap();
            let status = if script.is_empty() {
                200
            } else {
                script.remove(0)
            };
            async move { StatusCode::from_u16(status).unwrap() }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (format!("http://{addr}/hook"), calls)
}

async fn status_of(app: &TestApp, effect: &EffectId) -> EffectStatus {
    outbox(&app.pool)
        .entry(effect)
        .await
        .expect("entry")
        .expect("the effect's row")
        .status
}

/// A dispatcher that polls once an hour wakes only on the triggers' NOTIFY: the insert's
/// (a statement trigger on the partitioned table) delivers a new effect, and the requeue's
/// (a row trigger, cloned onto the partitions) delivers a repaired dead one. Each effect is
/// delivered once; a duplicate enqueue writes nothing.
#[tokio::test]
async fn enqueued_effects_wake_the_dispatcher_and_are_delivered_once() {
    let app = partitioned_app().await;
    let (url, calls) = counting_receiver(vec![200, 404]).await;
    let dispatcher = Dispatcher::builder(
        app.pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .schema(schema())
    .poll_interval(Duration::from_secs(3600))
    .build()
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(dispatcher.run(async {
        let _ = stopped.await;
    }));
    let outbox = outbox(&app.pool);
    let enqueue = |id: &'static str| {
        let (outbox, url, app) = (outbox.clone(), url.clone(), &app);
        async move {
            let mut tx = app.pool.begin().await.unwrap();
            let message = OutboxMessage::new(url, "{}");
            let first = outbox
                .enqueue_with_id(&mut *tx, EffectId::new(id), "hook", &message)
                .await
                .expect("enqueue");
            let again = outbox
                .enqueue_with_id(&mut *tx, EffectId::new(id), "hook", &message)
                .await
                .expect("duplicate enqueue");
            assert!(first.inserted && !again.inserted, "one row per effect");
            tx.commit().await.unwrap();
            first.effect_id
        }
    };
    let first = enqueue("first").await;
    until(|| calls.lock().unwrap().get("first") == Some(&1)).await;
    // Recorded as delivered, then past the dispatcher's look for the next due effect (which
    // would find one enqueued meanwhile without any NOTIFY): it sleeps for the hour, and
    // only a NOTIFY brings the next one.
    for _ in 0..400 {
        let status: String = sqlx::query_scalar(
            "select status from part_outbox.message_outbox where effect_id = 'first'",
        )
        .fetch_one(&app.owner)
        .await
        .unwrap();
        if status == "delivered" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let dead = enqueue("dead").await;
    until(|| calls.lock().unwrap().get("dead") == Some(&1)).await;
    let quarantine = Quarantine::new(app.pool.clone()).with_schema(schema());
    let mut open = Vec::new();
    for _ in 0..400 {
        open = quarantine.list(QuarantineFilter::Open, 10).await.unwrap();
        if !open.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(open.len(), 1, "the 404 made the effect dead");
    assert_eq!(status_of(&app, &dead).await, EffectStatus::Dead);
    quarantine
        .repair(open[0].id, "oncall", "receiver fixed")
        .await
        .expect("repair");
    until(|| calls.lock().unwrap().get("dead") == Some(&2)).await;
    let _ = stop.send(());
    running.await.unwrap().unwrap();
    assert_eq!(status_of(&app, &first).await, EffectStatus::Delivered);
    assert_eq!(status_of(&app, &dead).await, EffectStatus::Delivered);
    assert_eq!(calls.lock().unwrap().get("first"), Some(&1));
    assert_eq!(rows_of(&app.pool, "first").await, 1);
}

/// A duplicate enqueue writes nothing, whatever runs it: the same transaction, a later one,
/// or the pool itself (one autocommit statement).
#[tokio::test]
async fn a_duplicate_enqueue_writes_nothing() {
    let app = partitioned_app().await;
    let outbox = outbox(&app.pool);
    let id = || EffectId::new("e1");
    let first = outbox
        .enqueue_with_id(&app.pool, id(), "hook", &message())
        .await
        .expect("enqueue");
    assert!(first.inserted);
    let mut tx = app.pool.begin().await.unwrap();
    let again = outbox
        .enqueue_with_id(&mut *tx, id(), "hook", &message())
        .await
        .expect("duplicate");
    assert!(!again.inserted);
    tx.commit().await.unwrap();
    let identity = tower_inbox::MessageIdentity::new(
        "c",
        tower_inbox::Producer::new("p").unwrap(),
        tower_inbox::MessageKey::new("k").unwrap(),
    );
    for expected in [true, false] {
        let enqueued = outbox
            .enqueue(&app.pool, &identity, "mail", &message())
            .await
            .expect("enqueue");
        assert_eq!(enqueued.inserted, expected);
    }
    assert_eq!(rows_of(&app.pool, "e1").await, 1);
    let total: i64 = sqlx::query_scalar("select count(*) from part_outbox.message_outbox")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(total, 2);
}

/// The effect-ID lock the service role's open transaction holds: the one-`bigint` form
/// (`objsubid = 1`), apart from the claim locks' two-`int4` one.
async fn held_effect_lock(app: &TestApp) -> i64 {
    sqlx::query_scalar(
        "select ((l.classid::int8 << 32) | l.objid::int8)
         from pg_stat_activity a join pg_locks l on l.pid = a.pid
         where a.usename = $1 and l.locktype = 'advisory' and l.objsubid = 1 and l.granted",
    )
    .bind(app.role.name())
    .fetch_one(&app.owner)
    .await
    .expect("the enqueue's lock")
}

/// Two transactions enqueue one effect ID: the second waits for the first's lock and, once
/// the first committed, sees its row and inserts nothing. The same check sent as one
/// statement, with the lock taken inside the insert (a snapshot older than the lock),
/// inserts a second row: what this test would catch.
#[tokio::test]
async fn a_second_enqueue_waits_for_the_first_and_sees_its_row() {
    let app = partitioned_app().await;
    // Whether the second transaction inserted. `one_statement`: the lock and the insert in
    // one statement; otherwise the crate's enqueue.
    let race = |id: &'static str, one_statement: bool| {
        let app = &app;
        async move {
            let mut first = app.pool.begin().await.unwrap();
            let enqueued = outbox(&app.pool)
                .enqueue_with_id(&mut *first, EffectId::new(id), "hook", &message())
                .await
                .expect("first enqueue");
            assert!(enqueued.inserted);
            let lock = held_effect_lock(app).await;
            let mut conn = PgConnection::connect_with(&app.role.connect_options())
                .await
                .expect("connect");
            let pool = app.pool.clone();
            let second = tokio::spawn(async move {
                sqlx::query("begin").execute(&mut conn).await.unwrap();
                let inserted = if one_statement {
                    sqlx::query(
                        "with lock as (select pg_catalog.pg_advisory_xact_lock($2))
                         insert into part_outbox.message_outbox
                             (effect_id, effect_name, destination, payload)
                         select $1, 'hook', 'd', '' from lock
                         where not exists (select from part_outbox.message_outbox o
                                           where o.effect_id = $1)",
                    )
                    .bind(id)
                    .bind(lock)
                    .execute(&mut conn)
                    .await
                    .expect("one statement")
                    .rows_affected()
                        == 1
                } else {
                    outbox(&pool)
                        .enqueue_with_id(&mut conn, EffectId::new(id), "hook", &message())
                        .await
                        .expect("second enqueue")
                        .inserted
                };
                sqlx::query("commit").execute(&mut conn).await.unwrap();
                inserted
            });
            wait_until_a_lock_is_awaited(&app.owner).await;
            first.commit().await.expect("commit");
            second.await.expect("second task")
        }
    };
    assert!(
        !race("fresh", false).await,
        "the enqueue inserted a second row for a committed effect ID"
    );
    assert_eq!(rows_of(&app.pool, "fresh").await, 1);
    assert!(
        race("stale", true).await,
        "an insert whose snapshot predates its lock was expected to miss the commit"
    );
    assert_eq!(rows_of(&app.pool, "stale").await, 2);
}

/// An enqueue in a transaction of the caller's own at `REPEATABLE READ` or `SERIALIZABLE`
/// is refused: its check would read a snapshot older than its lock.
#[tokio::test]
async fn an_enqueue_above_read_committed_is_refused() {
    let app = partitioned_app().await;
    for level in ["repeatable read", "serializable"] {
        let mut tx = app.pool.begin().await.unwrap();
        sqlx::query(&format!("set transaction isolation level {level}"))
            .execute(&mut *tx)
            .await
            .unwrap();
        let err = outbox(&app.pool)
            .enqueue_with_id(&mut *tx, EffectId::new("e"), "hook", &message())
            .await
            .expect_err("refused");
        let OutboxError::Database(sqlx::Error::Database(db)) = &err else {
            panic!("{level}: {err}");
        };
        assert_eq!(db.code().as_deref(), Some("0A000"), "{level}: {err}");
        assert!(err.to_string().contains("READ COMMITTED only"), "{err}");
        assert!(!err.is_retryable(), "{err}");
    }
    assert_eq!(rows_of(&app.pool, "e").await, 0);
}

/// Adds an effect created `age` ago to the partitioned outbox, as the owner: `status`, and
/// `delivered` ago when delivered.
async fn add_effect(app: &TestApp, id: &str, age: Duration, status: &str, delivered: Duration) {
    sqlx::query(
        "insert into part_outbox.message_outbox
             (effect_id, effect_name, destination, payload, status, created_at, delivered_at)
         select $1, 'hook', 'http://127.0.0.1:9/hook', '', $2,
                now() - make_interval(secs => $3),
                case when $2 = 'delivered' then now() - make_interval(secs => $4) end",
    )
    .bind(id)
    .bind(status)
    .bind(age.as_secs_f64())
    .bind(delivered.as_secs_f64())
    .execute(&app.owner)
    .await
    .expect("effect");
}

/// Opens a dead-effect quarantine item about `id`, decided `discard` `decided` ago if given.
async fn add_item(app: &TestApp, id: &str, decided: Option<Duration>) {
    sqlx::query(
        "insert into part_outbox.inbox_quarantine
             (source, item_key, effect_id, payload_sha256, payload_ref, reason_code,
              decision, decided_by, decided_at)
         select 'dead-effect', 'dead-effect:' || $1, $1, repeat('a', 64), 'message_outbox:' || $1,
                'http-404', case when $2::float8 is not null then 'discard' end,
                case when $2::float8 is not null then 'oncall' end,
                now() - make_interval(secs => $2::float8)",
    )
    .bind(id)
    .bind(decided.map(|d| d.as_secs_f64()))
    .execute(&app.owner)
    .await
    .expect("item");
}

async fn outbox_partitions(app: &TestApp) -> Vec<String> {
    sqlx::query_scalar(
        "select c.relname::text from pg_inherits h join pg_class c on c.oid = h.inhrelid
         where h.inhparent = 'part_outbox.message_outbox'::regclass order by 1",
    )
    .fetch_all(&app.owner)
    .await
    .expect("partitions")
}

/// A two-day window.
fn policy() -> RetentionPolicy {
    RetentionPolicy::builder()
        .retry_horizon(DAY)
        .safety_margin(DAY)
        .build()
        .unwrap()
}

/// A purger of the partitioned schema's outbox with a two-day window.
fn purger(app: &TestApp) -> Purger {
    Purger::builder(app.pool.clone())
        .schema(schema())
        .outbox(policy())
        .build()
        .unwrap()
}

#[tokio::test]
async fn the_purge_drops_old_partitions_and_keeps_pending_dead_and_recent_effects() {
    let app = partitioned_app().await;
    PartitionPlan::default()
        .create_since(
            &app.pool,
            &schema(),
            Some(OffsetDateTime::now_utc() - time::Duration::days(20)),
        )
        .await
        .expect("past partitions");
    let before = outbox_partitions(&app).await;
    assert!(before.len() >= 23, "{before:?}");
    let (old, minute) = (10 * DAY, Duration::from_secs(60));
    add_effect(&app, "delivered-old", old, "delivered", old).await;
    add_effect(&app, "discarded-old", old, "dead", old).await;
    add_item(&app, "discarded-old", Some(old)).await;
    add_effect(&app, "pending-old", old, "pending", old).await;
    add_effect(&app, "dead-open", old, "dead", old).await;
    add_item(&app, "dead-open", None).await;
    add_effect(&app, "delivered-late", old, "delivered", minute).await;
    add_effect(&app, "delivered-now", minute, "delivered", minute).await;
    // Discarded long ago but reopened since: the open item keeps it.
    add_effect(&app, "discarded-reopened", old, "dead", old).await;
    add_item(&app, "discarded-reopened", Some(old)).await;
    add_item(&app, "discarded-reopened", None).await;
    // Discarded within the window: kept until the discard is past it.
    add_effect(&app, "discarded-recently", old, "dead", old).await;
    add_item(&app, "discarded-recently", Some(minute)).await;
    let purger = purger(&app);
    let dry = purger.dry_run().await.expect("dry run");
    assert_eq!(dry.rows(PurgedTable::MessageOutbox), 2, "{dry}");
    assert_eq!(
        outbox_partitions(&app).await,
        before,
        "a dry run drops nothing"
    );

    let report = purger.purge().await.expect("purge");
    assert_eq!(report.rows(PurgedTable::MessageOutbox), 2, "{report}");
    let after = outbox_partitions(&app).await;
    assert!(after.len() < before.len() - 15, "{after:?}");
    assert!(after.contains(&"message_outbox_default".to_owned()));
    let kept: Vec<(String, String)> = sqlx::query_as(
        "select effect_id, tableoid::regclass::text from part_outbox.message_outbox
         order by effect_id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let ids: Vec<&str> = kept.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        ids,
        [
            "dead-open",
            "delivered-late",
            "delivered-now",
            "discarded-recently",
            "discarded-reopened",
            "pending-old"
        ],
        "{kept:?}"
    );
    for (id, home) in &kept {
        assert_eq!(
            home.ends_with("message_outbox_default"),
            *id != "delivered-now",
            "{kept:?}"
        );
    }
    // A kept pending effect is still due and delivered: the dispatcher finds it there.
    let (url, calls) = counting_receiver(Vec::new()).await;
    sqlx::query("update part_outbox.message_outbox set destination = $1")
        .bind(&url)
        .execute(&app.owner)
        .await
        .unwrap();
    let dispatcher = Dispatcher::builder(
        app.pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .schema(schema())
    .build()
    .unwrap();
    let report = dispatcher.dispatch_due().await.expect("dispatch");
    assert_eq!(report.delivered, 1, "{report:?}");
    assert_eq!(calls.lock().unwrap().get("pending-old"), Some(&1));

    // Delivered long ago, a row of the default partition goes in the batched purge; the
    // open item's dead effect stays.
    sqlx::query(
        "update part_outbox.message_outbox set delivered_at = now() - interval '10 days'
         where effect_id = 'delivered-late'",
    )
    .execute(&app.owner)
    .await
    .unwrap();
    let report = purger.purge().await.expect("purge");
    assert_eq!(report.rows(PurgedTable::MessageOutbox), 1, "{report}");
    assert_eq!(rows_of(&app.pool, "delivered-late").await, 0);
    assert_eq!(rows_of(&app.pool, "dead-open").await, 1);
}

#[tokio::test]
async fn partitions_are_created_ahead_and_an_enqueue_without_one_lands_in_the_default() {
    let app = TestApp::new().await;
    migrate_schema(&app.owner, &schema())
        .await
        .expect("migrate");
    grant(&app, app.role.name(), Access::ServiceAndPurge).await;
    assert_eq!(outbox_partitions(&app).await, ["message_outbox_default"]);
    let outbox = outbox(&app.pool);
    let early = outbox
        .enqueue_with_id(&app.pool, EffectId::new("early"), "hook", &message())
        .await
        .expect("enqueue");
    assert!(early.inserted);
    let plan = PartitionPlan::new(Duration::from_secs(3600), 3).unwrap();
    assert_eq!(plan.create(&app.pool, &schema()).await.unwrap(), 8);
    assert_eq!(outbox_partitions(&app).await.len(), 5);
    let home: String = sqlx::query_scalar(
        "select tableoid::regclass::text from part_outbox.message_outbox
         where effect_id = 'early'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(home.contains("message_outbox_p"), "{home}");
    // Moved, it still stops a duplicate.
    let again = outbox
        .enqueue_with_id(&app.pool, EffectId::new("early"), "hook", &message())
        .await
        .expect("duplicate");
    assert!(!again.inserted);
    // An outbox purger creates them too, with its plan.
    Purger::builder(app.pool.clone())
        .schema(schema())
        .outbox(policy())
        .partitions(PartitionPlan::new(Duration::from_secs(3600), 6).unwrap())
        .build()
        .unwrap()
        .purge()
        .await
        .expect("purge");
    assert_eq!(outbox_partitions(&app).await.len(), 8);
}

#[tokio::test]
async fn the_service_role_without_purge_grants_cannot_manage_outbox_partitions() {
    let app = partitioned_app().await;
    let role = app.db.login_role().await.expect("role");
    grant(&app, role.name(), Access::Service).await;
    let service = role.pool(2);
    // It enqueues...
    let enqueued = outbox(&service)
        .enqueue_with_id(&service, EffectId::new("e"), "hook", &message())
        .await
        .expect("enqueue");
    assert!(enqueued.inserted);
    // ...but neither creates, lists nor drops partitions.
    let err = PartitionPlan::default()
        .create(&service, &schema())
        .await
        .expect_err("no EXECUTE");
    assert!(err.to_string().contains("permission denied"), "{err}");
    for statement in [
        "select * from part_outbox.outbox_drop_partition('message_outbox_default', now())",
        "select * from part_outbox.outbox_partitions()",
        "select part_outbox.outbox_create_partitions('1 day', now(), 1)",
        "select part_outbox.create_partitions('message_outbox', 'created_at', 100, '1 day', now(), 1)",
    ] {
        let err = sqlx::query(statement)
            .execute(&service)
            .await
            .expect_err("no EXECUTE");
        assert!(err.to_string().contains("permission denied"), "{statement}: {err}");
    }
    let purge = Purger::builder(service.clone())
        .schema(schema())
        .outbox(policy())
        .build()
        .unwrap()
        .purge()
        .await;
    assert!(purge.is_err(), "the purge needs the purge grants");
}

#[tokio::test]
async fn the_partitioned_migration_refuses_an_outbox_with_rows() {
    let app = TestApp::new().await;
    let plain = Schema::new("part_outbox").unwrap();
    migrate_schema(&app.owner, &plain).await.expect("plain");
    tower_inbox::outbox::Outbox::new(app.owner.clone())
        .with_schema(plain)
        .enqueue_with_id(&app.owner, EffectId::new("e"), "hook", &message())
        .await
        .expect("enqueue");
    let err = migrate_schema(&app.owner, &schema())
        .await
        .expect_err("refused");
    assert!(
        err.to_string()
            .contains("the partitioned layout is for an empty outbox"),
        "{err}"
    );
    assert_eq!(rows_of(&app.owner, "e").await, 1, "the rows are kept");
}

/// An enqueue in flight while a plain schema is converted: the migration waits for it,
/// then finds its row and refuses, rather than dropping the old table with the row in it.
#[tokio::test]
async fn an_enqueue_in_flight_during_the_conversion_is_refused_not_dropped() {
    let app = TestApp::new().await;
    let plain = Schema::new("part_outbox").unwrap();
    migrate_schema(&app.owner, &plain).await.expect("plain");
    let mut writer = app.owner.begin().await.unwrap();
    tower_inbox::outbox::Outbox::new(app.owner.clone())
        .with_schema(plain)
        .enqueue_with_id(&mut *writer, EffectId::new("e"), "hook", &message())
        .await
        .expect("enqueue");
    let schema = schema();
    let (migrated, ()) = tokio::join!(migrate_schema(&app.owner, &schema), async {
        // The migration waits for the enqueue's transaction before it reads the table.
        wait_until_a_lock_is_awaited(&app.owner).await;
        writer.commit().await.unwrap();
    });
    let err = migrated.expect_err("an outbox with a row is refused");
    assert!(
        err.to_string()
            .contains("the partitioned layout is for an empty outbox"),
        "{err}"
    );
    assert_eq!(rows_of(&app.owner, "e").await, 1, "the row is kept");
}

/// Expected inputs on the partitioned outbox (duplicate enqueues, one of them waiting for
/// the original's lock, the purge's creations and drops) leave no error or warning in the
/// server log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expected_inputs_leave_the_server_log_quiet() {
    let cluster = common::logging_cluster().await;
    let app = TestApp::on(cluster.database().await.expect("database"), 10).await;
    migrate_schema(&app.owner, &schema())
        .await
        .expect("migrate");
    grant(&app, app.role.name(), Access::ServiceAndPurge).await;
    PartitionPlan::default()
        .create_since(
            &app.pool,
            &schema(),
            Some(OffsetDateTime::now_utc() - time::Duration::days(5)),
        )
        .await
        .expect("partitions");
    add_effect(&app, "old", 4 * DAY, "delivered", 4 * DAY).await;
    add_effect(&app, "kept", 4 * DAY, "pending", 4 * DAY).await;
    let mark = cluster.log_mark().expect("log mark");

    let outbox = outbox(&app.pool);
    let mut first = app.pool.begin().await.unwrap();
    outbox
        .enqueue_with_id(&mut *first, EffectId::new("e"), "hook", &message())
        .await
        .expect("enqueue");
    let waiting = {
        let outbox = outbox.clone();
        let pool = app.pool.clone();
        tokio::spawn(async move {
            outbox
                .enqueue_with_id(&pool, EffectId::new("e"), "hook", &message())
                .await
        })
    };
    wait_until_a_lock_is_awaited(&app.owner).await;
    first.commit().await.unwrap();
    assert!(!waiting.await.unwrap().expect("duplicate").inserted);
    let report = purger(&app).purge().await.expect("purge");
    assert_eq!(report.rows(PurgedTable::MessageOutbox), 1, "{report}");
    assert_eq!(rows_of(&app.pool, "kept").await, 1);

    common::assert_log_quiet(&cluster, mark);
}
