//! Test support for `tower-inbox`: finds a PostgreSQL server and hands out
//! isolated throwaway databases.
//!
//! - [`TestDatabase::create`] gives each test a fresh database, dropped when
//!   the value is dropped; [`TestDatabase::login_role`] adds a login role
//!   that is neither superuser nor owner, for least-privilege tests.
//! - [`app_database_url`] gives examples and benches a named database that
//!   persists between runs.
//! - [`server()`] tells which server is used and how it was found.
//! - [`Cluster`] starts a private server for a test that needs one: to read
//!   its log, to give it settings, or to set its clock off; to crash it and
//!   start it again, or to fail it over to a standby.
//! - [`PgBouncer`] puts a pooler in front of a server, and points it at
//!   another on a failover.
//!
//! The server is chosen once per process: `DATABASE_URL` if set, else a
//! server listening on `127.0.0.1:5432`, else a throwaway cluster started
//! from the local PostgreSQL binaries, shared by all test processes of a run
//! and stopped about ten seconds after the last one exits. Set
//! `TOWER_INBOX_TEST_PG` to `local` or `throwaway` to force one of the last
//! two. See [`server()`] for the details.
//!
//! ```no_run
//! use tower_inbox_testdb::TestDatabase;
//!
//! #[tokio::test]
//! async fn stores_rows() {
//!     let db = TestDatabase::create().await.expect("test database");
//!     let pool = db.pool(5).await;
//!     sqlx::query("CREATE TABLE t (id int)")
//!         .execute(&pool)
//!         .await
//!         .expect("create table");
//! }
//! # fn main() {}
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bouncer;
mod cluster;
mod database;
mod error;
mod owner;
mod postgres;
mod server;
mod throwaway;

pub use bouncer::{PgBouncer, PoolMode};
pub use cluster::{Cluster, ClusterBuilder, LogMark};
pub use database::{app_database_url, TestDatabase, TestRole};
pub use error::Error;
pub use server::{server, Server, ServerKind};
