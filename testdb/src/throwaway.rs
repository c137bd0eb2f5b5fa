//! A throwaway PostgreSQL cluster shared by all test processes of a run.
//!
//! Everything lives in `<temp dir>/tower-inbox-pg-<uid>/`:
//!
//! | entry          | what                                                      |
//! |----------------|-----------------------------------------------------------|
//! | `start.lock`   | held exclusively while checking, starting or stopping     |
//! | `users.lock`   | held shared by every process using the cluster            |
//! | `port`         | TCP port of the running server; absent when none runs     |
//! | `data/`        | the cluster's data directory                              |
//! | `sock/`        | the server's Unix socket directory                        |
//! | `server.log`   | output of `initdb`, the server and the watchdog           |
//! | `watchdog.pid` | pid of the process that stops the server when unused      |
//! | `joined`       | left by each process that joins; the watchdog removes it  |
//!
//! A process joins by taking `start.lock`, then `users.lock` shared, which it
//! keeps until it exits (the kernel releases the lock then, however the
//! process ends). A detached watchdog shell polls: once it has found
//! `users.lock` free for several checks in a row it stops the server and
//! removes the data directory. Both sides look at `users.lock` only while
//! holding `start.lock`, so a process cannot join a cluster that is being
//! stopped. A process that lives shorter than the check interval may never
//! be seen holding `users.lock`, so each one also leaves a `joined` marker,
//! which restarts the watchdog's count.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use crate::error::{Context, Error};
use crate::postgres::{
    accepts_sessions, detached, effective_uid, log_stdio, remove_dir_if_exists, ClusterDirs,
    Launch, Postgres, StopMode,
};

/// Seconds between two watchdog checks.
const CHECK_INTERVAL_SECS: u32 = 2;

/// Consecutive checks without users after which the watchdog stops the
/// server: about ten seconds, long enough to bridge the gap between two test
/// binaries of one `cargo test` run.
const IDLE_CHECKS: u32 = 5;

/// Name the watchdog shell runs under (its `$0`), so that its pid file can be
/// told from a recycled pid.
const WATCHDOG_NAME: &str = "tower-inbox-pg-watchdog";

/// The watchdog. Arguments: base directory, idle checks, check interval, then
/// the command that stops the server.
///
/// A `joined` marker counts as a use even if its process has exited by the
/// time of the check.
///
/// The lock files are opened by a redirection on the `{ ... }` group, so the
/// shell holds them only for one check and closes them before it sleeps; the
/// commands run inside the group (`flock`, `pg_ctl`, `rm`) exit before the
/// group ends, so no descriptor outlives a check. `flock -n -x 9` succeeds only
/// when no process holds `users.lock` shared.
const WATCHDOG_SCRIPT: &str = r#"
base=$1
checks=$2
interval=$3
shift 3
idle=0
while :; do
    sleep "$interval"
    if [ ! -e "$base/start.lock" ] || [ ! -e "$base/users.lock" ]; then
        echo "$0: lock files are gone, exiting"
        exit 0
    fi
    {
        flock -x 8 || exit 1
        if [ -e "$base/joined" ]; then
            rm -f "$base/joined"
            idle=0
        elif flock -n -x 9; then
            flock -u 9
            idle=$((idle + 1))
        else
            idle=0
        fi
        if [ "$idle" -ge "$checks" ]; then
            echo "$0: no test process has used the server for $idle checks, stopping it"
            rm -f "$base/port"
            if [ -e "$base/data/postmaster.pid" ]; then
                "$@" || echo "$0: stopping the server failed"
            fi
            rm -rf "$base/data" "$base/sock"
            rm -f "$base/watchdog.pid"
            exit 0
        fi
    } 8<"$base/start.lock" 9<"$base/users.lock"
done
"#;

/// This process's shared lock on `users.lock`. Never closed: the kernel
/// releases it when the process exits.
static USERS_LOCK: OnceLock<File> = OnceLock::new();

/// Makes sure the shared cluster runs and that this process is registered as
/// one of its users; returns the server's TCP port on 127.0.0.1.
pub(crate) fn ensure_running() -> Result<u16, Error> {
    let uid = effective_uid()?;
    let pg = Postgres::find(uid)?;
    let layout = Layout::new(uid);
    layout.prepare(uid, &pg)?;

    let start_lock = open_lock_file(&layout.start_lock)?;
    start_lock
        .lock()
        .context(|| format!("cannot lock {}", layout.start_lock.display()))?;

    join_users(&layout)?;
    let port = match running_port(&layout) {
        Some(port) => port,
        None => create_cluster(&layout, &pg)?,
    };
    ensure_watchdog(&layout, &pg)?;

    // Closing the file would release the lock too; unlocking first makes
    // the hand-over explicit.
    start_lock
        .unlock()
        .context(|| format!("cannot unlock {}", layout.start_lock.display()))?;
    Ok(port)
}

/// Paths of the shared state.
struct Layout {
    dirs: ClusterDirs,
    port_file: PathBuf,
    start_lock: PathBuf,
    users_lock: PathBuf,
    watchdog_pid: PathBuf,
    joined: PathBuf,
}

impl Layout {
    fn new(uid: u32) -> Self {
        let base = std::env::temp_dir().join(format!("tower-inbox-pg-{uid}"));
        Self {
            port_file: base.join("port"),
            start_lock: base.join("start.lock"),
            users_lock: base.join("users.lock"),
            watchdog_pid: base.join("watchdog.pid"),
            joined: base.join("joined"),
            dirs: ClusterDirs::in_dir(base),
        }
    }

