//! Finding the PostgreSQL server that test databases are created on.
//! (Over 400 lines: the three places a server is found, and starting the throwaway one.)

use std::net::{SocketAddr, TcpStream};
use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

use crate::error::{Context, Error};
use crate::throwaway;

/// Environment variable that overrides how the server is chosen.
pub(crate) const MODE_VAR: &str = "TOWER_INBOX_TEST_PG";

/// Environment variable naming the server to use (rule 1).
pub(crate) const DATABASE_URL_VAR: &str = "DATABASE_URL";

/// The well-known address probed for a local server (rule 2).
const LOCAL_ADDR: ([u8; 4], u16) = ([127, 0, 0, 1], 5432);

/// Maintenance URL of a local server with the usual trust setup.
const LOCAL_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// How long to wait for something to answer on the local address.
const LOCAL_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Where a [`Server`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServerKind {
    /// The server named by `DATABASE_URL`.
    Env,
    /// A server that was already listening on `127.0.0.1:5432`.
    Local,
    /// A cluster started from the local PostgreSQL binaries, shared by all
    /// test processes of a run and stopped a few seconds after the last one
    /// exits.
    Throwaway,
    /// A private cluster of one test, started by [`Cluster`](crate::Cluster).
    Cluster,
}

impl std::fmt::Display for ServerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Env => "env",
            Self::Local => "local",
            Self::Throwaway => "throwaway",
            Self::Cluster => "cluster",
        })
    }
}

/// A PostgreSQL server this process may create and drop databases on.
///
/// Obtained from [`server()`], which lives for the rest of the process, or
/// from [`Cluster::server`](crate::Cluster::server).
#[derive(Debug)]
pub struct Server {
    kind: ServerKind,
    maintenance_url: String,
    maintenance_options: PgConnectOptions,
}

impl Server {
    pub(crate) fn new(kind: ServerKind, maintenance_url: String) -> Result<Self, Error> {
        let maintenance_options = PgConnectOptions::from_str(&maintenance_url)
            .context(|| format!("invalid PostgreSQL URL {}", redact(&maintenance_url)))?
            // CREATE/DROP DATABASE statements are noise in test logs.
            .disable_statement_logging();
        Ok(Self {
            kind,
            maintenance_url,
            maintenance_options,
        })
    }

    /// Where this server came from.
    pub fn kind(&self) -> ServerKind {
        self.kind
    }

    /// URL of the maintenance database, the one connected to for
    /// `CREATE DATABASE` and `DROP DATABASE`.
    ///
    /// With [`ServerKind::Env`] this is `DATABASE_URL` as given.
    pub fn maintenance_url(&self) -> &str {
        &self.maintenance_url
    }

    /// Connect options for the maintenance database.
    pub fn maintenance_options(&self) -> PgConnectOptions {
        self.maintenance_options.clone()
    }

    /// URL of the database `database` on this server, with the same
    /// credentials and parameters as the maintenance URL.
    pub fn database_url(&self, database: &str) -> String {
        with_database(&self.maintenance_url, database)
    }

    /// Connect options for the database `database` on this server.
    pub fn database_options(&self, database: &str) -> PgConnectOptions {
        self.maintenance_options.clone().database(database)
    }

    /// Whether the server runs on this machine, so that `/proc` tells whether
    /// the process that created a database is still alive.
    pub(crate) fn is_on_this_machine(&self) -> bool {
        match self.kind {
            ServerKind::Local | ServerKind::Throwaway | ServerKind::Cluster => true,
            ServerKind::Env => {
                let options = &self.maintenance_options;
                let host = options.get_host();
                options.get_socket().is_some()
                    || host.starts_with('/')
                    || matches!(host, "localhost" | "127.0.0.1" | "::1" | "[::1]")
            }
        }
    }
}

static SERVER: OnceLock<Result<Server, Error>> = OnceLock::new();

