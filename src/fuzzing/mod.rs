//! The properties the fuzz targets check, one function per target (feature `fuzzing`).
//!
//! For the fuzz targets in `fuzz/` and the test that replays their committed corpus
//! (`tests/fuzz_corpus.rs`); **not a stable API**. Each function takes any bytes and panics,
//! naming the property, when the crate breaks it, so a fuzz target is one call and a corpus
//! file fails the normal test suite exactly as it would fail the fuzzer. [`TARGETS`] ties each
//! function to its target and its corpus directory, `fuzz/corpus/<name>/`.
//!
//! Every function here reaches the crate the way a request does (the key parser, the producer
//! scope, the fingerprint strategies, problems, a replay through the layer), so the properties
//! hold of the code that serves traffic, not of a copy of it.

mod json;
mod replay;

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Request, StatusCode};
use serde_json::Value;

use crate::key::{KeyError, MessageKey, MAX_KEY_LEN};
use crate::problem::{Problem, ProblemKind};
use crate::producer::{ProducerScope, TrustedHeader};
use crate::{Producer, MAX_SCOPE_LEN};

pub use json::check_fingerprint;
pub use replay::{check_record, check_replay};

/// A property check over any bytes: it returns, or panics naming the property the crate broke.
pub type Check = fn(&[u8]);

/// Every fuzz target: its name (the file `fuzz/fuzz_targets/<name>.rs` and the corpus
/// directory `fuzz/corpus/<name>/`) and the property function it calls.
pub const TARGETS: &[(&str, Check)] = &[
    ("key", check_key),
    ("producer", check_producer),
    ("fingerprint", check_fingerprint),
    ("problem", check_problem),
    ("replay", check_replay),
];

/// `Idempotency-Key` values: [`MessageKey::parse`] never panics; an accepted key is 1 to
/// `max_len` visible ASCII characters, its sf-string form parses back to the same key, and a
/// lower limit refuses exactly the keys longer than it.
pub fn check_key(data: &[u8]) {
    let parsed = MessageKey::parse(data, MAX_KEY_LEN);
    if let Ok(key) = &parsed {
        let text = key.as_str();
        assert!(
            (1..=MAX_KEY_LEN).contains(&text.len()),
            "an accepted key has {} characters",
            text.len()
        );
        assert!(
            text.bytes().all(|b| b.is_ascii_graphic()),
            "an accepted key is not visible ASCII: {text:?}"
        );
        let sent = key.to_sf_string();
        assert_eq!(
            MessageKey::parse(sent.as_bytes(), MAX_KEY_LEN).as_ref(),
            Ok(key),
            "the sf-string {sent} does not parse back to its key"
        );
        // Bare, the key is the same key when it has none of the characters only a quoted key
        // may hold (a bare value that starts with a quote is read as an sf-string).
        if !text.contains(['"', '\\', ',']) {
            assert_eq!(MessageKey::new(text).as_ref(), Ok(key), "bare {text:?}");
        }
    }
    // The limit is applied last, to the unquoted key: every other outcome is the same.
    for max in [1, 16, 64] {
        let expected = match &parsed {
            Ok(key) if key.as_str().len() > max => Err(KeyError::TooLong {
                len: key.as_str().len(),
                max,
            }),
            Err(KeyError::TooLong { len, .. }) => Err(KeyError::TooLong { len: *len, max }),
            other => other.clone(),
        };
        assert_eq!(MessageKey::parse(data, max), expected, "limit {max}");
    }
}

/// Producer names from a gateway header ([`TrustedHeader`]) and from code
/// ([`Producer::new`], [`Producer::with_tenant`]): never a panic, and a name is accepted
/// exactly when it follows the documented rules (1 to [`MAX_SCOPE_LEN`] bytes, no control
/// character, not the reserved `migration:` prefix; from the header, one visible-ASCII value,
/// trimmed).
///
/// The bytes are the header's values, one per line (`\n`, which no header value holds).
pub fn check_producer(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let by_code = Producer::new(text.as_ref());
    match (&by_code, is_producer_name(&text)) {
        (Ok(producer), true) => {
            assert_eq!(producer.name(), text, "the name is kept as given");
            assert_eq!(producer.tenant(), None);
        }
        (Err(_), false) => {}
        (outcome, _) => panic!("Producer::new({text:?}) gave {outcome:?}"),
    }
    let tenant = Producer::new("fuzz").and_then(|p| p.with_tenant(text.as_ref()));
    assert_eq!(
        tenant.is_ok(),
        is_scope_name(&text),
        "with_tenant({text:?}) gave {tenant:?}"
    );

    let Ok(values) = data
        .split(|&b| b == b'\n')
        .map(HeaderValue::from_bytes)
        .collect::<Result<Vec<_>, _>>()
    else {
        return; // http refuses the bytes as a header value: no request can carry them
    };
    let mut request = Request::builder();
    for value in &values {
        request = request.header("x-producer", value);
    }
    let parts = request
        .body(())
        .expect("a request of valid header values")
        .into_parts()
        .0;
    let expected = match values.as_slice() {
        [one] => one
            .to_str()
            .ok()
            .map(str::trim)
            .filter(|name| is_producer_name(name)),
        _ => None,
    };
    let read = TrustedHeader::new("x-producer").producer(&parts);
    match (&read, expected) {
        (Ok(producer), Some(name)) => assert_eq!(producer.name(), name),
        (Err(_), None) => {}
        (outcome, _) => panic!("TrustedHeader read {values:?} as {outcome:?}"),
    }
}

