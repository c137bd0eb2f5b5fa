//! The partitioned layout (`Layout::Partitioned`): the protocol on a partitioned inbox, the
//! race its claim must win, the purge dropping whole partitions, the partitions created
//! ahead, the layout and isolation checks, and the service role's grants.
//! (Over 400 lines: one test per rule of the layout and per error path, over shared helpers.)

mod common;

use std::time::Duration;

use http::StatusCode;
use sqlx::{Connection, PgConnection, PgPool};
use time::OffsetDateTime;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{
    Claim, ClaimedMessage, Inbox, InboxError, IsolationLevel, RecordedResponse,
};
use tower_inbox::middleware::ConfigError;
use tower_inbox::partition::{LayoutError, PartitionPlan};
use tower_inbox::retention::{PurgedTable, Purger, PurgerBuilder, RetentionPolicy};
use tower_inbox::schema::{migrate_schema, Access, Layout, Schema};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

use common::{credit, gated_router, send, spawn_send, wait_until_a_lock_is_awaited, TestApp};

const DAY: Duration = Duration::from_secs(24 * 3600);

fn schema() -> Schema {
    Schema::new("part_inbox")
        .expect("schema name")
        .with_layout(Layout::Partitioned)
}

/// A test app with a partitioned inbox in `part_inbox` beside the plain default one,
/// migrated by the owner, with today's partitions and the service role's grants for it.
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

fn identity(key: &str) -> MessageIdentity {
    MessageIdentity::new(
        "part",
        Producer::new("app").expect("producer"),
        MessageKey::new(key).expect("key"),
    )
}

/// Claims `key` with payload `body`, which must be free.
async fn claimed(inbox: &Inbox, key: &str, body: &[u8]) -> ClaimedMessage {
    match inbox
        .claim(
            identity(key),
            Fingerprint::of_bytes(body),
            "v1",
            Duration::ZERO,
        )
        .await
        .expect("claim")
    {
        Claim::Claimed(message) => message,
        other => panic!("{key} was not free: {other:?}"),
    }
}

/// The error a claim of `k` through `inbox` fails with.
async fn refused(inbox: Inbox) -> InboxError {
    inbox
        .claim(
            identity("k"),
            Fingerprint::of_bytes(b"x"),
            "v1",
            Duration::ZERO,
        )
        .await
        .expect_err("refused")
}

/// Runs the grants `access` needs in the partitioned schema for `role`, as the owner.
async fn grant(app: &TestApp, role: &str, access: Access) {
    common::grant_in(&app.owner, &schema(), role, access).await;
}

fn response() -> RecordedResponse {
    RecordedResponse {
        status: 201,
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"{}"),
    }
}

