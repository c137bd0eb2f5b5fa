//! Where the tables are and what a session can do to the protocol: the schema is a setting,
//! every statement names it, and no `search_path`, same-named object or string and encoding
//! setting of a session changes what the protocol reads or writes.

mod common;

use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::{credit, credit_raw, send, TestApp};
use http::request::Parts;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use tower_inbox::outbox::{Dispatcher, EffectStatus, HttpTransport, Outbox};
use tower_inbox::producer::TrustedHeader;
use tower_inbox::quarantine::{Quarantine, QuarantineFilter};
use tower_inbox::schema::{migrate_schema, Schema};
use tower_inbox::{migrate, InboxLayer, InboxTx, Producer, ProducerError};
use tower_inbox_testdb::TestDatabase;

const CREDITS_SCHEMA: &str = include_str!("../examples/credits/schema.sql");

/// A fresh database with the credits tables, and the inbox in `schema` (migrated twice, to
/// show it is idempotent).
async fn database_with(schema: &Schema) -> (TestDatabase, PgPool) {
    let db = TestDatabase::create().await.expect("db");
    let pool = db.pool(8).await;
    migrate_schema(&pool, schema).await.expect("migrate");
    migrate_schema(&pool, schema).await.expect("migrate again");
    sqlx::raw_sql(CREDITS_SCHEMA)
        .execute(&pool)
        .await
        .expect("credits tables");
    (db, pool)
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test]
async fn the_schema_is_one_setting_and_every_component_follows_it() {
    let schema = Schema::new("payments_inbox").unwrap();
    let (_db, pool) = database_with(&schema).await;
    let hook = Router::new().route("/hook", post(|| async { StatusCode::OK }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, hook).await });
    let layer = common::credits::inbox_layer(pool.clone())
        .schema(schema.clone())
        .build()
        .unwrap();
    let router = common::credits::routes_with_webhook(pool.clone(), layer, Some(url));

    let first = send(&router, credit("a1", Some("k"), Some("app"), 5)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(send(&router, credit("a1", Some("k"), Some("app"), 5))
        .await
        .replayed());
    let conflict = send(&router, credit("a1", Some("k"), Some("app"), 6)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");

    assert_eq!(
        count(&pool, "select count(*) from payments_inbox.consumer_inbox").await,
        1
    );
    assert_eq!(
        count(
            &pool,
            "select count(*) from pg_namespace where nspname = 'tower_inbox'"
        )
        .await,
        0,
        "nothing went to the default schema"
    );
    // The migrations are recorded in the schema they created.
    assert!(
        count(
            &pool,
            "select count(*) from payments_inbox._sqlx_migrations"
        )
        .await
            > 0
    );

    // The effect went to this schema's outbox, and this schema's dispatcher delivers it.
    let dispatcher = Dispatcher::builder(
        pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .schema(schema.clone())
    .build()
    .unwrap();
    assert_eq!(dispatcher.dispatch_due().await.unwrap().delivered, 1);
    let effect: String = sqlx::query_scalar("select effect_id from payments_inbox.message_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    let entry = Outbox::new(pool.clone())
        .with_schema(schema.clone())
        .entry(&tower_inbox::outbox::EffectId::new(effect))
        .await
        .unwrap()
        .expect("effect");
    assert_eq!(entry.status, EffectStatus::Delivered);
    // The conflict is in this schema's quarantine.
    let open = Quarantine::new(pool.clone())
        .with_schema(schema)
        .list(QuarantineFilter::Open, 10)
        .await
        .unwrap();
    assert_eq!(open.len(), 1);
}

#[tokio::test]
async fn two_schemas_in_one_database_keep_their_own_tables_and_migration_records() {
    let a = Schema::new("inbox_a").unwrap();
    let b = Schema::new("inbox_b").unwrap();
    let (_db, pool) = database_with(&a).await;
    migrate_schema(&pool, &b).await.expect("migrate b");
    // The application's own sqlx migrations table, if any, is not ours: none was made in
    // public.
    assert_eq!(
        count(
            &pool,
            "select count(*) from pg_tables where tablename = '_sqlx_migrations'
             and schemaname not in ('inbox_a', 'inbox_b')"
        )
        .await,
        0
    );
    let applied = |schema: &'static str| {
        let pool = pool.clone();
        async move {
            count(
                &pool,
                &format!("select count(*) from {schema}._sqlx_migrations where success"),
            )
            .await
        }
    };
    assert_eq!(applied("inbox_a").await, applied("inbox_b").await);
    assert_eq!(
        applied("inbox_a").await,
        tower_inbox::schema::MIGRATOR.iter().count() as i64
    );

    let router_a = layered(&pool, &a);
    let router_b = layered(&pool, &b);
    assert_eq!(
        send(&router_a, credit("a1", Some("k"), Some("app"), 1))
            .await
            .status,
        StatusCode::CREATED
    );
    // The same key is new in the other schema: another inbox entirely.
    let other = send(&router_b, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    assert_eq!(
        count(&pool, "select count(*) from inbox_a.consumer_inbox").await,
        1
    );
    assert_eq!(
        count(&pool, "select count(*) from inbox_b.consumer_inbox").await,
        1
    );
}

fn layered(pool: &PgPool, schema: &Schema) -> Router {
    let layer = common::credits::inbox_layer(pool.clone())
        .schema(schema.clone())
        .build()
        .unwrap();
    common::credits::routes(pool.clone(), layer)
}

/// A handler that, before its business write, points its session's `search_path` at
/// `public` (for good: `set`, not `set local`, on a pool of one connection) where
/// look-alikes of the inbox table and of `now()` wait.
#[tokio::test]
async fn a_handler_that_changes_search_path_cannot_redirect_the_protocol() {
    let app = TestApp::with_pool_size(1).await;
    sqlx::raw_sql(
        "create table public.consumer_inbox (like tower_inbox.consumer_inbox including all);
         create table public.inbox_quarantine (like tower_inbox.inbox_quarantine including all);
         create function public.now() returns timestamptz language sql
             as $$ select timestamptz '2001-01-01' $$;
         create function public.clock_timestamp() returns timestamptz language sql
             as $$ select timestamptz '2001-01-01' $$;",
    )
    .execute(&app.pool)
    .await
    .expect("look-alikes");
    let router = Router::new()
        .route(
            "/accounts/{account}/credits",
            post(|mut tx: InboxTx| async move {
                tx.execute("set search_path to public, pg_catalog")
                    .await
                    .expect("set search_path");
                sqlx::query(
                    "insert into credit_account (account_id, balance) values ('a1', 1)
                     on conflict (account_id) do update set balance = credit_account.balance + 1",
                )
                .execute(&mut *tx)
                .await
                .expect("write");
                (StatusCode::CREATED, "credited")
            }),
        )
        .layer(
            InboxLayer::builder(app.pool.clone(), "credits")
                .producer(TrustedHeader::new("x-producer"))
                .build()
                .unwrap(),
        );
    for _ in 0..3 {
        let reply = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let conflict = send(&router, credit("a1", Some("k"), Some("app"), 2)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    let other = send(&router, credit("a1", Some("k2"), Some("app"), 1)).await;
    assert_eq!(other.status, StatusCode::CREATED);

    assert_eq!(
        app.balance("a1").await,
        Some(2),
        "two commands, each applied once"
    );
    let recent: i64 = count(
        &app.pool,
        "select count(*) from tower_inbox.consumer_inbox
         where processed_at > pg_catalog.now() - interval '1 hour'",
    )
    .await;
    assert_eq!(
        recent, 2,
        "both recorded in the inbox, on the server's clock"
    );
    assert_eq!(
        count(&app.pool, "select count(*) from public.consumer_inbox").await,
        0
    );
    assert_eq!(
        count(&app.pool, "select count(*) from public.inbox_quarantine").await,
        0
    );
    assert_eq!(
        count(
            &app.pool,
            "select count(*) from tower_inbox.inbox_quarantine"
        )
        .await,
        1
    );
}

/// Takes the producer from `x-producer` as UTF-8 (the example's `TrustedHeader` accepts
/// visible ASCII only).
fn utf8_producer(parts: &Parts) -> Result<Producer, ProducerError> {
    let value = parts
        .headers
        .get("x-producer")
        .ok_or_else(|| ProducerError::new("no x-producer"))?;
    let name = std::str::from_utf8(value.as_bytes())
        .map_err(|_| ProducerError::new("x-producer is not UTF-8"))?;
    Producer::new(name)
}

/// The credits example with a UTF-8 producer scope, on `pool`.
fn credits_on(pool: &PgPool) -> Router {
    let layer = common::credits::inbox_layer(pool.clone())
        .producer(utf8_producer)
        .build()
        .unwrap();
    common::credits::routes(pool.clone(), layer)
}

#[tokio::test]
async fn hostile_string_and_encoding_settings_change_no_identity() {
    let app = TestApp::new().await;
    // Every connection of this pool reads literals the old way, lets `\'` through, and
    // converts what the client sends from LATIN1.
    let hostile = PgPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(
                    "set standard_conforming_strings = off;
                     set backslash_quote = on;
                     set escape_string_warning = off;
                     set client_encoding = 'LATIN1'",
                )
                .await?;
                Ok(())
            })
        })
        .connect_with(app.db.connect_options())
        .await
        .expect("hostile pool");
    let encoding: String = sqlx::query_scalar("show client_encoding")
        .fetch_one(&hostile)
        .await
        .unwrap();
    assert_eq!(encoding, "LATIN1");

    let producer = "pá'y\\ments ✓";
    let key = r#""a\\b'c""#; // the key a\b'c, as an RFC 8941 string
    let request = |delta: i64| {
        let mut request = credit_raw("a1", Some(key), None, format!(r#"{{"delta": {delta}}}"#));
        request.headers_mut().insert(
            "x-producer",
            http::HeaderValue::from_bytes(producer.as_bytes()).unwrap(),
        );
        request
    };
    let first = send(&credits_on(&hostile), request(5)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    // A retry on a connection with the server's own settings is the same command.
    let retry = send(&credits_on(&app.pool), request(5)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    // And back on a hostile one.
    assert!(send(&credits_on(&hostile), request(5)).await.replayed());
    let conflict = send(&credits_on(&hostile), request(6)).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");

    let (stored_producer, stored_key): (String, String) =
        sqlx::query_as("select producer_name, message_id from tower_inbox.consumer_inbox")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(stored_producer, producer);
    assert_eq!(stored_key, "a\\b'c");
    assert_eq!(app.ledger_rows("a1").await, 1);
}

#[tokio::test]
async fn the_default_migrate_makes_the_tower_inbox_schema() {
    let db = TestDatabase::create().await.expect("db");
    let pool = db.pool(2).await;
    migrate(&pool).await.expect("migrate");
    assert_eq!(
        count(&pool, "select count(*) from tower_inbox.consumer_inbox").await,
        0
    );
    // The pool's own connections keep the server's search_path.
    let path: String = sqlx::query_scalar("show search_path")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!path.contains("tower_inbox"), "{path}");
}
