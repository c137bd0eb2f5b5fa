//! A load generator for the credits service: what the inbox layer costs over real HTTP/1.1.
//!
//! It drives a **running** `examples/credits.rs` over keep-alive connections and runs the
//! unprotected baseline route (`POST /baseline/accounts/{id}/credits`, the same credit in its
//! own transaction) and the layered route (`POST /accounts/{id}/credits`) **in the same run,
//! interleaved**: `--rounds R` alternates phases baseline → layered → baseline → layered …, so
//! that machine noise hits both, and each route's figures are aggregated over its phases.
//!
//! ```sh
//! # terminal 1: the service, with the baseline route
//! CREDITS_BASELINE_ROUTE=1 cargo run --release --example credits
//! # terminal 2: 3 rounds of 10 s per route, 32 connections, new keys only
//! cargo run --release --example loadgen -- --connections 32 --duration 10 --rounds 3
//! # half of the requests repeat a key this run already got an answer for
//! cargo run --release --example loadgen -- --connections 32 --duration 10 --rounds 3 --duplicates 0.5
//! # replays only, no baseline (e.g. to try a response cache)
//! cargo run --release --example loadgen -- --routes layered --duplicates 1 --duration 10
//! ```
//!
//! `benches/http.sh [loadgen arguments]` does all of it in one command: it builds both in
//! release, starts the service with the baseline route on a free port, waits for it to listen,
//! runs the load generator against it and stops the service again.
//!
//! # What it sends
//!
//! Each of `--connections` connections is one task that sends its requests back to back
//! (closed loop: a new request as soon as the previous response has been read), for
//! `--duration` seconds or until the phase's `--requests` are sent. Before the measured rounds,
//! each route gets `--warmup` seconds whose figures are discarded (their errors are still
//! reported). Every request credits one of `--accounts` accounts (`lg-0` … `lg-9999`), chosen at
//! random, so that one account's row lock does not serialise the run; both routes credit the
//! same accounts. Each request is one of three kinds:
//!
//! | kind | share | request | expected on the layered route | expected on the baseline |
//! |---|---|---|---|---|
//! | new | the rest | a key never sent before, `{"delta":1}` | 201, no `idempotent-replayed` | 201 |
//! | duplicate | `--duplicates` | a key of the same route already answered with 201, the same account and body | 201 with `idempotent-replayed: true` | 201 (it credits again) |
//! | conflict | `--conflicts` | such a key with `{"delta":2}` | 409 | 201 (it credits again) |
//!
//! Duplicates and conflicts pick from the last 1024 keys the same connection got answered, so a
//! connection's first requests are new until it has one (the warmup fills them). Keys are
//! `lg-<run id>-<route><connection>-<n>`, with a time-based run id, so a re-run against the
//! same database never reuses a key. The producer is `--producer` (header `X-Producer`, default
//! `loadgen`). Before any load, one new request per route (on account `lg-0`) checks that the
//! route answers 201.
//!
//! # What it prints
//!
//! Per route and per kind (and all kinds together): requests sent (responses and transport
//! errors), throughput (responses per second of the route's measured time, so the kinds add up
//! to the route's throughput), p50, p99, p999 and max latency in milliseconds, mismatches (a
//! response that is not the expected one above) and transport errors (connect, request, body,
//! no response within `--timeout`); each route's throughput per phase; its responses by status
//! and how many were replayed; then the ratios **layered / baseline**: throughput (layered
//! req/s ÷ baseline req/s), p50 and p99, and the p99 of each layered kind against the
//! baseline's, and the throughput ratio of each round (its layered phase over its baseline
//! phase). `--json` prints the same as one JSON object instead. The first distinct
//! mismatches and errors are printed with their key and the start of the body. Latencies are
//! recorded for every response, expected or not; a transport error has none, and its
//! connection is closed and opened again.
//!
//! # Over uptime
//!
//! `--report-every SECS` prints, on stderr as the measured rounds go, the responses per second
//! of each interval (all routes and kinds together: use one route, `--routes layered`, for a
//! soak), and with `--server-pid PID` the server's resident memory (`VmRSS` in
//! `/proc/PID/status`, Linux) at each interval's end. At the end the report compares the
//! first tenth of the intervals with the last tenth: is throughput flat, is memory flat?
//! `benches/http.sh` passes the server's pid itself, so only `--report-every` is needed:
//!
//! ```sh
//! benches/http.sh --routes layered --rounds 1 --requests 1000000 --report-every 10
//! ```
//!
//! On a shared machine the intervals swing with other load. Many short interleaved rounds of
//! both routes give a measure that does not: the throughput ratio of each round, and its first
//! fifth of the rounds against its last fifth. A trend in that ratio is the layer's own:
//!
//! ```sh
//! benches/http.sh --rounds 30 --duration 10
//! ```
//!
//! Exit status: 0 when every response was the expected one; 3 when the run completed but saw
//! mismatches or transport errors (the figures are printed all the same, with a warning on
//! stderr); 1 when it could not run (bad URL, server unreachable, or a route that does not
//! answer a first request with 201, such as a service started without the baseline route);
//! 2 for bad arguments.
//!
//! # Client cost
//!
//! The load generator shares the machine with the service and PostgreSQL, so it stays lean:
//! one task per connection on a plain `hyper` HTTP/1.1 connection (no pool, no retries; hyper's
//! connection driver is a task beside it); the bodies, request URIs and constant headers are
//! built once and shared by reference count; keys are written into one buffer and split off,
//! not allocated one by one; latencies go into an HDR histogram per connection and kind
//! (3 significant digits, grown during the warmup and reset in place), merged at the end.
//!
//! It runs on a **current-thread** runtime by default. Measured on a busy 2-core machine at
//! 1,000–3,000 req/s: about 35–55 µs of client CPU per request, about half of it in the kernel
//! (socket reads and writes, wake-ups), i.e. under 10% of one core; a 2-worker runtime
//! (`--threads 2`) reached no more requests and spent as much or more CPU per request (threads
//! waking each other). One thread is far from its limit here, and a second one would only take
//! CPU from the server and PostgreSQL. `--threads N` is there for a bigger machine. The report
//! gives the client's own CPU time per request and its share of one core (`getrusage`, on
//! Unix), and says so when the client was near a full core, i.e. the bottleneck itself.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};
use hdrhistogram::Histogram;
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpStream;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
const X_PRODUCER: HeaderName = HeaderName::from_static("x-producer");

/// The body of a new request and of its duplicates.
const CREDIT_BODY: &[u8] = br#"{"delta":1}"#;
/// The body of a conflict: the same key, another delta.
const CONFLICT_BODY: &[u8] = br#"{"delta":2}"#;
/// Answered keys each connection remembers for duplicates and conflicts.
const ANSWERED_KEYS: usize = 1024;
/// Mismatch and error descriptions each connection keeps for the report.
const SAMPLES_PER_CONNECTION: usize = 3;
/// Mismatch and error descriptions the report prints.
const SAMPLES_PRINTED: usize = 10;
/// Bytes of an unexpected response body kept for the report.
const SAMPLE_BODY_BYTES: usize = 200;
/// Pause after a failed connect, so that a dead server is not hammered.
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);

