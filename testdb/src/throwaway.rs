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

use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{Context, Error};

/// The OS user that runs the server when the tests run as root, because
/// PostgreSQL refuses to run as root.
const SERVER_USER: &str = "postgres";

/// How long the server may take to accept sessions after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(30);

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
    let run_as = RunAs::detect(uid)?;
    let bins = Binaries::find()?;
    let layout = Layout::new(uid);
    layout.prepare(uid, &run_as)?;

    let start_lock = open_lock_file(&layout.start_lock)?;
    start_lock
        .lock()
        .context(|| format!("cannot lock {}", layout.start_lock.display()))?;

    join_users(&layout)?;
    let port = match running_port(&layout) {
        Some(port) => port,
        None => create_cluster(&layout, &bins, &run_as)?,
    };
    ensure_watchdog(&layout, &bins, &run_as)?;

    // Closing the file would release the lock too; unlocking first makes
    // the hand-over explicit.
    start_lock
        .unlock()
        .context(|| format!("cannot unlock {}", layout.start_lock.display()))?;
    Ok(port)
}

/// Paths of the shared state.
struct Layout {
    base: PathBuf,
    data: PathBuf,
    sock: PathBuf,
    port_file: PathBuf,
    log_file: PathBuf,
    start_lock: PathBuf,
    users_lock: PathBuf,
    watchdog_pid: PathBuf,
    joined: PathBuf,
}

impl Layout {
    fn new(uid: u32) -> Self {
        let base = std::env::temp_dir().join(format!("tower-inbox-pg-{uid}"));
        Self {
            data: base.join("data"),
            sock: base.join("sock"),
            port_file: base.join("port"),
            log_file: base.join("server.log"),
            start_lock: base.join("start.lock"),
            users_lock: base.join("users.lock"),
            watchdog_pid: base.join("watchdog.pid"),
            joined: base.join("joined"),
            base,
        }
    }

    /// Creates the base directory and refuses one that belongs to someone
    /// else, since everything in it is trusted (a foreign `port` file would
    /// send our tests to a foreign server).
    fn prepare(&self, uid: u32, run_as: &RunAs) -> Result<(), Error> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&self.base)
            .context(|| format!("cannot create {}", self.base.display()))?;
        let meta = fs::metadata(&self.base)
            .context(|| format!("cannot inspect {}", self.base.display()))?;
        if meta.uid() != uid {
            return Err(Error::msg(format!(
                "{} belongs to uid {}, not to this user (uid {uid}); remove it or set TMPDIR",
                self.base.display(),
                meta.uid()
            )));
        }
        if run_as.switches_user() && meta.permissions().mode() & 0o005 != 0o005 {
            // The server user must be able to reach data/ and sock/ inside,
            // whatever the umask was when the directory was created.
            fs::set_permissions(&self.base, fs::Permissions::from_mode(0o755))
                .context(|| format!("cannot make {} accessible", self.base.display()))?;
        }
        Ok(())
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
    if !layout.data.join("postmaster.pid").exists() {
        return None;
    }
    accepts_sessions(port, Duration::from_secs(2)).then_some(port)
}

