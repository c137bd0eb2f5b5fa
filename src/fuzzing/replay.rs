//! Recorded responses replayed through the layer: what a duplicate gets back from a stored
//! status, header names, header values and body.

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt as _;
use serde_json::Value;
use tower::{Layer as _, Service};

use crate::body::Body;
use crate::fingerprint::{Fingerprint, FingerprintStrategy};
use crate::inbox::{InboxEntry, RecordedResponse};
use crate::middleware::ReplayCache;
use crate::problem::ProblemKind;
use crate::producer::ConstantProducer;
use crate::{InboxLayer, MessageIdentity, MessageKey, Producer};

/// The header every replay carries.
const REPLAYED: &str = "idempotent-replayed";

/// Recorded responses: a duplicate whose record is a valid HTTP response (a status code, header
/// names and values that http accepts, no more headers than a header map holds) gets it back
/// with the same status, the same values for each header name in the same order, the same body
/// and `Idempotent-Replayed: true`; any other record gets a 500 `internal` problem. Never a
/// panic.
///
/// The record is answered from the layer's replay cache, the same replay a record read from
/// the database gets, so no database is needed. The bytes are the record in a text form: the
/// status in decimal on the first line, then one `name:value` line per header (a space after
/// the colon is dropped; a name that is not UTF-8 has its bad bytes replaced, as a text
/// column would hold it), then an empty line and the body.
pub fn check_replay(data: &[u8]) {
    if let Some(record) = decode(data) {
        check_record(record);
    }
}

/// Checks the replay of one record: the property of [`check_replay`] for records built in
/// code, such as ones too large for a corpus file.
pub fn check_record(record: RecordedResponse) {
    let expected = expected_headers(&record);
    let response = replay(record.clone());
    let (parts, body) = response.into_parts();
    let body = body_bytes(body);
    let Some(expected) = expected else {
        // A bad record is an error for this key, answered like the layer's other failures.
        assert_eq!(
            parts.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "a bad record is a 500: {record:?}"
        );
        assert_eq!(parts.extensions.get(), Some(&ProblemKind::Internal));
        assert_eq!(
            parts.headers.get(CONTENT_TYPE).map(|v| v.as_bytes()),
            Some(&b"application/problem+json"[..]),
            "a bad record is answered with a problem"
        );
        assert!(
            parts.headers.get(REPLAYED).is_none(),
            "a problem is not a replay"
        );
        let problem: Value = serde_json::from_slice(&body).expect("a problem is JSON");
        assert_eq!(problem["type"], ProblemKind::Internal.type_uri());
        return;
    };
    assert_eq!(parts.status.as_u16(), record.status, "the recorded status");
    assert_eq!(
        parts.extensions.get::<ProblemKind>(),
        None,
        "a replay, not a problem: {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(body, record.body, "the body is replayed byte for byte");
    assert_eq!(
        parts.headers.keys_len(),
        expected.keys_len(),
        "the recorded header names and {REPLAYED}: {:?}",
        parts.headers
    );
    for name in expected.keys() {
        assert!(
            parts
                .headers
                .get_all(name)
                .iter()
                .eq(expected.get_all(name)),
            "the values of {name}"
        );
    }
}

/// The headers a replay of `record` has, or `None` if the record cannot be replayed.
fn expected_headers(record: &RecordedResponse) -> Option<HeaderMap> {
    StatusCode::from_u16(record.status).ok()?;
    let mut headers = HeaderMap::new();
    for (name, value) in &record.headers {
        let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
        let value = HeaderValue::from_bytes(value).ok()?;
        headers.try_append(name, value).ok()?;
    }
    headers
        .try_insert(REPLAYED, HeaderValue::from_static("true"))
        .ok()?;
    Some(headers)
}

/// The record in a fuzz input (see [`check_replay`]); `None` without a decimal `u16` status.
fn decode(data: &[u8]) -> Option<RecordedResponse> {
    let (head, body) = match data.windows(2).position(|pair| pair == b"\n\n") {
        Some(at) => (&data[..at], &data[at + 2..]),
        None => (data, &[][..]),
    };
    let mut lines = head.split(|&b| b == b'\n');
    let status = std::str::from_utf8(lines.next()?).ok()?.parse().ok()?;
    let headers = lines
        .map(|line| {
            let (name, value) = match line.iter().position(|&b| b == b':') {
                Some(at) => (&line[..at], &line[at + 1..]),
                None => (line, &[][..]),
            };
            let value = value.strip_prefix(b" ").unwrap_or(value);
            (String::from_utf8_lossy(name).into_owned(), value.to_vec())
        })
        .collect();
    Some(RecordedResponse {
        status,
        headers,
        body: Bytes::copy_from_slice(body),
    })
}

/// A layer whose replay cache holds every record checked, over a closed pool: a request the
/// cache does not answer fails at once instead of reaching a database.
struct Harness {
    runtime: tokio::runtime::Runtime,
    layer: InboxLayer,
    cache: ReplayCache,
    producer: Producer,
    fingerprint: Fingerprint,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a tokio runtime");
        let pool = runtime.block_on(async {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .connect_lazy("postgres://fuzz@127.0.0.1:1/fuzz")
                .expect("a lazy pool");
            pool.close().await;
            pool
        });
        let cache = ReplayCache::new(64, 1 << 30).expect("a positive limit");
        let producer = Producer::new("fuzz").expect("a producer name");
        let fingerprint = Fingerprint::of_bytes(b"fuzz");
        let layer = InboxLayer::builder(pool, "fuzz")
            .producer(ConstantProducer::new(producer.clone()))
            .fingerprint(FingerprintStrategy::custom(move |_| fingerprint))
            .replay_cache(cache.clone())
            .build()
            .expect("a valid configuration");
        Harness {
            runtime,
            layer,
            cache,
            producer,
            fingerprint,
        }
    })
}

