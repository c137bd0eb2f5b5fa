//! The client side of one connection: opening it, one request-response exchange, and a
//! connection's state across phases with the sending of one request, which both loops share.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use crate::plan::{Answered, AnsweredKeys, KeyMaker, Kind, Plan, Route, Target};
use crate::stats::{Failure, Stats};

const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Bytes of an unexpected response body kept for the report.
const SAMPLE_BODY_BYTES: usize = 200;
/// Pause after a failed connect, so that a dead server is not hammered.
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);

pub(crate) type Sender = SendRequest<Full<Bytes>>;

/// Opens one HTTP/1.1 connection; its driver runs as a task of its own until the sender is
/// dropped or the server closes it.
pub(crate) async fn connect(target: &Target) -> Result<Sender, String> {
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
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) replayed: bool,
    /// The start of the body, kept only when the response was not the expected one.
    pub(crate) unexpected_body: Option<Vec<u8>>,
}

/// Sends `request` on `sender` and reads the whole response (so that the connection can be
/// reused), keeping the start of the body only if it is not the `expected` response.
pub(crate) async fn exchange(
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

/// One connection's state on one route, kept across phases: its keys, the keys it got
/// answered and what it measured.
pub(crate) struct Slot {
    route: Route,
    rng: fastrand::Rng,
    keys: KeyMaker,
    answered: AnsweredKeys,
    pub(crate) stats: Stats,
}

impl Slot {
    pub(crate) fn new(run_id: &str, route: Route, connection: u32) -> Slot {
        Slot {
            route,
            rng: fastrand::Rng::new(),
            keys: KeyMaker::new(run_id, route, connection),
            answered: AnsweredKeys::new(),
            stats: Stats::new(),
        }
    }

    /// Sends one request on `sender` (opened again first if it is closed) and records what
    /// it got. Its latency runs from `due` where given (open loop: the time it was due), else
    /// from when it is sent. After a failed connect it pauses before returning.
    pub(crate) async fn send(
        &mut self,
        plan: &Plan,
        sender: &mut Option<Sender>,
        due: Option<Instant>,
    ) {
        let route = self.route;
        let accounts = u32::try_from(plan.uris[route as usize].len()).unwrap_or(u32::MAX);
        // The kind, then the key and account it needs.
        let draw = self.rng.f64();
        let wanted = if draw < plan.duplicates {
            Kind::Duplicate
        } else if draw < plan.duplicates + plan.conflicts {
            Kind::Conflict
        } else {
            Kind::New
        };
        let (kind, key, account) = match (wanted, self.answered.pick(&mut self.rng)) {
            (Kind::Duplicate | Kind::Conflict, Some(answered)) => {
                (wanted, answered.key.clone(), answered.account)
            }
            _ => (Kind::New, self.keys.next_key(), self.rng.u32(..accounts)),
        };
        let expected = route.expected(kind);
        let stats = &mut self.stats;
        let kind_stats = &mut stats.kinds[kind.index()];

        let connection = match sender.as_mut() {
            Some(s) if !s.is_closed() => s,
            _ => match connect(&plan.target).await {
                Ok(s) => sender.insert(s),
                Err(e) => {
                    *sender = None;
                    kind_stats.errors[Failure::Connect as usize] += 1;
                    stats
                        .sample(|| format!("{} {}: connect error: {e}", route.name(), kind.name()));
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                    return;
                }
            },
        };
        let request = plan.request(route, account, key.clone(), kind == Kind::Conflict);
        let started = Instant::now();
        let outcome =
            tokio::time::timeout(plan.timeout, exchange(connection, request, expected)).await;
        let latency = latency(due, started, Instant::now());
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
                    self.answered.push(Answered { key, account });
                }
            }
            Ok(Err((failure, error))) => {
                *sender = None;
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
                *sender = None;
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
}

/// A response's latency: from the time its request was due (open loop), else from the time
/// it was sent.
pub(crate) fn latency(due: Option<Instant>, sent: Instant, answered: Instant) -> Duration {
    answered.saturating_duration_since(due.unwrap_or(sent))
}

/// Waits for every connection task and hands back what each returned.
pub(crate) async fn join<T>(tasks: Vec<JoinHandle<T>>) -> Result<Vec<T>, String> {
    let mut done = Vec::with_capacity(tasks.len());
    for task in tasks {
        done.push(
            task.await
                .map_err(|e| format!("a connection task failed: {e}"))?,
        );
    }
    Ok(done)
}

pub(crate) fn replayed_note(replayed: bool) -> &'static str {
    if replayed {
        " replayed"
    } else {
        ""
    }
}

/// Checks, before any load, that the service answers each route as expected, so that a
/// wrong URL or a service without the baseline route fails clearly instead of as a flood of
/// mismatches.
pub(crate) async fn preflight(plan: &Plan, routes: &[Route]) -> Result<(), String> {
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
                (Route::Baseline | Route::Minimal, StatusCode::NOT_FOUND) => {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_runs_from_the_due_time_when_there_is_one() {
        let due = Instant::now();
        let sent = due + Duration::from_millis(30);
        let answered = sent + Duration::from_millis(5);
        // Open loop: the 30 ms the request waited to go out are in its latency.
        assert_eq!(
            latency(Some(due), sent, answered),
            Duration::from_millis(35)
        );
        // Closed loop: from the send.
        assert_eq!(latency(None, sent, answered), Duration::from_millis(5));
    }
}