/// Drives a running credits service (examples/credits.rs) over HTTP/1.1 and compares the
/// layered route with the unprotected baseline route, interleaved in one run.
#[derive(Parser, Debug)]
#[command(name = "loadgen", version, about)]
struct Args {
    /// Base URL of the running service (http only).
    #[arg(long, default_value = "http://127.0.0.1:3000")]
    url: String,
    /// Keep-alive connections per route; each sends its requests back to back.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    connections: u32,
    /// Seconds per phase [default: 10, unless --requests is given].
    #[arg(long, value_name = "SECS", value_parser = parse_phase_secs, conflicts_with = "requests")]
    duration: Option<Duration>,
    /// Requests per phase, over all connections, instead of a duration.
    #[arg(long, value_name = "COUNT", value_parser = clap::value_parser!(u64).range(1..))]
    requests: Option<u64>,
    /// Phases per route: R rounds of baseline then layered.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    rounds: u32,
    /// Share (0 to 1) of requests that repeat an already answered key of the same route.
    #[arg(long, value_name = "RATIO", default_value_t = 0.0, value_parser = parse_ratio)]
    duplicates: f64,
    /// Share (0 to 1) of requests that reuse an answered key with a different delta.
    #[arg(long, value_name = "RATIO", default_value_t = 0.0, value_parser = parse_ratio)]
    conflicts: f64,
    /// Accounts the credits are spread over (their request URIs are built up front).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    accounts: u32,
    /// The X-Producer header: the producer the layer scopes the keys to.
    #[arg(long, value_name = "NAME", default_value = "loadgen")]
    producer: String,
    /// Seconds of unmeasured load per route before the first round (0: none).
    #[arg(long, value_name = "SECS", default_value = "1", value_parser = parse_secs)]
    warmup: Duration,
    /// Which routes to load: both interleaved, or one alone.
    #[arg(long, value_enum, default_value_t = Routes::Both)]
    routes: Routes,
    /// Seconds a request may take before it counts as a transport error.
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = parse_phase_secs)]
    timeout: Duration,
    /// Client runtime threads: 1 is a current-thread runtime, more a multi-thread one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    threads: u32,
    /// Print the measured rounds' throughput every SECS seconds (on stderr, as it goes) and
    /// compare the first and last intervals at the end: is throughput flat over uptime?
    #[arg(long, value_name = "SECS", value_parser = parse_phase_secs)]
    report_every: Option<Duration>,
    /// The server's process id (Linux): its CPU time per request is reported per route, and
    /// with --report-every its resident memory (VmRSS in /proc/PID/status) is printed with
    /// each interval: is memory flat over uptime?
    #[arg(long, value_name = "PID")]
    server_pid: Option<u32>,
    /// Also report the CPU time per request of every process named `postgres` on this
    /// machine (Linux; the server under test should be the only PostgreSQL busy).
    #[arg(long)]
    postgres_cpu: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

/// The routes a run loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Routes {
    /// The baseline and the layered route, interleaved, with their ratios.
    Both,
    /// Only the layered route (no baseline needed on the server).
    Layered,
    /// Only the unprotected baseline route.
    Baseline,
}

impl Routes {
    fn list(self) -> &'static [Route] {
        match self {
            Routes::Both => &[Route::Baseline, Route::Layered],
            Routes::Layered => &[Route::Layered],
            Routes::Baseline => &[Route::Baseline],
        }
    }
}

/// A seconds value: finite, not negative, at most a day.
fn parse_secs(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number of seconds"))?;
    if !secs.is_finite() || !(0.0..=86_400.0).contains(&secs) {
        return Err(format!("`{text}` is not between 0 and 86400 seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
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
    let ratio: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))?;
    if !(0.0..=1.0).contains(&ratio) {
        return Err(format!("`{text}` is not between 0 and 1"));
    }
    Ok(ratio)
}

/// One of the two routes the service serves the credit on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Baseline,
    Layered,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Route::Baseline => "baseline",
            Route::Layered => "layered",
        }
    }

    fn path_prefix(self) -> &'static str {
        match self {
            Route::Baseline => "/baseline/accounts/",
            Route::Layered => "/accounts/",
        }
    }

    /// The route's letter in keys.
    fn tag(self) -> char {
        match self {
            Route::Baseline => 'b',
            Route::Layered => 'l',
        }
    }

    /// The response a request of `kind` must get on this route: status and whether it is
    /// marked `idempotent-replayed: true`.
    fn expected(self, kind: Kind) -> (StatusCode, bool) {
        match (self, kind) {
            (Route::Layered, Kind::Duplicate) => (StatusCode::CREATED, true),
            (Route::Layered, Kind::Conflict) => (StatusCode::CONFLICT, false),
            _ => (StatusCode::CREATED, false),
        }
    }
}

/// What a request is, relative to the keys already answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    New,
    Duplicate,
    Conflict,
}

const KINDS: [Kind; 3] = [Kind::New, Kind::Duplicate, Kind::Conflict];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::New => "new",
            Kind::Duplicate => "duplicate",
            Kind::Conflict => "conflict",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Where the service listens, resolved once.
struct Target {
    addr: SocketAddr,
    /// The `Host` header.
    host: HeaderValue,
    /// The URL's path without a trailing slash, put before the routes' paths.
    base_path: String,
}

async fn resolve(url: &str) -> Result<Target, String> {
    let uri: Uri = url
        .parse()
        .map_err(|e| format!("--url `{url}` is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("--url `{url}`: only http:// is supported"));
    }
    if uri.query().is_some() {
        return Err(format!("--url `{url}` must not have a query"));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("--url `{url}` has no host"))?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(80);
    let addr = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| format!("--url `{url}`: cannot resolve `{host}`: {e}"))?
        .next()
        .ok_or_else(|| format!("--url `{url}`: `{host}` has no address"))?;
    let host = HeaderValue::from_str(authority.as_str())
        .map_err(|e| format!("--url `{url}`: bad host: {e}"))?;
    Ok(Target {
        addr,
        host,
        base_path: uri.path().trim_end_matches('/').to_owned(),
    })
}

/// Everything the connections share, built once.
struct Plan {
    target: Target,
    producer: HeaderValue,
    content_type: HeaderValue,
    credit_body: Bytes,
    conflict_body: Bytes,
    /// Per route (indexed by `Route as usize`), the request URI of every account.
    uris: [Vec<Uri>; 2],
    duplicates: f64,
    conflicts: f64,
    timeout: Duration,
    run_id: String,
    /// Responses so far, every route and kind: read by the interval reports.
    responses: AtomicU64,
    /// Whose CPU time each phase measures besides the load generator's own.
    server_pid: Option<u32>,
    postgres_cpu: bool,
}