async fn rows_of(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("select count(*) from part_inbox.consumer_inbox where message_id = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test]
async fn first_seen_duplicate_conflict_and_in_flight() {
    let app = partitioned_app().await;
    let (router, gate, calls) = gated_router(&app, |b| b.schema(schema()));
    // In flight: a duplicate waits, then is answered "in progress".
    let started = gate.started.notified();
    let original = spawn_send(&router, credit("a1", Some("k1"), Some("app"), 1));
    started.await;
    let busy = send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
    assert_eq!(busy.problem_type(), "in-progress");
    gate.release.notify_one();
    let first = original.await.expect("original");
    assert_eq!(first.status, StatusCode::CREATED);
    // Finished: a duplicate gets the recorded response; another payload is a conflict.
    let replay = send(&router, credit("a1", Some("k1"), Some("app"), 1)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    let conflict = send(&router, credit("a1", Some("k1"), Some("app"), 2)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch", "{conflict:?}");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(rows_of(&app.pool, "k1").await, 1);
    assert_eq!(app.balance("a1").await, Some(1));
}

#[tokio::test]
async fn the_claim_at_commit_claims_once_and_replays() {
    let app = partitioned_app().await;
    let (router, gate, calls) = gated_router(&app, |b| {
        b.schema(schema())
            .claim_mode(tower_inbox::inbox::ClaimMode::AtCommit)
    });
    let started = gate.started.notified();
    let original = spawn_send(&router, credit("a2", Some("k2"), Some("app"), 1));
    started.await;
    gate.release.notify_one();
    let first = original.await.expect("original");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = send(&router, credit("a2", Some("k2"), Some("app"), 1)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(rows_of(&app.pool, "k2").await, 1);
    assert_eq!(app.balance("a2").await, Some(1));
}

#[tokio::test]
async fn a_duplicate_claimed_after_the_original_committed_is_a_duplicate() {
    let app = partitioned_app().await;
    let inbox = Inbox::new(app.pool.clone()).with_schema(schema());
    let fp = Fingerprint::of_bytes(b"one");
    let original = claimed(&inbox, "k", b"one").await;
    let busy = inbox
        .claim(identity("k"), fp, "v1", Duration::ZERO)
        .await
        .expect("duplicate");
    assert!(matches!(busy, Claim::InProgress), "{busy:?}");
    original.commit(Some(&response())).await.expect("commit");
    let again = inbox
        .claim(identity("k"), fp, "v1", Duration::ZERO)
        .await
        .expect("duplicate");
    assert!(matches!(again, Claim::Duplicate(_)), "{again:?}");
    let other = inbox
        .claim(
            identity("k"),
            Fingerprint::of_bytes(b"two"),
            "v1",
            Duration::ZERO,
        )
        .await
        .expect("conflict");
    assert!(matches!(other, Claim::Conflict(_)), "{other:?}");
    assert_eq!(rows_of(&app.pool, "k").await, 1);
}

/// The claim statement `inbox` sends, read from its connection's prepared statements (its
/// pool has one connection, idle now), so the test runs the very statement the crate sends.
async fn claim_statement(pool: &PgPool) -> String {
    sqlx::query_scalar(
        "select statement from pg_prepared_statements
         where statement like 'insert into %consumer_inbox %'
           and statement not like '%pg_prepared_statements%'",
    )
    .fetch_one(pool)
    .await
    .expect("the claim's prepared statement")
}

/// The claim lock the service role's open transaction holds.
async fn held_lock(app: &TestApp) -> (i32, i32) {
    let (k1, k2): (i64, i64) = sqlx::query_as(
        "select l.classid::int8, l.objid::int8
         from pg_stat_activity a join pg_locks l on l.pid = a.pid
         where a.usename = $1 and l.locktype = 'advisory' and l.objsubid = 2 and l.granted",
    )
    .bind(app.role.name())
    .fetch_one(&app.owner)
    .await
    .expect("the claim's lock");
    (k1 as u32 as i32, k2 as u32 as i32)
}

/// The partitioned claim's check must read with a snapshot taken after its lock was
/// granted: a duplicate that asked for the lock while the original was in flight, and got
/// it once the original committed, must see the original's row. The crate takes the lock in
/// a statement of its own before the claim; here that statement is made a waiting one (so
/// that the duplicate is held until the original commits), then the crate's claim statement
/// runs and must insert nothing. Sent as one statement, with the lock taken inside the
/// claim (a snapshot older than the lock), the same claim inserts a second row: what the
/// test would catch.
#[tokio::test]
async fn the_partitioned_claim_sees_a_row_committed_while_it_waited_for_the_lock() {
    let app = partitioned_app().await;
    let single = app.pool_with(1, &[]);
    let inbox = Inbox::new(single).with_schema(schema());
    let warm_up = claimed(&inbox, "warm-up", b"one").await;
    warm_up.rollback().await.expect("rollback");
    let claim = claim_statement(inbox.pool()).await;
    // The crate took the lock in a statement of its own before that claim.
    let lock_first: bool = sqlx::query_scalar(
        "select exists (select from pg_prepared_statements
                        where statement = 'select pg_catalog.pg_try_advisory_xact_lock($1, $2)')",
    )
    .fetch_one(inbox.pool())
    .await
    .unwrap();
    assert!(lock_first, "no lock statement before the partitioned claim");
    let try_lock = "pg_catalog.pg_try_advisory_xact_lock($7, $8)";
    assert!(claim.contains(try_lock), "{claim}");
    // The same condition, waiting for the lock inside the claim's own statement.
    let waiting_lock = "(select true from pg_catalog.pg_advisory_xact_lock($7, $8))";

    // Whether the duplicate's claim inserted a row. `lock_inside`: the waiting lock is the
    // claim's own, in its statement; otherwise a statement of its own, before the claim.
    let race = |key: &'static str, lock_inside: bool| {
        let (app, inbox, claim) = (&app, &inbox, claim.clone());
        async move {
            let original = claimed(inbox, key, b"one").await;
            let (k1, k2) = held_lock(app).await;
            let mut conn = PgConnection::connect_with(&app.role.connect_options())
                .await
                .expect("connect");
            let duplicate = tokio::spawn(async move {
                sqlx::query("begin").execute(&mut conn).await.unwrap();
                let statement = if lock_inside {
                    claim.replace(try_lock, waiting_lock)
                } else {
                    sqlx::query("select pg_catalog.pg_advisory_xact_lock($1, $2)")
                        .bind(k1)
                        .bind(k2)
                        .execute(&mut conn)
                        .await
                        .expect("the lock");
                    claim
                };
                let row = sqlx::query(&statement)
                    .bind(b"part".as_slice())
                    .bind(b"app".as_slice())
                    .bind(b"".as_slice())
                    .bind(key)
                    .bind(Fingerprint::of_bytes(b"one").to_hex())
                    .bind(b"v1".as_slice())
                    .bind(k1)
                    .bind(k2)
                    .fetch_optional(&mut conn)
                    .await
                    .expect("the duplicate's claim");
                sqlx::query("commit").execute(&mut conn).await.unwrap();
                row.is_some()
            });
            wait_until_a_lock_is_awaited(&app.owner).await;
            original.commit(Some(&response())).await.expect("commit");
            duplicate.await.expect("duplicate task")
        }
    };
    assert!(
        !race("fresh", false).await,
        "the partitioned claim inserted a second row for a committed key"
    );
    assert_eq!(rows_of(&app.pool, "fresh").await, 1);
    assert!(
        race("stale", true).await,
        "a claim whose snapshot predates its lock was expected to miss the commit"
    );
    assert_eq!(rows_of(&app.pool, "stale").await, 2);
}

/// The partitioned claim is correct under `READ COMMITTED` only, so the default level is named
/// there: a database whose default is stricter does not change it.
#[tokio::test]
async fn the_default_level_is_read_committed_named() {
    let app = partitioned_app().await;
    app.set_for_new_sessions("default_transaction_isolation", "'serializable'")
        .await;
    let inbox = Inbox::new(app.pool_with(2, &[])).with_schema(schema());
    assert_eq!(inbox.isolation(), IsolationLevel::DatabaseDefault);
    let mut message = claimed(&inbox, "level", b"x").await;
    let level: String = message
        .with_connection(async |conn| {
            sqlx::query_scalar("show transaction_isolation")
                .fetch_one(conn)
                .await
        })
        .await
        .expect("level");
    assert_eq!(level, "read committed");
    message.commit(Some(&response())).await.expect("commit");
    assert_eq!(rows_of(&app.pool, "level").await, 1);
}

#[tokio::test]
async fn repeatable_read_and_serializable_are_refused() {
    let app = partitioned_app().await;
    for level in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable] {
        let built = tower_inbox::InboxLayer::builder(app.pool.clone(), "part")
            .producer(tower_inbox::producer::TrustedHeader::new("x-producer"))
            .schema(schema())
            .isolation_level(level)
            .build();
        assert!(
            matches!(
                built,
                Err(ConfigError::Layout(LayoutError::Isolation { .. }))
            ),
            "{level:?}"
        );
        let consumer = tower_inbox::consumer::Consumer::builder(app.pool.clone(), "part")
            .schema(schema())
            .isolation_level(level)
            .build();
        assert!(consumer.is_err(), "{level:?}");
        let claim = Inbox::new(app.pool.clone())
            .with_schema(schema())
            .with_isolation(level)
            .claim(
                identity("k"),
                Fingerprint::of_bytes(b"x"),
                "v1",
                Duration::ZERO,
            )
            .await;
        let err = claim.expect_err("refused");
        assert!(matches!(err, InboxError::Layout(_)), "{err}");
        assert!(err.to_string().contains("part_inbox"), "{err}");
    }
    assert_eq!(rows_of(&app.pool, "k").await, 0);
}

#[tokio::test]
async fn a_layout_other_than_the_databases_is_refused_at_the_first_claim() {
    let app = partitioned_app().await;
    // Partitioned in the database, plain in the settings (and the reverse).
    let plain = Schema::new("part_inbox").unwrap();
    let err = refused(Inbox::new(app.pool.clone()).with_schema(plain)).await;
    let text = err.to_string();
    assert!(
        text.contains("part_inbox") && text.contains("partitioned in the database"),
        "{text}"
    );
    let err = refused(
        Inbox::new(app.pool.clone())
            .with_schema(Schema::default().with_layout(Layout::Partitioned)),
    )
    .await;
    assert!(err.to_string().contains("plain in the database"), "{err}");
    let missing = Schema::new("nowhere").unwrap();
    let err = refused(Inbox::new(app.pool.clone()).with_schema(missing)).await;
    assert!(err.to_string().contains("missing in the database"), "{err}");
    // The plain migrator refuses the partitioned schema.
    assert!(
        migrate_schema(&app.owner, &Schema::new("part_inbox").unwrap())
            .await
            .is_err()
    );
}

/// Adds processed rows received `age` ago to the partitioned inbox, as the owner.
async fn add_row(app: &TestApp, producer: &str, key: &str, age: Duration) {
    sqlx::query(
        "insert into part_inbox.consumer_inbox
             (consumer_name, producer_name, message_id, payload_sha256, handler_version,
              received_at, processed_at, response_status)
         select 'part', $1, $2, repeat('a', 64), 'v1', t, t, 201
         from (select now() - make_interval(secs => $3)) r(t)",
    )
    .bind(producer)
    .bind(key)
    .bind(age.as_secs_f64())
    .execute(&app.owner)
    .await
    .expect("row");
}

/// Creates the default plan's partitions from `days` days ago on.
async fn partitions_since(app: &TestApp, days: i64) {
    PartitionPlan::default()
        .create_since(
            &app.pool,
            &schema(),
            Some(OffsetDateTime::now_utc() - time::Duration::days(days)),
        )
        .await
        .expect("past partitions");
}

async fn partitions(app: &TestApp) -> Vec<String> {
    sqlx::query_scalar(
        "select c.relname::text from pg_inherits h join pg_class c on c.oid = h.inhrelid
         where h.inhparent = 'part_inbox.consumer_inbox'::regclass order by 1",
    )
    .fetch_all(&app.owner)
    .await
    .expect("partitions")
}

#[tokio::test]
async fn the_purge_drops_old_partitions_and_keeps_what_must_be_kept() {
    let app = partitioned_app().await;
    partitions_since(&app, 20).await;
    let before = partitions(&app).await;
    assert!(before.len() >= 23, "{before:?}");
    add_row(&app, "app", "old", 10 * DAY).await;
    add_row(&app, "migration:m1", "step", 10 * DAY).await;
    add_row(&app, "app", "quarantined", 10 * DAY).await;
    add_row(&app, "app", "recent", Duration::from_secs(60)).await;
    sqlx::query(
        "insert into part_inbox.inbox_quarantine
             (source, item_key, consumer_name, producer_name, tenant_id, message_id,
              payload_sha256, payload_ref, reason_code)
         values ('identity-conflict', 'k', 'part', 'app', '', 'quarantined', repeat('b', 64),
                 'sha256:b', 'conflict')",
    )
    .execute(&app.owner)
    .await
    .expect("open item");
    let purger = purger(&app, |b| b);
    let dry = purger.dry_run().await.expect("dry run");
    assert_eq!(dry.rows(PurgedTable::ConsumerInbox), 1, "{dry}");
    assert_eq!(partitions(&app).await, before, "a dry run dropped nothing");

    let report = purger.purge().await.expect("purge");
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1, "{report}");
    let after = partitions(&app).await;
    // Every partition whose range ended two days ago or earlier is gone; today's is there.
    assert!(after.len() < before.len() - 15, "{after:?}");
    assert!(after.contains(&"consumer_inbox_default".to_owned()));
    let kept: Vec<(String, String)> = sqlx::query_as(
        "select message_id, tableoid::regclass::text from part_inbox.consumer_inbox
         order by message_id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let keys: Vec<&str> = kept.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["quarantined", "recent", "step"], "{kept:?}");
    assert!(kept[0].1.ends_with("consumer_inbox_default"), "{kept:?}");
    assert!(kept[2].1.ends_with("consumer_inbox_default"), "{kept:?}");

    // Decided, the item no longer keeps its row: the default partition's batched purge
    // takes it.
    sqlx::query("update part_inbox.inbox_quarantine set decision = 'discard', decided_at = now()")
        .execute(&app.owner)
        .await
        .unwrap();
    let report = purger.purge().await.expect("purge");
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1, "{report}");
    assert_eq!(rows_of(&app.pool, "quarantined").await, 0);
    assert_eq!(rows_of(&app.pool, "step").await, 1);
}