/// Runs `initdb` and starts the server; returns its port.
fn create_cluster(layout: &Layout, bins: &Binaries, run_as: &RunAs) -> Result<u16, Error> {
    remove_if_exists(&layout.port_file)?;
    if layout.data.join("postmaster.pid").exists() {
        // A server from an earlier run that stopped answering, or a start
        // that was interrupted: it must not keep the old files busy.
        let _ = run_as
            .command(
                &bins.pg_ctl,
                &[
                    "-D".as_ref(),
                    layout.data.as_os_str(),
                    "-m".as_ref(),
                    "immediate".as_ref(),
                    "stop".as_ref(),
                ],
            )
            .current_dir(&layout.base)
            .stdin(Stdio::null())
            .output();
    }
    remove_dir_if_exists(&layout.data)?;
    remove_dir_if_exists(&layout.sock)?;
    for dir in [&layout.data, &layout.sock] {
        fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .context(|| format!("cannot create {}", dir.display()))?;
        run_as.give(dir)?;
    }

    let mut log = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&layout.log_file)
        .context(|| format!("cannot open {}", layout.log_file.display()))?;
    let output = run_as
        .command(
            &bins.initdb,
            &[
                "-D".as_ref(),
                layout.data.as_os_str(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "--auth=trust".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
                "--locale=C".as_ref(),
                "--no-sync".as_ref(),
            ],
        )
        // The server user may not be allowed into the caller's directory.
        .current_dir(&layout.base)
        .stdin(Stdio::null())
        .output()
        .context(|| format!("cannot run {}", bins.initdb.display()))?;
    // The log is for diagnosis only; failing to write it must not hide the
    // initdb result.
    let _ = log.write_all(&output.stdout);
    let _ = log.write_all(&output.stderr);
    if !output.status.success() {
        return Err(Error::msg(format!(
            "{} failed ({}){}:\n{}{}",
            bins.initdb.display(),
            output.status,
            run_as.describe(),
            String::from_utf8_lossy(&output.stderr),
            String::from_utf8_lossy(&output.stdout),
        )));
    }
    drop(log);

    // A port that was free when probed can be taken before the server binds
    // it; a new one is picked for each attempt.
    let mut attempt = 1;
    let port = loop {
        let port = free_port()?;
        match start_server(layout, bins, run_as, port) {
            Ok(()) => break port,
            Err(StartError::PortTaken) if attempt < 3 => attempt += 1,
            Err(StartError::PortTaken) => {
                return Err(Error::msg(format!(
                    "PostgreSQL could not bind a free port in {attempt} attempts; log {}:\n{}",
                    layout.log_file.display(),
                    log_tail(&layout.log_file)
                )))
            }
            Err(StartError::Other(err)) => return Err(err),
        }
    };

    write_atomically(&layout.port_file, format!("{port}\n").as_bytes())?;
    Ok(port)
}

enum StartError {
    PortTaken,
    Other(Error),
}

