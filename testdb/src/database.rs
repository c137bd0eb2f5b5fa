//! Per-test databases and named databases for examples and benches.
//!
//! (Over 400 lines: creating, cleaning up and connecting to a test database, with its login role, belong together; each piece is short.)

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError, Weak};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection};

use crate::cluster::Instance;
use crate::error::{Context, Error};
use crate::owner::{is_gone, owned_name, owner_pid};
use crate::server::{self, server_async, Server, ServerKind};

/// Prefix of every database [`TestDatabase::create`] makes; the creating
/// process's pid follows it, so leftovers of dead processes can be found.
const TEST_DB_PREFIX: &str = "tower_inbox_t_";

/// Upper bound for dropping a database from [`Drop`], which blocks.
const DROP_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`TestDatabase::pool`] waits for a free connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);

/// PostgreSQL's limit on identifier length, in bytes.
const MAX_IDENTIFIER_LEN: usize = 63;

static STALE_CLEANUP_STARTED: AtomicBool = AtomicBool::new(false);

/// A database of its own for one test, dropped when this value is dropped.
///
/// ```no_run
/// # async fn example() -> Result<(), tower_inbox_testdb::Error> {
/// use tower_inbox_testdb::TestDatabase;
///
/// let db = TestDatabase::create().await?;
/// let pool = db.pool(5).await;
/// sqlx::query("CREATE TABLE t (id int)").execute(&pool).await.expect("create table");
/// # Ok(())
/// # }
/// ```
///
/// Dropping blocks the current thread until `DROP DATABASE ... WITH (FORCE)`
/// has run (PostgreSQL 13 or later), which also ends connections that pools
/// of the test still hold. Failures to drop are printed to stderr, never
/// raised. A database on a [`Cluster`](crate::Cluster) that is already gone
/// went with it, so there is nothing left to drop.
#[derive(Debug)]
pub struct TestDatabase {
    name: String,
    url: String,
    options: PgConnectOptions,
    maintenance: PgConnectOptions,
    /// The private cluster the database is on, if any.
    cluster: Option<Weak<Instance>>,
    /// The roles [`TestDatabase::login_role`] made, dropped after the database.
    roles: Mutex<Vec<String>>,
}

/// A login role of its own for one [`TestDatabase`]: not a superuser, allowed nothing but
/// what the test grants it, and dropped right after the database.
#[derive(Debug, Clone)]
pub struct TestRole {
    name: String,
    options: PgConnectOptions,
}

impl TestRole {
    /// The role's name, as a statement would quote it (`GRANT ... TO "<name>"`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connect options for the database as this role.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// A pool of at most `max_connections` connections to the database as this role, as
    /// [`TestDatabase::pool`] makes them.
    pub fn pool(&self, max_connections: u32) -> PgPool {
        lazy_pool(self.connect_options(), max_connections)
    }
}

impl TestDatabase {
    /// Creates a new, empty database on the [`server()`](crate::server()).
    ///
    /// Safe to call from many tests and processes at once: each database
    /// gets a unique name (`tower_inbox_t_<pid>_<counter>_<suffix>`) and is
    /// created from `template1`, which no test connects to.
    ///
    /// The first call in a process also drops, best effort, databases left
    /// behind by test processes that no longer exist (killed runs), when the
    /// server is on this machine.
    pub async fn create() -> Result<Self, Error> {
        let server = server_async().await?;
        let mut conn = connect_maintenance(server).await?;

        if server.is_on_this_machine() && !STALE_CLEANUP_STARTED.swap(true, Ordering::SeqCst) {
            drop_stale_databases(&mut conn).await;
        }

        Self::create_with(server, conn, None).await
    }

    /// Creates a new, empty database on the private cluster `cluster`,
    /// whose server is `server`.
    pub(crate) async fn create_on(server: &Server, cluster: Weak<Instance>) -> Result<Self, Error> {
        let conn = connect_maintenance(server).await?;
        Self::create_with(server, conn, Some(cluster)).await
    }

    /// Creates the database through `conn`, a maintenance connection to
    /// `server`, and closes `conn`.
    async fn create_with(
        server: &Server,
        mut conn: PgConnection,
        cluster: Option<Weak<Instance>>,
    ) -> Result<Self, Error> {
        let name = owned_name(TEST_DB_PREFIX);
        execute(
            &mut conn,
            &format!("CREATE DATABASE {}", quote_ident(&name)),
        )
        .await
        .context(|| format!("cannot create the test database {name}"))?;
        // The database exists either way; a failed goodbye is irrelevant.
        let _ = conn.close().await;

        Ok(Self {
            url: server.database_url(&name),
            options: server.database_options(&name),
            maintenance: server.maintenance_options(),
            name,
            cluster,
            roles: Mutex::default(),
        })
    }