#[tokio::test]
async fn partitions_are_created_ahead_and_claims_without_one_land_in_the_default() {
    let app = TestApp::new().await;
    migrate_schema(&app.owner, &schema())
        .await
        .expect("migrate");
    grant(&app, app.role.name(), Access::ServiceAndPurge).await;
    assert_eq!(partitions(&app).await, ["consumer_inbox_default"]);
    // No partition yet: the claim lands in the default partition.
    let inbox = Inbox::new(app.pool.clone()).with_schema(schema());
    let message = claimed(&inbox, "early", b"x").await;
    message.commit(Some(&response())).await.unwrap();
    let plan = PartitionPlan::new(Duration::from_secs(3600), 3).unwrap();
    // Four of the inbox's and four of the outbox's.
    assert_eq!(plan.create(&app.pool, &schema()).await.unwrap(), 8);
    assert_eq!(plan.create(&app.pool, &schema()).await.unwrap(), 0);
    assert_eq!(partitions(&app).await.len(), 5);
    // The early row moved into the partition created for its time.
    let home: String = sqlx::query_scalar(
        "select tableoid::regclass::text from part_inbox.consumer_inbox where message_id = 'early'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(home.contains("consumer_inbox_p"), "{home}");
    // A duplicate still finds it.
    let again = inbox
        .claim(
            identity("early"),
            Fingerprint::of_bytes(b"x"),
            "v1",
            Duration::ZERO,
        )
        .await
        .unwrap();
    assert!(matches!(again, Claim::Duplicate(_)), "{again:?}");
    // The purger creates them too, with its plan.
    let hourly = purger(&app, |b| {
        b.partitions(PartitionPlan::new(Duration::from_secs(3600), 6).unwrap())
    });
    hourly.purge().await.expect("purge");
    assert_eq!(partitions(&app).await.len(), 8);
    // Created elsewhere (pg_partman): the purger creates none.
    let elsewhere = purger(&app, |b| {
        b.partitions(PartitionPlan::new(Duration::from_secs(3600), 20).unwrap())
            .partitions_created_elsewhere()
    });
    elsewhere.purge().await.expect("purge");
    assert_eq!(partitions(&app).await.len(), 8);
    assert!(PartitionPlan::new(Duration::from_secs(90), 1).is_err());
}

#[tokio::test]
async fn the_service_role_without_purge_grants_cannot_manage_partitions() {
    let app = partitioned_app().await;
    let role = app.db.login_role().await.expect("role");
    grant(&app, role.name(), Access::Service).await;
    let service = role.pool(2);
    // It claims and records...
    let inbox = Inbox::new(service.clone()).with_schema(schema());
    let message = claimed(&inbox, "k", b"x").await;
    message.commit(Some(&response())).await.expect("commit");
    // ...but neither creates nor drops partitions.
    let err = PartitionPlan::default()
        .create(&service, &schema())
        .await
        .expect_err("no EXECUTE");
    assert!(err.to_string().contains("permission denied"), "{err}");
    let dropped = sqlx::query(
        "select * from part_inbox.inbox_drop_partition('consumer_inbox_default', now())",
    )
    .execute(&service)
    .await
    .expect_err("no EXECUTE");
    assert!(
        dropped.to_string().contains("permission denied"),
        "{dropped}"
    );
}

#[tokio::test]
async fn the_stats_count_the_partitions_bytes_and_rows() {
    let app = partitioned_app().await;
    let inbox = Inbox::new(app.pool.clone()).with_schema(schema());
    for key in ["s1", "s2"] {
        claimed(&inbox, key, b"x")
            .await
            .commit(Some(&response()))
            .await
            .expect("commit");
    }
    let stats = tower_inbox::metrics::StatsTask::new(app.pool.clone())
        .with_schema(schema())
        .collect()
        .await
        .expect("stats");
    let bytes: i64 = sqlx::query_scalar(
        "select sum(pg_total_relation_size(relid))::int8
         from pg_partition_tree('part_inbox.consumer_inbox') where isleaf",
    )
    .fetch_one(&app.owner)
    .await
    .unwrap();
    assert!(bytes > 0);
    assert_eq!(stats.inbox_table_bytes, bytes);
    let rows: i64 = stats.inbox.iter().map(|c| c.rows).sum();
    assert_eq!(rows, 2, "{:?}", stats.inbox);
}

/// A purger of the partitioned schema with a one-day window, and `configure`d.
fn purger(app: &TestApp, configure: impl FnOnce(PurgerBuilder) -> PurgerBuilder) -> Purger {
    let policy = RetentionPolicy::builder()
        .retry_horizon(DAY)
        .safety_margin(DAY)
        .build()
        .unwrap();
    configure(
        Purger::builder(app.pool.clone())
            .schema(schema())
            .inbox(policy),
    )
    .build()
    .unwrap()
}

#[tokio::test]
async fn a_drop_gives_up_on_the_table_lock_a_claim_in_flight_holds() {
    let app = partitioned_app().await;
    partitions_since(&app, 5).await;
    add_row(&app, "app", "old", 4 * DAY).await;
    let before = partitions(&app).await;
    // A claim in flight holds the inbox (a row lock on the parent table) until it ends: the
    // detach waits for it, and gives up past the purge's lock timeout.
    let inbox = Inbox::new(app.pool.clone()).with_schema(schema());
    let in_flight = claimed(&inbox, "in-flight", b"x").await;
    let purger = purger(&app, |b| b.lock_timeout(Duration::from_millis(100)));
    // The bound only keeps a missing lock_timeout from hanging the suite.
    let result = tokio::time::timeout(Duration::from_secs(60), purger.purge())
        .await
        .expect("the purge gives up instead of waiting");
    common::assert_inbox_purge_gave_up_on_a_lock(result);
    assert_eq!(partitions(&app).await, before, "nothing dropped");
    in_flight.commit(Some(&response())).await.expect("commit");
    let report = purger.purge().await.expect("purge");
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1, "{report}");
    assert_eq!(rows_of(&app.pool, "old").await, 0);
    assert_eq!(rows_of(&app.pool, "in-flight").await, 1);
}

