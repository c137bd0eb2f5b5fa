//! A private PostgreSQL cluster for one test: its own data directory, port
//! and server log, gone when the test drops it.
//!
//! (Over 400 lines: the cluster, its builder and the removal of clusters
//! left behind share the directory layout; a sixth is their tests. Crashes
//! and standbys are in the submodules.)
//!
//! Each cluster lives in `<temp dir>/tower-inbox-cluster-<pid>_<n>_<suffix>/`
//! (`data/`, `sock/`, `server.log`, `initdb.log`), named after the process
//! that owns it. A process that was killed cannot stop its clusters, so each
//! start also stops and removes the clusters of processes that are gone.

use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::database::TestDatabase;
use crate::error::{Context, Error};
use crate::owner::{left_over_in_temp_dir, owned_name};
use crate::postgres::{
    effective_uid, remove_dir_if_exists, ClusterDirs, Launch, Postgres, StopMode,
};
use crate::server::{Server, ServerKind};

mod crash;
mod standby;

/// Start of the name of every cluster directory; the owner's pid follows.
const DIR_PREFIX: &str = "tower-inbox-cluster-";

/// How long the started process may take to exit once `pg_ctl stop` has
/// returned (`runuser` and `su` exit right after the server).
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// Settings the cluster makes itself: its port and address, and a log that
/// [`Cluster::log`] can read.
const RESERVED_SETTINGS: [&str; 5] = [
    "port",
    "listen_addresses",
    "unix_socket_directories",
    "logging_collector",
    "log_destination",
];

/// The library that fakes the server's clock.
const FAKETIME_LIB: &str = "libfaketime.so.1";

/// A PostgreSQL cluster of its own for one test, stopped and deleted when
/// dropped.
///
/// For tests that need the server itself: to read its log after driving the
/// service (no `ERROR` lines, no secret in a logged statement), to run it
/// with particular settings, or with its clock set off from the test's.
/// Everything else should use [`TestDatabase::create`], which shares one
/// server: a cluster costs an `initdb` and a server start, about 1 to 2 s.
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_inbox_testdb::Cluster;
///
/// let cluster = Cluster::builder()
///     .setting("log_statement", "all")
///     .clock_offset_seconds(-2 * 60 * 60) // the server's now() is two hours behind
///     .start()
///     .await?;
/// let db = cluster.database().await?;
/// let pool = db.pool(5).await;
///
/// let mark = cluster.log_mark()?;
/// sqlx::query("SELECT 1").execute(&pool).await?;
/// let log = cluster.log_since(mark)?;
/// assert!(!log.contains("ERROR:"), "{log}");
/// # Ok(())
/// # }
/// ```
///
/// The cluster has its own temporary directory (see [`Cluster::dir`]), a
/// free TCP port on 127.0.0.1, trust authentication for the superuser
/// `postgres`, UTF8 encoding and `fsync=off`. The server writes its log to
/// stderr, which goes to [`Cluster::log_path`]. As root, the server runs as
/// the `postgres` OS user, like the shared throwaway cluster.
///
/// Dropping the cluster, also while a failed test unwinds, stops the server
/// (fast shutdown, bounded) and removes the directory; it blocks the current
/// thread meanwhile. Databases made by [`Cluster::database`] go with it. Do
/// not keep a cluster in a `static`: statics are never dropped. A cluster
/// left behind by a killed test process is removed by the next start of a
/// cluster.
pub struct Cluster {
    server: Server,
    port: u16,
    instance: Arc<Instance>,
}

impl Cluster {
    /// A builder for a cluster with the default settings.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    /// The server, with the URL and connect options of its maintenance
    /// database (`postgres` as the superuser `postgres`) and of others.
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// The server's TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster's directory, removed on drop.
    pub fn dir(&self) -> &Path {
        &self.instance.dirs.base
    }