impl Plan {
    fn new(args: &Args, target: Target, run_id: String) -> Result<Plan, String> {
        let producer = HeaderValue::from_str(&args.producer)
            .ok()
            .filter(|_| {
                !args.producer.is_empty() && args.producer.bytes().all(|b| b.is_ascii_graphic())
            })
            .ok_or_else(|| {
                format!(
                    "--producer `{}` must be visible ASCII without spaces",
                    args.producer
                )
            })?;
        let uris = |route: Route| -> Result<Vec<Uri>, String> {
            let mut path = String::new();
            (0..args.accounts)
                .map(|account| {
                    path.clear();
                    let _ = write!(
                        path,
                        "{}{}lg-{account}/credits",
                        target.base_path,
                        route.path_prefix()
                    );
                    Uri::try_from(path.as_str()).map_err(|e| format!("bad path `{path}`: {e}"))
                })
                .collect()
        };
        Ok(Plan {
            uris: [uris(Route::Baseline)?, uris(Route::Layered)?],
            target,
            producer,
            content_type: HeaderValue::from_static("application/json"),
            credit_body: Bytes::from_static(CREDIT_BODY),
            conflict_body: Bytes::from_static(CONFLICT_BODY),
            duplicates: args.duplicates,
            conflicts: args.conflicts,
            timeout: args.timeout,
            run_id,
            responses: AtomicU64::new(0),
            server_pid: args.server_pid,
            postgres_cpu: args.postgres_cpu,
        })
    }

    /// The request for `key` on `account` of `route`; `conflict` sends the other delta.
    fn request(
        &self,
        route: Route,
        account: u32,
        key: HeaderValue,
        conflict: bool,
    ) -> Request<Full<Bytes>> {
        let body = if conflict {
            self.conflict_body.clone()
        } else {
            self.credit_body.clone()
        };
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = self.uris[route as usize][account as usize].clone();
        let headers = request.headers_mut();
        headers.reserve(4);
        headers.insert(HOST, self.target.host.clone());
        headers.insert(CONTENT_TYPE, self.content_type.clone());
        headers.insert(X_PRODUCER, self.producer.clone());
        headers.insert(IDEMPOTENCY_KEY, key);
        request
    }
}

/// Writes a connection's keys into one buffer and splits each off, instead of allocating one
/// string per request.
struct KeyMaker {
    buffer: BytesMut,
    prefix: String,
    next: u64,
}

impl KeyMaker {
    fn new(run_id: &str, route: Route, connection: u32) -> KeyMaker {
        KeyMaker {
            buffer: BytesMut::new(),
            prefix: format!("lg-{run_id}-{}{connection}-", route.tag()),
            next: 0,
        }
    }

    fn next_key(&mut self) -> HeaderValue {
        if self.buffer.capacity() - self.buffer.len() < self.prefix.len() + 20 {
            self.buffer.reserve(16 * 1024);
        }
        self.buffer.extend_from_slice(self.prefix.as_bytes());
        let _ = write!(self.buffer, "{}", self.next);
        self.next += 1;
        HeaderValue::from_maybe_shared(self.buffer.split().freeze())
            .expect("a key is the run id (hex), a route letter and numbers: visible ASCII")
    }
}

/// A key that got its 201, for duplicates and conflicts.
struct Answered {
    key: HeaderValue,
    account: u32,
}

/// The last [`ANSWERED_KEYS`] keys a connection got answered.
struct AnsweredKeys {
    keys: Vec<Answered>,
    oldest: usize,
}

impl AnsweredKeys {
    fn new() -> AnsweredKeys {
        AnsweredKeys {
            keys: Vec::with_capacity(ANSWERED_KEYS),
            oldest: 0,
        }
    }

    fn push(&mut self, answered: Answered) {
        if self.keys.len() < ANSWERED_KEYS {
            self.keys.push(answered);
        } else {
            self.keys[self.oldest] = answered;
            self.oldest = (self.oldest + 1) % ANSWERED_KEYS;
        }
    }

    fn pick(&self, rng: &mut fastrand::Rng) -> Option<&Answered> {
        if self.keys.is_empty() {
            None
        } else {
            self.keys.get(rng.usize(..self.keys.len()))
        }
    }
}

/// Why a request got no response.
#[derive(Clone, Copy, Debug)]
enum Failure {
    Connect,
    Request,
    Body,
    Timeout,
}

const FAILURES: [Failure; 4] = [
    Failure::Connect,
    Failure::Request,
    Failure::Body,
    Failure::Timeout,
];

impl Failure {
    fn name(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Request => "request",
            Failure::Body => "body",
            Failure::Timeout => "timeout",
        }
    }
}

/// What one kind of request on one route got.
#[derive(Clone)]
struct KindStats {
    /// Latency of every response, in microseconds.
    latency: Histogram<u64>,
    responses: u64,
    mismatches: u64,
    /// Transport errors by [`Failure`].
    errors: [u64; 4],
    /// Responses by status code.
    statuses: Vec<(u16, u64)>,
    /// Responses marked `idempotent-replayed: true`.
    replayed: u64,
}

impl KindStats {
    fn new() -> KindStats {
        KindStats {
            // Auto-resizing, 3 significant digits: small until long latencies show up.
            latency: Histogram::new(3).expect("3 significant digits are supported"),
            responses: 0,
            mismatches: 0,
            errors: [0; 4],
            statuses: Vec::new(),
            replayed: 0,
        }
    }

    fn record(&mut self, latency: Duration, status: StatusCode, replayed: bool, mismatch: bool) {
        // `record` grows the auto-resizing histogram; `saturating_record` would clamp to
        // its current range.
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        if self.latency.record(micros).is_err() {
            self.latency.saturating_record(micros);
        }
        self.responses += 1;
        self.mismatches += u64::from(mismatch);
        self.replayed += u64::from(replayed);
        let status = status.as_u16();
        match self.statuses.iter_mut().find(|(s, _)| *s == status) {
            Some((_, n)) => *n += 1,
            None => self.statuses.push((status, 1)),
        }
    }

    /// Forgets what was recorded, keeping the histogram's grown range (no re-allocation in
    /// the next phase).
    fn clear(&mut self) {
        self.latency.reset();
        self.responses = 0;
        self.mismatches = 0;
        self.errors = [0; 4];
        self.statuses.clear();
        self.replayed = 0;
    }

    fn errors(&self) -> u64 {
        self.errors.iter().sum()
    }

    /// Requests sent: responses and transport errors.
    fn requests(&self) -> u64 {
        self.responses + self.errors()
    }

    fn merge(&mut self, other: &KindStats) -> Result<(), String> {
        self.latency
            .add(&other.latency)
            .map_err(|e| format!("merging latency histograms: {e:?}"))?;
        self.responses += other.responses;
        self.mismatches += other.mismatches;
        for (mine, theirs) in self.errors.iter_mut().zip(other.errors) {
            *mine += theirs;
        }
        for &(status, n) in &other.statuses {
            match self.statuses.iter_mut().find(|(s, _)| *s == status) {
                Some((_, mine)) => *mine += n,
                None => self.statuses.push((status, n)),
            }
        }
        self.replayed += other.replayed;
        Ok(())
    }
}

/// What one route got, per kind, with the first mismatches and errors described.
#[derive(Clone)]
struct Stats {
    kinds: [KindStats; 3],
    samples: Vec<String>,
}

impl Stats {
    fn new() -> Stats {
        Stats {
            kinds: [KindStats::new(), KindStats::new(), KindStats::new()],
            samples: Vec::new(),
        }
    }

    fn requests(&self) -> u64 {
        self.kinds.iter().map(KindStats::requests).sum()
    }

