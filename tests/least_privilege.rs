//! Least privilege: the service runs as a role that is neither superuser nor owner, with
//! only `tower_inbox::schema::grant_statements`' grants, and a missing grant is a clear error.
//!
//! Every `TestApp` test (protocol, outbox, retention, waiting, ...) runs its service on such
//! a role (`TestApp::pool`); this file checks that the role really is one, that the grants
//! cover exactly the crate's tables, and what happens without them.

mod common;

use std::time::Duration;

use common::{credit, send, TestApp};
use http::StatusCode;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{Claim, Inbox, InboxError};
use tower_inbox::retention::{PurgedTable, Purger, RetentionPolicy};
use tower_inbox::schema::{grant_statements, Access, Schema};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

const WAIT: Duration = Duration::from_secs(5);

fn identity(key: &str) -> MessageIdentity {
    MessageIdentity::new(
        "credits",
        Producer::new("app").unwrap(),
        MessageKey::new(key).unwrap(),
    )
}

/// Grants `statements` to nothing else: runs them as the owner.
async fn run_as_owner(app: &TestApp, statements: &[String]) {
    for statement in statements {
        sqlx::query(statement)
            .execute(&app.owner)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
}

#[tokio::test]
async fn the_service_role_is_neither_superuser_nor_owner_and_the_grants_cover_the_crates_tables() {
    let app = TestApp::new().await;
    let (user, session, superuser, create_role, create_db, bypass_rls, memberships): (
        String,
        String,
        bool,
        bool,
        bool,
        bool,
        i64,
    ) = sqlx::query_as(
        "select current_user::text, session_user::text, r.rolsuper, r.rolcreaterole,
                r.rolcreatedb, r.rolbypassrls,
                (select count(*) from pg_auth_members m where m.member = r.oid)
         from pg_roles r where r.rolname = current_user",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(user, app.role.name());
    assert_eq!(session, user, "logged in as the role, not SET ROLE");
    assert!(!superuser && !create_role && !create_db && !bypass_rls);
    assert_eq!(
        memberships, 0,
        "member of no role (no pg_read_all_stats either)"
    );

    let (owned_tables, owns_schema): (i64, bool) = sqlx::query_as(
        "select (select count(*) from pg_tables where tableowner = current_user),
                exists (select 1 from pg_namespace
                        where nspname = 'tower_inbox' and nspowner = current_user::regrole)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(owned_tables, 0, "owns no table at all");
    assert!(!owns_schema);

    // Every table the migrations made, and only those, is granted; not the migrations' record.
    let granted: Vec<(String, bool, bool, bool, bool, bool)> = sqlx::query_as(
        "select tablename::text,
                has_table_privilege(current_user, format('tower_inbox.%I', tablename), 'select'),
                has_table_privilege(current_user, format('tower_inbox.%I', tablename), 'insert'),
                has_table_privilege(current_user, format('tower_inbox.%I', tablename), 'update'),
                has_table_privilege(current_user, format('tower_inbox.%I', tablename), 'truncate'),
                has_table_privilege(current_user, format('tower_inbox.%I', tablename), 'trigger')
         from pg_tables where schemaname = 'tower_inbox' order by tablename",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    for (table, select, insert, update, truncate, trigger) in &granted {
        let crate_table = table != "_sqlx_migrations";
        assert_eq!(
            (*select, *insert, *update),
            (crate_table, crate_table, crate_table),
            "{table}"
        );
        assert!(!truncate && !trigger, "{table}");
    }
    assert_eq!(
        granted.len(),
        5,
        "four tables and _sqlx_migrations: {granted:?}"
    );

    // Migrations are the owner's: the service's role cannot run them, even with nothing
    // left to apply.
    let refused = tower_inbox::migrate(&app.pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("permission denied"), "{refused}");

    // The role can do the protocol's work: a command, its replay.
    let router = app.credits();
    let first = send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let again = send(&router, credit("a1", Some("k1"), Some("app"), 5)).await;
    assert!(again.replayed() && again.body == first.body);
}

#[tokio::test]
async fn a_role_without_the_grants_gets_a_clear_permission_error_not_a_panic() {
    let app = TestApp::new().await;
    let bare = app.db.login_role().await.expect("role");
    // The credits tables, so that only the inbox's grants are missing.
    run_as_owner(
        &app,
        &[format!(
            "grant select, insert, update on credit_account, credit_ledger to \"{}\"",
            bare.name()
        )],
    )
    .await;
    let pool = bare.pool(2);

    let inbox = Inbox::new(pool.clone());
    let err = match inbox
        .claim(identity("k1"), Fingerprint::of_bytes(b"{}"), "v1", WAIT)
        .await
    {
        Err(err) => err,
        Ok(claim) => panic!(
            "claimed without grants: {}",
            matches!(claim, Claim::Claimed(_))
        ),
    };
    assert!(matches!(err, InboxError::Database(_)), "{err:?}");
    assert!(!err.is_retryable(), "retrying cannot grant anything");
    let message = err.to_string();
    assert!(
        message.contains("permission denied for schema tower_inbox"),
        "names what is missing: {message}"
    );
    assert!(!message.contains('\n'), "one line: {message}");

    // Through the layer: a 500 internal problem, and nothing applied.
    let router = common::credits::router(pool.clone()).expect("router");
    let reply = send(&router, credit("a1", Some("k2"), Some("app"), 5)).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.problem_type(), "internal");
    assert_eq!(app.ledger_rows("a1").await, 0);
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn the_service_grants_alone_claim_and_record_but_cannot_purge() {
    let app = TestApp::new().await;
    let service = app.db.login_role().await.expect("role");
    run_as_owner(
        &app,
        &grant_statements(&Schema::default(), service.name(), Access::Service).unwrap(),
    )
    .await;
    let pool = service.pool(2);

    let inbox = Inbox::new(pool.clone());
    match inbox
        .claim(identity("k1"), Fingerprint::of_bytes(b"{}"), "v1", WAIT)
        .await
        .unwrap()
    {
        Claim::Claimed(message) => message.commit(None).await.unwrap(),
        _ => panic!("k1 was not first-seen"),
    };
    sqlx::query(
        "update tower_inbox.consumer_inbox
         set received_at = now() - interval '30 days', processed_at = now() - interval '30 days'",
    )
    .execute(&app.owner)
    .await
    .unwrap();

    let policy = RetentionPolicy::builder()
        .retry_horizon(Duration::from_secs(3600))
        .safety_margin(Duration::from_secs(3600))
        .build()
        .unwrap();
    let purge = |pool| Purger::builder(pool).inbox(policy.clone()).build().unwrap();
    let err = purge(pool.clone()).purge().await.unwrap_err();
    assert_eq!(err.table, PurgedTable::ConsumerInbox);
    assert!(
        err.to_string()
            .contains("permission denied for table consumer_inbox"),
        "{err}"
    );
    assert_eq!(app.inbox_rows().await, 1, "nothing deleted");

    // With the purge's grant added, the same purger deletes the old row.
    let purge_grants =
        grant_statements(&Schema::default(), service.name(), Access::ServiceAndPurge).unwrap();
    run_as_owner(&app, &purge_grants).await;
    let report = purge(pool).purge().await.unwrap();
    assert_eq!(report.rows(PurgedTable::ConsumerInbox), 1);
}