/// Starts the server detached from this process and waits until it accepts
/// sessions.
fn start_server(
    layout: &Layout,
    bins: &Binaries,
    run_as: &RunAs,
    port: u16,
) -> Result<(), StartError> {
    let port_arg = port.to_string();
    let args: [&OsStr; 14] = [
        "-D".as_ref(),
        layout.data.as_os_str(),
        "-p".as_ref(),
        port_arg.as_ref(),
        "-k".as_ref(),
        layout.sock.as_os_str(),
        "-c".as_ref(),
        "listen_addresses=127.0.0.1".as_ref(),
        "-c".as_ref(),
        "fsync=off".as_ref(),
        "-c".as_ref(),
        "max_connections=200".as_ref(),
        "-c".as_ref(),
        // Tests commit constantly; their data is thrown away anyway.
        "synchronous_commit=off".as_ref(),
    ];
    let log_start = fs::metadata(&layout.log_file).map_or(0, |meta| meta.len());
    let mut child = detached(run_as.argv(&bins.postgres, &args))
        .current_dir(&layout.base)
        .stdin(Stdio::null())
        .stdout(log_stdio(&layout.log_file).map_err(StartError::Other)?)
        .stderr(log_stdio(&layout.log_file).map_err(StartError::Other)?)
        .spawn()
        .context(|| format!("cannot start {}", bins.postgres.display()))
        .map_err(StartError::Other)?;

    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if accepts_sessions(port, Duration::from_secs(1)) {
            return Ok(());
        }
        match child.try_wait() {
            Ok(Some(status)) => {
                let tail = log_tail_from(&layout.log_file, log_start);
                if tail.contains("Address already in use") {
                    return Err(StartError::PortTaken);
                }
                return Err(StartError::Other(Error::msg(format!(
                    "PostgreSQL exited during startup ({status}){}; log {}:\n{tail}",
                    run_as.describe(),
                    layout.log_file.display(),
                ))));
            }
            Ok(None) => {}
            Err(err) => {
                return Err(StartError::Other(Error::with_source(
                    "cannot check on the starting PostgreSQL server",
                    err,
                )))
            }
        }
        if Instant::now() >= deadline {
            stop_starting_server(&mut child, layout, bins, run_as);
            return Err(StartError::Other(Error::msg(format!(
                "PostgreSQL did not accept connections on 127.0.0.1:{port} within {}s; log {}:\n{}",
                START_TIMEOUT.as_secs(),
                layout.log_file.display(),
                log_tail_from(&layout.log_file, log_start),
            ))));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Best effort: a server that never became ready must not linger.
fn stop_starting_server(child: &mut Child, layout: &Layout, bins: &Binaries, run_as: &RunAs) {
    let _ = run_as
        .command(
            &bins.pg_ctl,
            &[
                "-D".as_ref(),
                layout.data.as_os_str(),
                "-m".as_ref(),
                "immediate".as_ref(),
                "stop".as_ref(),
            ],
        )
        .current_dir(&layout.base)
        .stdin(Stdio::null())
        .output();
    let _ = child.kill();
    let _ = child.wait();
}

/// Starts a watchdog unless one is alive already.
fn ensure_watchdog(layout: &Layout, bins: &Binaries, run_as: &RunAs) -> Result<(), Error> {
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
        layout.base.clone().into(),
        checks.into(),
        interval.into(),
    ];
    argv.extend(run_as.argv(
        &bins.pg_ctl,
        &[
            "-D".as_ref(),
            layout.data.as_os_str(),
            "-m".as_ref(),
            "fast".as_ref(),
            "-w".as_ref(),
            "stop".as_ref(),
        ],
    ));
    let child = detached(argv)
        // Not the base directory: the watchdog outlives what it deletes.
        .current_dir("/")
        .stdin(Stdio::null())
        // Never the test harness's pipes: a harness that waits for their
        // end (nextest does) would wait for the watchdog.
        .stdout(log_stdio(&layout.log_file)?)
        .stderr(log_stdio(&layout.log_file)?)
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

/// A command that runs in its own session, so that neither the terminal's
/// Ctrl-C nor the end of the test process takes it down.
fn detached(argv: Vec<OsString>) -> Command {
    match find_on_path("setsid") {
        Some(setsid) => {
            let mut command = Command::new(setsid);
            command.args(argv);
            command
        }
        None => {
            let mut argv = argv.into_iter();
            let mut command = Command::new(argv.next().unwrap_or_default());
            command.args(argv).process_group(0);
            command
        }
    }
}

fn log_stdio(path: &Path) -> Result<Stdio, Error> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map(Stdio::from)
        .context(|| format!("cannot open {}", path.display()))
}

/// Whether a PostgreSQL server on 127.0.0.1:`port` accepts sessions.
///
/// Accepting TCP connections is not enough: during startup the server
/// listens but rejects sessions ("the database system is starting up").
/// So this sends a protocol 3.0 startup packet and expects an authentication
/// message (`R`) rather than an error (`E`).
fn accepts_sessions(port: u16, timeout: Duration) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    if stream.set_read_timeout(Some(timeout)).is_err()
        || stream.set_write_timeout(Some(timeout)).is_err()
    {
        return false;
    }
    let mut body = 196_608_u32.to_be_bytes().to_vec(); // protocol version 3.0
    for (key, value) in [("user", "postgres"), ("database", "postgres")] {
        body.extend_from_slice(key.as_bytes());
        body.push(0);
        body.extend_from_slice(value.as_bytes());
        body.push(0);
    }
    body.push(0);
    let Ok(len) = u32::try_from(body.len() + 4) else {
        return false;
    };
    let mut packet = len.to_be_bytes().to_vec();
    packet.extend_from_slice(&body);
    if stream.write_all(&packet).is_err() {
        return false;
    }
    let mut tag = [0_u8; 1];
    let ready = stream.read_exact(&mut tag).is_ok() && tag[0] == b'R';
    if ready {
        // Terminate, so the server does not log an unexpected EOF.
        let _ = stream.write_all(&[b'X', 0, 0, 0, 4]);
    }
    ready
}

