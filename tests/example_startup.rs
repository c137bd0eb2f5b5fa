//! The example service's startup failures: one line naming the culprit, a non-zero exit, and
//! nothing done to the database before the address is bound.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tower_inbox_testdb::TestDatabase;

/// Runs the example with `env` until it exits; fails the test if it runs past `limit`.
fn run(env: &[(&str, &str)], limit: Duration) -> (Output, Duration) {
    let mut command = Command::new(common::example::binary("credits"));
    command
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in env {
        command.env(name, value);
    }
    let started = Instant::now();
    let mut child = command.spawn().expect("start the example");
    loop {
        if child.try_wait().expect("wait for the example").is_some() {
            break;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("the example still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = started.elapsed();
    (child.wait_with_output().expect("example output"), elapsed)
}

/// The example failed, with exactly one line of its own on stderr (its log lines at warn and
/// above aside): that line.
fn the_one_error_line(output: &Output) -> String {
    assert!(!output.status.success(), "the example exited successfully");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("credits: "))
        .collect();
    assert_eq!(lines.len(), 1, "stderr: {stderr}");
    assert!(!stderr.contains("Error:"), "a Debug dump: {stderr}");
    lines[0].to_owned()
}

#[test]
fn a_closed_database_port_is_one_line_naming_it_and_the_variable() {
    let (output, _) = run(
        &[
            ("DATABASE_URL", "postgres://postgres@127.0.0.1:1/x"),
            ("BIND_ADDR", "127.0.0.1:0"),
        ],
        Duration::from_secs(20),
    );
    let line = the_one_error_line(&output);
    assert!(line.contains("127.0.0.1:1"), "{line}");
    assert!(line.contains("DATABASE_URL"), "{line}");
}

#[test]
fn a_malformed_database_url_says_so() {
    let (output, _) = run(
        &[("DATABASE_URL", "not a url"), ("BIND_ADDR", "127.0.0.1:0")],
        Duration::from_secs(20),
    );
    let line = the_one_error_line(&output);
    assert!(
        line.contains("DATABASE_URL is not a valid PostgreSQL URL"),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_taken_address_is_named_and_the_database_left_untouched() {
    let db = TestDatabase::create().await.expect("test database");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = taken.local_addr().expect("address").to_string();
    let url = db.url().to_owned();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("BIND_ADDR", address.as_str()),
    ];
    let (output, _) = tokio::task::spawn_blocking({
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move || {
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (&k[..], &v[..])).collect();
            run(&env, Duration::from_secs(20))
        }
    })
    .await
    .expect("run the example");
    let line = the_one_error_line(&output);
    assert!(line.contains(&address), "{line}");
    assert!(line.contains("BIND_ADDR"), "{line}");
    let pool = db.pool(1).await;
    let schemas: i64 =
        sqlx::query_scalar("select count(*) from pg_namespace where nspname = 'tower_inbox'")
            .fetch_one(&pool)
            .await
            .expect("count schemas");
    assert_eq!(schemas, 0, "the example migrated before it had its address");
    drop(taken);
}
