//! Private clusters: settings, the server log, a skewed clock, and clean-up.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::{Connection, PgConnection};
use tower_inbox_testdb::{Cluster, ServerKind};

/// Seconds between the server's `now()` and this process's clock.
async fn server_clock_offset(conn: &mut PgConnection) -> f64 {
    let server: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
        .fetch_one(&mut *conn)
        .await
        .expect("select now()");
    let here = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64();
    server - here
}

/// The postmaster's pid, from the first line of `postmaster.pid`.
fn postmaster_pid(cluster: &Cluster) -> u32 {
    let text = std::fs::read_to_string(cluster.dir().join("data/postmaster.pid"))
        .expect("read postmaster.pid");
    text.lines()
        .next()
        .and_then(|line| line.trim().parse().ok())
        .expect("pid in postmaster.pid")
}

#[tokio::test]
async fn settings_apply_and_errors_show_in_the_log() {
    let cluster = Cluster::builder()
        .setting("log_min_messages", "warning")
        .setting("log_min_error_statement", "error")
        .start()
        .await
        .expect("cluster");
    assert_eq!(cluster.server().kind(), ServerKind::Cluster);
    let db = cluster.database().await.expect("database");
    let mut conn = PgConnection::connect_with(&db.connect_options())
        .await
        .expect("connect");

    let level: String = sqlx::query_scalar("SHOW log_min_messages")
        .fetch_one(&mut conn)
        .await
        .expect("show");
    assert_eq!(level, "warning");
    let port: String = sqlx::query_scalar("SHOW port")
        .fetch_one(&mut conn)
        .await
        .expect("show port");
    assert_eq!(port, cluster.port().to_string());

    let before = cluster.log_mark().expect("mark");
    assert!(!cluster.log().expect("log").contains("division by zero"));
    let err = sqlx::raw_sql("SELECT 1/0")
        .execute(&mut conn)
        .await
        .expect_err("division by zero");
    assert!(err.to_string().contains("division by zero"), "{err}");
    let after = cluster.log_mark().expect("mark");

    let logged = cluster.log_since(before).expect("log");
    assert!(logged.contains("ERROR:  division by zero"), "{logged}");
    assert!(logged.contains("STATEMENT:  SELECT 1/0"), "{logged}");
    assert!(
        !cluster
            .log_since(after)
            .expect("log")
            .contains("division by zero"),
        "logged after the mark taken after the error"
    );

    // No clock offset asked for: the server's clock is this one.
    let offset = server_clock_offset(&mut conn).await;
    assert!(offset.abs() < 600.0, "offset {offset} s without faketime");
    conn.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_offset_moves_the_servers_now() {
    const OFFSET: i64 = -2 * 60 * 60;
    let cluster = Cluster::builder()
        .clock_offset_seconds(OFFSET)
        .start()
        .await
        .expect("cluster");
    let db = cluster.database().await.expect("database");
    let mut conn = PgConnection::connect_with(&db.connect_options())
        .await
        .expect("connect");

    // Generous: this checks that the offset applies, not how precisely.
    let offset = server_clock_offset(&mut conn).await;
    assert!(
        (offset - OFFSET as f64).abs() < 600.0,
        "the server's clock is {offset} s off this one, not about {OFFSET} s"
    );
    conn.close().await.expect("close");
}

#[test]
fn drop_stops_the_server_and_removes_the_directory() {
    let cluster = Cluster::builder().start_blocking().expect("cluster");
    let dir = cluster.dir().to_owned();
    let port = cluster.port();
    let pid = postmaster_pid(&cluster);
    assert!(dir.join("data/PG_VERSION").exists());
    TcpStream::connect((Ipv4Addr::LOCALHOST, port)).expect("server listens");

    drop(cluster);

    assert!(!dir.exists(), "{} is still there", dir.display());
    assert!(
        !PathBuf::from(format!("/proc/{pid}")).exists(),
        "postmaster {pid} lives"
    );
    assert!(TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err());
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("the port is free again");
}

#[test]
fn a_panicking_test_leaves_nothing_behind() {
    let mut seen = None;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let cluster = Cluster::builder().start_blocking().expect("cluster");
        seen = Some((cluster.dir().to_owned(), postmaster_pid(&cluster)));
        panic!("the test fails while it holds the cluster");
    }));
    assert!(outcome.is_err());
    let (dir, pid) = seen.expect("the cluster started");
    assert!(!dir.exists(), "{} is still there", dir.display());
    assert!(
        !PathBuf::from(format!("/proc/{pid}")).exists(),
        "postmaster {pid} lives"
    );
}

#[tokio::test]
async fn databases_are_dropped_alone_or_with_the_cluster() {
    let cluster = Cluster::builder().start().await.expect("cluster");
    let db = cluster.database().await.expect("database");
    let other = cluster.database().await.expect("second database");
    assert_ne!(db.name(), other.name());
    let name = other.name().to_owned();
    drop(other);
    let mut conn = PgConnection::connect_with(&cluster.server().maintenance_options())
        .await
        .expect("connect");
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut conn)
            .await
            .expect("query pg_database");
    assert!(!exists, "{name} was not dropped");
    conn.close().await.expect("close");

    let dir = cluster.dir().to_owned();
    drop(cluster);
    assert!(!dir.exists());
    // Its database went with the cluster: dropping it has nothing to do.
    drop(db);
}

#[test]
fn reserved_and_invalid_settings_are_refused() {
    for (name, value) in [("port", "5433"), ("logging_collector", "on"), ("a=b", "c")] {
        let err = Cluster::builder()
            .setting(name, value)
            .start_blocking()
            .expect_err("refused");
        assert!(err.to_string().contains(name), "{err}");
    }
}

#[test]
fn a_bad_setting_fails_the_start_with_the_servers_complaint() {
    let err = Cluster::builder()
        .setting("no_such_setting", "1")
        .start_blocking()
        .expect_err("start fails");
    // The server's own words, from the log tail in the error.
    let message = format!("{err:?}");
    assert!(
        message.contains("unrecognized configuration parameter \"no_such_setting\""),
        "{message}"
    );
}