    /// The server log: what the server wrote to stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.instance.dirs.log_file
    }

    /// Creates a new, empty database on this cluster, dropped when the value
    /// is dropped, or with the cluster.
    pub async fn database(&self) -> Result<TestDatabase, Error> {
        TestDatabase::create_on(&self.server, Arc::downgrade(&self.instance)).await
    }

    /// The position of the end of the log, for [`Cluster::log_since`].
    pub fn log_mark(&self) -> Result<LogMark, Error> {
        let path = self.log_path();
        let meta = fs::metadata(path).context(|| format!("cannot inspect {}", path.display()))?;
        Ok(LogMark(meta.len()))
    }

    /// The whole server log, from the server's start.
    pub fn log(&self) -> Result<String, Error> {
        self.log_since(LogMark(0))
    }

    /// What the server logged after `mark`.
    ///
    /// A session's messages are in the log by the time the session's client
    /// has the response they came with: the server writes its log before it
    /// answers. Background processes (autovacuum, the checkpointer) log on
    /// their own schedule.
    pub fn log_since(&self, mark: LogMark) -> Result<String, Error> {
        let path = self.log_path();
        let mut text = Vec::new();
        File::open(path)
            .and_then(|mut file| {
                file.seek(SeekFrom::Start(mark.0))?;
                file.read_to_end(&mut text)
            })
            .context(|| format!("cannot read {}", path.display()))?;
        Ok(String::from_utf8_lossy(&text).into_owned())
    }
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster")
            .field("port", &self.port)
            .field("dir", &self.dir())
            .finish_non_exhaustive()
    }
}

/// A position in a [`Cluster`]'s log, from [`Cluster::log_mark`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct LogMark(u64);

/// How to start a [`Cluster`]; from [`Cluster::builder`].
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct ClusterBuilder {
    settings: Vec<(String, String)>,
    clock_offset_seconds: Option<i64>,
}

impl ClusterBuilder {
    /// Starts the server with the setting `name` set to `value`, as
    /// `postgres -c name=value`; e.g. `log_min_messages`, `log_statement`,
    /// `lock_timeout`.
    ///
    /// Settings apply in the order given, after the cluster's own
    /// (`fsync=off`), so a later one wins. The server refuses to start, and
    /// [`start`](Self::start) fails with its log, on an unknown name or a bad
    /// value. The cluster's port, address and logging to stderr
    /// (`port`, `listen_addresses`, `unix_socket_directories`,
    /// `logging_collector`, `log_destination`) cannot be changed.
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Runs the server under libfaketime with its wall clock `seconds` off
    /// the real one (negative: behind), so that `now()` in SQL differs from
    /// the test's clock by that much. The log's timestamps follow the
    /// server's clock too, but for a few lines.
    ///
    /// For tests about dates, not about server timeouts: libfaketime shows
    /// the real clock to code that runs while the server waits (for a lock,
    /// for the client, in `pg_sleep`), and the server's timeout handler is
    /// such code, as is some of the postmaster's logging. A
    /// `statement_timeout`, `lock_timeout` or idle timeout that expires
    /// during a wait then fires late or never with a positive offset; with a
    /// negative one, all the session's pending timeouts fire at once (a
    /// `statement_timeout` fires at a lock wait's `deadlock_timeout`).
    ///
    /// Needs libfaketime (Debian and Ubuntu: `apt-get install faketime`);
    /// without it [`start`](Self::start) fails and says so.
    pub fn clock_offset_seconds(mut self, seconds: i64) -> Self {
        self.clock_offset_seconds = Some(seconds);
        self
    }

    /// Creates and starts the cluster: `initdb`, then the server, waiting
    /// until it accepts connections.
    ///
    /// The work runs on tokio's blocking pool, so this works on
    /// current-thread and multi-thread runtimes.
    pub async fn start(self) -> Result<Cluster, Error> {
        tokio::task::spawn_blocking(move || self.start_blocking())
            .await
            .context(|| "the task starting the private PostgreSQL cluster failed")?
    }

