//! PgBouncer in front of a test's server: the pooler an application reaches
//! its database through, pointed at another server on a failover.

use std::fs;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use crate::error::{Context, Error};
use crate::owner::{left_over_in_temp_dir, owned_name};
use crate::postgres::{effective_uid, free_port, log_stdio, remove_dir_if_exists, Postgres};

/// How long PgBouncer may take to listen, and to exit.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The start of the name of each PgBouncer's directory, followed by its owner's pid.
const DIR_PREFIX: &str = "tower-inbox-pgbouncer-";

/// How PgBouncer hands server connections to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// A client keeps one server connection for as long as it is connected.
    Session,
    /// A client holds a server connection only during a transaction.
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Transaction => "transaction",
        }
    }
}

/// A PgBouncer of the test's own, on a free port of 127.0.0.1, forwarding
/// every database to one PostgreSQL server as the superuser `postgres`
/// (trust authentication); stopped and its directory removed when dropped.
///
/// Needs the `pgbouncer` program (Debian and Ubuntu: `apt-get install
/// pgbouncer`), on PATH or in `/usr/sbin`. As root it runs as the `postgres`
/// user, as the clusters do.
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_inbox_testdb::{Cluster, PgBouncer, PoolMode};
///
/// let primary = Cluster::builder().start().await?;
/// let bouncer = PgBouncer::start(primary.port(), PoolMode::Session)?;
/// let url = bouncer.url("postgres"); // what the application connects to
/// // ... on a failover, once another server is primary:
/// # let other_port = 0;
/// bouncer.point_at(other_port)?;
/// # let _ = url; Ok(())
/// # }
/// ```
pub struct PgBouncer {
    dir: PathBuf,
    port: u16,
    mode: PoolMode,
    server_connections: u32,
    child: Option<Child>,
}

impl PgBouncer {
    /// Starts PgBouncer in front of the server on 127.0.0.1:`upstream_port`
    /// and waits until it listens. Blocks the current thread (under a
    /// second).
    pub fn start(upstream_port: u16, mode: PoolMode) -> Result<Self, Error> {
        Self::start_for(upstream_port, mode, &[], 40)
    }

