//! `Retry-After` in both of its forms.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{HeaderMap, HeaderValue, RETRY_AFTER};

use crate::client::retry_after::retry_after;

fn headers(values: &[&'static str]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for value in values {
        headers.append(RETRY_AFTER, HeaderValue::from_static(value));
    }
    headers
}

/// Sun, 06 Nov 1994 08:49:37 GMT, RFC 9110's example date.
fn example_date() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(784_111_777)
}

#[test]
fn delta_seconds_are_the_wait() {
    let now = example_date();
    assert_eq!(
        retry_after(&headers(&["120"]), now),
        Some(Duration::from_secs(120))
    );
    assert_eq!(retry_after(&headers(&[" 0 "]), now), Some(Duration::ZERO));
    assert_eq!(
        retry_after(&headers(&["99999999999999999999999"]), now),
        Some(Duration::MAX)
    );
}

#[test]
fn an_http_date_is_the_time_until_it_in_any_of_the_three_formats() {
    let now = example_date() - Duration::from_secs(90);
    for date in [
        "Sun, 06 Nov 1994 08:49:37 GMT",
        "Sunday, 06-Nov-94 08:49:37 GMT",
        "Sun Nov  6 08:49:37 1994",
    ] {
        assert_eq!(
            retry_after(&headers(&[date]), now),
            Some(Duration::from_secs(90)),
            "{date}"
        );
    }
}

#[test]
fn a_date_in_the_past_is_no_wait() {
    let later = example_date() + Duration::from_secs(3600);
    assert_eq!(
        retry_after(&headers(&["Sun, 06 Nov 1994 08:49:37 GMT"]), later),
        Some(Duration::ZERO)
    );
}

#[test]
fn malformed_missing_or_repeated_values_count_as_absent() {
    let now = example_date();
    for values in [
        &[][..],
        &[""],
        &["soon"],
        &["-5"],
        &["1.5"],
        &["Sun, 06 Nov 1994 08:49:37"],
        &["1", "2"],
    ] {
        assert_eq!(retry_after(&headers(values), now), None, "{values:?}");
    }
}