    fn responses(&self) -> u64 {
        self.kinds.iter().map(|k| k.responses).sum()
    }

    fn mismatches(&self) -> u64 {
        self.kinds.iter().map(|k| k.mismatches).sum()
    }

    fn errors(&self) -> u64 {
        self.kinds.iter().map(KindStats::errors).sum()
    }

    /// All kinds together.
    fn all(&self) -> Result<KindStats, String> {
        let mut all = KindStats::new();
        for kind in &self.kinds {
            all.merge(kind)?;
        }
        Ok(all)
    }

    fn merge(&mut self, other: &Stats) -> Result<(), String> {
        for (mine, theirs) in self.kinds.iter_mut().zip(&other.kinds) {
            mine.merge(theirs)?;
        }
        for sample in &other.samples {
            if self.samples.len() < SAMPLES_PRINTED && !self.samples.contains(sample) {
                self.samples.push(sample.clone());
            }
        }
        Ok(())
    }

    fn clear(&mut self) {
        self.kinds.iter_mut().for_each(KindStats::clear);
        self.samples.clear();
    }

    fn sample(&mut self, describe: impl FnOnce() -> String) {
        if self.samples.len() < SAMPLES_PER_CONNECTION {
            let sample = describe();
            if !self.samples.contains(&sample) {
                self.samples.push(sample);
            }
        }
    }
}

/// One connection's state on one route, kept across phases: its keys, the keys it got
/// answered and what it measured.
struct Slot {
    route: Route,
    rng: fastrand::Rng,
    keys: KeyMaker,
    answered: AnsweredKeys,
    stats: Stats,
}

/// When a phase ends.
#[derive(Clone)]
enum Stop {
    At(Instant),
    /// Requests left to send over all connections.
    Budget(Arc<AtomicU64>),
}

impl Stop {
    /// Whether one more request may be sent.
    fn admit(&self, now: Instant) -> bool {
        match self {
            Stop::At(deadline) => now < *deadline,
            Stop::Budget(left) => left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok(),
        }
    }
}

/// How long each phase runs.
#[derive(Clone, Copy)]
enum Limit {
    Duration(Duration),
    Requests(u64),
}

type Sender = SendRequest<Full<Bytes>>;

/// Opens one HTTP/1.1 connection; its driver runs as a task of its own until the sender is
/// dropped or the server closes it.
async fn connect(target: &Target) -> Result<Sender, String> {
    let stream = TcpStream::connect(target.addr)
        .await
        .map_err(|e| format!("connect to {}: {e}", target.addr))?;
    stream
        .set_nodelay(true)
        .map_err(|e| format!("TCP_NODELAY: {e}"))?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP/1.1 handshake: {e}"))?;
    // Its errors reach the sender: the request in flight fails with them.
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// A response as far as the checks need it.
struct Reply {
    status: StatusCode,
    replayed: bool,
    /// The start of the body, kept only when the response was not the expected one.
    unexpected_body: Option<Vec<u8>>,
}

/// Sends `request` on `sender` and reads the whole response (so that the connection can be
/// reused), keeping the start of the body only if it is not the `expected` response.
async fn exchange(
    sender: &mut Sender,
    request: Request<Full<Bytes>>,
    expected: (StatusCode, bool),
) -> Result<Reply, (Failure, String)> {
    sender
        .ready()
        .await
        .map_err(|e| (Failure::Request, e.to_string()))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| (Failure::Request, e.to_string()))?;
    let status = response.status();
    let replayed = response
        .headers()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    let mut unexpected_body = ((status, replayed) != expected).then(Vec::new);
    let mut body = response.into_body();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| (Failure::Body, e.to_string()))?;
        if let (Some(kept), Some(data)) = (unexpected_body.as_mut(), frame.data_ref()) {
            let room = SAMPLE_BODY_BYTES.saturating_sub(kept.len());
            kept.extend_from_slice(&data[..data.len().min(room)]);
        }
    }
    Ok(Reply {
        status,
        replayed,
        unexpected_body,
    })
}

/// One connection's closed loop for one phase.
async fn drive(mut slot: Slot, plan: Arc<Plan>, mut sender: Option<Sender>, stop: Stop) -> Slot {
    let route = slot.route;
    let accounts = u32::try_from(plan.uris[route as usize].len()).unwrap_or(u32::MAX);
    loop {
        if !stop.admit(Instant::now()) {
            break;
        }
        // The kind, then the key and account it needs.
        let draw = slot.rng.f64();
        let wanted = if draw < plan.duplicates {
            Kind::Duplicate
        } else if draw < plan.duplicates + plan.conflicts {
            Kind::Conflict
        } else {
            Kind::New
        };
        let (kind, key, account) = match (wanted, slot.answered.pick(&mut slot.rng)) {
            (Kind::Duplicate | Kind::Conflict, Some(answered)) => {
                (wanted, answered.key.clone(), answered.account)
            }
            _ => (Kind::New, slot.keys.next_key(), slot.rng.u32(..accounts)),
        };
        let expected = route.expected(kind);
        let stats = &mut slot.stats;
        let kind_stats = &mut stats.kinds[kind.index()];

        let connection = match sender.as_mut() {
            Some(s) if !s.is_closed() => s,
            _ => match connect(&plan.target).await {
                Ok(s) => sender.insert(s),
                Err(e) => {
                    sender = None;
                    kind_stats.errors[Failure::Connect as usize] += 1;
                    stats
                        .sample(|| format!("{} {}: connect error: {e}", route.name(), kind.name()));
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                    continue;
                }
            },
        };
        let request = plan.request(route, account, key.clone(), kind == Kind::Conflict);
        let started = Instant::now();
        let outcome =
            tokio::time::timeout(plan.timeout, exchange(connection, request, expected)).await;
        let latency = started.elapsed();
        match outcome {
            Ok(Ok(reply)) => {
                plan.responses.fetch_add(1, Ordering::Relaxed);
                let mismatch = (reply.status, reply.replayed) != expected;
                kind_stats.record(latency, reply.status, reply.replayed, mismatch);
                if mismatch {
                    let body = reply.unexpected_body.unwrap_or_default();
                    stats.sample(|| {
                        format!(
                            "{} {} key {}: got {}{}, expected {}{}; body: {}",
                            route.name(),
                            kind.name(),
                            String::from_utf8_lossy(key.as_bytes()),
                            reply.status.as_u16(),
                            replayed_note(reply.replayed),
                            expected.0.as_u16(),
                            replayed_note(expected.1),
                            String::from_utf8_lossy(&body),
                        )
                    });
                } else if kind == Kind::New {
                    slot.answered.push(Answered { key, account });
                }
            }
            Ok(Err((failure, error))) => {
                sender = None;
                kind_stats.errors[failure as usize] += 1;
                stats.sample(|| {
                    format!(
                        "{} {} key {}: {} error: {error}",
                        route.name(),
                        kind.name(),
                        String::from_utf8_lossy(key.as_bytes()),
                        failure.name()
                    )
                });
            }
            Err(_elapsed) => {
                // The connection is in the middle of an exchange: it cannot be reused.
                sender = None;
                kind_stats.errors[Failure::Timeout as usize] += 1;
                stats.sample(|| {
                    format!(
                        "{} {} key {}: no response within {:?}",
                        route.name(),
                        kind.name(),
                        String::from_utf8_lossy(key.as_bytes()),
                        plan.timeout
                    )
                });
            }
        }
    }
    slot
}