#[tokio::test]
async fn the_partitioned_migration_refuses_an_inbox_with_rows() {
    let app = TestApp::new().await;
    let plain = Schema::new("part_inbox").unwrap();
    migrate_schema(&app.owner, &plain).await.expect("plain");
    sqlx::query(
        "insert into part_inbox.consumer_inbox
             (consumer_name, producer_name, message_id, payload_sha256, handler_version)
         values ('c', 'p', 'm', repeat('a', 64), 'v')",
    )
    .execute(&app.owner)
    .await
    .unwrap();
    let err = migrate_schema(&app.owner, &schema())
        .await
        .expect_err("refused");
    assert!(
        err.to_string()
            .contains("the partitioned layout is for an empty inbox"),
        "{err}"
    );
    assert_eq!(rows_of(&app.owner, "m").await, 1, "the rows are kept");
}

#[tokio::test]
async fn too_many_partitions_at_once_are_refused() {
    let app = partitioned_app().await;
    let before = partitions(&app).await;
    let err = PartitionPlan::new(Duration::from_secs(60), 0)
        .unwrap()
        .create_since(
            &app.pool,
            &schema(),
            Some(OffsetDateTime::now_utc() - time::Duration::days(30)),
        )
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("at most 10000 at once"), "{err}");
    assert_eq!(partitions(&app).await, before);
}

