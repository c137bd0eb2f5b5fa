//! The `tower-inbox` command line (feature `cli`), run as a process against a real database:
//! each command on seeded data, its JSON compared with what the library reports for the
//! same rows, refusals and their exit codes, and an unreachable database.
//! The partitioned layout through the command line: `migrate --layout`, the purge's
//! partition drops and their dry run, and the partitions in `status`.
//! (Over 400 lines: one test per command, all on the same seeded database shape.)

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{credit, receiver, send, TestApp};
use serde_json::Value;
use sqlx::PgPool;
use time::OffsetDateTime;
use tower_inbox::inbox::Inbox;
use tower_inbox::metrics::StatsTask;
use tower_inbox::outbox::{enqueue, Dispatcher, HttpTransport, OutboxMessage};
use tower_inbox::partition::{self, InboxPartition, PartitionPlan};
use tower_inbox::quarantine::{Quarantine, QuarantineFilter, QuarantineSource};
use tower_inbox::schema::{Layout, Schema};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

/// Runs the binary against `url` with `args`; `DATABASE_URL` carries the URL.
fn cli(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tower-inbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .env_remove("TOWER_INBOX_SCHEMA")
        .output()
        .expect("run tower-inbox")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Succeeds, or the test fails with what it printed.
fn ok(output: Output) -> String {
    assert!(
        output.status.success(),
        "exit {:?}: {}",
        output.status.code(),
        stderr(&output)
    );
    stdout(&output)
}

fn json(output: Output) -> Value {
    let text = ok(output);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The credits service after three commands, a retry and a conflicting reuse of a key.
async fn seeded() -> TestApp {
    let app = TestApp::new().await;
    let credits = app.credits();
    for key in ["k1", "k2", "k3"] {
        assert!(send(&credits, credit("a1", Some(key), Some("app"), 5))
            .await
            .status
            .is_success());
    }
    assert!(send(&credits, credit("a1", Some("k1"), Some("app"), 5))
        .await
        .replayed());
    let conflict = send(&credits, credit("a1", Some("k1"), Some("app"), 7)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    app
}

#[tokio::test]
async fn migrate_lists_then_applies_the_pending_migrations() {
    let db = tower_inbox_testdb::TestDatabase::create()
        .await
        .expect("test database");
    let url = db.url();
    let fresh = ok(cli(url, &["migrate", "--dry-run", "--schema", "cli_fresh"]));
    assert!(
        fresh.starts_with("schema cli_fresh (plain layout): would apply 3 migration(s)"),
        "{fresh}"
    );
    let pool = db.pool(1).await;
    let tables = || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pg_tables where schemaname = 'cli_fresh'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(tables().await, 0, "a dry run changes nothing");
    let applied = ok(cli(url, &["migrate", "--schema", "cli_fresh"]));
    assert!(applied.contains("applying 3 migration(s)"), "{applied}");
    assert!(tables().await >= 4, "the crate's tables exist");
    let again = ok(cli(url, &["migrate", "--dry-run", "--schema", "cli_fresh"]));
    assert_eq!(
        again.trim(),
        "schema cli_fresh (plain layout): up to date (3 migrations)"
    );
}

#[tokio::test]
async fn status_reports_what_the_library_and_the_tables_hold() {
    let app = seeded().await;
    let url = app.db.url();
    let status = json(cli(url, &["status", "--json"]));
    let stats = StatsTask::new(app.pool.clone()).collect().await.unwrap();

    let consumers = status["consumers"].as_array().expect("consumers");
    assert_eq!(consumers.len(), stats.inbox.len());
    let credits = consumers
        .iter()
        .find(|c| c["consumer"] == "credits")
        .expect("the credits consumer");
    assert_eq!(credits["rows"], 3);
    assert_eq!(credits["rows"], app.inbox_rows().await);
    assert_eq!(credits["completed_last_hour"], 3);
    assert_eq!(credits["conflicts_last_hour"], 1);
    assert!(credits["oldest_row_seconds"].as_f64().unwrap() >= 0.0);
    assert_eq!(credits["in_progress"], 0);
    assert_eq!(credits["oldest_in_progress_seconds"], 0.0);
    assert_eq!(status["in_flight"]["claims"], 0);

    let count = |sql: &'static str| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let pending =
        count("select count(*) from tower_inbox.message_outbox where status = 'pending'").await;
    assert_eq!(status["outbox"]["pending"], pending);
    assert_eq!(status["outbox"]["pending"], stats.outbox_pending);
    assert_eq!(status["outbox"]["dead"], 0);
    let open =
        count("select count(*) from tower_inbox.inbox_quarantine where decision is null").await;
    assert_eq!(open, 1);
    assert_eq!(status["quarantine"]["open"], open);
    assert_eq!(
        status["quarantine"]["open_by_reason"]["identity-conflict/payload-mismatch"],
        1
    );

    let human = ok(cli(url, &["status"]));
    for expected in [
        "credits",
        "Claims in flight",
        "Outbox:",
        "Quarantine: 1 open",
    ] {
        assert!(
            human.contains(expected),
            "{expected:?} missing from:\n{human}"
        );
    }

    // Two claims of `credits` in flight, uncommitted: invisible in its rows, seen per
    // consumer through their locks, with the older one's age.
    let inbox = Inbox::new(app.pool.clone());
    let hold = |key: &'static str| {
        let inbox = inbox.clone();
        async move {
            let identity = MessageIdentity::new(
                "credits",
                Producer::new("app").unwrap(),
                MessageKey::new(key).unwrap(),
            );
            let fingerprint = tower_inbox::fingerprint::Fingerprint::of_bytes(key.as_bytes());
            match inbox
                .claim(identity, fingerprint, "1", Duration::ZERO)
                .await
                .unwrap()
            {
                tower_inbox::inbox::Claim::Claimed(claimed) => claimed,
                other => panic!("{other:?}"),
            }
        }
    };
    let first = hold("held-1").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let second = hold("held-2").await;
    let held = json(cli(url, &["status", "--json"]));
    let credits = held["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer"] == "credits")
        .unwrap();
    assert_eq!(credits["in_progress"], 2, "{held}");
    assert!(
        credits["oldest_in_progress_seconds"].as_f64().unwrap() >= 1.0,
        "{held}"
    );
    assert_eq!(credits["rows"], 3, "the held claims are not rows yet");
    assert_eq!(held["in_flight"]["claims"], 2);
    let library = inbox.claims_in_flight(&["credits", "other"]).await.unwrap();
    assert_eq!((library[0].claims, library[1].claims), (2, 0));
    let text = ok(cli(url, &["status"]));
    assert!(text.contains("2, oldest"), "{text}");
    first.rollback().await.unwrap();
    second.rollback().await.unwrap();
    let after = json(cli(url, &["status", "--json"]));
    assert_eq!(after["consumers"][0]["in_progress"], 0, "{after}");
}

#[tokio::test]
async fn quarantine_commands_list_show_and_decide_once() {
    let app = seeded().await;
    let url = app.db.url();
    let quarantine = Quarantine::new(app.pool.clone());
    let open = quarantine.list(QuarantineFilter::Open, 100).await.unwrap();
    assert_eq!(open.len(), 1);
    let item = &open[0];
    assert_eq!(item.source, QuarantineSource::IdentityConflict);

    let listed = json(cli(url, &["quarantine", "list", "--json"]));
    let listed = listed.as_array().expect("a list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["id"], item.id);
    assert_eq!(listed[0]["source"], "identity-conflict");
    assert_eq!(listed[0]["reason_code"], item.reason_code);
    assert_eq!(listed[0]["consumer"], "credits");
    assert_eq!(listed[0]["message_id"], "k1");
    assert!(listed[0]["decision"].is_null());
    let filtered = json(cli(
        url,
        &["quarantine", "list", "--json", "--consumer", "other"],
    ));
    assert_eq!(filtered.as_array().map(Vec::len), Some(0));
    let table = ok(cli(url, &["quarantine", "list"]));
    assert!(
        table.contains("identity-conflict") && table.contains("open"),
        "{table}"
    );

    let id = item.id.to_string();
    let shown = json(cli(url, &["quarantine", "show", &id, "--json"]));
    assert_eq!(shown, listed[0]);
    let text = ok(cli(url, &["quarantine", "show", &id]));
    assert!(
        text.contains("payload sha256") && text.contains("decision         open"),
        "{text}"
    );

    let repaired = ok(cli(
        url,
        &[
            "quarantine",
            "repair",
            &id,
            "--by",
            "alice",
            "--why",
            "client fixed its keys",
        ],
    ));
    assert_eq!(
        repaired.trim(),
        format!("quarantine item {id} repaired by alice")
    );
    let decided = quarantine.get(item.id).await.unwrap().unwrap();
    assert_eq!(decided.decided_by.as_deref(), Some("alice"));
    assert_eq!(
        decided.decision_reason.as_deref(),
        Some("client fixed its keys")
    );

    // Deciding again is refused, naming who decided, when and why.
    let again = cli(
        url,
        &["quarantine", "discard", &id, "--by", "bob", "--why", "late"],
    );
    assert_eq!(again.status.code(), Some(1));
    let line = stderr(&again);
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(line.contains("already decided: repair by alice"), "{line}");
    assert!(line.contains("(client fixed its keys)"), "{line}");
    let decided_again = quarantine.get(item.id).await.unwrap().unwrap();
    assert_eq!(
        decided_again.decided_by.as_deref(),
        Some("alice"),
        "unchanged"
    );
    let listed = json(cli(url, &["quarantine", "list", "--decided", "--json"]));
    assert_eq!(listed[0]["decision"], "repair");
    // A newer open item: the filters apply before the limit, so the decided one is still
    // the one `--decided --limit 1` finds.
    let credits = app.credits();
    let conflict = send(&credits, credit("a1", Some("k2"), Some("app"), 9)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    let decided = json(cli(
        url,
        &["quarantine", "list", "--decided", "--limit", "1", "--json"],
    ));
    assert_eq!(decided.as_array().map(Vec::len), Some(1), "{decided}");
    assert_eq!(decided[0]["id"], item.id);
    let open = json(cli(url, &["quarantine", "list", "--limit", "1", "--json"]));
    assert_eq!(open[0]["message_id"], "k2");
    let by_reason = json(cli(
        url,
        &[
            "quarantine",
            "list",
            "--all",
            "--reason",
            "payload-mismatch",
            "--json",
        ],
    ));
    assert_eq!(by_reason.as_array().map(Vec::len), Some(2));

    let unknown = cli(url, &["quarantine", "show", "999999"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert_eq!(
        stderr(&unknown).trim(),
        "tower-inbox: no quarantine item 999999"
    );
}

#[tokio::test]
async fn bad_input_is_exit_2_and_an_unreachable_database_exit_3_without_the_password() {
    let app = TestApp::new().await;
    let url = app.db.url();
    for args in [
        &["quarantine", "show", "banana"][..],
        &["status", "--watch", "0"],
        &["quarantine", "list", "--open", "--all"],
        &["frobnicate"],
    ] {
        let output = cli(url, args);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{args:?}: {}",
            stderr(&output)
        );
    }
    let schema = cli(url, &["status", "--schema", "Bad-Name"]);
    assert_eq!(schema.status.code(), Some(2), "{}", stderr(&schema));
    // Argument errors are usage errors even when the database cannot be reached.
    let down = "postgres://u@127.0.0.1:1/x";
    for args in [
        &["quarantine", "repair", "1", "--by", " ", "--why", "x"][..],
        &["outbox", "retry", "e1", "--by", "ops", "--why", ""],
        &["inspect", "--consumer", "c", "--producer", "", "k"],
        &["purge", "--dry-run", "--retry-horizon", "1d"],
    ] {
        let output = cli(down, args);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{args:?}: {}",
            stderr(&output)
        );
    }

    let started = Instant::now();
    let unreachable = cli("postgres://u:s3cret-pw@127.0.0.1:1/x", &["status"]);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(unreachable.status.code(), Some(3));
    let line = stderr(&unreachable);
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(
        line.starts_with(
            "tower-inbox: cannot connect to PostgreSQL at 127.0.0.1:1 (URL from DATABASE_URL)"
        ),
        "{line}"
    );
    assert!(!line.contains("s3cret-pw"), "{line}");

    let flagged = Command::new(env!("CARGO_BIN_EXE_tower-inbox"))
        .args([
            "status",
            "--database-url",
            "postgres://u:s3cret-pw@127.0.0.1:1/x",
        ])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(flagged.status.code(), Some(3));
    assert!(stderr(&flagged).contains("(URL from --database-url)"));
    let missing = Command::new(env!("CARGO_BIN_EXE_tower-inbox"))
        .args(["status"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(stderr(&missing).contains("pass --database-url or set DATABASE_URL"));
}

#[tokio::test]
async fn inspect_shows_a_keys_state_response_quarantine_and_effects() {
    let app = seeded().await;
    let url = app.db.url();
    let args = [
        "inspect",
        "--consumer",
        "credits",
        "--producer",
        "app",
        "k1",
    ];
    let report = json(cli(url, &[&args[..], &["--json"]].concat()));
    let identity = MessageIdentity::new(
        "credits",
        Producer::new("app").unwrap(),
        MessageKey::new("k1").unwrap(),
    );
    let entry = Inbox::new(app.pool.clone())
        .lookup(&identity)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report["state"], "completed");
    assert_eq!(report["payload_sha256"], entry.payload_sha256);
    assert_eq!(report["handler_version"], entry.handler_version);
    let response = entry.response.unwrap();
    assert_eq!(report["response_status"], response.status);
    assert_eq!(report["response_body_bytes"], response.body.len());
    assert_eq!(
        report["response_body"],
        String::from_utf8_lossy(&response.body).as_ref()
    );
    assert_eq!(report["failed_attempts"], 0);
    let items = report["quarantine"].as_array().unwrap();
    assert_eq!(items.len(), 1, "the conflict on k1");
    assert_eq!(items[0]["reason_code"], "payload-mismatch");
    assert!(report["received_at"].is_string() && report["processed_at"].is_string());
    let text = ok(cli(url, &args));
    assert!(
        text.contains("state            completed") && text.contains("status           201"),
        "{text}"
    );

    let unknown = cli(
        url,
        &[
            "inspect",
            "--consumer",
            "credits",
            "--producer",
            "app",
            "nope",
        ],
    );
    assert_eq!(unknown.status.code(), Some(1));
    assert!(
        stderr(&unknown).contains("no key \"nope\""),
        "{}",
        stderr(&unknown)
    );
    let bad = cli(
        url,
        &["inspect", "--consumer", "credits", "--producer", "", "k1"],
    );
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
}

async fn dispatch(pool: &PgPool) -> tower_inbox::outbox::DispatchReport {
    Dispatcher::builder(
        pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .delivery_timeout(Duration::from_secs(5))
    .max_attempts(3)
    .build()
    .unwrap()
    .dispatch_due()
    .await
    .unwrap()
}

#[tokio::test]
async fn a_dead_effect_retried_through_the_cli_is_delivered_and_its_item_recovered() {
    let app = TestApp::new().await;
    let url = app.db.url();
    // The receiver refuses the first delivery for good (410), then takes it.
    let hook = receiver([410]).await;
    let identity = MessageIdentity::new(
        "cli-outbox",
        Producer::new("app").unwrap(),
        MessageKey::new("m1").unwrap(),
    );
    let mut tx = app.pool.begin().await.unwrap();
    let effect = enqueue(
        &mut *tx,
        &identity,
        "webhook",
        &OutboxMessage::new(hook, "{}"),
    )
    .await
    .unwrap()
    .effect_id;
    tx.commit().await.unwrap();
    let id = effect.as_str().to_owned();

    let pending = json(cli(url, &["outbox", "list", "--json"]));
    assert_eq!(pending[0]["effect_id"], id.as_str());
    assert_eq!(pending[0]["status"], "pending");
    assert_eq!(pending[0]["message_id"], "m1");
    assert_eq!(dispatch(&app.pool).await.dead, 1);
    assert_eq!(
        json(cli(url, &["outbox", "list", "--json"]))
            .as_array()
            .map(Vec::len),
        Some(0)
    );
    let dead = json(cli(url, &["outbox", "list", "--dead", "--json"]));
    assert_eq!(dead[0]["effect_id"], id.as_str());
    let shown = json(cli(url, &["outbox", "show", &id, "--json"]));
    assert_eq!(shown, dead[0]);
    assert_eq!(shown["status"], "dead");
    assert_eq!(shown["remote_status"], 410);
    let text = ok(cli(url, &["outbox", "show", &id]));
    assert!(text.contains("status         dead"), "{text}");
    let table = ok(cli(
        url,
        &["outbox", "list", "--all", "--effect", "webhook"],
    ));
    assert!(table.contains(&id), "{table}");

    let retried = ok(cli(
        url,
        &[
            "outbox",
            "retry",
            &id,
            "--by",
            "carol",
            "--why",
            "receiver fixed",
        ],
    ));
    assert!(
        retried.contains(&format!("outbox effect {id} goes back to the dispatcher")),
        "{retried}"
    );
    let quarantine = Quarantine::new(app.pool.clone());
    let item = quarantine
        .list(QuarantineFilter::All, 10)
        .await
        .unwrap()
        .into_iter()
        .find(|i| i.effect_id.as_deref() == Some(id.as_str()))
        .expect("the dead effect's item");
    assert_eq!(item.decided_by.as_deref(), Some("carol"));
    assert_eq!(item.decision_reason.as_deref(), Some("receiver fixed"));

    // The dispatcher delivers it now, and the item is marked recovered.
    assert_eq!(dispatch(&app.pool).await.delivered, 1);
    let recovered = quarantine.get(item.id).await.unwrap().unwrap();
    assert!(recovered.recovered_at.is_some(), "{recovered:?}");
    let delivered = json(cli(url, &["outbox", "show", &id, "--json"]));
    assert_eq!(delivered["status"], "delivered");

    // Retrying what is not dead, or what does not exist, is refused.
    let again = cli(
        url,
        &["outbox", "retry", &id, "--by", "carol", "--why", "again"],
    );
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr(&again).contains("is delivered, not dead"),
        "{}",
        stderr(&again)
    );
    let unknown = cli(url, &["outbox", "show", "no-such-effect"]);
    assert_eq!(unknown.status.code(), Some(1));
}

/// `n` processed inbox rows of consumer `cli-purge`, received and processed `days` ago.
async fn aged_rows(pool: &PgPool, prefix: &str, n: i32, days: i32) {
    sqlx::query(
        "insert into tower_inbox.consumer_inbox
             (consumer_name, producer_name, message_id, payload_sha256, handler_version,
              received_at, processed_at, response_status)
         select 'cli-purge', 'app', $1 || '-' || g, repeat('a', 64), 'v1',
                now() - make_interval(days => $3), now() - make_interval(days => $3), 200
         from generate_series(1, $2) g",
    )
    .bind(prefix)
    .bind(n)
    .bind(days)
    .execute(pool)
    .await
    .unwrap();
}

async fn inbox_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from tower_inbox.consumer_inbox where consumer_name = 'cli-purge'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

const WINDOW: [&str; 4] = ["--retry-horizon", "1d", "--safety-margin", "1d"];

#[tokio::test]
async fn purge_dry_run_counts_what_purge_yes_deletes_and_never_an_in_flight_claim() {
    let app = TestApp::new().await;
    let url = app.db.url();
    aged_rows(&app.pool, "old", 25, 10).await;
    aged_rows(&app.pool, "young", 5, 0).await;
    // A claim in flight: its row is uncommitted, and stays out of the purge's reach.
    let inbox = Inbox::new(app.pool.clone());
    let identity = MessageIdentity::new(
        "cli-purge",
        Producer::new("app").unwrap(),
        MessageKey::new("in-flight").unwrap(),
    );
    let claimed = match inbox
        .claim(
            identity.clone(),
            tower_inbox::fingerprint::Fingerprint::of_bytes(b"x"),
            "v1",
            Duration::ZERO,
        )
        .await
        .unwrap()
    {
        tower_inbox::inbox::Claim::Claimed(claimed) => claimed,
        other => panic!("{other:?}"),
    };

    let dry = ok(cli(url, &[&["purge", "--dry-run"][..], &WINDOW].concat()));
    assert!(dry.starts_with("inbox: retention window 2d"), "{dry}");
    assert!(
        dry.contains("consumer_inbox: would delete 25 rows older than"),
        "{dry}"
    );
    assert_eq!(
        inbox_count(&app.pool).await,
        30,
        "a dry run deletes nothing"
    );
    let done = ok(cli(
        url,
        &[
            &["purge", "--yes", "--batch-size", "10", "--pause", "0ms"][..],
            &WINDOW,
        ]
        .concat(),
    ));
    assert!(
        done.contains("consumer_inbox: deleted 25 rows older than"),
        "{done}"
    );
    assert_eq!(inbox_count(&app.pool).await, 5, "the young rows stay");

    claimed.commit(None).await.unwrap();
    assert!(
        inbox.lookup(&identity).await.unwrap().is_some(),
        "the claim committed its row"
    );
}

#[tokio::test]
async fn ctrl_c_stops_a_purge_between_batches() {
    let app = TestApp::new().await;
    aged_rows(&app.pool, "old", 50, 10).await;
    let child = Command::new(env!("CARGO_BIN_EXE_tower-inbox"))
        .args(
            [
                &["purge", "--yes", "--batch-size", "10", "--pause", "2s"][..],
                &WINDOW,
            ]
            .concat(),
        )
        .env("DATABASE_URL", app.db.url())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The first batch is gone: the purge runs, and its pause is long.
    let started = Instant::now();
    while inbox_count(&app.pool).await == 50 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no batch deleted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Interrupted during the pause that follows: no batch more is deleted.
    let at_signal = inbox_count(&app.pool).await;
    let pid = child.id().to_string();
    let signalled = Command::new("kill").args(["-INT", &pid]).status().unwrap();
    assert!(signalled.success());
    let output = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(130), "{}", stderr(&output));
    assert!(
        stdout(&output).contains("stopped before the end"),
        "{}",
        stdout(&output)
    );
    assert!(
        stderr(&output).contains("interrupted"),
        "{}",
        stderr(&output)
    );
    let left = inbox_count(&app.pool).await;
    assert_eq!(left, at_signal, "stopped before another batch");
    assert_eq!(left, 40, "one whole batch deleted");
}

#[tokio::test]
async fn purge_refuses_bad_durations_policies_and_a_missing_mode() {
    let app = TestApp::new().await;
    let url = app.db.url();
    let dir = std::env::temp_dir().join(format!("tower-inbox-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let unknown = dir.join("unknown.toml");
    std::fs::write(
        &unknown,
        "[inbox]\nretry_horizon = \"1d\"\nsafety_margin = \"1d\"\nforever = \"1d\"\n",
    )
    .unwrap();
    let banana = dir.join("banana.toml");
    std::fs::write(&banana, "[inbox]\nretry_horizon = \"banana\"\n").unwrap();
    let unknown = unknown.to_str().unwrap();
    let banana = banana.to_str().unwrap();
    for (args, says) in [
        (
            vec!["purge", "--dry-run", "--retry-horizon", "banana"],
            "is not a duration",
        ),
        (
            vec!["purge", "--retry-horizon", "1d", "--safety-margin", "1d"],
            "--dry-run|--yes",
        ),
        (
            vec!["purge", "--dry-run", "--policy", unknown],
            "unknown field `forever`",
        ),
        (
            vec!["purge", "--dry-run", "--policy", banana],
            "[inbox] retry_horizon",
        ),
        (
            vec!["purge", "--dry-run", "--retry-horizon", "1d"],
            "safety margin",
        ),
        (
            vec![
                "purge",
                "--dry-run",
                "--safety-margin",
                "1d",
                "--outbox-window",
                "1d",
                "--window",
                "1d",
            ],
            "no failure scenario",
        ),
        (
            vec!["purge", "--dry-run", "--quarantine-window", "30d"],
            "needs a --safety-margin",
        ),
        (vec!["purge", "--dry-run"], "give the inbox's scenarios"),
    ] {
        let output = cli(url, &args);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{args:?}: {}",
            stderr(&output)
        );
        assert!(
            stderr(&output).contains(says),
            "{args:?}: {}",
            stderr(&output)
        );
    }
    // The quarantine alone, with the flags.
    let alone = ok(cli(
        url,
        &[
            "purge",
            "--dry-run",
            "--quarantine-window",
            "30d",
            "--safety-margin",
            "1d",
        ],
    ));
    assert!(
        alone.starts_with("quarantine: retention window 31d"),
        "{alone}"
    );
    assert!(!alone.contains("consumer_inbox"), "{alone}");
    // The README's policy file works.
    let readme = dir.join("readme.toml");
    std::fs::write(
        &readme,
        "[inbox]\nretry_horizon = \"1d\"\noutage_tolerance = \"1d\"\nsafety_margin = \"1d\"\n\n\
         [quarantine]\naudit = \"30d\"\nsafety_margin = \"1d\"\n",
    )
    .unwrap();
    let shown = ok(cli(
        url,
        &["purge", "--dry-run", "--policy", readme.to_str().unwrap()],
    ));
    assert!(shown.starts_with("inbox: retention window 3d"), "{shown}");
    assert!(
        shown.contains("quarantine: retention window 31d: audit 30d"),
        "{shown}"
    );
    assert!(
        shown.contains("inbox_quarantine: would delete 0 rows"),
        "{shown}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The `relkind` of `schema`'s inbox table: `p` partitioned, `r` plain.
async fn relkind(pool: &PgPool, schema: &str) -> String {
    sqlx::query_scalar(
        "select c.relkind::text from pg_class c join pg_namespace n on n.oid = c.relnamespace
         where n.nspname = $1 and c.relname = 'consumer_inbox'",
    )
    .bind(schema)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A migration that refuses (here the partitioned outbox's, on an outbox with rows, as when
/// a schema with only the partitioned inbox is brought up to date) is one line, exit 1, with
/// the migration's hint.
#[tokio::test]
async fn a_migration_that_refuses_is_one_line_with_its_hint() {
    let db = tower_inbox_testdb::TestDatabase::create()
        .await
        .expect("test database");
    let url = db.url();
    let pool = db.pool(1).await;
    ok(cli(
        url,
        &["migrate", "--layout", "partitioned", "--schema", "cli_hint"],
    ));
    // As if the outbox's migration had not run yet, with an effect waiting.
    for statement in [
        "delete from cli_hint._sqlx_migrations where version = 20261206000002",
        "insert into cli_hint.message_outbox (effect_id, effect_name, destination, payload) \
         values ('e1', 'hook', 'http://127.0.0.1:9/', '')",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let refused = cli(url, &["migrate", "--schema", "cli_hint"]);
    let message = stderr(&refused);
    assert_eq!(refused.status.code(), Some(1), "{message}");
    assert_eq!(message.trim().lines().count(), 1, "{message}");
    assert!(
        message.contains("migration 20261206000002 refused")
            && message.contains("for an empty outbox")
            && message.contains("deliver or purge the effects first"),
        "{message}"
    );
}

#[tokio::test]
async fn migrate_creates_the_partitioned_layout_and_refuses_to_change_a_layout() {
    let db = tower_inbox_testdb::TestDatabase::create()
        .await
        .expect("test database");
    let url = db.url();
    let pool = db.pool(1).await;
    let part = ["--schema", "cli_part"];
    let dry = ok(cli(
        url,
        &[
            &["migrate", "--dry-run", "--layout", "partitioned"][..],
            &part,
        ]
        .concat(),
    ));
    assert!(
        dry.starts_with("schema cli_part (partitioned layout): would apply 5 migration(s)"),
        "{dry}"
    );
    let applied = ok(cli(
        url,
        &[&["migrate", "--layout", "partitioned"][..], &part].concat(),
    ));
    assert!(applied.contains("applying 5 migration(s)"), "{applied}");
    assert!(applied.contains("partitions: none yet"), "{applied}");
    assert_eq!(relkind(&pool, "cli_part").await, "p");
    // Without --layout, an existing schema is migrated in its own.
    let again = ok(cli(url, &[&["migrate", "--dry-run"][..], &part].concat()));
    assert_eq!(
        again.trim(),
        "schema cli_part (partitioned layout): up to date (5 migrations)"
    );
    // Another layout than the schema's is refused, in one line, either way round; the
    // empty plain inbox is not converted.
    ok(cli(url, &["migrate", "--schema", "cli_plain"]));
    for (schema, asked, has) in [
        ("cli_part", "plain", "partitioned"),
        ("cli_plain", "partitioned", "plain"),
    ] {
        let refused = cli(url, &["migrate", "--layout", asked, "--schema", schema]);
        assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
        let message = stderr(&refused);
        assert_eq!(message.lines().count(), 1, "{message}");
        assert!(
            message.contains(&format!("has the {has} layout, not {asked}")),
            "{message}"
        );
    }
    assert_eq!(relkind(&pool, "cli_plain").await, "r");
    assert_eq!(relkind(&pool, "cli_part").await, "p");
    // `grant` gives the purge what the schema's layout needs: the partition functions.
    let printed = ok(cli(
        url,
        &[
            "grant",
            "someone",
            "--purge",
            "--dry-run",
            "--layout",
            "partitioned",
        ],
    ));
    assert!(printed.contains("inbox_drop_partition"), "{printed}");
    let role = db.login_role().await.unwrap();
    let granted = ok(cli(
        url,
        &[&["grant", role.name(), "--purge"][..], &part].concat(),
    ));
    assert!(granted.contains("(partitioned layout)"), "{granted}");
    let may_drop: bool = sqlx::query_scalar(
        "select has_function_privilege($1, 'cli_part.inbox_drop_partition(text, timestamptz)', 'execute')",
    )
    .bind(role.name())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(may_drop, "the purge's role may drop partitions");
}

/// Processed rows of consumer `cli-part` in schema `cli_part`, received and processed
/// `days` ago (not processed when `processed` is false), as the owner.
async fn partitioned_rows(app: &TestApp, prefix: &str, n: i32, days: i32, processed: bool) {
    sqlx::query(
        "insert into cli_part.consumer_inbox
             (consumer_name, producer_name, message_id, payload_sha256, handler_version,
              received_at, processed_at, response_status)
         select 'cli-part', 'app', $1 || '-' || g, repeat('a', 64), 'v1', t,
                case when $4 then t end, case when $4 then 200 end
         from generate_series(1, $2) g, (select now() - make_interval(days => $3)) r(t)",
    )
    .bind(prefix)
    .bind(n)
    .bind(days)
    .bind(processed)
    .execute(&app.owner)
    .await
    .unwrap();
}

fn cli_part() -> Schema {
    Schema::new("cli_part")
        .unwrap()
        .with_layout(Layout::Partitioned)
}

async fn cli_partitions(app: &TestApp) -> Vec<InboxPartition> {
    partition::list(&app.owner, &cli_part()).await.unwrap()
}

#[tokio::test]
async fn purge_drops_a_partitioned_inbox_partitions_and_status_shows_them() {
    let app = TestApp::new().await;
    let url = app.db.url();
    let part = ["--schema", "cli_part"];
    ok(cli(
        url,
        &[&["migrate", "--layout", "partitioned"][..], &part].concat(),
    ));
    // Partitions from ten days ago on, then rows in the oldest: three processed, one in
    // flight (kept by the drop), and two young ones.
    let ten_days_ago = OffsetDateTime::now_utc() - time::Duration::days(10);
    PartitionPlan::default()
        .create_since(&app.owner, &cli_part(), Some(ten_days_ago))
        .await
        .unwrap();
    partitioned_rows(&app, "old", 3, 10, true).await;
    partitioned_rows(&app, "stuck", 1, 10, false).await;
    partitioned_rows(&app, "young", 2, 0, true).await;
    let before = cli_partitions(&app).await;
    let oldest = before
        .iter()
        .find(|p| p.from <= ten_days_ago && ten_days_ago < p.to)
        .expect("the partition ten days ago")
        .clone();

    let status = json(cli(url, &[&["status", "--json"][..], &part].concat()));
    assert_eq!(status["layout"], "partitioned", "{status}");
    assert_eq!(status["partitions"]["count"], before.len(), "{status}");
    assert_eq!(
        status["partitions"]["oldest"]["name"], oldest.name,
        "{status}"
    );
    assert_eq!(
        status["partitions"]["newest"]["name"],
        before.last().unwrap().name,
        "{status}"
    );
    assert_eq!(status["partitions"]["covers_now"], true, "{status}");
    let human = ok(cli(url, &[&["status"][..], &part].concat()));
    assert!(
        human.contains(&format!(
            "Inbox partitions: {}, oldest {}",
            before.len(),
            oldest.name
        )),
        "{human}"
    );
    let plain = json(cli(url, &["status", "--json"]));
    assert_eq!(plain["layout"], "plain");
    assert!(plain.get("partitions").is_none(), "{plain}");

    let dry = ok(cli(
        url,
        &[&["purge", "--dry-run"][..], &part, &WINDOW].concat(),
    ));
    assert!(dry.contains("partitions: 1d each, 2 ahead"), "{dry}");
    assert!(
        dry.contains("consumer_inbox: would delete 3 rows older than"),
        "{dry}"
    );
    assert!(
        dry.contains(&format!(
            "would drop partition {} ({} to ",
            oldest.name,
            oldest
                .from
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap()
        )),
        "{dry}"
    );
    assert!(
        dry.contains("): 3 rows, keeping 1 (moved to the default partition)"),
        "{dry}"
    );
    assert_eq!(
        cli_partitions(&app).await,
        before,
        "a dry run drops nothing"
    );

    let done = ok(cli(
        url,
        &[
            &["purge", "--yes", "--partitions-ahead", "4"][..],
            &part,
            &WINDOW,
        ]
        .concat(),
    ));
    assert!(
        done.contains("consumer_inbox: deleted 3 rows older than"),
        "{done}"
    );
    assert!(done.contains("partitions dropped: "), "{done}");
    assert!(done.contains(&oldest.name), "{done}");
    assert!(done.contains("partitions created: "), "{done}");
    let after = cli_partitions(&app).await;
    assert!(!after.contains(&oldest), "{after:?}");
    assert!(
        after.last().unwrap().to > before.last().unwrap().to,
        "two more created ahead: {after:?}"
    );
    let left: Vec<(String, String)> = sqlx::query_as(
        "select message_id, tableoid::regclass::text from cli_part.consumer_inbox
         order by message_id",
    )
    .fetch_all(&app.owner)
    .await
    .unwrap();
    let keys: Vec<&str> = left.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["stuck-1", "young-1", "young-2"], "{left:?}");
    assert_eq!(left[0].1, "cli_part.consumer_inbox_default", "{left:?}");

    // Partition flags on a plain schema are a usage error.
    let refused = cli(
        url,
        &[
            &["purge", "--dry-run", "--partitions-created-elsewhere"][..],
            &WINDOW,
        ]
        .concat(),
    );
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("is plain"),
        "{}",
        stderr(&refused)
    );
}
