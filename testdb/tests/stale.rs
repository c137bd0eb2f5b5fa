//! Leftovers of killed test processes are dropped by the next process.
//!
//! A binary of its own: the cleanup runs on the first `create()` of a
//! process, so nothing else may create a database here first.

use sqlx::{Connection, PgConnection};
use tower_inbox_testdb::{server, TestDatabase};

#[tokio::test]
async fn drops_databases_of_dead_processes() {
    let server = tokio::task::spawn_blocking(server)
        .await
        .expect("join")
        .expect("server");
    let mut conn = PgConnection::connect_with(&server.maintenance_options())
        .await
        .expect("connect");
    // Above any pid_max Linux allows (2^22), so never a live process.
    let stale = "tower_inbox_t_999999999_0_0";
    sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS \"{stale}\""))
        .execute(&mut conn)
        .await
        .expect("drop leftover");
    sqlx::raw_sql(&format!("CREATE DATABASE \"{stale}\""))
        .execute(&mut conn)
        .await
        .expect("create stale database");

    let db = TestDatabase::create().await.expect("database");

    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname::text FROM pg_database WHERE datname IN ($1, $2)")
            .bind(stale)
            .bind(db.name())
            .fetch_all(&mut conn)
            .await
            .expect("list");
    assert_eq!(names, vec![db.name().to_owned()]);
    conn.close().await.expect("close");
}