/// Finds (or starts) the PostgreSQL server for this process.
///
/// The first call decides, in this order:
///
/// 1. `DATABASE_URL`, if set: that server, whose URL database is the
///    maintenance database;
/// 2. otherwise, if something answers on `127.0.0.1:5432`:
///    `postgres://postgres@127.0.0.1:5432/postgres` (trust authentication);
/// 3. otherwise a throwaway cluster started from the local PostgreSQL
///    binaries, shared with the other test processes of the run and stopped
///    about ten seconds after the last of them exits.
///
/// `TOWER_INBOX_TEST_PG=local` forces rule 2 and `TOWER_INBOX_TEST_PG=throwaway`
/// forces rule 3 (`env` forces rule 1, `auto` or empty means the default).
///
/// This blocks (rule 3 may run `initdb` and wait for the server to start), so
/// call it from async code through [`tokio::task::spawn_blocking`]. The result,
/// success or failure, is cached for the life of the process.
pub fn server() -> Result<&'static Server, Error> {
    SERVER.get_or_init(discover).as_ref().map_err(Clone::clone)
}

/// [`server()`] for async callers: the blocking discovery runs on tokio's
/// blocking pool, so this works on current-thread and multi-thread runtimes.
pub(crate) async fn server_async() -> Result<&'static Server, Error> {
    if let Some(found) = SERVER.get() {
        return found.as_ref().map_err(Clone::clone);
    }
    tokio::task::spawn_blocking(server)
        .await
        .context(|| "the PostgreSQL server discovery task failed")?
}

/// What `TOWER_INBOX_TEST_PG` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Auto,
    Env,
    Local,
    Throwaway,
}

impl Mode {
    fn from_env() -> Result<Self, Error> {
        let value = match std::env::var(MODE_VAR) {
            Ok(value) => value,
            Err(std::env::VarError::NotPresent) => return Ok(Self::Auto),
            Err(err) => return Err(Error::with_source(format!("cannot read {MODE_VAR}"), err)),
        };
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Self::Auto),
            "env" => Ok(Self::Env),
            "local" => Ok(Self::Local),
            "throwaway" => Ok(Self::Throwaway),
            other => Err(Error::msg(format!(
                "{MODE_VAR}={other:?} is not understood; use `env`, `local`, `throwaway` or `auto`"
            ))),
        }
    }
}

fn discover() -> Result<Server, Error> {
    match Mode::from_env()? {
        Mode::Auto => {
            if let Some(url) = database_url_from_env()? {
                return Server::new(ServerKind::Env, url);
            }
            if local_server_answers() {
                return Server::new(ServerKind::Local, LOCAL_URL.to_owned());
            }
            throwaway_server().map_err(|err| {
                err.prefixed(&format!(
                    "{DATABASE_URL_VAR} is not set and nothing answers on 127.0.0.1:5432; "
                ))
            })
        }
        Mode::Env => match database_url_from_env()? {
            Some(url) => Server::new(ServerKind::Env, url),
            None => Err(Error::msg(format!(
                "{MODE_VAR}=env but {DATABASE_URL_VAR} is not set"
            ))),
        },
        Mode::Local => {
            if local_server_answers() {
                Server::new(ServerKind::Local, LOCAL_URL.to_owned())
            } else {
                let (ip, port) = LOCAL_ADDR;
                Err(Error::msg(format!(
                    "{MODE_VAR}=local but nothing answers on {}:{port}",
                    std::net::Ipv4Addr::from(ip)
                )))
            }
        }
        Mode::Throwaway => throwaway_server(),
    }
}

fn throwaway_server() -> Result<Server, Error> {
    let port = throwaway::ensure_running()?;
    Server::new(
        ServerKind::Throwaway,
        format!("postgres://postgres@127.0.0.1:{port}/postgres"),
    )
}

fn database_url_from_env() -> Result<Option<String>, Error> {
    match std::env::var(DATABASE_URL_VAR) {
        Ok(url) if url.trim().is_empty() => Ok(None),
        Ok(url) => Ok(Some(url.trim().to_owned())),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(err) => Err(Error::with_source(
            format!("cannot read {DATABASE_URL_VAR}"),
            err,
        )),
    }
}

fn local_server_answers() -> bool {
    TcpStream::connect_timeout(&SocketAddr::from(LOCAL_ADDR), LOCAL_PROBE_TIMEOUT).is_ok()
}

/// Whether `DATABASE_URL` itself names a database, as opposed to leaving it
/// to the driver's default.
pub(crate) fn url_names_database(url: &str) -> bool {
    let parts = UrlParts::split(url);
    !parts.path.trim_start_matches('/').is_empty()
        || query_pairs(parts.query).any(|(key, _)| key == "dbname")
}