    /// Creates a new login role for this database: no superuser, no `CREATEDB`, no
    /// `CREATEROLE`, no memberships, and a random password (which its connect options carry,
    /// so any `pg_hba.conf` method that takes a password works). It may connect, as `PUBLIC`
    /// may; everything else is the test's to grant, as the database's owner.
    ///
    /// Roles belong to the whole server: the role is dropped when this value is, after the
    /// database (which takes the role's privileges with it), and roles left by killed test
    /// processes go with their databases.
    pub async fn login_role(&self) -> Result<TestRole, Error> {
        let name = {
            let mut roles = self.roles.lock().unwrap_or_else(PoisonError::into_inner);
            let name = format!("{}_r{}", self.name, roles.len());
            roles.push(name.clone());
            name
        };
        // Random enough for a role that lives as long as a test: two randomly keyed hashes.
        let password = format!(
            "{:016x}{:016x}",
            RandomState::new().hash_one(&name),
            RandomState::new().hash_one(&name)
        );
        let mut conn = PgConnection::connect_with(&self.maintenance)
            .await
            .context(|| "cannot connect to the maintenance database")?;
        let sql = format!(
            "CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION \
             NOBYPASSRLS PASSWORD '{password}'",
            quote_ident(&name)
        );
        let created = execute(&mut conn, &sql)
            .await
            .context(|| format!("cannot create the test role {name}"));
        let _ = conn.close().await;
        created?;
        Ok(TestRole {
            options: self.options.clone().username(&name).password(&password),
            name,
        })
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A URL for the database, with the server's credentials.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Connect options for the database.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// A pool of at most `max_connections` connections to the database,
    /// waiting up to 30 s for a free connection.
    ///
    /// The pool connects lazily, so connection errors surface on first use.
    /// Call it inside the runtime the pool will be used on.
    pub async fn pool(&self, max_connections: u32) -> PgPool {
        lazy_pool(self.connect_options(), max_connections)
    }
}

fn lazy_pool(options: PgConnectOptions, max_connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_lazy_with(options)
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        // Held until the database is dropped: the cluster stops only after.
        let _cluster = match self.cluster.as_ref().map(Weak::upgrade) {
            Some(None) => return,
            Some(Some(instance)) => Some(instance),
            None => None,
        };
        // Drop cannot await, and the caller's runtime (if any) may be a
        // current-thread one that is busy running us: a thread with its own
        // runtime does the work.
        let maintenance = self.maintenance.clone();
        let name = std::mem::take(&mut self.name);
        let roles = std::mem::take(self.roles.get_mut().unwrap_or_else(PoisonError::into_inner));
        let spawned = std::thread::Builder::new()
            .name("tower-inbox-testdb-drop".to_owned())
            .spawn(move || -> Result<(), Error> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context(|| "cannot build a runtime")?;
                runtime.block_on(async {
                    tokio::time::timeout(DROP_TIMEOUT, drop_database(&maintenance, &name, &roles))
                        .await
                        .map_err(|_| {
                            Error::msg(format!(
                                "timed out after {}s dropping {name}",
                                DROP_TIMEOUT.as_secs()
                            ))
                        })?
                })
            });
        let outcome = match spawned {
            Ok(handle) => handle
                .join()
                .unwrap_or_else(|_| Err(Error::msg("the thread dropping it panicked"))),
            Err(err) => Err(Error::with_source("cannot spawn a thread", err)),
        };
        if let Err(err) = outcome {
            eprintln!(
                "tower-inbox-testdb: could not drop test database {}: {err:?}",
                self.url
            );
        }
    }
}

/// The URL of a database named `name` for an example or a bench, creating it
/// if it does not exist yet.
///
/// The server is chosen as by [`server()`](crate::server()). When that is
/// `DATABASE_URL` and the URL names a database, the URL is returned
/// unchanged: the user's choice wins. Otherwise the database `name` is
/// created if needed (concurrent callers are fine) and its URL returned.
///
/// `name` must be 1 to 63 ASCII letters, digits, `_` or `-`. The database
/// is kept, so repeated runs reuse it; on a throwaway server it disappears
/// with the server, which stays up while this process runs and for about ten
/// seconds after.
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let url = tower_inbox_testdb::app_database_url("tower_inbox_example").await?;
/// let pool = sqlx::PgPool::connect(&url).await?;
/// # drop(pool);
/// # Ok(())
/// # }
/// ```
pub async fn app_database_url(name: &str) -> Result<String, Error> {
    validate_name(name)?;
    let server = server_async().await?;
    if server.kind() == ServerKind::Env && server::url_names_database(server.maintenance_url()) {
        return Ok(server.maintenance_url().to_owned());
    }

    let mut conn = connect_maintenance(server).await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&mut conn)
            .await
            .context(|| format!("cannot look up database {name}"))?;
    if !exists {
        match execute(&mut conn, &format!("CREATE DATABASE {}", quote_ident(name))).await {
            Ok(_) => {}
            // Someone created it between our check and our CREATE:
            // duplicate_database, or unique_violation on pg_database's index
            // when both CREATEs ran at once.
            Err(sqlx::Error::Database(err))
                if matches!(err.code().as_deref(), Some("42P04" | "23505")) => {}
            Err(err) => {
                return Err(Error::with_source(
                    format!("cannot create database {name}"),
                    err,
                ))
            }
        }
    }
    let _ = conn.close().await;
    Ok(server.database_url(name))
}