/// Expected inputs on the partitioned layout (first seen, duplicates, a conflict, a storm of
/// one key, the purge's creations and drops) leave no error or warning in the server log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expected_inputs_leave_the_server_log_quiet() {
    let cluster = common::logging_cluster().await;
    let app = TestApp::on(cluster.database().await.expect("database"), 10).await;
    migrate_schema(&app.owner, &schema())
        .await
        .expect("migrate");
    grant(&app, app.role.name(), Access::ServiceAndPurge).await;
    partitions_since(&app, 5).await;
    add_row(&app, "app", "old", 4 * DAY).await;
    add_row(&app, "migration:m", "kept", 4 * DAY).await;
    let router = app.credits_with(|b| b.schema(schema()));
    let mark = cluster.log_mark().expect("log mark");

    let first = send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let again = send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    assert!(again.replayed(), "{again:?}");
    let conflict = send(&router, credit("a1", Some("k"), Some("app"), 11)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    let storm = (0..40).map(|_| send(&router, credit("a2", Some("storm"), Some("app"), 3)));
    let replies = futures_util::future::join_all(storm).await;
    let created = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
        .count();
    assert_eq!(created, 1, "one of the storm's copies is applied");
    let report = purger(&app, |b| b).purge().await.expect("purge");
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1, "{report}");
    assert_eq!(app.balance("a2").await, Some(3));

    common::assert_log_quiet(&cluster, mark);
}

