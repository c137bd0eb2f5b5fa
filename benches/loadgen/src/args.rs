//! The command line.

use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};

use crate::plan::Route;

/// What `--help` says after the options: the two ways of sending.
const MODES: &str = "\
Modes:
  closed loop (the default): each connection sends its next request as soon as the previous
      response has been read; the service sets the pace.
  open loop (--rate): the requests of a phase are due on a fixed schedule, REQ_PER_SEC over
      all connections of the route, however fast the answers come. A due request goes out on
      a free connection; when all --connections are busy it waits for one and counts as late.
      Latency is measured from the time a request was due, so that wait is in it (no
      coordinated omission). The report adds the achieved rate, the late requests, the send
      delay and the connections used.";

/// Drives a running credits service (examples/credits.rs) over HTTP/1.1 and compares the
/// layered route with the unprotected baseline route, interleaved in one run.
#[derive(Parser, Debug)]
#[command(name = "loadgen", version, about, after_help = MODES)]
pub(crate) struct Args {
    /// Base URL of the running service (http only).
    #[arg(long, default_value = "http://127.0.0.1:3000")]
    pub(crate) url: String,
    /// Keep-alive connections per route; in closed loop each sends its requests back to back,
    /// in open loop (--rate) they are the most requests in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) connections: u32,
    /// Seconds per phase [default: 10, unless --requests is given].
    #[arg(long, value_name = "SECS", value_parser = parse_phase_secs, conflicts_with = "requests")]
    pub(crate) duration: Option<Duration>,
    /// Requests per phase, over all connections, instead of a duration.
    #[arg(long, value_name = "COUNT", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) requests: Option<u64>,
    /// Open loop: send REQ_PER_SEC requests per second over all connections of a route, on a
    /// fixed schedule, and measure latency from each request's due time (see Modes below).
    #[arg(long, value_name = "REQ_PER_SEC", value_parser = parse_rate)]
    pub(crate) rate: Option<f64>,
    /// Phases per route: R rounds of baseline then layered (baseline, minimal, layered with
    /// `--routes ceiling`).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) rounds: u32,
    /// Share (0 to 1) of requests that repeat an already answered key of the same route.
    #[arg(long, value_name = "RATIO", default_value_t = 0.0, value_parser = parse_ratio)]
    pub(crate) duplicates: f64,
    /// Share (0 to 1) of requests that reuse an answered key with a different delta.
    #[arg(long, value_name = "RATIO", default_value_t = 0.0, value_parser = parse_ratio)]
    pub(crate) conflicts: f64,
    /// Accounts the credits are spread over (their request URIs are built up front).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub(crate) accounts: u32,
    /// The X-Producer header: the producer the layer scopes the keys to.
    #[arg(long, value_name = "NAME", default_value = "loadgen")]
    pub(crate) producer: String,
    /// Seconds of unmeasured load per route before the first round (0: none).
    #[arg(long, value_name = "SECS", default_value = "1", value_parser = parse_secs)]
    pub(crate) warmup: Duration,
    /// Which routes to load: baseline and layered interleaved, those two with the minimal
    /// protocol's route between them (`ceiling`), or one alone (`minimal` is the minimal
    /// protocol's route alone, for profiling it).
    #[arg(long, value_enum, default_value_t = Routes::Both)]
    pub(crate) routes: Routes,
    /// Seconds a request may take before it counts as a transport error.
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = parse_phase_secs)]
    pub(crate) timeout: Duration,
    /// Client runtime threads: 1 is a current-thread runtime, more a multi-thread one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) threads: u32,
    /// Print the measured rounds' throughput every SECS seconds (on stderr, as it goes) and
    /// compare the first and last intervals at the end: is throughput flat over uptime?
    #[arg(long, value_name = "SECS", value_parser = parse_phase_secs)]
    pub(crate) report_every: Option<Duration>,
    /// The server's process id (Linux): its CPU time per request is reported per route, and
    /// with --report-every its resident memory (VmRSS in /proc/PID/status) is printed with
    /// each interval: is memory flat over uptime?
    #[arg(long, value_name = "PID")]
    pub(crate) server_pid: Option<u32>,
    /// Also report the CPU time per request of every process named `postgres` on this
    /// machine (Linux; the server under test should be the only PostgreSQL busy).
    #[arg(long)]
    pub(crate) postgres_cpu: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
}