fn free_port() -> Result<u16, Error> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .context(|| "cannot bind 127.0.0.1:0 to find a free port")?;
    let port = listener
        .local_addr()
        .context(|| "cannot read the address of a bound socket")?
        .port();
    Ok(port)
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

fn remove_dir_if_exists(path: &Path) -> Result<(), Error> {
    match fs::remove_dir_all(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(Error::with_source(
            format!("cannot remove {}", path.display()),
            err,
        )),
        _ => Ok(()),
    }
}

/// The last lines of the log, for error messages.
fn log_tail(path: &Path) -> String {
    log_tail_from(path, 0)
}

/// The last lines of the log written after byte `start`.
fn log_tail_from(path: &Path, start: u64) -> String {
    const MAX_BYTES: u64 = 4096;
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(start.max(len.saturating_sub(MAX_BYTES))))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) if text.trim().is_empty() => "(the log is empty)".to_owned(),
        Ok(text) => text,
        Err(err) => format!("(cannot read the log: {err})"),
    }
}

/// The effective uid of this process.
fn effective_uid() -> Result<u32, Error> {
    // "Uid:\treal\teffective\tsaved\tfs"
    if let Ok(status) = fs::read_to_string("/proc/self/status") {
        let euid = status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            .and_then(|id| id.parse().ok());
        if let Some(euid) = euid {
            return Ok(euid);
        }
    }
    let output = Command::new("id")
        .arg("-u")
        .stdin(Stdio::null())
        .output()
        .context(|| "cannot determine the effective uid: /proc/self/status is unreadable and `id -u` did not run")?;
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .map_err(|_| {
            Error::msg(format!(
                "cannot determine the effective uid: `id -u` printed {:?}",
                String::from_utf8_lossy(&output.stdout)
            ))
        })
}

/// How the PostgreSQL programs are run.
enum RunAs {
    /// As the current user.
    Me,
    /// As [`SERVER_USER`] through `runuser -u postgres -- ...`.
    Runuser(PathBuf),
    /// As [`SERVER_USER`] through `su postgres -s /bin/sh -c ...`.
    Su(PathBuf),
}

impl RunAs {
    fn detect(uid: u32) -> Result<Self, Error> {
        if uid != 0 {
            return Ok(Self::Me);
        }
        if let Some(runuser) = find_on_path("runuser") {
            return Ok(Self::Runuser(runuser));
        }
        if let Some(su) = find_on_path("su") {
            return Ok(Self::Su(su));
        }
        Err(Error::msg(format!(
            "running as root, and PostgreSQL refuses to run as root, but neither `runuser` nor \
             `su` is on PATH to run it as the `{SERVER_USER}` user; run the tests as another user \
             or set DATABASE_URL"
        )))
    }

    fn switches_user(&self) -> bool {
        !matches!(self, Self::Me)
    }