/// The guard works on the partitioned layout: once the purge dropped a message's partition, a
/// redrive of it produced before the window is refused and quarantined, not applied again;
/// one inside the window is a duplicate.
#[tokio::test]
async fn the_guard_refuses_a_message_whose_partition_was_dropped() {
    use tower_inbox::retention::{GuardedClaim, RetentionGuard};
    let app = partitioned_app().await;
    partitions_since(&app, 5).await;
    add_row(&app, "app", "forgotten", 4 * DAY).await;
    let inbox = Inbox::new(app.pool.clone()).with_schema(schema());
    claimed(&inbox, "remembered", b"x")
        .await
        .commit(Some(&response()))
        .await
        .expect("commit");
    let report = purger(&app, |b| b).purge().await.expect("purge");
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1, "{report}");
    let policy = RetentionPolicy::builder()
        .retry_horizon(DAY)
        .safety_margin(DAY)
        .build()
        .unwrap();
    let guard = RetentionGuard::new(inbox.clone(), &policy);
    let claim = |key: &'static str, age: Duration| {
        guard.claim(
            identity(key),
            Fingerprint::of_bytes(b"x"),
            "v1",
            Duration::ZERO,
            OffsetDateTime::now_utc() - age,
        )
    };
    let refused = claim("forgotten", 4 * DAY).await.expect("guard");
    assert!(matches!(refused, GuardedClaim::Expired(_)), "{refused:?}");
    assert_eq!(rows_of(&app.pool, "forgotten").await, 0, "not claimed");
    let duplicate = claim("remembered", Duration::from_secs(60))
        .await
        .expect("guard");
    assert!(
        matches!(duplicate, GuardedClaim::Claim(Claim::Duplicate(_))),
        "{duplicate:?}"
    );
}