    /// Creates the base directory and refuses one that belongs to someone
    /// else, since everything in it is trusted (a foreign `port` file would
    /// send our tests to a foreign server).
    fn prepare(&self, uid: u32, pg: &Postgres) -> Result<(), Error> {
        let base = &self.dirs.base;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(base)
            .context(|| format!("cannot create {}", base.display()))?;
        let meta = fs::metadata(base).context(|| format!("cannot inspect {}", base.display()))?;
        if meta.uid() != uid {
            return Err(Error::msg(format!(
                "{} belongs to uid {}, not to this user (uid {uid}); remove it or set TMPDIR",
                base.display(),
                meta.uid()
            )));
        }
        // The server user must be able to reach data/ and sock/ inside.
        pg.open_to_server(base)
    }
}

fn open_lock_file(path: &Path) -> Result<File, Error> {
    // std opens with O_CLOEXEC, so neither the server nor the watchdog
    // inherits (and thereby keeps) this process's locks.
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .context(|| format!("cannot open {}", path.display()))
}

fn join_users(layout: &Layout) -> Result<(), Error> {
    if USERS_LOCK.get().is_some() {
        return Ok(());
    }
    let file = open_lock_file(&layout.users_lock)?;
    file.lock_shared()
        .context(|| format!("cannot lock {} shared", layout.users_lock.display()))?;
    // Only reached under start.lock, so no other thread of this process
    // races here and `set` cannot fail.
    let _ = USERS_LOCK.set(file);
    fs::write(&layout.joined, b"").context(|| format!("cannot write {}", layout.joined.display()))
}

/// The port of a server that runs and accepts sessions, if any.
fn running_port(layout: &Layout) -> Option<u16> {
    let port = fs::read_to_string(&layout.port_file)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if !layout.dirs.data.join("postmaster.pid").exists() {
        return None;
    }
    accepts_sessions(port, Duration::from_secs(2)).then_some(port)
}

/// Runs `initdb` and starts the server; returns its port.
fn create_cluster(layout: &Layout, pg: &Postgres) -> Result<u16, Error> {
    let dirs = &layout.dirs;
    remove_if_exists(&layout.port_file)?;
    if dirs.data.join("postmaster.pid").exists() {
        // A server from an earlier run that stopped answering, or a start
        // that was interrupted: it must not keep the old files busy.
        let _ = pg.stop(dirs, StopMode::Immediate);
    }
    remove_dir_if_exists(&dirs.data)?;
    remove_dir_if_exists(&dirs.sock)?;
    pg.init(dirs, &dirs.log_file)?;

    let launch = Launch {
        settings: [
            "fsync=off",
            "max_connections=200",
            // Tests commit constantly; their data is thrown away anyway.
            "synchronous_commit=off",
        ]
        .map(String::from)
        .to_vec(),
        env: Vec::new(),
        // The server outlives this process; the watchdog stops it.
        detach: true,
    };
    // The server process is not waited for: it is the watchdog's to stop.
    let (port, _server) = pg.start(dirs, &launch)?;
    write_atomically(&layout.port_file, format!("{port}\n").as_bytes())?;
    Ok(port)
}

/// Starts a watchdog unless one is alive already.
fn ensure_watchdog(layout: &Layout, pg: &Postgres) -> Result<(), Error> {
    if watchdog_alive(layout) {
        return Ok(());
    }
    let interval = CHECK_INTERVAL_SECS.to_string();
    let checks = IDLE_CHECKS.to_string();
    let mut argv: Vec<OsString> = vec![
        "sh".into(),
        "-c".into(),
        WATCHDOG_SCRIPT.into(),
        WATCHDOG_NAME.into(),
        layout.dirs.base.clone().into(),
        checks.into(),
        interval.into(),
    ];
    argv.extend(pg.stop_argv(&layout.dirs.data, StopMode::Fast));
    let child = detached(argv)
        // Not the base directory: the watchdog outlives what it deletes.
        .current_dir("/")
        .stdin(Stdio::null())
        // Never the test harness's pipes: a harness that waits for their
        // end (nextest does) would wait for the watchdog.
        .stdout(log_stdio(&layout.dirs.log_file)?)
        .stderr(log_stdio(&layout.dirs.log_file)?)
        .spawn()
        .context(|| "cannot start the watchdog shell (sh)")?;
    // `setsid` execs in place (the child is never a process-group leader),
    // so this is the shell's pid.
    write_atomically(&layout.watchdog_pid, format!("{}\n", child.id()).as_bytes())
}

fn watchdog_alive(layout: &Layout) -> bool {
    let Some(pid) = fs::read_to_string(&layout.watchdog_pid)
        .ok()
        .and_then(|text| text.trim().parse::<u32>().ok())
    else {
        return false;
    };
    // A zombie has an empty command line, and a recycled pid another one.
    fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
        cmdline
            .split(|&byte| byte == 0)
            .any(|arg| arg == WATCHDOG_NAME.as_bytes())
    })
}

/// Writes via a temporary file and a rename, so that readers never see a
/// half-written file.
fn write_atomically(path: &Path, contents: &[u8]) -> Result<(), Error> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, contents)
        .and_then(|()| fs::rename(&tmp, path))
        .context(|| format!("cannot write {}", path.display()))
}

fn remove_if_exists(path: &Path) -> Result<(), Error> {
    match fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(Error::with_source(
            format!("cannot remove {}", path.display()),
            err,
        )),
        _ => Ok(()),
    }
}