    /// [`start`](Self::start) for code outside a runtime: blocks the current
    /// thread.
    pub fn start_blocking(self) -> Result<Cluster, Error> {
        let mut settings = vec![
            // Its data is thrown away with it.
            "fsync=off".to_owned(),
            "logging_collector=off".to_owned(),
            "log_destination=stderr".to_owned(),
        ];
        for (name, value) in &self.settings {
            check_setting_name(name)?;
            settings.push(format!("{name}={value}"));
        }
        let env = match self.clock_offset_seconds {
            Some(seconds) => faketime_env(&find_faketime(&faketime_dirs())?, seconds),
            None => Vec::new(),
        };
        let uid = effective_uid()?;
        let pg = Postgres::find(uid)?;
        remove_stale_clusters(&pg, uid);

        // From here on, dropping `instance` (also on an error) removes the
        // directory and stops what was started in it.
        let mut instance = Instance::create(pg)?;
        let dirs = &instance.dirs;
        instance.pg.init(dirs, &dirs.base.join("initdb.log"))?;
        let launch = Launch {
            settings,
            env,
            // Stays in the test's process group: a Ctrl-C in the terminal
            // stops it too.
            detach: false,
        };
        let port = instance.start_server(launch)?;
        if self.clock_offset_seconds.is_some() {
            check_preloaded(&instance.dirs.log_file)?;
        }
        Cluster::of(instance, port)
    }
}

impl Cluster {
    /// The cluster whose server `instance` started on `port`.
    fn of(instance: Instance, port: u16) -> Result<Cluster, Error> {
        let server = Server::new(
            ServerKind::Cluster,
            format!("postgres://postgres@127.0.0.1:{port}/postgres"),
        )?;
        Ok(Cluster {
            server,
            port,
            instance: Arc::new(instance),
        })
    }
}

/// A cluster's directory and server process: dropping it stops the server
/// and removes the directory. The cluster's [`TestDatabase`]s hold it weakly,
/// to know whether there is still a database to drop.
pub(crate) struct Instance {
    pg: Postgres,
    dirs: ClusterDirs,
    /// `postgres`, or the `runuser` or `su` that runs it; `None` once stopped
    /// ([`Cluster::crash`]).
    server: Mutex<Option<Child>>,
    /// How the server was started and on which port, to start it again the
    /// same way ([`Cluster::start_again`]).
    launch: Option<(Launch, u16)>,
}

impl Instance {
    /// A new, empty cluster directory that the server user can enter, and
    /// nothing started in it yet.
    fn create(pg: Postgres) -> Result<Self, Error> {
        let base = new_cluster_dir();
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&base)
            .context(|| format!("cannot create {}", base.display()))?;
        let instance = Instance {
            pg,
            dirs: ClusterDirs::in_dir(base),
            server: Mutex::new(None),
            launch: None,
        };
        instance.pg.open_to_server(&instance.dirs.base)?;
        Ok(instance)
    }

    /// Starts the server of the initialised data directory on a free port
    /// and keeps how, to start it again ([`Cluster::start_again`]).
    fn start_server(&mut self, launch: Launch) -> Result<u16, Error> {
        let (port, server) = self.pg.start(&self.dirs, &launch)?;
        *self.server.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(server);
        self.launch = Some((launch, port));
        Ok(port)
    }

    fn stop(&self, server: &mut Child) {
        // Only a server that still runs: the `postmaster.pid` of one that
        // died may name a recycled pid, which `pg_ctl` would signal.
        if matches!(server.try_wait(), Ok(None)) {
            if let Err(err) = self.pg.stop(&self.dirs, StopMode::Fast) {
                eprintln!("tower-inbox-testdb: {err}; trying an immediate shutdown");
                if let Err(err) = self.pg.stop(&self.dirs, StopMode::Immediate) {
                    eprintln!("tower-inbox-testdb: {err}");
                }
            }
        }
        let deadline = Instant::now() + EXIT_TIMEOUT;
        loop {
            match server.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => break,
            }
        }
        eprintln!(
            "tower-inbox-testdb: the server process {} of {} did not exit; killing it",
            server.id(),
            self.dirs.base.display()
        );
        let _ = server.kill();
        let _ = server.wait();
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let server = self.server.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(mut server) = server.take() {
            self.stop(&mut server);
        }
        if let Err(err) = remove_dir_if_exists(&self.dirs.base) {
            eprintln!("tower-inbox-testdb: {err:?}");
        }
    }
}