fn replayed_note(replayed: bool) -> &'static str {
    if replayed {
        " replayed"
    } else {
        ""
    }
}

/// One phase's figures.
#[derive(Clone, Copy)]
struct Phase {
    /// Responses received (transport errors not counted), like the route's throughput.
    responses: u64,
    elapsed: Duration,
    /// The load generator's own CPU time during the phase, where the platform tells it.
    cpu: Option<Duration>,
    /// The server's CPU time during the phase (`--server-pid`, Linux).
    server_cpu: Option<Duration>,
    /// PostgreSQL's CPU time during the phase (`--postgres-cpu`, Linux).
    postgres_cpu: Option<Duration>,
}

/// Runs one phase of `route` on all its connections and hands the slots back.
async fn run_phase(
    plan: &Arc<Plan>,
    slots: Vec<Slot>,
    limit: Limit,
) -> Result<(Vec<Slot>, Phase), String> {
    let before: u64 = slots.iter().map(|s| s.stats.responses()).sum();
    // Connect first, so that the phase measures requests, not handshakes. A connection that
    // fails here is retried (and counted) by its task.
    let mut senders = Vec::with_capacity(slots.len());
    for _ in &slots {
        senders.push(connect(&plan.target).await.ok());
    }
    let cpu_before = cpu_time();
    let server_before = plan.server_pid.and_then(|pid| process_cpu(&[pid]));
    let postgres_before = plan.postgres_cpu.then(postgres_cpu).flatten();
    let started = Instant::now();
    let stop = match limit {
        Limit::Duration(d) => Stop::At(started + d),
        Limit::Requests(n) => Stop::Budget(Arc::new(AtomicU64::new(n))),
    };
    let tasks: Vec<_> = slots
        .into_iter()
        .zip(senders)
        .map(|(slot, sender)| tokio::spawn(drive(slot, plan.clone(), sender, stop.clone())))
        .collect();
    let mut slots = Vec::with_capacity(tasks.len());
    for task in tasks {
        slots.push(
            task.await
                .map_err(|e| format!("a connection task failed: {e}"))?,
        );
    }
    let elapsed = started.elapsed();
    let cpu = cpu_time()
        .zip(cpu_before)
        .map(|(after, before)| after.saturating_sub(before));
    let server_cpu = plan
        .server_pid
        .and_then(|pid| process_cpu(&[pid]))
        .zip(server_before)
        .map(|(after, before)| after.saturating_sub(before));
    let postgres_cpu = plan
        .postgres_cpu
        .then(postgres_cpu)
        .flatten()
        .zip(postgres_before)
        .map(|(after, before)| after.saturating_sub(before));
    let after: u64 = slots.iter().map(|s| s.stats.responses()).sum();
    Ok((
        slots,
        Phase {
            responses: after - before,
            elapsed,
            cpu,
            server_cpu,
            postgres_cpu,
        },
    ))
}

/// The process's user and system CPU time so far.
#[cfg(unix)]
fn cpu_time() -> Option<Duration> {
    // SAFETY: `rusage` is plain data, for which all zeroes is a valid value, and getrusage
    // only writes into the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return None;
        }
        usage
    };
    let time = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    Some(time(usage.ru_utime) + time(usage.ru_stime))
}

#[cfg(not(unix))]
fn cpu_time() -> Option<Duration> {
    None
}

/// The user and system CPU time the processes `pids` have used so far, from
/// `/proc/PID/stat` (Linux); `None` where it cannot be read. A process that exits during a
/// phase takes its time with it: the pool's connections (and so their backends) live on.
#[cfg(unix)]
fn process_cpu(pids: &[u32]) -> Option<Duration> {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = u64::try_from(ticks).ok().filter(|t| *t > 0)?;
    let mut total = 0u64;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name is in parentheses and may hold spaces: count after its end.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        // utime and stime are the 14th and 15th fields, the 12th and 13th after the name.
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        total += utime + stime;
    }
    Some(Duration::from_micros(total * 1_000_000 / ticks))
}

#[cfg(not(unix))]
fn process_cpu(_pids: &[u32]) -> Option<Duration> {
    None
}

/// The CPU time every process named `postgres` has used so far (Linux).
fn postgres_cpu() -> Option<Duration> {
    let pids: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid: &u32| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim_end() == "postgres")
        })
        .collect();
    // Processes that exit between the listing and the read are left out.
    let readable: Vec<u32> = pids
        .into_iter()
        .filter(|pid| process_cpu(&[*pid]).is_some())
        .collect();
    process_cpu(&readable)
}

/// Everything one route measured.
struct RouteReport {
    route: Route,
    stats: Stats,
    phases: Vec<Phase>,
    warmup: Stats,
}

impl RouteReport {
    fn elapsed(&self) -> Duration {
        self.phases.iter().map(|p| p.elapsed).sum()
    }

    fn cpu(&self) -> Option<Duration> {
        self.phases.iter().map(|p| p.cpu).sum()
    }

    fn server_cpu(&self) -> Option<Duration> {
        self.phases.iter().map(|p| p.server_cpu).sum()
    }

    fn postgres_cpu(&self) -> Option<Duration> {
        self.phases.iter().map(|p| p.postgres_cpu).sum()
    }

    /// The first distinct mismatches and errors, warmup included.
    fn samples(&self) -> Vec<&str> {
        let mut samples: Vec<&str> = Vec::new();
        for sample in self.warmup.samples.iter().chain(&self.stats.samples) {
            if samples.len() < SAMPLES_PRINTED && !samples.contains(&sample.as_str()) {
                samples.push(sample);
            }
        }
        samples
    }
}

/// A run id unique enough that re-runs against the same database never share a key: the
/// time in milliseconds and 16 random bits, in hex.
fn run_id() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    format!("{millis:x}{:04x}", fastrand::u16(..))
}

/// Checks, before any load, that the service answers each route as expected, so that a
/// wrong URL or a service without the baseline route fails clearly instead of as a flood of
/// mismatches.
async fn preflight(plan: &Plan, routes: &[Route]) -> Result<(), String> {
    let mut sender = connect(&plan.target).await.map_err(|e| {
        format!("{e}: is the credits service running (cargo run --release --example credits)?")
    })?;
    for &route in routes {
        let key = format!("lg-{}-{}-preflight", plan.run_id, route.tag());
        let key = HeaderValue::from_str(&key).map_err(|e| format!("preflight key: {e}"))?;
        let request = plan.request(route, 0, key, false);
        let expected = route.expected(Kind::New);
        let reply = tokio::time::timeout(plan.timeout, exchange(&mut sender, request, expected))
            .await
            .map_err(|_| {
                format!(
                    "{} route: no response within {:?}",
                    route.name(),
                    plan.timeout
                )
            })?
            .map_err(|(failure, e)| {
                format!("{} route: {} error: {e}", route.name(), failure.name())
            })?;
        if (reply.status, reply.replayed) != expected {
            let hint = match (route, reply.status) {
                (Route::Baseline, StatusCode::NOT_FOUND) => {
                    ": start the service with CREDITS_BASELINE_ROUTE=1, or pass --routes layered"
                }
                _ => "",
            };
            return Err(format!(
                "{} route answered {}{} instead of {}{hint}; body: {}",
                route.name(),
                reply.status,
                replayed_note(reply.replayed),
                expected.0,
                String::from_utf8_lossy(&reply.unexpected_body.unwrap_or_default()),
            ));
        }
    }
    Ok(())
}