    /// As [`start`](Self::start), letting in `users` (roles of the server,
    /// such as a [`TestRole`](crate::TestRole)'s) besides `postgres`, with at
    /// most `server_connections` server connections per user and database
    /// (40 for [`start`](Self::start)). PgBouncer asks no password, but lets
    /// in only the users its auth file names, and logs in to the server as
    /// the same user. One server connection makes every client's
    /// transactions take turns on it.
    pub fn start_for(
        upstream_port: u16,
        mode: PoolMode,
        users: &[&str],
        server_connections: u32,
    ) -> Result<Self, Error> {
        let program = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .map(PathBuf::from)
            .chain(std::env::var_os("PATH").into_iter().flat_map(|paths| {
                std::env::split_paths(&paths)
                    .map(|dir| dir.join("pgbouncer"))
                    .collect::<Vec<_>>()
            }))
            .find(|path| path.is_file())
            .ok_or_else(|| {
                Error::msg(
                    "pgbouncer is not installed (Debian and Ubuntu: apt-get install pgbouncer)",
                )
            })?;
        let pg = Postgres::find(effective_uid()?)?;
        static STALE: Once = Once::new();
        STALE.call_once(remove_stale_bouncers);
        let dir = std::env::temp_dir().join(owned_name(DIR_PREFIX));
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&dir)
            .context(|| format!("cannot create {}", dir.display()))?;
        let mut bouncer = Self {
            dir,
            port: free_port()?,
            mode,
            server_connections,
            child: None,
        };
        // PgBouncer writes its pid file and log here as the server user.
        pg.give_to_server(&bouncer.dir)?;
        let auth: String = std::iter::once("postgres")
            .chain(users.iter().copied())
            .map(|user| format!("\"{}\" \"\"\n", user.replace('"', "\"\"")))
            .collect();
        fs::write(bouncer.dir.join("users.txt"), auth)
            .context(|| "cannot write PgBouncer's auth file")?;
        bouncer.write_config(upstream_port)?;
        let ini = bouncer.dir.join("pgbouncer.ini");
        let log = bouncer.dir.join("pgbouncer.log");
        let child = pg
            .server_user_command(&program, &[ini.as_os_str()])
            .current_dir(&bouncer.dir)
            .stdin(Stdio::null())
            .stdout(log_stdio(&log)?)
            .stderr(log_stdio(&log)?)
            .spawn()
            .context(|| format!("cannot start {}", program.display()))?;
        bouncer.child = Some(child);
        let deadline = Instant::now() + TIMEOUT;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, bouncer.port));
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            let exited = bouncer
                .child
                .as_mut()
                .and_then(|child| child.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() >= deadline {
                return Err(Error::msg(format!(
                    "PgBouncer did not listen on {addr}; its log:\n{}",
                    fs::read_to_string(&log).unwrap_or_default()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(bouncer)
    }

    /// The port PgBouncer listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of `database` through PgBouncer, as the superuser `postgres`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Sends new server connections to 127.0.0.1:`upstream_port` from now on:
    /// rewrites the configuration and reloads it (SIGHUP), as an operator or
    /// a failover script does. Connections to the old server are not closed
    /// here; they fail when it is gone.
    pub fn point_at(&self, upstream_port: u16) -> Result<(), Error> {
        self.write_config(upstream_port)?;
        self.signal("-HUP")
    }

    fn write_config(&self, upstream_port: u16) -> Result<(), Error> {
        let dir = self.dir.display();
        // extra_float_digits: sqlx sets it at startup, and PgBouncer refuses unknown
        // startup parameters.
        let config = format!(
            "[databases]\n\
             * = host=127.0.0.1 port={upstream_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/users.txt\n\
             pool_mode = {mode}\n\
             max_client_conn = 1000\n\
             default_pool_size = {server_connections}\n\
             ignore_startup_parameters = extra_float_digits\n\
             server_login_retry = 1\n\
             pidfile = {dir}/pgbouncer.pid\n",
            port = self.port,
            mode = self.mode.as_str(),
            server_connections = self.server_connections,
        );
        // Written beside and renamed, so a reload never reads half a file.
        let path = self.dir.join("pgbouncer.ini");
        let next = self.dir.join("pgbouncer.ini.next");
        fs::write(&next, config).context(|| format!("cannot write {}", next.display()))?;
        fs::rename(&next, &path).context(|| format!("cannot replace {}", path.display()))
    }

    /// Sends `signal` (`-HUP`, `-INT`) to PgBouncer itself (the pid in its
    /// pid file: as root, the child is `runuser`).
    fn signal(&self, signal: &str) -> Result<(), Error> {
        let pid = read_pid(&self.dir.join("pgbouncer.pid"))?;
        let status = Command::new("kill")
            .args([signal, &pid])
            .status()
            .context(|| "cannot run kill")?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::msg(format!(
                "`kill {signal} {pid}` failed ({status})"
            )))
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGINT: PgBouncer's safe shutdown; its runner exits with it.
            let _ = self.signal("-INT");
            let deadline = Instant::now() + TIMEOUT;
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if matches!(child.try_wait(), Ok(None)) {
                let _ = self.signal("-KILL");
                let _ = child.kill();
            }
            let _ = child.wait();
        }
        if let Err(err) = remove_dir_if_exists(&self.dir) {
            eprintln!("tower-inbox-testdb: {err}");
        }
    }
}

/// Stops the PgBouncers, and removes the directories, of test processes that no longer exist
/// (a killed run never dropped its [`PgBouncer`]). Best effort: what fails stays for the
/// next run.
fn remove_stale_bouncers() {
    for dir in left_over_in_temp_dir(DIR_PREFIX) {
        if let Ok(pid) = read_pid(&dir.join("pgbouncer.pid")) {
            // Only the PgBouncer running on this directory's configuration: its pid may
            // since have gone to another process.
            let ini = dir.join("pgbouncer.ini");
            let runs_here = fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                cmdline
                    .split(|&b| b == 0)
                    .any(|arg| arg == ini.as_os_str().as_bytes())
            });
            if runs_here {
                let _ = Command::new("kill").args(["-TERM", &pid]).status();
            }
        }
        let _ = remove_dir_if_exists(&dir);
    }
}

fn read_pid(path: &Path) -> Result<String, Error> {
    let text = fs::read_to_string(path).context(|| format!("cannot read {}", path.display()))?;
    let pid = text.trim();
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::msg(format!("{} holds no pid", path.display())));
    }
    Ok(pid.to_owned())
}

#[cfg(test)]
mod tests {
    use sqlx::{Connection, PgConnection};

    use super::{PgBouncer, PoolMode};
    use crate::Cluster;

    async fn port_behind(url: &str) -> i32 {
        let mut conn = PgConnection::connect(url)
            .await
            .expect("connect through PgBouncer");
        // Unnamed: in transaction mode this session may get a server connection an earlier
        // one used, which still holds that one's named statements (PgBouncer 1.18 keeps no
        // track of them), and sqlx names each connection's first statement alike.
        sqlx::query_scalar("select current_setting('port')::int")
            .persistent(false)
            .fetch_one(&mut conn)
            .await
            .expect("read the server's port")
    }

    /// The failover step: pointed at another server, new connections reach it.
    #[tokio::test]
    async fn forwards_to_the_server_it_is_pointed_at() {
        let first = Cluster::builder().start().await.expect("cluster");
        let second = Cluster::builder().start().await.expect("cluster");
        let bouncer =
            PgBouncer::start(first.port(), PoolMode::Transaction).expect("start PgBouncer");
        let url = bouncer.url("postgres");
        assert_eq!(port_behind(&url).await, i32::from(first.port()));

        bouncer.point_at(second.port()).expect("repoint");
        // The reload is asynchronous: poll until a new session lands on the other server.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while port_behind(&url).await != i32::from(second.port()) {
            assert!(
                std::time::Instant::now() < deadline,
                "still the first server"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}