/// A duplicate's answer when `record` is the recorded response of its key.
fn replay(record: RecordedResponse) -> Response<Body> {
    static KEYS: AtomicU64 = AtomicU64::new(0);
    // One replay at a time, so that no other check's record evicts this one from the cache
    // before its request reads it. (A check that failed poisons the lock, not the cache.)
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let harness = harness();
    let key =
        MessageKey::new(format!("k{}", KEYS.fetch_add(1, Ordering::Relaxed))).expect("a valid key");
    let identity = MessageIdentity::new("fuzz", harness.producer.clone(), key.clone());
    let entry = InboxEntry {
        payload_sha256: harness.fingerprint.to_hex(),
        handler_version: "fuzz".to_owned(),
        processed: true,
        response: Some(record),
    };
    harness.cache.insert(&identity, harness.fingerprint, entry);
    assert!(
        harness.cache.get(&identity).is_some(),
        "the fuzz harness's replay cache did not keep the record"
    );
    let request = Request::builder()
        .method(Method::POST)
        .uri("/fuzz")
        .header("idempotency-key", key.as_str())
        .body(Body::empty())
        .expect("a valid request");
    let mut service = harness.layer.layer(Unreached);
    let answer = harness.runtime.block_on(async {
        std::future::poll_fn(|cx| Service::<Request<Body>>::poll_ready(&mut service, cx)).await?;
        service.call(request).await
    });
    match answer {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// The inner service, which a duplicate never reaches.
#[derive(Clone)]
struct Unreached;

impl Service<Request<Body>> for Unreached {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Body>) -> Self::Future {
        ready(Ok(Response::new(Body::from(
            "the handler ran: the replay cache missed",
        ))))
    }
}

/// The bytes of a body held in memory, as the layer's own answers are.
pub(super) fn body_bytes(body: Body) -> Bytes {
    body.collect()
        .now_or_never()
        .expect("an in-memory body is ready at once")
        .expect("an in-memory body does not fail")
        .to_bytes()
}
