//! Running the local PostgreSQL programs: finding them, running them as a
//! user PostgreSQL accepts, creating a cluster, starting and stopping its
//! server.
//!
//! (Over 400 lines: finding the programs, running them as the server user,
//! `initdb`, start and stop share one error style and one notion of the
//! server user; a sixth is their tests.)
//!
//! Shared by the cluster that all test processes of a run use (`throwaway`)
//! and the private clusters of single tests ([`Cluster`](crate::Cluster)).

use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Context, Error};

/// The OS user that runs the server when the tests run as root, because
/// PostgreSQL refuses to run as root.
const SERVER_USER: &str = "postgres";

/// How long the server may take to accept sessions after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long `pg_ctl stop` waits for the server to exit. A test cluster
/// (`fsync=off`) shuts down in well under a second; this bounds a hung one.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// How many free ports a start tries: a port that was free when probed can
/// be taken before the server binds it.
const PORT_ATTEMPTS: u32 = 3;

/// Where one cluster keeps its files.
pub(crate) struct ClusterDirs {
    /// The directory holding the others; the programs run in it, because
    /// the server user may not be allowed into the caller's directory.
    pub(crate) base: PathBuf,
    /// The data directory.
    pub(crate) data: PathBuf,
    /// The server's Unix socket directory.
    pub(crate) sock: PathBuf,
    /// The server's stdout and stderr.
    pub(crate) log_file: PathBuf,
}

impl ClusterDirs {
    /// The layout inside `base`: `data/`, `sock/` and `server.log`.
    pub(crate) fn in_dir(base: PathBuf) -> Self {
        Self {
            data: base.join("data"),
            sock: base.join("sock"),
            log_file: base.join("server.log"),
            base,
        }
    }
}

/// How a server is started, beyond its directories and port.
#[derive(Clone)]
pub(crate) struct Launch {
    /// `name=value` settings passed as `-c`, after the common ones and in
    /// this order, so that a later one wins.
    pub(crate) settings: Vec<String>,
    /// Environment variables for the server process alone. They are set
    /// through `env` right before `postgres`, so that `runuser` or `su`
    /// neither drop them nor run under them (`LD_PRELOAD`).
    pub(crate) env: Vec<(&'static str, OsString)>,
    /// Whether the server runs in a session of its own, to outlive this
    /// process.
    pub(crate) detach: bool,
}

/// How `pg_ctl stop` ends the server.
#[derive(Debug, Clone, Copy)]
pub(crate) enum StopMode {
    /// Ends the sessions and shuts down cleanly.
    Fast,
    /// Ends every process at once, without a shutdown checkpoint.
    Immediate,
}

impl StopMode {
    fn as_arg(self) -> &'static str {
        match self {
            Self::Fast => "fast",
            Self::Immediate => "immediate",
        }
    }
}

/// The local PostgreSQL programs and the user they run as.
pub(crate) struct Postgres {
    bins: Binaries,
    run_as: RunAs,
}

impl Postgres {
    /// Finds the programs; `uid` is this process's effective uid, which
    /// decides whether they must run as [`SERVER_USER`].
    pub(crate) fn find(uid: u32) -> Result<Self, Error> {
        let run_as = RunAs::detect(uid)?;
        let bins = Binaries::find()?;
        Ok(Self { bins, run_as })
    }