/// A path for a new cluster directory, named after this process.
fn new_cluster_dir() -> PathBuf {
    std::env::temp_dir().join(owned_name(DIR_PREFIX))
}

/// Stops the servers and removes the directories of clusters whose process
/// is gone. Best effort: what fails stays for the next start.
fn remove_stale_clusters(pg: &Postgres, uid: u32) {
    for left_over in left_over_in_temp_dir(DIR_PREFIX) {
        // As root, other users' clusters are none of our business.
        let ours =
            fs::symlink_metadata(&left_over).is_ok_and(|meta| meta.is_dir() && meta.uid() == uid);
        if !ours {
            continue;
        }
        // Renaming claims it: of two processes cleaning up at once, one
        // wins, and the name now carries a live pid.
        let claimed = new_cluster_dir();
        if fs::rename(&left_over, &claimed).is_err() {
            continue;
        }
        let dirs = ClusterDirs::in_dir(claimed);
        if server_runs_in(&dirs.data) {
            if let Err(err) = pg.stop(&dirs, StopMode::Immediate) {
                eprintln!("tower-inbox-testdb: cannot stop a stale cluster's server: {err}");
            }
        }
        if let Err(err) = remove_dir_if_exists(&dirs.base) {
            eprintln!("tower-inbox-testdb: cannot remove a stale cluster: {err:?}");
        }
    }
}

/// Whether the pid in `data/postmaster.pid` is a process working in `data`
/// (the server chdirs there), not a recycled pid.
fn server_runs_in(data: &Path) -> bool {
    let pid = fs::read_to_string(data.join("postmaster.pid"))
        .ok()
        .and_then(|text| text.lines().next()?.trim().parse::<u32>().ok());
    let (Some(pid), Ok(data)) = (pid, fs::canonicalize(data)) else {
        return false;
    };
    fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd == data)
}

fn check_setting_name(name: &str) -> Result<(), Error> {
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.');
    if !valid {
        return Err(Error::msg(format!(
            "invalid PostgreSQL setting name {name:?}: use ASCII letters, digits, `_` and `.`"
        )));
    }
    if RESERVED_SETTINGS.contains(&name.to_ascii_lowercase().as_str()) {
        return Err(Error::msg(format!(
            "the setting {name} cannot be given to a Cluster: the cluster sets it itself"
        )));
    }
    Ok(())
}

/// Where libfaketime is looked for: Debian's and Ubuntu's multiarch
/// directory, then the other usual places.
fn faketime_dirs() -> Vec<PathBuf> {
    [
        format!("/usr/lib/{}-linux-gnu/faketime", std::env::consts::ARCH),
        "/usr/lib/faketime".to_owned(),
        "/usr/lib64/faketime".to_owned(),
        "/usr/local/lib/faketime".to_owned(),
    ]
    .map(PathBuf::from)
    .to_vec()
}

fn find_faketime(dirs: &[PathBuf]) -> Result<PathBuf, Error> {
    if let Some(lib) = dirs
        .iter()
        .map(|dir| dir.join(FAKETIME_LIB))
        .find(|lib| lib.is_file())
    {
        return Ok(lib);
    }
    let looked_in: Vec<String> = dirs.iter().map(|dir| dir.display().to_string()).collect();
    Err(Error::msg(format!(
        "a cluster with a clock offset needs libfaketime, but {FAKETIME_LIB} is in none of {}; \
         install it with `apt-get install faketime`",
        looked_in.join(", ")
    )))
}

/// The server's environment for a clock `seconds` off the real one.
fn faketime_env(lib: &Path, seconds: i64) -> Vec<(&'static str, OsString)> {
    vec![
        ("LD_PRELOAD", lib.into()),
        // libfaketime's relative offset, in seconds: "+N" or "-N".
        ("FAKETIME", format!("{seconds:+}").into()),
        // Only the wall clock moves. The server times its waits with the
        // monotonic clock, which counts from boot: shifted back by more than
        // the uptime it would go negative. The second name is the one
        // libfaketime used before 0.9.8. (FAKETIME_DONT_RESET concerns the
        // "start at" forms only, not offsets.)
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".into()),
        ("DONT_FAKE_MONOTONIC", "1".into()),
    ]
}

