//! pg_partman (4.x, native partitioning) creating the partitions of a partitioned-layout
//! inbox and outbox, with the purge built `partitions_created_elsewhere`: the exact calls the
//! docs give (`docs/scaling.md`, "pg_partman"), claims and enqueues landing in pg_partman's
//! partitions, the purge dropping the expired ones and keeping what must be kept, the
//! command line leaving the partitions to pg_partman, and why pg_partman's own retention
//! must stay off. (Over 400 lines: one setup shared by the four tests, which read better
//! beside it than split across files.)
//!
//! Skipped, saying so, only when the server cannot install the extension (no `pg_partman`
//! among its available extensions: no files in `pg_config --sharedir`/extension; Debian:
//! `postgresql-<major>-partman`, which `.ci/run` installs) or has another major version of
//! it; under `.ci/run`, which sets `TOWER_INBOX_REQUIRE_PARTMAN` once the files are there,
//! either fails the test instead.

mod common;

use std::time::Duration;

use sqlx::PgPool;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{Claim, Inbox, RecordedResponse};
use tower_inbox::outbox::{EffectId, Outbox, OutboxMessage};
use tower_inbox::retention::{PurgedTable, Purger, RetentionPolicy};
use tower_inbox::schema::{grant_statements, migrate_schema, Access, Layout, Schema};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

use common::TestApp;

const DAY: Duration = Duration::from_secs(24 * 3600);

fn schema() -> Schema {
    Schema::new("pm_inbox")
        .expect("schema name")
        .with_layout(Layout::Partitioned)
}

/// The docs' setup, statement by statement, after `migrate_schema` of the partitioned
/// layout (the test adds `p_start_partition`, for partitions ten days back to put old rows
/// in). Our migration's default partition is dropped first: pg_partman 4.x creates
/// `consumer_inbox_default` itself and fails if it exists ("relation
/// consumer_inbox_default already exists"); the inbox is new, so it is empty.
const SETUP: &[&str] = &[
    "create schema partman",
    "create extension pg_partman schema partman",
    "drop table pm_inbox.consumer_inbox_default",
    // A template with the fill factor of our partitions (room for recording's HOT update):
    // pg_partman gives its storage parameters to every partition it creates, the default
    // one too.
    "create table partman.template_pm_inbox_consumer_inbox (like pm_inbox.consumer_inbox) \
         with (fillfactor = 80)",
    "select partman.create_parent('pm_inbox.consumer_inbox', 'received_at', 'native', 'daily', \
         p_premake := 2, p_template_table := 'partman.template_pm_inbox_consumer_inbox', \
         p_start_partition := (now() - interval '10 days')::text)",
    // Partitions ahead even through a quiet spell; no retention of pg_partman's own.
    "update partman.part_config set infinite_time_partitions = true, retention = null \
         where parent_table = 'pm_inbox.consumer_inbox'",
    "select partman.run_maintenance('pm_inbox.consumer_inbox')",
    // The outbox the same way, by created_at (its default partition is also pg_partman's).
    "drop table pm_inbox.message_outbox_default",
    "create table partman.template_pm_inbox_message_outbox (like pm_inbox.message_outbox)",
    "select partman.create_parent('pm_inbox.message_outbox', 'created_at', 'native', 'daily', \
         p_premake := 2, p_template_table := 'partman.template_pm_inbox_message_outbox', \
         p_start_partition := (now() - interval '10 days')::text)",
    "update partman.part_config set infinite_time_partitions = true, retention = null \
         where parent_table = 'pm_inbox.message_outbox'",
    "select partman.run_maintenance('pm_inbox.message_outbox')",
];