impl Args {
    /// The command line, checked beyond what each option checks alone (exits with status 2
    /// and the usage on an error), with the default duration filled in.
    pub(crate) fn parse_checked() -> Args {
        let mut args = Args::parse();
        if args.duplicates + args.conflicts > 1.0 {
            Args::command()
                .error(
                    ErrorKind::ValueValidation,
                    "--duplicates and --conflicts together must not exceed 1",
                )
                .exit();
        }
        if args.requests.is_none() && args.duration.is_none() {
            args.duration = Some(Duration::from_secs(10));
        }
        args
    }

    /// How long each measured phase runs.
    pub(crate) fn limit(&self) -> Limit {
        match (self.requests, self.duration) {
            (Some(n), _) => Limit::Requests(n),
            (None, Some(d)) => Limit::Duration(d),
            (None, None) => Limit::Duration(Duration::from_secs(10)),
        }
    }

    /// How the requests are sent.
    pub(crate) fn mode(&self) -> Mode {
        match self.rate {
            Some(rate) => Mode::Open { rate },
            None => Mode::Closed,
        }
    }
}

/// How long a phase runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Limit {
    Duration(Duration),
    Requests(u64),
}

/// How the requests of a phase are sent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Mode {
    /// Each connection sends its next request when the previous response has been read.
    Closed,
    /// `rate` requests per second over the route's connections, on a fixed schedule.
    Open { rate: f64 },
}

/// The routes a run loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Routes {
    /// The baseline and the layered route, interleaved, with their ratios.
    Both,
    /// Only the layered route (no baseline needed on the server).
    Layered,
    /// Only the unprotected baseline route.
    Baseline,
    /// Only the hand-written minimal protocol (`/minimal`), for profiling it alone.
    Minimal,
    /// The baseline, the hand-written minimal protocol (`/minimal`) and the layered route,
    /// interleaved: the layer against the ceiling over HTTP, in the same run.
    Ceiling,
}

impl Routes {
    pub(crate) fn list(self) -> &'static [Route] {
        match self {
            Routes::Both => &[Route::Baseline, Route::Layered],
            Routes::Layered => &[Route::Layered],
            Routes::Baseline => &[Route::Baseline],
            Routes::Minimal => &[Route::Minimal],
            Routes::Ceiling => &[Route::Baseline, Route::Minimal, Route::Layered],
        }
    }
}

/// A number within `range`, named `what` when it is none and followed by `unit` when it is
/// out of range.
fn parse_number(
    text: &str,
    what: &str,
    range: std::ops::RangeInclusive<f64>,
    unit: &str,
) -> Result<f64, String> {
    let number: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a {what}"))?;
    if !number.is_finite() || !range.contains(&number) {
        return Err(format!(
            "`{text}` is not between {} and {}{unit}",
            range.start(),
            range.end()
        ));
    }
    Ok(number)
}

/// A seconds value: finite, not negative, at most a day.
fn parse_secs(text: &str) -> Result<Duration, String> {
    parse_number(text, "number of seconds", 0.0..=86_400.0, " seconds").map(Duration::from_secs_f64)
}

/// Like [`parse_secs`], but more than zero.
fn parse_phase_secs(text: &str) -> Result<Duration, String> {
    match parse_secs(text)? {
        d if d.is_zero() => Err("must be more than 0 seconds".to_owned()),
        d => Ok(d),
    }
}

/// A share from 0 to 1.
fn parse_ratio(text: &str) -> Result<f64, String> {
    parse_number(text, "number", 0.0..=1.0, "")
}

/// Requests per second: more than 0, at most ten million.
fn parse_rate(text: &str) -> Result<f64, String> {
    let what = "number of requests per second";
    match parse_number(text, what, 0.0..=10_000_000.0, " requests per second")? {
        rate if rate > 0.0 => Ok(rate),
        _ => Err("must be more than 0 requests per second".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_must_be_positive_and_finite() {
        assert_eq!(parse_rate("300"), Ok(300.0));
        assert_eq!(parse_rate("0.5"), Ok(0.5));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("-1").is_err());
        assert!(parse_rate("inf").is_err());
        assert!(parse_rate("NaN").is_err());
        assert!(parse_rate("fast").is_err());
    }

    #[test]
    fn rate_selects_the_open_loop() {
        let closed = Args::try_parse_from(["loadgen"]).expect("no arguments parse");
        assert_eq!(closed.mode(), Mode::Closed);
        let open = Args::try_parse_from(["loadgen", "--rate", "300", "--requests", "900"])
            .expect("--rate parses");
        assert_eq!(open.mode(), Mode::Open { rate: 300.0 });
        assert_eq!(open.limit(), Limit::Requests(900));
    }
}
