//! What is sent: the routes, the kinds of request, the service's address, and the plan every
//! connection shares (request URIs, headers, bodies), with each connection's keys.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::Full;

use crate::args::Args;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const X_PRODUCER: HeaderName = HeaderName::from_static("x-producer");

/// The body of a new request and of its duplicates.
const CREDIT_BODY: &[u8] = br#"{"delta":1}"#;
/// The body of a conflict: the same key, another delta.
const CONFLICT_BODY: &[u8] = br#"{"delta":2}"#;
/// Answered keys each connection remembers for duplicates and conflicts.
const ANSWERED_KEYS: usize = 1024;

/// One of the routes the service serves the credit on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// The credit without any protocol.
    Baseline,
    /// The credit behind the inbox layer.
    Layered,
    /// The credit with the fewest statements that claim and record it, written by hand
    /// (the example's `/minimal` route): the ceiling for the layered route over HTTP.
    Minimal,
}

impl Route {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Route::Baseline => "baseline",
            Route::Layered => "layered",
            Route::Minimal => "minimal",
        }
    }

    pub(crate) fn path_prefix(self) -> &'static str {
        match self {
            Route::Baseline => "/baseline/accounts/",
            Route::Layered => "/accounts/",
            Route::Minimal => "/minimal/accounts/",
        }
    }

    /// The route's letter in keys.
    pub(crate) fn tag(self) -> char {
        match self {
            Route::Baseline => 'b',
            Route::Layered => 'l',
            Route::Minimal => 'm',
        }
    }

    /// The response a request of `kind` must get on this route: status and whether it is
    /// marked `idempotent-replayed: true`.
    pub(crate) fn expected(self, kind: Kind) -> (StatusCode, bool) {
        match (self, kind) {
            (Route::Layered, Kind::Duplicate) => (StatusCode::CREATED, true),
            (Route::Layered, Kind::Conflict) => (StatusCode::CONFLICT, false),
            // The hand-written protocol refuses a key it has seen, whatever the body: it
            // neither replays nor compares payloads.
            (Route::Minimal, Kind::Duplicate | Kind::Conflict) => (StatusCode::CONFLICT, false),
            _ => (StatusCode::CREATED, false),
        }
    }
}

/// What a request is, relative to the keys already answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    New,
    Duplicate,
    Conflict,
}

pub(crate) const KINDS: [Kind; 3] = [Kind::New, Kind::Duplicate, Kind::Conflict];

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::New => "new",
            Kind::Duplicate => "duplicate",
            Kind::Conflict => "conflict",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Where the service listens, resolved once.
pub(crate) struct Target {
    pub(crate) addr: SocketAddr,
    /// The `Host` header.
    host: HeaderValue,
    /// The URL's path without a trailing slash, put before the routes' paths.
    base_path: String,
}

pub(crate) async fn resolve(url: &str) -> Result<Target, String> {
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
pub(crate) struct Plan {
    pub(crate) target: Target,
    producer: HeaderValue,
    content_type: HeaderValue,
    credit_body: Bytes,
    conflict_body: Bytes,
    /// Per route (indexed by `Route as usize`), the request URI of every account.
    pub(crate) uris: [Vec<Uri>; 3],
    pub(crate) duplicates: f64,
    pub(crate) conflicts: f64,
    pub(crate) timeout: Duration,
    pub(crate) run_id: String,
    /// Responses so far, every route and kind: read by the interval reports.
    pub(crate) responses: AtomicU64,
    /// Whose CPU time each phase measures besides the load generator's own.
    pub(crate) server_pid: Option<u32>,
    pub(crate) postgres_cpu: bool,
}

impl Plan {
    pub(crate) fn new(args: &Args, target: Target, run_id: String) -> Result<Plan, String> {
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
            uris: [
                uris(Route::Baseline)?,
                uris(Route::Layered)?,
                uris(Route::Minimal)?,
            ],
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
    pub(crate) fn request(
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
pub(crate) struct KeyMaker {
    buffer: BytesMut,
    prefix: String,
    next: u64,
}

impl KeyMaker {
    pub(crate) fn new(run_id: &str, route: Route, connection: u32) -> KeyMaker {
        KeyMaker {
            buffer: BytesMut::new(),
            prefix: format!("lg-{run_id}-{}{connection}-", route.tag()),
            next: 0,
        }
    }

    pub(crate) fn next_key(&mut self) -> HeaderValue {
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
pub(crate) struct Answered {
    pub(crate) key: HeaderValue,
    pub(crate) account: u32,
}

/// The last [`ANSWERED_KEYS`] keys a connection got answered.
pub(crate) struct AnsweredKeys {
    keys: Vec<Answered>,
    oldest: usize,
}

impl AnsweredKeys {
    pub(crate) fn new() -> AnsweredKeys {
        AnsweredKeys {
            keys: Vec::with_capacity(ANSWERED_KEYS),
            oldest: 0,
        }
    }

    pub(crate) fn push(&mut self, answered: Answered) {
        if self.keys.len() < ANSWERED_KEYS {
            self.keys.push(answered);
        } else {
            self.keys[self.oldest] = answered;
            self.oldest = (self.oldest + 1) % ANSWERED_KEYS;
        }
    }

    pub(crate) fn pick(&self, rng: &mut fastrand::Rng) -> Option<&Answered> {
        if self.keys.is_empty() {
            None
        } else {
            self.keys.get(rng.usize(..self.keys.len()))
        }
    }
}