    /// Makes `dir`, owned by this process, reachable for the server user,
    /// whatever the umask was when it was created.
    pub(crate) fn open_to_server(&self, dir: &Path) -> Result<(), Error> {
        if !self.run_as.switches_user() {
            return Ok(());
        }
        let mode = fs::metadata(dir)
            .context(|| format!("cannot inspect {}", dir.display()))?
            .permissions()
            .mode();
        if mode & 0o005 == 0o005 {
            return Ok(());
        }
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755))
            .context(|| format!("cannot make {} accessible", dir.display()))
    }

    /// Creates the data and socket directories, which must not exist yet,
    /// and runs `initdb` (trust authentication, superuser `postgres`, UTF8);
    /// its output goes to `output`, which is truncated first.
    pub(crate) fn init(&self, dirs: &ClusterDirs, output: &Path) -> Result<(), Error> {
        for dir in [&dirs.data, &dirs.sock] {
            fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .context(|| format!("cannot create {}", dir.display()))?;
            self.run_as.give(dir)?;
        }

        let mut log = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(output)
            .context(|| format!("cannot open {}", output.display()))?;
        let initdb = &self.bins.initdb;
        let result = self
            .run_as
            .command(
                initdb,
                &[
                    "-D".as_ref(),
                    dirs.data.as_os_str(),
                    "-U".as_ref(),
                    "postgres".as_ref(),
                    "--auth=trust".as_ref(),
                    "-E".as_ref(),
                    "UTF8".as_ref(),
                    "--locale=C".as_ref(),
                    "--no-sync".as_ref(),
                ],
            )
            .current_dir(&dirs.base)
            .stdin(Stdio::null())
            .output()
            .context(|| format!("cannot run {}", initdb.display()))?;
        // The log is for diagnosis only; failing to write it must not hide
        // the initdb result.
        let _ = log.write_all(&result.stdout);
        let _ = log.write_all(&result.stderr);
        if !result.status.success() {
            return Err(Error::msg(format!(
                "{} failed ({}){}:\n{}{}",
                initdb.display(),
                result.status,
                self.run_as.describe(),
                String::from_utf8_lossy(&result.stderr),
                String::from_utf8_lossy(&result.stdout),
            )));
        }
        Ok(())
    }

    /// Starts the server of an initialised cluster on a free port of
    /// 127.0.0.1 and waits until it accepts sessions; returns the port and
    /// the started process (`postgres`, or the `runuser` or `su` that runs
    /// it). Its output is appended to the cluster's log file.
    pub(crate) fn start(&self, dirs: &ClusterDirs, launch: &Launch) -> Result<(u16, Child), Error> {
        let env_program = env_program(launch)?;
        let mut attempt = 1;
        loop {
            let port = free_port()?;
            match self.start_on(dirs, launch, env_program.as_deref(), port) {
                Ok(child) => return Ok((port, child)),
                Err(StartError::PortTaken) if attempt < PORT_ATTEMPTS => attempt += 1,
                Err(StartError::PortTaken) => {
                    return Err(Error::msg(format!(
                        "PostgreSQL could not bind a free port in {attempt} attempts; log {}:\n{}",
                        dirs.log_file.display(),
                        log_tail(&dirs.log_file)
                    )))
                }
                Err(StartError::Other(err)) => return Err(err),
            }
        }
    }

    /// Starts the server of an initialised cluster again on `port`, the one
    /// it had, so that clients find it where it was; waits until it accepts
    /// sessions.
    pub(crate) fn start_again(
        &self,
        dirs: &ClusterDirs,
        launch: &Launch,
        port: u16,
    ) -> Result<Child, Error> {
        let env_program = env_program(launch)?;
        match self.start_on(dirs, launch, env_program.as_deref(), port) {
            Ok(child) => Ok(child),
            Err(StartError::PortTaken) => Err(Error::msg(format!(
                "PostgreSQL could not bind 127.0.0.1:{port} again: another process took it; log {}",
                dirs.log_file.display()
            ))),
            Err(StartError::Other(err)) => Err(err),
        }
    }

    fn start_on(
        &self,
        dirs: &ClusterDirs,
        launch: &Launch,
        env_program: Option<&Path>,
        port: u16,
    ) -> Result<Child, StartError> {
        let mut args: Vec<OsString> = launch
            .env
            .iter()
            .map(|(name, value)| {
                let mut assignment = OsString::from(format!("{name}="));
                assignment.push(value);
                assignment
            })
            .collect();
        let program = match env_program {
            Some(env) => {
                args.push(self.bins.postgres.clone().into());
                env
            }
            None => self.bins.postgres.as_path(),
        };
        args.extend([
            "-D".into(),
            dirs.data.clone().into(),
            "-p".into(),
            port.to_string().into(),
            "-k".into(),
            dirs.sock.clone().into(),
            "-c".into(),
            "listen_addresses=127.0.0.1".into(),
        ]);
        for setting in &launch.settings {
            args.extend(["-c".into(), setting.into()]);
        }
        let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
        let argv = self.run_as.argv(program, &args);

        let log_start = fs::metadata(&dirs.log_file).map_or(0, |meta| meta.len());
        let mut command = if launch.detach {
            detached(argv)
        } else {
            command_from(argv)
        };
        let mut child = command
            .current_dir(&dirs.base)
            .stdin(Stdio::null())
            .stdout(log_stdio(&dirs.log_file).map_err(StartError::Other)?)
            .stderr(log_stdio(&dirs.log_file).map_err(StartError::Other)?)
            .spawn()
            .context(|| format!("cannot start {}", self.bins.postgres.display()))
            .map_err(StartError::Other)?;

        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if accepts_sessions(port, Duration::from_secs(1)) {
                return Ok(child);
            }
            match child.try_wait() {
                Ok(Some(status)) => {
                    let tail = log_tail_from(&dirs.log_file, log_start);
                    if tail.contains("Address already in use") {
                        return Err(StartError::PortTaken);
                    }
                    return Err(StartError::Other(Error::msg(format!(
                        "PostgreSQL exited during startup ({status}){}; log {}:\n{tail}",
                        self.run_as.describe(),
                        dirs.log_file.display(),
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
                // Best effort: a server that never became ready must not
                // linger.
                let _ = self.stop(dirs, StopMode::Immediate);
                let _ = child.kill();
                let _ = child.wait();
                return Err(StartError::Other(Error::msg(format!(
                    "PostgreSQL did not accept connections on 127.0.0.1:{port} within {}s; log {}:\n{}",
                    START_TIMEOUT.as_secs(),
                    dirs.log_file.display(),
                    log_tail_from(&dirs.log_file, log_start),
                ))));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The command line of `pg_ctl stop` for the server of `data`: it waits
    /// up to [`STOP_TIMEOUT`] for the server to exit.
    pub(crate) fn stop_argv(&self, data: &Path, mode: StopMode) -> Vec<OsString> {
        let timeout = STOP_TIMEOUT.as_secs().to_string();
        self.run_as.argv(
            &self.bins.pg_ctl,
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-m".as_ref(),
                mode.as_arg().as_ref(),
                "-w".as_ref(),
                "-t".as_ref(),
                timeout.as_ref(),
                "stop".as_ref(),
            ],
        )
    }

    /// Stops the server of the cluster with `pg_ctl stop` and waits until it
    /// has exited.
    ///
    /// `pg_ctl` signals the pid in `postmaster.pid`: call this only for a
    /// server known to run, since the file of one that died may name a
    /// recycled pid.
    pub(crate) fn stop(&self, dirs: &ClusterDirs, mode: StopMode) -> Result<(), Error> {
        let output = command_from(self.stop_argv(&dirs.data, mode))
            .current_dir(&dirs.base)
            .stdin(Stdio::null())
            .output()
            .context(|| format!("cannot run {}", self.bins.pg_ctl.display()))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(Error::msg(format!(
                "`pg_ctl stop -m {}` failed for {} ({}): {}",
                mode.as_arg(),
                dirs.data.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )))
        }
    }
}

/// `env`, when the server needs environment variables of its own.
fn env_program(launch: &Launch) -> Result<Option<PathBuf>, Error> {
    if launch.env.is_empty() {
        return Ok(None);
    }
    find_on_path("env")
        .map(Some)
        .ok_or_else(|| Error::msg("cannot find `env` on PATH to set the server's environment"))
}

impl Postgres {
    /// A command that runs `program` with `args` as the user the server runs
    /// as (PgBouncer refuses root too).
    pub(crate) fn server_user_command(&self, program: &Path, args: &[&OsStr]) -> Command {
        self.run_as.command(program, args)
    }

    /// Hands `dir` to the server user.
    pub(crate) fn give_to_server(&self, dir: &Path) -> Result<(), Error> {
        self.run_as.give(dir)
    }

    /// Runs the installation's program `name` (`pg_basebackup`, `pg_ctl`)
    /// with `args` as the server user, in `dir`, and waits for it; a failure
    /// quotes its output.
    pub(crate) fn run_tool(&self, name: &str, args: &[&OsStr], dir: &Path) -> Result<(), Error> {
        // Beside pg_ctl or postgres, or beside what a symlink to them on PATH points to.
        let program = [&self.bins.pg_ctl, &self.bins.postgres]
            .into_iter()
            .flat_map(|bin| [Some(bin.clone()), fs::canonicalize(bin).ok()])
            .flatten()
            .map(|bin| bin.with_file_name(name))
            .find(|path| is_executable(path))
            .ok_or_else(|| {
                Error::msg(format!(
                    "cannot find {name} beside {}",
                    self.bins.pg_ctl.display()
                ))
            })?;
        let output = self
            .run_as
            .command(&program, args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .context(|| format!("cannot run {}", program.display()))?;
        if output.status.success() {
            return Ok(());
        }
        Err(Error::msg(format!(
            "{} failed ({}){}: {}{}",
            program.display(),
            output.status,
            self.run_as.describe(),
            String::from_utf8_lossy(&output.stderr).trim(),
            String::from_utf8_lossy(&output.stdout).trim(),
        )))
    }
}

enum StartError {
    PortTaken,
    Other(Error),
}

/// A command from a whole command line.
fn command_from(argv: Vec<OsString>) -> Command {
    let mut argv = argv.into_iter();
    let mut command = Command::new(argv.next().unwrap_or_default());
    command.args(argv);
    command
}

/// A command that runs in its own session, so that neither the terminal's
/// Ctrl-C nor the end of the test process takes it down.
pub(crate) fn detached(argv: Vec<OsString>) -> Command {
    match find_on_path("setsid") {
        Some(setsid) => {
            let mut command = Command::new(setsid);
            command.args(argv);
            command
        }
        None => {
            let mut command = command_from(argv);
            command.process_group(0);
            command
        }
    }
}

pub(crate) fn log_stdio(path: &Path) -> Result<Stdio, Error> {
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
pub(crate) fn accepts_sessions(port: u16, timeout: Duration) -> bool {
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

pub(crate) fn free_port() -> Result<u16, Error> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .context(|| "cannot bind 127.0.0.1:0 to find a free port")?;
    let port = listener
        .local_addr()
        .context(|| "cannot read the address of a bound socket")?
        .port();
    Ok(port)
}

pub(crate) fn remove_dir_if_exists(path: &Path) -> Result<(), Error> {
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
pub(crate) fn effective_uid() -> Result<u32, Error> {
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
        command_from(self.argv(program, args))
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