/// The documented rules of a producer or tenant name.
fn is_scope_name(name: &str) -> bool {
    (1..=MAX_SCOPE_LEN).contains(&name.len()) && !name.chars().any(char::is_control)
}

/// Spelt out rather than taken from the crate, so that the rule stays the documented one.
fn is_producer_name(name: &str) -> bool {
    is_scope_name(name) && !name.starts_with("migration:")
}

/// The problem kinds, in the order a fuzz input's first byte picks them.
const KINDS: [ProblemKind; 16] = [
    ProblemKind::KeyMissing,
    ProblemKind::KeyMalformed,
    ProblemKind::ProducerMissing,
    ProblemKind::BodyTooLarge,
    ProblemKind::BodyUnreadable,
    ProblemKind::PayloadMismatch,
    ProblemKind::InProgress,
    ProblemKind::Unavailable,
    ProblemKind::TransactionConflict,
    ProblemKind::LayerMissing,
    ProblemKind::TransactionInUse,
    ProblemKind::TransactionLeaked,
    ProblemKind::ResponseTooLarge,
    ProblemKind::ResponseUnreadable,
    ProblemKind::HandlerPanicked,
    ProblemKind::Internal,
];

/// problem+json answers: for any detail text the body is a JSON object whose `detail` is that
/// text, with the kind's `type`, a `title` and the response's `status`; the content type is
/// `application/problem+json`, and `Retry-After` is there exactly when it was asked for.
///
/// The first byte picks the kind, the second the options (bit 0: a `Retry-After` of
/// `byte << 24` seconds; bit 1: the status `100 + 3 * byte`); the rest, as UTF-8 with
/// invalid sequences replaced, is the detail.
pub fn check_problem(data: &[u8]) {
    let (kind, options, detail) = match data {
        [kind, options, detail @ ..] => (
            KINDS[usize::from(*kind) % KINDS.len()],
            *options,
            String::from_utf8_lossy(detail),
        ),
        _ => return,
    };
    let mut problem = Problem::new(kind, detail.as_ref());
    let retry_after = (options & 1 == 1).then(|| u32::from(options) << 24);
    if let Some(seconds) = retry_after {
        problem = problem.retry_after(seconds);
    }
    if options & 2 == 2 {
        let status = StatusCode::from_u16(100 + 3 * u16::from(options))
            .expect("100 to 865 are status codes");
        problem = problem.with_status(status);
    }
    let status = problem.status();
    assert!(
        problem.to_string().ends_with(detail.as_ref()),
        "Display ends with the detail: {problem}"
    );

    let response = problem.response();
    assert_eq!(response.status(), status, "the problem's status");
    assert_eq!(
        response.extensions().get(),
        Some(&kind),
        "the kind, for logs"
    );
    let headers = response.headers();
    assert_eq!(
        headers.get_all(CONTENT_TYPE).iter().collect::<Vec<_>>(),
        ["application/problem+json"],
        "the content type"
    );
    assert_eq!(
        headers.get(RETRY_AFTER).map(|v| v.as_bytes()),
        retry_after
            .map(|s| s.to_string())
            .as_deref()
            .map(str::as_bytes),
        "Retry-After"
    );
    let body = replay::body_bytes(response.into_body());
    let json: Value = serde_json::from_slice(&body).expect("the body is JSON");
    let member = |name: &str| json.get(name).unwrap_or(&Value::Null);
    assert_eq!(
        json.as_object().map(|fields| fields.len()),
        Some(4),
        "an object of type, title, status and detail: {json}"
    );
    assert_eq!(member("detail"), detail.as_ref(), "the detail: {json}");
    assert_eq!(member("type"), &kind.type_uri(), "the type: {json}");
    assert_eq!(member("status"), status.as_u16(), "the status: {json}");
    assert!(
        member("title").as_str().is_some_and(|t| !t.is_empty()),
        "a title: {json}"
    );
}