/// One `--report-every` interval of the measured rounds.
struct Interval {
    /// Time since the measured rounds started, at the interval's end.
    at: Duration,
    /// Responses per second in the interval, all routes and kinds.
    per_second: f64,
    /// The server's resident memory at the interval's end, in KiB (`--server-pid`).
    rss_kib: Option<u64>,
}

/// The server's resident memory in KiB: VmRSS in `/proc/PID/status` (Linux).
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    line.trim().trim_end_matches("kB").trim().parse().ok()
}

/// Prints a line on stderr every `every` until `stop` fires, and returns the intervals.
/// Rates are taken over the time that really passed, so a late tick skews nothing.
async fn report_intervals(
    plan: Arc<Plan>,
    every: Duration,
    pid: Option<u32>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Vec<Interval> {
    let started = Instant::now();
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut last_at, mut last_responses) = (started, plan.responses.load(Ordering::Relaxed));
    let mut intervals = Vec::new();
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => return intervals,
            _ = ticks.tick() => {}
        }
        let now = Instant::now();
        let responses = plan.responses.load(Ordering::Relaxed);
        let interval = Interval {
            at: now - started,
            per_second: (responses - last_responses) as f64 / (now - last_at).as_secs_f64(),
            rss_kib: pid.and_then(rss_kib),
        };
        (last_at, last_responses) = (now, responses);
        let rss = interval
            .rss_kib
            .map(|kib| format!(", server RSS {:.1} MiB", kib as f64 / 1024.0))
            .unwrap_or_default();
        eprintln!(
            "loadgen: interval {:>4} at {:>7.1} s: {:>8.0} responses/s{rss}",
            intervals.len() + 1,
            interval.at.as_secs_f64(),
            interval.per_second
        );
        intervals.push(interval);
    }
}

/// Throughput and memory over the measured rounds, interval by interval.
struct Uptime {
    every: Duration,
    intervals: Vec<Interval>,
}

impl Uptime {
    /// Intervals averaged at each end: the first and last tenth, at least one.
    fn edge(&self) -> usize {
        (self.intervals.len() / 10).max(1)
    }

    /// The mean of `value` over the first and over the last [`edge`](Self::edge) intervals,
    /// and its minimum and maximum over all; `None` with fewer than two intervals.
    fn compare(&self, value: impl Fn(&Interval) -> Option<f64>) -> Option<[f64; 4]> {
        let n = self.edge();
        if self.intervals.len() < 2 {
            return None;
        }
        let values: Option<Vec<f64>> = self.intervals.iter().map(value).collect();
        let values = values?;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some([
            mean(&values[..n]),
            mean(&values[values.len() - n..]),
            min,
            max,
        ])
    }

    fn throughput(&self) -> Option<[f64; 4]> {
        self.compare(|i| Some(i.per_second))
    }

    fn rss_mib(&self) -> Option<[f64; 4]> {
        self.compare(|i| i.rss_kib.map(|kib| kib as f64 / 1024.0))
    }

    fn print(&self) {
        let n = self.intervals.len();
        println!();
        println!(
            "uptime: {n} intervals of {} s; the first {} against the last {}:",
            self.every.as_secs_f64(),
            self.edge(),
            self.edge()
        );
        let line = |what: &str, unit: &str, v: Option<[f64; 4]>| match v {
            Some([first, last, min, max]) => println!(
                "  {what}: first {first:.1} {unit}, last {last:.1} {unit}, last / first {:.3} \
                 (min {min:.1}, max {max:.1})",
                last / first
            ),
            None => println!("  {what}: fewer than two intervals, or not readable"),
        };
        line("throughput", "responses/s", self.throughput());
        if self.intervals.iter().any(|i| i.rss_kib.is_some()) {
            line("server RSS", "MiB", self.rss_mib());
        }
    }

    fn json(&self) -> Value {
        let pair = |v: Option<[f64; 4]>| {
            v.map(|[first, last, min, max]| {
                json!({"first": first, "last": last, "last_over_first": last / first,
                       "min": min, "max": max})
            })
        };
        json!({
            "every_s": self.every.as_secs_f64(),
            "edge_intervals": self.edge(),
            "throughput": pair(self.throughput()),
            "server_rss_mib": pair(self.rss_mib()),
            "intervals": self.intervals.iter().map(|i| json!({
                "at_s": i.at.as_secs_f64(),
                "per_second": i.per_second,
                "rss_kib": i.rss_kib,
            })).collect::<Vec<_>>(),
        })
    }
}

/// What a run measured: its id, each route's figures and, with `--report-every`, the
/// intervals.
type RunResult = (String, Vec<RouteReport>, Option<Uptime>);

/// Runs the warmup and the rounds.
async fn run(args: &Args) -> Result<RunResult, String> {
    let target = resolve(&args.url).await?;
    let plan = Arc::new(Plan::new(args, target, run_id())?);
    if let Some(pid) = args.server_pid {
        rss_kib(pid).ok_or_else(|| {
            format!("--server-pid {pid}: cannot read VmRSS from /proc/{pid}/status")
        })?;
    }
    let routes = args.routes.list();
    preflight(&plan, routes).await?;

    let limit = match (args.requests, args.duration) {
        (Some(n), _) => Limit::Requests(n),
        (None, Some(d)) => Limit::Duration(d),
        (None, None) => Limit::Duration(Duration::from_secs(10)),
    };
    // Per route, its connections' slots, then what it measured.
    let mut state: Vec<(Vec<Slot>, RouteReport)> = routes
        .iter()
        .map(|&route| {
            let slots = (0..args.connections)
                .map(|connection| Slot {
                    route,
                    rng: fastrand::Rng::new(),
                    keys: KeyMaker::new(&plan.run_id, route, connection),
                    answered: AnsweredKeys::new(),
                    stats: Stats::new(),
                })
                .collect();
            let report = RouteReport {
                route,
                stats: Stats::new(),
                phases: Vec::new(),
                warmup: Stats::new(),
            };
            (slots, report)
        })
        .collect();

    if !args.warmup.is_zero() {
        for (slots, report) in &mut state {
            let (mut warm, _) =
                run_phase(&plan, std::mem::take(slots), Limit::Duration(args.warmup)).await?;
            // Keep the keys answered for duplicates, drop the figures (but not the errors).
            for slot in &mut warm {
                report.warmup.merge(&slot.stats)?;
                slot.stats.clear();
            }
            *slots = warm;
        }
    }
    let reporter = args.report_every.map(|every| {
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(report_intervals(
            plan.clone(),
            every,
            args.server_pid,
            stopped,
        ));
        (every, stop, task)
    });
    for _ in 0..args.rounds {
        for (slots, report) in &mut state {
            let (done, phase) = run_phase(&plan, std::mem::take(slots), limit).await?;
            report.phases.push(phase);
            *slots = done;
        }
    }
    let mut reports = Vec::with_capacity(state.len());
    for (slots, mut report) in state {
        for slot in &slots {
            report.stats.merge(&slot.stats)?;
        }
        reports.push(report);
    }
    let uptime = match reporter {
        Some((every, stop, task)) => {
            let _ = stop.send(());
            let intervals = task
                .await
                .map_err(|e| format!("the interval reports failed: {e}"))?;
            Some(Uptime { every, intervals })
        }
        None => None,
    };
    Ok((plan.run_id.clone(), reports, uptime))
}

