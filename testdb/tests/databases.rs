//! Per-test databases against whatever server `server()` finds.

use sqlx::{Connection, PgConnection};
use tower_inbox_testdb::{app_database_url, server, ServerKind, TestDatabase};

async fn database_exists(name: &str) -> bool {
    let server = tokio::task::spawn_blocking(server)
        .await
        .expect("join")
        .expect("server");
    let mut conn = PgConnection::connect_with(&server.maintenance_options())
        .await
        .expect("connect to the maintenance database");
    let exists = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .expect("query pg_database");
    conn.close().await.expect("close");
    exists
}

#[test]
fn server_matches_the_requested_mode() {
    let server = server().expect("server");
    match std::env::var("TOWER_INBOX_TEST_PG").as_deref() {
        Ok("throwaway") => assert_eq!(server.kind(), ServerKind::Throwaway),
        Ok("local") => assert_eq!(server.kind(), ServerKind::Local),
        _ => {}
    }
    eprintln!(
        "using the {} server at {}",
        server.kind(),
        server.maintenance_url()
    );
}

#[tokio::test]
async fn parallel_databases_are_isolated_and_dropped() {
    let (a, b) = tokio::join!(TestDatabase::create(), TestDatabase::create());
    let (a, b) = (a.expect("database a"), b.expect("database b"));
    assert_ne!(a.name(), b.name());
    assert!(a.url().ends_with(&format!("/{}", a.name())), "{}", a.url());

    let pool_a = a.pool(2).await;
    let mut conn_b = PgConnection::connect(b.url()).await.expect("connect to b");

    sqlx::query("CREATE TABLE only_in_a (id int)")
        .execute(&pool_a)
        .await
        .expect("create table in a");
    let in_a: Option<String> = sqlx::query_scalar("SELECT to_regclass('only_in_a')::text")
        .fetch_one(&pool_a)
        .await
        .expect("look up in a");
    let in_b: Option<String> = sqlx::query_scalar("SELECT to_regclass('only_in_a')::text")
        .fetch_one(&mut conn_b)
        .await
        .expect("look up in b");
    assert_eq!(in_a.as_deref(), Some("only_in_a"));
    assert_eq!(in_b, None);

    let current: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&mut conn_b)
        .await
        .expect("current_database");
    assert_eq!(current, b.name());

    let (name_a, name_b) = (a.name().to_owned(), b.name().to_owned());
    // Dropped while the pool and the connection are still open: FORCE has
    // to end them.
    drop(a);
    drop(b);
    assert!(!database_exists(&name_a).await);
    assert!(!database_exists(&name_b).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn works_on_a_multi_thread_runtime() {
    let db = TestDatabase::create().await.expect("database");
    let mut conn = PgConnection::connect_with(&db.connect_options())
        .await
        .expect("connect");
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut conn)
        .await
        .expect("select");
    assert_eq!(one, 1);
    let name = db.name().to_owned();
    drop(db);
    assert!(!database_exists(&name).await);
}

#[tokio::test]
async fn many_databases_at_once() {
    let handles: Vec<_> = (0..8)
        .map(|i| {
            tokio::spawn(async move {
                let db = TestDatabase::create().await.expect("database");
                let pool = db.pool(1).await;
                let got: i32 = sqlx::query_scalar("SELECT $1")
                    .bind(i)
                    .fetch_one(&pool)
                    .await
                    .expect("select");
                assert_eq!(got, i);
                pool.close().await;
                db.name().to_owned()
            })
        })
        .collect();
    let mut names = Vec::new();
    for handle in handles {
        names.push(handle.await.expect("task"));
    }
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 8);
}

#[tokio::test]
async fn app_database_url_creates_once_and_reuses() {
    let name = format!("tower_inbox_app_test_{}", std::process::id());
    let (first, second) = tokio::join!(app_database_url(&name), app_database_url(&name));
    let (first, second) = (first.expect("first"), second.expect("second"));
    assert_eq!(first, second);

    let mut conn = PgConnection::connect(&first).await.expect("connect");
    let current: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&mut conn)
        .await
        .expect("current_database");
    conn.close().await.expect("close");

    let server = tokio::task::spawn_blocking(server)
        .await
        .expect("join")
        .expect("server");
    // Only a DATABASE_URL that names a database is handed back unchanged.
    if server.kind() != ServerKind::Env {
        assert_eq!(current, name);
    }
    if current == name {
        assert!(database_exists(&name).await);
        // Not a per-test database: clean it up by hand.
        let mut conn = PgConnection::connect_with(&server.maintenance_options())
            .await
            .expect("connect");
        sqlx::raw_sql(&format!("DROP DATABASE \"{name}\" WITH (FORCE)"))
            .execute(&mut conn)
            .await
            .expect("drop");
        conn.close().await.expect("close");
    }

    assert!(app_database_url("not a name").await.is_err());
}