    /// For error messages.
    fn describe(&self) -> &'static str {
        match self {
            Self::Me => "",
            Self::Runuser(_) | Self::Su(_) => " (run as the `postgres` user)",
        }
    }

    /// The command line that runs `program` with `args` as the right user.
    fn argv(&self, program: &Path, args: &[&OsStr]) -> Vec<OsString> {
        match self {
            Self::Me => std::iter::once(program.as_os_str())
                .chain(args.iter().copied())
                .map(OsString::from)
                .collect(),
            Self::Runuser(runuser) => [
                runuser.as_os_str(),
                "-u".as_ref(),
                SERVER_USER.as_ref(),
                "--".as_ref(),
                program.as_os_str(),
            ]
            .into_iter()
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect(),
            Self::Su(su) => {
                let script = std::iter::once(program.as_os_str())
                    .chain(args.iter().copied())
                    .map(|arg| shell_quote(&arg.to_string_lossy()))
                    .collect::<Vec<_>>()
                    .join(" ");
                vec![
                    su.into(),
                    SERVER_USER.into(),
                    "-s".into(),
                    "/bin/sh".into(),
                    "-c".into(),
                    format!("exec {script}").into(),
                ]
            }
        }
    }

    fn command(&self, program: &Path, args: &[&OsStr]) -> Command {
        let mut argv = self.argv(program, args).into_iter();
        let mut command = Command::new(argv.next().unwrap_or_default());
        command.args(argv);
        command
    }

    /// Hands `dir` to the server user, which must own its data and socket
    /// directories.
    fn give(&self, dir: &Path) -> Result<(), Error> {
        if !self.switches_user() {
            return Ok(());
        }
        let output = Command::new("chown")
            .arg(SERVER_USER)
            .arg(dir)
            .stdin(Stdio::null())
            .output()
            .context(|| "cannot run chown")?;
        if output.status.success() {
            Ok(())
        } else {
            Err(Error::msg(format!(
                "`chown {SERVER_USER} {}` failed ({}): {}; PostgreSQL refuses to run as root and \
                 needs a `{SERVER_USER}` system user",
                dir.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )))
        }
    }
}

fn shell_quote(arg: &str) -> String {
    format!("'{}'", arg.replace('\'', r"'\''"))
}

/// The PostgreSQL programs this module runs, all from one directory.
struct Binaries {
    initdb: PathBuf,
    postgres: PathBuf,
    pg_ctl: PathBuf,
}

impl Binaries {
    const NAMES: &'static str = "initdb, postgres and pg_ctl";

    fn in_dir(dir: &Path) -> Option<Self> {
        let bins = Self {
            initdb: dir.join("initdb"),
            postgres: dir.join("postgres"),
            pg_ctl: dir.join("pg_ctl"),
        };
        let complete = [&bins.initdb, &bins.postgres, &bins.pg_ctl]
            .into_iter()
            .all(|path| is_executable(path));
        complete.then_some(bins)
    }

    /// Looks on PATH, then in `pg_config --bindir`, then in the newest
    /// `/usr/lib/postgresql/*/bin` (Debian and Ubuntu keep them there, off
    /// PATH).
    fn find() -> Result<Self, Error> {
        Self::search(
            std::env::var_os("PATH"),
            "pg_config",
            Path::new("/usr/lib/postgresql"),
        )
    }