/// A test app with the partitioned inbox `pm_inbox` whose partitions pg_partman creates,
/// and the service role's grants (given after `create_parent`: its default partition is a
/// new table); `None`, having said why, when the server has no pg_partman to install.
async fn partman_app() -> Option<TestApp> {
    let app = TestApp::new().await;
    // The calls below are pg_partman 4.x's (5.x changed create_parent's arguments).
    let version: Option<String> = sqlx::query_scalar(
        "select default_version from pg_available_extensions where name = 'pg_partman'",
    )
    .fetch_optional(&app.owner)
    .await
    .expect("available extensions");
    let required = std::env::var_os("TOWER_INBOX_REQUIRE_PARTMAN").is_some();
    if let Some(other) = version.as_deref().filter(|v| !v.starts_with("4.")) {
        assert!(
            !required,
            "pg_partman {other} is installed; these tests and the docs are for 4.x"
        );
        eprintln!("SKIPPED: pg_partman {other} is installed; these tests are for 4.x");
        return None;
    }
    if version.is_none() {
        assert!(
            !required,
            "TOWER_INBOX_REQUIRE_PARTMAN is set but the server cannot install pg_partman"
        );
        let sharedir = std::process::Command::new("pg_config")
            .arg("--sharedir")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_else(|_| "(pg_config --sharedir)".to_owned());
        eprintln!(
            "SKIPPED: the PostgreSQL server cannot install pg_partman (no pg_partman files in \
             {sharedir}/extension); install postgresql-<major>-partman, as .ci/run does"
        );
        return None;
    }
    migrate_schema(&app.owner, &schema())
        .await
        .expect("partitioned migrations");
    for statement in SETUP {
        sqlx::query(statement)
            .execute(&app.owner)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    for grant in grant_statements(&schema(), app.role.name(), Access::ServiceAndPurge).unwrap() {
        sqlx::query(&grant)
            .execute(&app.owner)
            .await
            .unwrap_or_else(|e| panic!("{grant}: {e}"));
    }
    Some(app)
}

/// pg_partman's children of the inbox, as it lists them (oldest first).
async fn partman_partitions(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "select partition_tablename::text \
         from partman.show_partitions('pm_inbox.consumer_inbox')",
    )
    .fetch_all(pool)
    .await
    .expect("show_partitions")
}

/// Every partition of the inbox, the default one too, by name.
async fn all_partitions(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "select c.relname::text from pg_inherits h join pg_class c on c.oid = h.inhrelid
         where h.inhparent = 'pm_inbox.consumer_inbox'::regclass order by 1",
    )
    .fetch_all(pool)
    .await
    .expect("partitions")
}

/// Adds a row received `age` ago, processed `processed` ago (or not processed), as the
/// owner.
async fn add_row(
    pool: &PgPool,
    producer: &str,
    key: &str,
    age: Duration,
    processed: Option<Duration>,
) {
    sqlx::query(
        "insert into pm_inbox.consumer_inbox
             (consumer_name, producer_name, message_id, payload_sha256, handler_version,
              received_at, processed_at, response_status)
         values ('pm', $1, $2, repeat('a', 64), 'v1', now() - make_interval(secs => $3),
                 now() - make_interval(secs => $4), case when $4 is not null then 201 end)",
    )
    .bind(producer)
    .bind(key)
    .bind(age.as_secs_f64())
    .bind(processed.map(|d| d.as_secs_f64()))
    .execute(pool)
    .await
    .expect("row");
}

/// Where each row of the inbox is: key and partition, by key.
async fn rows(pool: &PgPool) -> Vec<(String, String)> {
    sqlx::query_as(
        "select message_id, tableoid::regclass::text from pm_inbox.consumer_inbox
         order by message_id",
    )
    .fetch_all(pool)
    .await
    .expect("rows")
}

/// Claims and records `key` through the service's inbox.
async fn claim(inbox: &Inbox, key: &str) {
    let identity = MessageIdentity::new(
        "pm",
        Producer::new("app").expect("producer"),
        MessageKey::new(key).expect("key"),
    );
    let claimed = match inbox
        .claim(
            identity,
            Fingerprint::of_bytes(key.as_bytes()),
            "v1",
            Duration::ZERO,
        )
        .await
        .expect("claim")
    {
        Claim::Claimed(claimed) => claimed,
        other => panic!("{key} was not free: {other:?}"),
    };
    let response = RecordedResponse {
        status: 201,
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"{}"),
    };
    claimed.commit(Some(&response)).await.expect("commit");
}