/// What the report prints for one kind (or all kinds) of one route: the counts, the rate
/// over the route's measured time and the latency percentiles.
struct Figures {
    stats: KindStats,
    per_second: f64,
    p50_us: u64,
    p99_us: u64,
    p999_us: u64,
}

impl Figures {
    fn of(mut stats: KindStats, elapsed: Duration) -> Figures {
        stats.statuses.sort_unstable();
        let secs = elapsed.as_secs_f64();
        Figures {
            per_second: if secs > 0.0 {
                stats.responses as f64 / secs
            } else {
                0.0
            },
            p50_us: stats.latency.value_at_quantile(0.5),
            p99_us: stats.latency.value_at_quantile(0.99),
            p999_us: stats.latency.value_at_quantile(0.999),
            stats,
        }
    }

    fn json(&self) -> Value {
        let stats = &self.stats;
        let errors: serde_json::Map<String, Value> = FAILURES
            .iter()
            .map(|f| (f.name().to_owned(), json!(stats.errors[*f as usize])))
            .collect();
        let statuses: serde_json::Map<String, Value> = stats
            .statuses
            .iter()
            .map(|(s, n)| (s.to_string(), json!(n)))
            .collect();
        json!({
            "requests": stats.requests(),
            "responses": stats.responses,
            "per_second": self.per_second,
            "p50_us": self.p50_us,
            "p99_us": self.p99_us,
            "p999_us": self.p999_us,
            "max_us": stats.latency.max(),
            "mismatches": stats.mismatches,
            "errors": errors,
            "statuses": statuses,
            "replayed": stats.replayed,
        })
    }
}

/// One route's figures: all kinds, then each kind that was sent.
struct RouteFigures<'a> {
    report: &'a RouteReport,
    all: Figures,
    kinds: Vec<(Kind, Figures)>,
}