/// `url` with its database replaced by `database`.
///
/// `database` must not need percent-encoding; this crate only ever passes
/// names made of ASCII letters, digits, `_` and `-`.
pub(crate) fn with_database(url: &str, database: &str) -> String {
    let parts = UrlParts::split(url);
    // A `dbname` parameter would override the path, so it has to go.
    let query: Vec<&str> = query_pairs(parts.query)
        .filter(|(key, _)| *key != "dbname")
        .map(|(_, pair)| pair)
        .collect();
    let mut out = format!("{}/{database}", parts.head);
    if !query.is_empty() {
        out.push('?');
        out.push_str(&query.join("&"));
    }
    out.push_str(parts.fragment);
    out
}

/// A URL cut into the pieces this crate rewrites. Delimiters follow RFC 3986,
/// where `/`, `?` and `#` cannot occur unescaped in the authority.
struct UrlParts<'a> {
    /// Scheme and authority, e.g. `postgres://user:pw@host:5432`.
    head: &'a str,
    /// The path including its leading `/`, possibly empty.
    path: &'a str,
    /// The query without its leading `?`, possibly empty.
    query: &'a str,
    /// The fragment including its leading `#`, possibly empty.
    fragment: &'a str,
}

impl<'a> UrlParts<'a> {
    fn split(url: &'a str) -> Self {
        let authority_start = url.find("://").map_or(0, |i| i + 3);
        let (before_fragment, fragment) = match url.find('#') {
            Some(i) => url.split_at(i),
            None => (url, ""),
        };
        let (before_query, query) = match before_fragment.find('?') {
            Some(i) => (&before_fragment[..i], &before_fragment[i + 1..]),
            None => (before_fragment, ""),
        };
        let path_start = before_query[authority_start.min(before_query.len())..]
            .find('/')
            .map_or(before_query.len(), |i| authority_start + i);
        Self {
            head: &before_query[..path_start],
            path: &before_query[path_start..],
            query,
            fragment,
        }
    }
}

/// Iterates over `(key, whole pair)` of a query string.
fn query_pairs(query: &str) -> impl Iterator<Item = (&str, &str)> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| (pair.split_once('=').map_or(pair, |(key, _)| key), pair))
}

/// A URL safe to put in an error message: without its password.
pub(crate) fn redact(url: &str) -> String {
    let parts = UrlParts::split(url);
    let authority_start = parts.head.find("://").map_or(0, |i| i + 3);
    let authority = &parts.head[authority_start..];
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!(
                    "{}{user}:***{}",
                    &parts.head[..authority_start],
                    &url[authority_start + at..]
                ),
                None => url.to_owned(),
            }
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_database_in_the_path() {
        assert_eq!(
            with_database("postgres://u:p@h:5432/postgres", "t1"),
            "postgres://u:p@h:5432/t1"
        );
        assert_eq!(
            with_database("postgres://u@h/postgres?sslmode=disable", "t1"),
            "postgres://u@h/t1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "t1"), "postgres://h/t1");
        assert_eq!(
            with_database("postgres://h?a=b", "t1"),
            "postgres://h/t1?a=b"
        );
    }

    #[test]
    fn drops_a_dbname_parameter() {
        assert_eq!(
            with_database("postgres:///?host=/run/postgresql&dbname=x&user=me", "t1"),
            "postgres:///t1?host=/run/postgresql&user=me"
        );
        assert_eq!(
            with_database("postgres://h/?dbname=x", "t1"),
            "postgres://h/t1"
        );
    }

    #[test]
    fn tells_whether_a_url_names_a_database() {
        assert!(url_names_database("postgres://h/app"));
        assert!(url_names_database("postgres://h?dbname=app"));
        assert!(!url_names_database("postgres://h"));
        assert!(!url_names_database("postgres://u@h:5432/"));
        assert!(!url_names_database("postgres://u@h:5432/?sslmode=disable"));
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("postgres://h/db"), "postgres://h/db");
    }

    #[test]
    fn maintenance_options_follow_the_url() {
        let server = Server::new(
            ServerKind::Env,
            "postgres://someone@db.example:6543/maint".to_owned(),
        )
        .expect("valid URL");
        let options = server.database_options("t1");
        assert_eq!(options.get_database(), Some("t1"));
        assert_eq!(options.get_host(), "db.example");
        assert_eq!(options.get_port(), 6543);
        assert_eq!(options.get_username(), "someone");
        assert_eq!(
            server.database_url("t1"),
            "postgres://someone@db.example:6543/t1"
        );
        assert!(!server.is_on_this_machine());
    }
}