    /// [`Binaries::find`] with its inputs as parameters, for tests.
    fn search(path_var: Option<OsString>, pg_config: &str, root: &Path) -> Result<Self, Error> {
        let mut tried = Vec::new();

        if let Some(bins) = path_var
            .iter()
            .flat_map(std::env::split_paths)
            .find_map(|dir| Self::in_dir(&dir))
        {
            return Ok(bins);
        }
        tried.push("the directories on PATH".to_owned());

        match Command::new(pg_config)
            .arg("--bindir")
            .stdin(Stdio::null())
            .output()
        {
            Ok(output) if output.status.success() => {
                let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
                if let Some(bins) = Self::in_dir(&dir) {
                    return Ok(bins);
                }
                tried.push(format!("`pg_config --bindir` ({})", dir.display()));
            }
            Ok(output) => tried.push(format!(
                "`pg_config --bindir` (it failed: {})",
                output.status
            )),
            Err(err) => tried.push(format!("`pg_config --bindir` (cannot run it: {err})")),
        }

        let mut versions: Vec<(Vec<u32>, PathBuf)> = fs::read_dir(root)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name();
                let version = name
                    .to_str()?
                    .split('.')
                    .map(str::parse)
                    .collect::<Result<Vec<u32>, _>>()
                    .ok()?;
                Some((version, entry.path().join("bin")))
            })
            .collect();
        versions.sort();
        if let Some(bins) = versions.iter().rev().find_map(|(_, dir)| Self::in_dir(dir)) {
            return Ok(bins);
        }
        tried.push(format!("{}/*/bin", root.display()));

        Err(Error::msg(format!(
            "cannot start a throwaway PostgreSQL server: no directory with the PostgreSQL server \
             binaries ({}) found; looked in {}. Install PostgreSQL (e.g. `apt-get install \
             postgresql`), start a server on 127.0.0.1:5432, or set DATABASE_URL",
            Self::NAMES,
            tried.join(", ")
        )))
    }
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|path| is_executable(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_for_the_shell() {
        assert_eq!(shell_quote("plain"), "'plain'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn runs_commands_as_the_server_user_when_root() {
        let args: [&OsStr; 2] = ["-D".as_ref(), "/tmp/x y".as_ref()];
        let argv = RunAs::Runuser("/usr/sbin/runuser".into()).argv(Path::new("/bin/initdb"), &args);
        assert_eq!(
            argv,
            [
                "/usr/sbin/runuser",
                "-u",
                "postgres",
                "--",
                "/bin/initdb",
                "-D",
                "/tmp/x y"
            ]
            .map(OsString::from)
        );
        let argv = RunAs::Su("/bin/su".into()).argv(Path::new("/bin/initdb"), &args);
        assert_eq!(
            argv,
            [
                "/bin/su",
                "postgres",
                "-s",
                "/bin/sh",
                "-c",
                "exec '/bin/initdb' '-D' '/tmp/x y'"
            ]
            .map(OsString::from)
        );
        let argv = RunAs::Me.argv(Path::new("/bin/initdb"), &args);
        assert_eq!(argv, ["/bin/initdb", "-D", "/tmp/x y"].map(OsString::from));
    }

    #[test]
    fn reads_the_effective_uid() {
        let uid = effective_uid().expect("uid");
        let id = Command::new("id").arg("-u").output().expect("id -u");
        assert_eq!(uid.to_string(), String::from_utf8_lossy(&id.stdout).trim());
    }

    fn fake_bin_dir(dir: &Path, names: &[&str]) {
        fs::create_dir_all(dir).expect("create dir");
        for name in names {
            let path = dir.join(name);
            fs::write(&path, "#!/bin/sh\n").expect("write");
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
        }
    }

    #[test]
    fn finds_binaries_in_the_newest_versioned_directory() {
        let root =
            std::env::temp_dir().join(format!("tower-inbox-testdb-bins-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fake_bin_dir(&root.join("9.6/bin"), &["initdb", "postgres", "pg_ctl"]);
        fake_bin_dir(&root.join("16/bin"), &["initdb", "postgres", "pg_ctl"]);
        // Newest, but incomplete.
        fake_bin_dir(&root.join("17/bin"), &["initdb"]);
        let bins = Binaries::search(None, "/nonexistent/pg_config", &root).expect("found");
        assert_eq!(bins.postgres, root.join("16/bin/postgres"));

        let err = Binaries::search(None, "/nonexistent/pg_config", &root.join("none"))
            .err()
            .expect("nothing to find");
        let message = err.to_string();
        for expected in [
            "initdb, postgres and pg_ctl",
            "PATH",
            "pg_config --bindir",
            "none/*/bin",
        ] {
            assert!(
                message.contains(expected),
                "{expected:?} missing from: {message}"
            );
        }
        fs::remove_dir_all(&root).expect("clean up");
    }

    #[test]
    fn nothing_accepts_sessions_on_a_closed_port() {
        let port = free_port().expect("free port");
        assert!(!accepts_sessions(port, Duration::from_millis(200)));
    }
}