/// The rows the purge must keep in a partition it drops, one of each kind, and one it may
/// take; all received ten days ago.
async fn old_rows(app: &TestApp) {
    let ten_days = 10 * DAY;
    add_row(&app.owner, "app", "old", ten_days, Some(ten_days)).await;
    add_row(&app.owner, "app", "stuck", ten_days, None).await;
    add_row(
        &app.owner,
        "app",
        "late",
        ten_days,
        Some(Duration::from_secs(60)),
    )
    .await;
    add_row(&app.owner, "migration:m1", "step", ten_days, Some(ten_days)).await;
    add_row(&app.owner, "app", "quarantined", ten_days, Some(ten_days)).await;
    sqlx::query(
        "insert into pm_inbox.inbox_quarantine
             (source, item_key, consumer_name, producer_name, tenant_id, message_id,
              payload_sha256, payload_ref, reason_code)
         values ('identity-conflict', 'k', 'pm', 'app', '', 'quarantined', repeat('b', 64),
                 'sha256:b', 'conflict')",
    )
    .execute(&app.owner)
    .await
    .expect("open item");
}

/// The keys the purge must keep of [`old_rows`], and a young claim's.
const KEPT: [&str; 5] = ["fresh", "late", "quarantined", "step", "stuck"];

#[tokio::test]
async fn pg_partman_creates_the_partitions_and_the_purge_drops_the_expired_ones() {
    let Some(app) = partman_app().await else {
        return;
    };
    let created = partman_partitions(&app.owner).await;
    // Ten days back, today, two ahead.
    assert!(created.len() >= 13, "{created:?}");
    assert_eq!(
        all_partitions(&app.owner).await.len(),
        created.len() + 1,
        "pg_partman's partitions and its default one"
    );
    let without_fillfactor: Vec<String> = sqlx::query_scalar(
        "select c.relname::text from pg_inherits h join pg_class c on c.oid = h.inhrelid
         where h.inhparent = 'pm_inbox.consumer_inbox'::regclass
           and not coalesce('fillfactor=80' = any(c.reloptions), false)",
    )
    .fetch_all(&app.owner)
    .await
    .unwrap();
    assert!(without_fillfactor.is_empty(), "{without_fillfactor:?}");

    // A claim lands in pg_partman's partition of today, not in the default one.
    let inbox = Inbox::new(app.pool.clone()).with_schema(schema());
    claim(&inbox, "fresh").await;
    let (_, fresh) = rows(&app.pool).await.remove(0);
    let fresh = fresh.trim_start_matches("pm_inbox.").to_owned();
    assert!(
        created.contains(&fresh),
        "{fresh} is not one of {created:?}"
    );

    old_rows(&app).await;
    let policy = RetentionPolicy::builder()
        .retry_horizon(DAY)
        .safety_margin(DAY)
        .build()
        .unwrap();
    let purger = Purger::builder(app.pool.clone())
        .schema(schema())
        .inbox(policy)
        .partitions_created_elsewhere()
        .build()
        .unwrap();
    let dry = purger.dry_run().await.expect("dry run");
    assert_eq!(dry.rows(PurgedTable::ConsumerInbox), 1, "{dry}");
    let before = all_partitions(&app.owner).await;

    let report = purger.purge().await.expect("purge");
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1, "{report}");
    let after = all_partitions(&app.owner).await;
    // The partitions that ended two days ago or earlier are gone (eight at least), and the
    // purge created none of its own.
    assert!(after.len() + 8 <= before.len(), "{before:?} -> {after:?}");
    assert!(after.iter().all(|p| before.contains(p)), "{after:?}");
    assert!(after.contains(&fresh), "{after:?}");
    let left = rows(&app.pool).await;
    let keys: Vec<&str> = left.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, KEPT, "{left:?}");
    for (key, partition) in &left {
        if key != "fresh" {
            assert_eq!(partition, "pm_inbox.consumer_inbox_default", "{key}");
        }
    }

    // pg_partman's maintenance carries on: it creates no dropped partition again and
    // leaves the kept rows where they are; claims go on landing in its partitions.
    sqlx::query("select partman.run_maintenance('pm_inbox.consumer_inbox')")
        .execute(&app.owner)
        .await
        .expect("maintenance after the drops");
    let maintained = all_partitions(&app.owner).await;
    assert!(
        maintained
            .iter()
            .all(|p| !before.contains(p) || after.contains(p)),
        "{maintained:?}"
    );
    assert_eq!(rows(&app.pool).await, left);
    claim(&inbox, "fresh-2").await;
    let again = rows(&app.pool).await;
    let (_, partition) = again.iter().find(|(k, _)| k == "fresh-2").unwrap();
    assert_eq!(partition, &format!("pm_inbox.{fresh}"));
}

