//! `tower-inbox grant` (feature `cli`): the statements it prints are the library's, and the
//! role it grants to can then do the service's work and no more.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::TestApp;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{Claim, Inbox};
use tower_inbox::schema::{grant_statements, Access, Schema};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

/// Runs the binary with `DATABASE_URL` set to `url`.
fn cli(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tower-inbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .env_remove("TOWER_INBOX_SCHEMA")
        .output()
        .expect("run tower-inbox")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn dry_run_prints_the_librarys_statements_without_connecting() {
    // Nothing listens there: a dry run must not need the database.
    let unreachable = "postgres://postgres@127.0.0.1:1/none";
    let printed = cli(
        unreachable,
        &[
            "grant",
            "Payments Svc",
            "--schema",
            "payments_inbox",
            "--dry-run",
        ],
    );
    assert!(printed.status.success(), "{}", text(&printed.stderr));
    let expected: String = grant_statements(
        &Schema::new("payments_inbox").unwrap(),
        "Payments Svc",
        Access::Service,
    )
    .unwrap()
    .iter()
    .map(|s| format!("{s};\n"))
    .collect();
    assert_eq!(text(&printed.stdout), expected);

    let with_purge = cli(unreachable, &["grant", "app", "--purge", "--dry-run"]);
    assert!(text(&with_purge.stdout).contains("grant delete on \"tower_inbox\".consumer_inbox"));

    let bad = cli(
        unreachable,
        &["grant", "app", "--schema", "Bad", "--dry-run"],
    );
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
}

#[tokio::test]
async fn grant_gives_a_role_the_service_privileges_and_names_a_missing_role() {
    let app = TestApp::new().await;
    let role = app.db.login_role().await.expect("role");
    let url = app.db.url();

    let granted = cli(url, &["grant", role.name()]);
    assert!(granted.status.success(), "{}", text(&granted.stderr));
    assert_eq!(
        text(&granted.stdout),
        format!(
            "schema tower_inbox (plain layout): granted the service privileges to {}\n",
            role.name()
        )
    );
    let can_delete: bool = sqlx::query_scalar(
        "select has_table_privilege($1, 'tower_inbox.consumer_inbox', 'delete')",
    )
    .bind(role.name())
    .fetch_one(&app.owner)
    .await
    .unwrap();
    assert!(!can_delete, "no DELETE without --purge");

    // The role can now claim.
    let inbox = Inbox::new(role.pool(1));
    let identity = MessageIdentity::new(
        "credits",
        Producer::new("app").unwrap(),
        MessageKey::new("k1").unwrap(),
    );
    let claim = inbox
        .claim(
            identity,
            Fingerprint::of_bytes(b"{}"),
            "v1",
            Duration::from_secs(5),
        )
        .await
        .expect("claim with the granted privileges");
    assert!(matches!(claim, Claim::Claimed(_)));

    let missing = cli(url, &["grant", "no_such_role"]);
    assert_eq!(missing.status.code(), Some(3));
    let err = text(&missing.stderr);
    assert!(
        err.starts_with("tower-inbox: granting to \"no_such_role\" on PostgreSQL at ")
            && err.contains("role \"no_such_role\" does not exist")
            && err.lines().count() == 1,
        "{err}"
    );
}
