//! The `Retry-After` header (RFC 9110 §10.2.3): delta-seconds or an HTTP-date.

use std::time::{Duration, SystemTime};

use http::header::{HeaderMap, RETRY_AFTER};

/// The wait an answer asks for, counted from `now` (the wall clock's time when the answer
/// arrived): delta-seconds as they are, an HTTP-date as the time until it (zero when it has
/// passed). A malformed value, or more than one, counts as absent: the backoff alone decides.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let mut values = headers.get_all(RETRY_AFTER).iter();
    let value = match (values.next(), values.next()) {
        (Some(value), None) => value.to_str().ok()?.trim(),
        _ => return None,
    };
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for a u64 is still a wait past any budget.
        return Some(value.parse().map_or(Duration::MAX, Duration::from_secs));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}