impl<'a> RouteFigures<'a> {
    fn of(report: &'a RouteReport) -> Result<RouteFigures<'a>, String> {
        let elapsed = report.elapsed();
        Ok(RouteFigures {
            report,
            all: Figures::of(report.stats.all()?, elapsed),
            kinds: KINDS
                .iter()
                .filter(|k| report.stats.kinds[k.index()].requests() > 0)
                .map(|&k| {
                    (
                        k,
                        Figures::of(report.stats.kinds[k.index()].clone(), elapsed),
                    )
                })
                .collect(),
        })
    }

    fn phase_rates(&self) -> Vec<f64> {
        self.report
            .phases
            .iter()
            .map(|p| p.responses as f64 / p.elapsed.as_secs_f64().max(f64::EPSILON))
            .collect()
    }

    /// Microseconds of `cpu` per request of this route.
    fn per_request_us(&self, cpu: Option<Duration>) -> Option<f64> {
        let requests = self.report.stats.requests().max(1) as f64;
        Some(cpu?.as_secs_f64() / requests * 1e6)
    }

    /// The client's CPU time per request and its share of one core.
    fn client_cpu(&self) -> Option<(f64, f64)> {
        let cpu = self.report.cpu()?.as_secs_f64();
        let requests = self.report.stats.requests().max(1) as f64;
        let wall = self.report.elapsed().as_secs_f64().max(f64::EPSILON);
        Some((cpu / requests * 1e6, cpu / wall))
    }
}

/// Layered over baseline: throughput, p50, p99, and the p99 of each layered kind.
struct Ratios {
    throughput: f64,
    p50: f64,
    p99: f64,
    p99_by_kind: Vec<(Kind, f64)>,
    /// Each round's layered phase over the baseline phase just before it: machine noise that
    /// hits both cancels out, so a trend here is the layer's own (over uptime, say).
    by_round: Vec<f64>,
}

impl Ratios {
    /// The mean of the first and of the last fifth of [`by_round`](Self::by_round) (at least
    /// one round each, `rounds / 5` rounded down otherwise), once there are two rounds.
    fn first_and_last(&self) -> Option<(f64, f64)> {
        let n = self.by_round.len();
        if n < 2 {
            return None;
        }
        let k = (n / 5).max(1);
        let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len() as f64;
        Some((mean(&self.by_round[..k]), mean(&self.by_round[n - k..])))
    }
}

fn ratios(figures: &[RouteFigures<'_>]) -> Option<Ratios> {
    let find = |route| figures.iter().find(|f| f.report.route == route);
    let (baseline, layered) = (find(Route::Baseline)?, find(Route::Layered)?);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    Some(Ratios {
        throughput: ratio(layered.all.per_second, baseline.all.per_second),
        p50: ratio(layered.all.p50_us as f64, baseline.all.p50_us as f64),
        p99: ratio(layered.all.p99_us as f64, baseline.all.p99_us as f64),
        p99_by_kind: layered
            .kinds
            .iter()
            .map(|(k, f)| (*k, ratio(f.p99_us as f64, baseline.all.p99_us as f64)))
            .collect(),
        by_round: layered
            .phase_rates()
            .into_iter()
            .zip(baseline.phase_rates())
            .map(|(l, b)| ratio(l, b))
            .collect(),
    })
}

/// `items` separated by commas, or `none`.
fn joined_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(", ")
    }
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn print_text(args: &Args, run_id: &str, figures: &[RouteFigures<'_>], runtime: &str) {
    let phase = match (args.requests, args.duration) {
        (Some(n), _) => format!("{n} requests"),
        (None, Some(d)) => format!("{} s", d.as_secs_f64()),
        (None, None) => "10 s".to_owned(),
    };
    println!(
        "run {run_id}: {}, {} connections per route, {} rounds x {phase} per route \
         (+{} s warmup), duplicates {:.2}, conflicts {:.2}, {} accounts, producer {}, \
         client runtime {runtime}",
        args.url,
        args.connections,
        args.rounds,
        args.warmup.as_secs_f64(),
        args.duplicates,
        args.conflicts,
        args.accounts,
        args.producer,
    );
    println!();
    println!(
        "{:<9} {:<9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10} {:>6}",
        "route",
        "kind",
        "requests",
        "req/s",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "max ms",
        "mismatches",
        "errors"
    );
    for route in figures {
        let rows = std::iter::once(("all", &route.all))
            .chain(route.kinds.iter().map(|(k, f)| (k.name(), f)));
        for (kind, f) in rows {
            println!(
                "{:<9} {:<9} {:>9} {:>9.1} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10} {:>6}",
                route.report.route.name(),
                kind,
                f.stats.requests(),
                f.per_second,
                ms(f.p50_us),
                ms(f.p99_us),
                ms(f.p999_us),
                ms(f.stats.latency.max()),
                f.stats.mismatches,
                f.stats.errors(),
            );
        }
    }
    println!();
    for route in figures {
        let rates: Vec<String> = route
            .phase_rates()
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect();
        let statuses: Vec<String> = route
            .all
            .stats
            .statuses
            .iter()
            .map(|(s, n)| format!("{s} x{n}"))
            .collect();
        let errors: Vec<String> = FAILURES
            .iter()
            .filter(|f| route.all.stats.errors[**f as usize] > 0)
            .map(|f| format!("{} x{}", f.name(), route.all.stats.errors[*f as usize]))
            .collect();
        println!(
            "{:<9} phases req/s: {}; statuses: {}; replayed: {}; transport errors: {}",
            route.report.route.name(),
            rates.join(" "),
            joined_or_none(&statuses),
            route.all.stats.replayed,
            joined_or_none(&errors),
        );
    }
    if let Some(r) = ratios(figures) {
        let by_kind: Vec<String> = r
            .p99_by_kind
            .iter()
            .map(|(k, v)| format!("{} {v:.2}x", k.name()))
            .collect();
        println!();
        println!(
            "layered / baseline: throughput {:.2}x, p50 {:.2}x, p99 {:.2}x (p99 by layered kind: {})",
            r.throughput,
            r.p50,
            r.p99,
            by_kind.join(", ")
        );
        let rounds: Vec<String> = r.by_round.iter().map(|v| format!("{v:.2}")).collect();
        print!(
            "layered / baseline throughput by round: {}",
            rounds.join(" ")
        );
        if let Some((first, last)) = r.first_and_last() {
            print!(
                "; mean of the first fifth of the rounds {first:.2}x, of the last fifth {last:.2}x"
            );
            if first > 0.0 {
                print!(" (last / first {:.2})", last / first);
            }
        }
        println!();
    }
    println!();
    for route in figures {
        for (whose, cpu) in [
            ("server", route.report.server_cpu()),
            ("PostgreSQL", route.report.postgres_cpu()),
        ] {
            if let Some(us) = route.per_request_us(cpu) {
                println!(
                    "{whose} CPU on {}: {us:.1} us per request",
                    route.report.route.name()
                );
            }
        }
        if let Some((per_request_us, share)) = route.client_cpu() {
            println!(
                "client CPU on {}: {per_request_us:.1} us per request, {:.0}% of one core{}",
                route.report.route.name(),
                share * 100.0,
                if share > 0.9 * f64::from(args.threads) {
                    " (the load generator itself may be the bottleneck)"
                } else {
                    ""
                }
            );
        }
    }
    for route in figures {
        let warm = &route.report.warmup;
        if warm.requests() > 0 {
            println!(
                "warmup on {}: {} requests, {} mismatches, {} transport errors (not in the figures)",
                route.report.route.name(),
                warm.requests(),
                warm.mismatches(),
                warm.errors()
            );
        }
    }
    let samples: Vec<&str> = figures
        .iter()
        .flat_map(|f| f.report.samples())
        .take(SAMPLES_PRINTED)
        .collect();
    if !samples.is_empty() {
        println!();
        println!("first mismatches and errors:");
        for sample in samples {
            println!("  {sample}");
        }
    }
}

fn report_json(args: &Args, run_id: &str, figures: &[RouteFigures<'_>], runtime: &str) -> Value {
    let routes: serde_json::Map<String, Value> = figures
        .iter()
        .map(|f| {
            let kinds: serde_json::Map<String, Value> = f
                .kinds
                .iter()
                .map(|(k, fig)| (k.name().to_owned(), fig.json()))
                .collect();
            let warm = &f.report.warmup;
            let value = json!({
                "elapsed_s": f.report.elapsed().as_secs_f64(),
                "phase_per_second": f.phase_rates(),
                "all": f.all.json(),
                "kinds": kinds,
                "client_cpu_us_per_request": f.client_cpu().map(|c| c.0),
                "server_cpu_us_per_request": f.per_request_us(f.report.server_cpu()),
                "postgres_cpu_us_per_request": f.per_request_us(f.report.postgres_cpu()),
                "client_cpu_share_of_core": f.client_cpu().map(|c| c.1),
                "warmup": {
                    "requests": warm.requests(),
                    "responses": warm.responses(),
                    "mismatches": warm.mismatches(),
                    "errors": warm.errors(),
                },
                "samples": f.report.samples(),
            });
            (f.report.route.name().to_owned(), value)
        })
        .collect();
    let ratios = ratios(figures).map(|r| {
        let by_kind: serde_json::Map<String, Value> = r
            .p99_by_kind
            .iter()
            .map(|(k, v)| (k.name().to_owned(), json!(v)))
            .collect();
        let (first, last) = r.first_and_last().unzip();
        json!({
            "throughput": r.throughput,
            "p50": r.p50,
            "p99": r.p99,
            "p99_by_layered_kind": by_kind,
            "throughput_by_round": r.by_round,
            "throughput_first_fifth_of_rounds": first,
            "throughput_last_fifth_of_rounds": last,
        })
    });
    json!({
        "run_id": run_id,
        "url": args.url,
        "connections": args.connections,
        "rounds": args.rounds,
        "duration_s": args.duration.map(|d| d.as_secs_f64()),
        "requests_per_phase": args.requests,
        "warmup_s": args.warmup.as_secs_f64(),
        "duplicates": args.duplicates,
        "conflicts": args.conflicts,
        "accounts": args.accounts,
        "producer": args.producer,
        "client_runtime": runtime,
        "routes": routes,
        "layered_over_baseline": ratios,
    })
}

fn main() -> ExitCode {
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
    let runtime = if args.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads as usize)
            .enable_all()
            .build()
    };
    let runtime_name = if args.threads == 1 {
        "current-thread".to_owned()
    } else {
        format!("multi-thread ({} workers)", args.threads)
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("loadgen: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (run_id, reports, uptime) = match runtime.block_on(run(&args)) {
        Ok(done) => done,
        Err(e) => {
            eprintln!("loadgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    let figures = match reports
        .iter()
        .map(RouteFigures::of)
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(figures) => figures,
        Err(e) => {
            eprintln!("loadgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.json {
        let mut report = report_json(&args, &run_id, &figures, &runtime_name);
        if let Some(uptime) = &uptime {
            report["uptime"] = uptime.json();
        }
        println!("{report:#}");
    } else {
        print_text(&args, &run_id, &figures, &runtime_name);
        if let Some(uptime) = &uptime {
            uptime.print();
        }
    }
    let (mismatches, errors) = reports.iter().fold((0, 0), |(m, e), r| {
        (
            m + r.stats.mismatches() + r.warmup.mismatches(),
            e + r.stats.errors() + r.warmup.errors(),
        )
    });
    if mismatches + errors > 0 {
        eprintln!(
            "loadgen: WARNING: {mismatches} unexpected responses and {errors} transport errors \
             (warmup included): the figures include them"
        );
        return ExitCode::from(3);
    }
    ExitCode::SUCCESS
}