/// The dynamic loader skips a preload it cannot load with only a message,
/// and the server would run on the real clock.
fn check_preloaded(log_file: &Path) -> Result<(), Error> {
    let log = fs::read_to_string(log_file).unwrap_or_default();
    match log
        .lines()
        .find(|line| line.contains("cannot be preloaded"))
    {
        Some(line) => Err(Error::msg(format!(
            "the server runs without its clock offset, libfaketime was not loaded: {}",
            line.trim()
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::owner::owner_pid;

    #[test]
    fn cluster_dirs_are_named_after_this_process() {
        let dir = new_cluster_dir();
        let name = dir.file_name().and_then(|name| name.to_str());
        assert_eq!(
            name.and_then(|name| owner_pid(name, DIR_PREFIX)),
            Some(std::process::id())
        );
        assert_eq!(dir.parent(), Some(std::env::temp_dir().as_path()));
    }

    #[test]
    fn checks_setting_names() {
        check_setting_name("log_min_messages").expect("valid");
        check_setting_name("auto_explain.log_min_duration").expect("valid");
        for bad in ["", "a=b", "log min", "port", "Logging_Collector"] {
            assert!(check_setting_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn missing_faketime_is_one_line_that_says_what_to_install() {
        let dirs = [PathBuf::from("/nonexistent/faketime")];
        let message = find_faketime(&dirs)
            .expect_err("nothing to find")
            .to_string();
        assert!(!message.contains('\n'), "{message}");
        for expected in [
            FAKETIME_LIB,
            "/nonexistent/faketime",
            "apt-get install faketime",
        ] {
            assert!(
                message.contains(expected),
                "{expected:?} missing: {message}"
            );
        }
    }

    #[test]
    fn offsets_are_libfaketime_relative_seconds() {
        let env = faketime_env(Path::new("/lib/libfaketime.so.1"), -7200);
        let value = |name: &str| {
            env.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(value("FAKETIME"), Some("-7200".into()));
        assert_eq!(value("LD_PRELOAD"), Some("/lib/libfaketime.so.1".into()));
        let env = faketime_env(Path::new("/lib/libfaketime.so.1"), 90);
        assert!(env.contains(&("FAKETIME", "+90".into())));
    }

    /// What a killed test process leaves: a running server in a directory
    /// named after a pid that is gone.
    #[test]
    fn removes_clusters_of_dead_processes() {
        let cluster = Cluster::builder().start_blocking().expect("cluster");
        let uid = effective_uid().expect("uid");
        let pg = Postgres::find(uid).expect("programs");
        let port = cluster.port();
        let Cluster { instance, .. } = cluster;
        let mut instance = Arc::into_inner(instance).expect("sole owner");
        let mut server = instance
            .server
            .get_mut()
            .unwrap()
            .take()
            .expect("server process");
        // Above any pid_max Linux allows (2^22), so never a live process.
        let orphan =
            std::env::temp_dir().join(format!("{DIR_PREFIX}999999999_{}_0", std::process::id()));
        fs::rename(&instance.dirs.base, &orphan).expect("rename");
        // Without its server and directory, dropping it does nothing.
        drop(instance);
        assert!(server_runs_in(&orphan.join("data")));

        remove_stale_clusters(&pg, uid);

        assert!(!orphan.exists());
        // `pg_ctl stop` has waited for the server to exit.
        assert!(!crate::postgres::accepts_sessions(
            port,
            Duration::from_millis(500)
        ));
        // Its runner (`runuser`, `su` or the server itself) exits with it.
        let deadline = Instant::now() + EXIT_TIMEOUT;
        while server.try_wait().expect("try_wait").is_none() {
            assert!(
                Instant::now() < deadline,
                "the server process is still there"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