/// The outbox under pg_partman: an enqueue lands in its partition of today, and the purge
/// of an outbox policy built `partitions_created_elsewhere` drops the expired (empty) ones
/// and creates none of its own.
#[tokio::test]
async fn pg_partman_partitions_the_outbox_and_the_purge_drops_its_expired_partitions() {
    let Some(app) = partman_app().await else {
        return;
    };
    let outbox_partitions = || async {
        sqlx::query_scalar::<_, String>(
            "select c.relname::text from pg_inherits h join pg_class c on c.oid = h.inhrelid
             where h.inhparent = 'pm_inbox.message_outbox'::regclass order by 1",
        )
        .fetch_all(&app.owner)
        .await
        .expect("outbox partitions")
    };
    let outbox = Outbox::new(app.pool.clone()).with_schema(schema());
    let mut tx = app.pool.begin().await.unwrap();
    outbox
        .enqueue_with_id(
            &mut *tx,
            EffectId::new("pm-effect"),
            "hook",
            &OutboxMessage::new("http://127.0.0.1:9/hook", "{}"),
        )
        .await
        .expect("enqueue");
    tx.commit().await.unwrap();
    let (partition,): (String,) = sqlx::query_as(
        "select tableoid::regclass::text from pm_inbox.message_outbox where effect_id = 'pm-effect'",
    )
    .fetch_one(&app.owner)
    .await
    .unwrap();
    assert!(
        partition.starts_with("pm_inbox.message_outbox_p"),
        "the enqueue landed in {partition}"
    );

    let before = outbox_partitions().await;
    let purger = Purger::builder(app.pool.clone())
        .schema(schema())
        .outbox(
            RetentionPolicy::builder()
                .retry_horizon(DAY)
                .safety_margin(DAY)
                .build()
                .unwrap(),
        )
        .partitions_created_elsewhere()
        .build()
        .unwrap();
    purger.purge().await.expect("purge");
    let after = outbox_partitions().await;
    assert!(after.len() + 8 <= before.len(), "{before:?} -> {after:?}");
    assert!(after.iter().all(|p| before.contains(p)), "{after:?}");
    assert!(after.contains(&partition.trim_start_matches("pm_inbox.").to_owned()));
}

/// The command line's purge refuses to create partitions beside pg_partman's, and purges
/// when told they are created elsewhere.
#[cfg(feature = "cli")]
#[tokio::test]
async fn the_command_line_leaves_pg_partmans_partitions_to_it() {
    let Some(app) = partman_app().await else {
        return;
    };
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--schema",
            "pm_inbox",
            "purge",
            "--yes",
            "--retry-horizon",
            "1d",
            "--safety-margin",
            "1d",
        ];
        args.extend_from_slice(extra);
        std::process::Command::new(env!("CARGO_BIN_EXE_tower-inbox"))
            .args(&args)
            .env("DATABASE_URL", app.db.url())
            .env_remove("TOWER_INBOX_SCHEMA")
            .output()
            .expect("run tower-inbox")
    };
    let refused = run(&[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("pg_partman creates the partitions of pm_inbox.consumer_inbox"),
        "{stderr}"
    );
    let done = run(&["--partitions-created-elsewhere"]);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
}

/// Why the docs say to keep pg_partman's `retention` off: its drop takes a partition whole,
/// with rows the inbox must keep (a claim in flight, a row an open quarantine item refers
/// to, a migration step, a row processed within the window), which the purge's drop keeps.
#[tokio::test]
async fn pg_partmans_own_retention_would_drop_rows_the_inbox_must_keep() {
    let Some(app) = partman_app().await else {
        return;
    };
    old_rows(&app).await;
    sqlx::query(
        "update partman.part_config set retention = '2 days', retention_keep_table = false \
         where parent_table = 'pm_inbox.consumer_inbox'",
    )
    .execute(&app.owner)
    .await
    .expect("retention on");
    sqlx::query("select partman.run_maintenance('pm_inbox.consumer_inbox')")
        .execute(&app.owner)
        .await
        .expect("maintenance");
    let left = rows(&app.pool).await;
    assert!(
        left.is_empty(),
        "pg_partman's retention dropped them all: {left:?}"
    );
}
