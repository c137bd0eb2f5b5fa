//! Failures without an answer: a refused connection told apart from the others, and
//! `Retry-After` as an HTTP-date through the layer.

use std::time::{Duration, SystemTime};

use super::*;

#[tokio::test(start_paused = true)]
async fn refused_connections_are_retried_and_the_error_says_nothing_reached_the_server() {
    let script = Script::new([Step::Refused, Step::Refused]);
    let policy = RetryPolicy::default().max_attempts(2);
    let error = send(script.client(policy), command(Some("r1")))
        .await
        .unwrap_err();
    assert_eq!(
        (error.reason(), error.attempts()),
        (GiveUpReason::Attempts, 2)
    );
    assert!(!error.reached_server());
    assert!(matches!(error.last_answer(), Some(LastAnswer::Refused(_))));
    let line = error.to_string();
    assert!(line.contains("never reached the server"), "{line}");
    assert_eq!(script.seen().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn one_attempt_that_may_have_reached_the_server_is_remembered() {
    let script = Script::new([Step::Fail("connection reset"), Step::Refused]);
    let policy = RetryPolicy::default().max_attempts(2);
    let error = send(script.client(policy), command(Some("r2")))
        .await
        .unwrap_err();
    assert!(matches!(error.last_answer(), Some(LastAnswer::Refused(_))));
    assert!(
        error.reached_server(),
        "the reset attempt may have committed"
    );
}

#[test]
fn the_retry_reason_tells_a_refusal_from_other_failures() {
    use crate::client::policy::transport_reason;

    assert_eq!(transport_reason(refused().as_ref()), RetryReason::Refused);
    assert_eq!(RetryReason::Refused.label(), "refused");
    let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
    assert_eq!(transport_reason(&reset), RetryReason::Transport);
    let plain: BoxError = "no answer".into();
    assert_eq!(transport_reason(plain.as_ref()), RetryReason::Transport);
}

#[tokio::test(start_paused = true)]
async fn an_http_date_retry_after_is_waited_for() {
    // An HTTP-date has whole seconds: the wait is over 4 s, less the test's own run time.
    let until = SystemTime::now() + Duration::from_secs(5);
    let mut response = Response::builder()
        .status(503)
        .header("retry-after", httpdate::fmt_http_date(until))
        .body(Full::new(Bytes::new()))
        .unwrap();
    response.headers_mut().remove("content-type");
    let script = Script::new([Step::Answer(response), status(201)]);
    let started = Instant::now();
    let response = send(script.client(RetryPolicy::default()), command(None))
        .await
        .unwrap();
    assert_eq!(receipt(&response).attempts(), 2);
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}
