//! The budget, the backoff and the metrics.

use std::time::Duration;

use tokio::time::Instant;

use super::*;

#[tokio::test(start_paused = true)]
async fn the_attempts_run_out_with_the_key_and_the_last_answer() {
    let script = Script::new((0..4).map(|_| status(503)));
    let policy = RetryPolicy::default()
        .max_attempts(4)
        .key_generator(|| "k4".to_owned());
    let error = send(script.client(policy), command(None))
        .await
        .unwrap_err();
    assert_eq!(error.reason(), GiveUpReason::Attempts);
    assert_eq!((error.key(), error.attempts()), (Some("k4"), 4));
    match error.last_answer() {
        Some(LastAnswer::Response { status, body, .. }) => {
            assert_eq!((status.as_u16(), body.as_ref()), (503, &b"answer"[..]));
        }
        other => panic!("{other:?}"),
    }
    let line = error.to_string();
    assert!(!line.contains('\n') && !line.contains("answer\""), "{line}");
    assert!(
        line.contains("4 attempts") && line.contains("503"),
        "{line}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_budget_gives_up_at_once() {
    let script = Script::new([problem(ProblemKind::Unavailable, 503, Some(60))]);
    let policy = RetryPolicy::default().max_total_time(Duration::from_secs(30));
    let started = Instant::now();
    let error = send(script.client(policy), command(None))
        .await
        .unwrap_err();
    assert_eq!(
        (error.reason(), error.attempts()),
        (GiveUpReason::Deadline, 1)
    );
    assert_eq!(started.elapsed(), Duration::ZERO, "no wait was begun");
}

#[tokio::test(start_paused = true)]
async fn the_total_time_bounds_retries_of_hanging_attempts() {
    let script = Script::new((0..10).map(|_| Step::Hang));
    let policy = RetryPolicy::default()
        .attempt_timeout(Some(Duration::from_secs(4)))
        .max_total_time(Duration::from_secs(10));
    let started = Instant::now();
    let error = send(script.client(policy), command(None))
        .await
        .unwrap_err();
    assert_eq!(error.reason(), GiveUpReason::Deadline);
    assert!(matches!(error.last_answer(), Some(LastAnswer::TimedOut)));
    assert!((2..=3).contains(&error.attempts()), "{}", error.attempts());
    assert!(
        started.elapsed() <= Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn the_backoff_is_full_jitter_under_a_doubling_ceiling() {
    let policy = RetryPolicy::default().backoff(Duration::from_millis(100), Duration::from_secs(5));
    for retry in 1..=40 {
        let ceiling =
            Duration::from_millis(100 * (1u64 << (retry - 1).min(6))).min(Duration::from_secs(5));
        let waits: Vec<_> = (0..200).map(|_| policy.jittered_backoff(retry)).collect();
        assert!(waits.iter().all(|w| *w <= ceiling), "retry {retry}");
        // Jitter: not all the same (200 draws of a uniform variable).
        assert!(waits.iter().any(|w| *w != waits[0]), "retry {retry}");
    }
    assert!(policy.jittered_backoff(u32::MAX) <= Duration::from_secs(5));
}

#[test]
fn attempts_retries_and_give_ups_are_counted() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let script = Script::new([
                status(503),
                problem(ProblemKind::InProgress, 409, Some(1)),
                status(503),
            ]);
            let policy = RetryPolicy::default().max_attempts(3);
            send(script.client(policy), command(None))
                .await
                .unwrap_err();
        });
    });
    let mut counts: Vec<(String, Vec<String>, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let DebugValue::Counter(n) = value else {
                panic!("{key:?}")
            };
            let labels = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            (key.key().name().to_owned(), labels, n)
        })
        .collect();
    counts.sort();
    assert_eq!(
        counts,
        vec![
            ("inbox_client_attempts_total".to_owned(), vec![], 3),
            (
                "inbox_client_give_ups_total".to_owned(),
                vec!["reason=attempts".to_owned()],
                1
            ),
            (
                "inbox_client_retries_total".to_owned(),
                vec!["reason=in-progress".to_owned()],
                1
            ),
            (
                "inbox_client_retries_total".to_owned(),
                vec!["reason=status-503".to_owned()],
                1
            ),
        ]
    );
}