async fn connect_maintenance(server: &Server) -> Result<PgConnection, Error> {
    PgConnection::connect_with(&server.maintenance_options())
        .await
        .context(|| {
            format!(
                "cannot connect to the maintenance database {} ({} server)",
                server::redact(server.maintenance_url()),
                server.kind()
            )
        })
}

/// Drops the database `name`, then `roles`: its privileges went with it, so nothing holds
/// them any more.
async fn drop_database(
    maintenance: &PgConnectOptions,
    name: &str,
    roles: &[String],
) -> Result<(), Error> {
    let mut conn = PgConnection::connect_with(maintenance)
        .await
        .context(|| "cannot connect to the maintenance database")?;
    let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(name));
    execute(&mut conn, &sql)
        .await
        .context(|| "DROP DATABASE failed")?;
    for role in roles {
        let sql = format!("DROP ROLE IF EXISTS {}", quote_ident(role));
        execute(&mut conn, &sql)
            .await
            .context(|| format!("DROP ROLE {role} failed"))?;
    }
    let _ = conn.close().await;
    Ok(())
}

/// Runs one statement over the simple query protocol (a `&str` without
/// arguments is not prepared), which `CREATE DATABASE` and `DROP DATABASE`
/// need since they cannot be prepared.
async fn execute(conn: &mut PgConnection, sql: &str) -> Result<(), sqlx::Error> {
    // `Executor::execute` returns a boxed `Send` future. `RawSql::execute`
    // would do the same, but as an `async fn` generic over the executor its
    // future fails the higher-ranked `Send` check of `tokio::spawn` in
    // callers ("implementation of `Executor` is not general enough").
    conn.execute(sql).await.map(|_| ())
}

/// Drops test databases whose creating process is gone. Best effort: a
/// failure only means leftovers stay until the next attempt.
async fn drop_stale_databases(conn: &mut PgConnection) {
    let names: Vec<String> = match sqlx::query_scalar(
        r"SELECT datname::text FROM pg_database WHERE datname LIKE 'tower\_inbox\_t\_%'",
    )
    .fetch_all(&mut *conn)
    .await
    {
        Ok(names) => names,
        Err(err) => {
            eprintln!("tower-inbox-testdb: cannot list stale test databases: {err}");
            return;
        }
    };
    for name in names {
        if !owner_pid(&name, TEST_DB_PREFIX).is_some_and(is_gone) {
            continue;
        }
        let sql = format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            quote_ident(&name)
        );
        if let Err(err) = execute(conn, &sql).await {
            eprintln!("tower-inbox-testdb: cannot drop stale test database {name}: {err}");
        }
    }
    // Their roles (`<database>_r<n>`), whose privileges went with the databases.
    let roles: Vec<String> = match sqlx::query_scalar(
        r"SELECT rolname::text FROM pg_roles WHERE rolname LIKE 'tower\_inbox\_t\_%'",
    )
    .fetch_all(&mut *conn)
    .await
    {
        Ok(roles) => roles,
        Err(err) => {
            eprintln!("tower-inbox-testdb: cannot list stale test roles: {err}");
            return;
        }
    };
    for role in roles {
        if !owner_pid(&role, TEST_DB_PREFIX).is_some_and(is_gone) {
            continue;
        }
        if let Err(err) =
            execute(conn, &format!("DROP ROLE IF EXISTS {}", quote_ident(&role))).await
        {
            eprintln!("tower-inbox-testdb: cannot drop stale test role {role}: {err}");
        }
    }
}

fn validate_name(name: &str) -> Result<(), Error> {
    let valid = !name.is_empty()
        && name.len() <= MAX_IDENTIFIER_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if valid {
        Ok(())
    } else {
        Err(Error::msg(format!(
            "invalid database name {name:?}: use 1 to {MAX_IDENTIFIER_LEN} ASCII letters, \
             digits, `_` or `-`"
        )))
    }
}

/// `name` as a quoted SQL identifier.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>(_: T) {}

    /// Compile-time check: tests must be able to `tokio::spawn` these.
    #[test]
    fn futures_are_send() {
        // Never polled; the futures are dropped unstarted.
        assert_send(TestDatabase::create());
        assert_send(app_database_url("x"));
    }

    #[test]
    fn test_database_names_are_valid() {
        validate_name(&owned_name(TEST_DB_PREFIX)).expect("valid name");
    }

    #[test]
    fn validates_names() {
        validate_name("tower_inbox_example").expect("valid");
        validate_name("bench-1").expect("valid");
        assert!(validate_name("").is_err());
        assert!(validate_name("a b").is_err());
        assert!(validate_name("x\"; DROP").is_err());
        assert!(validate_name(&"a".repeat(64)).is_err());
    }

    #[test]
    fn quotes_identifiers() {
        assert_eq!(quote_ident("plain"), "\"plain\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
