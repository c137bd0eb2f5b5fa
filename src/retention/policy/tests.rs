//! Unit tests of the parent module.

use super::*;

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);

fn full() -> RetentionPolicyBuilder {
    RetentionPolicy::builder()
        .retry_horizon(DAY)
        .outage_tolerance(3 * DAY)
        .offset_rewind(7 * DAY)
        .dead_letter_redrive(14 * DAY)
        .backup_restore(30 * DAY)
        .planned_replay(10 * DAY)
        .custom("partner resend", 2 * DAY)
        .safety_margin(DAY)
}

#[test]
fn window_is_the_longest_path_plus_the_margin() {
    let policy = full().build().unwrap();
    assert_eq!(policy.required(), 31 * DAY);
    assert_eq!(policy.window(), 31 * DAY);
    assert!(!policy.is_explicit());
    assert_eq!(policy.dominant().scenario(), &Scenario::BackupRestore);
    assert_eq!(policy.dominant().latest_arrival(), 30 * DAY);
    assert_eq!(policy.paths().len(), 6, "outage tolerance is not a path");
    assert_eq!(policy.scenarios().count(), 7);
}

#[test]
fn outage_tolerance_extends_the_retry_horizon() {
    let policy = RetentionPolicy::builder()
        .retry_horizon(2 * DAY)
        .outage_tolerance(5 * DAY)
        .offset_rewind(6 * DAY)
        .safety_margin(HOUR)
        .build()
        .unwrap();
    // 2d + 5d of held-back redeliveries beats the 6d rewind.
    assert_eq!(policy.dominant().scenario(), &Scenario::RetryHorizon);
    assert_eq!(policy.dominant().horizon(), 2 * DAY);
    assert_eq!(policy.dominant().latest_arrival(), 7 * DAY);
    assert_eq!(policy.window(), 7 * DAY + HOUR);
}

#[test]
fn ties_go_to_the_first_declared() {
    let policy = RetentionPolicy::builder()
        .offset_rewind(DAY)
        .planned_replay(DAY)
        .safety_margin(HOUR)
        .build()
        .unwrap();
    assert_eq!(policy.dominant().scenario(), &Scenario::OffsetRewind);
}

#[test]
fn a_longer_explicit_window_is_kept() {
    let policy = full().window(45 * DAY).build().unwrap();
    assert_eq!(policy.window(), 45 * DAY);
    assert_eq!(policy.required(), 31 * DAY);
    assert!(policy.is_explicit());
    let exact = full().window(31 * DAY).build().unwrap();
    assert!(!exact.is_explicit(), "the window the scenarios require");
}

#[test]
fn a_shorter_explicit_window_is_refused_naming_the_scenario() {
    let err = full().window(30 * DAY).build().unwrap_err();
    assert_eq!(
        err,
        RetentionError::WindowTooShort {
            window: HumanDuration(30 * DAY),
            required: HumanDuration(31 * DAY),
            scenario: "backup restore".into(),
        }
    );
    let message = err.to_string();
    assert!(message.contains("backup restore"), "{message}");
    assert!(
        message.contains("30d") && message.contains("31d"),
        "{message}"
    );
}

#[test]
fn the_margin_counts_against_an_explicit_window() {
    let err = RetentionPolicy::builder()
        .dead_letter_redrive(14 * DAY)
        .safety_margin(HOUR)
        .window(14 * DAY)
        .build()
        .unwrap_err();
    assert!(
        matches!(err, RetentionError::WindowTooShort { ref scenario, .. } if scenario == "dead-letter redrive"),
        "{err:?}"
    );
}

#[test]
fn no_scenario_is_a_bare_ttl() {
    let err = RetentionPolicy::builder()
        .safety_margin(DAY)
        .window(30 * DAY)
        .build()
        .unwrap_err();
    assert_eq!(err, RetentionError::NoScenario);
}

#[test]
fn zero_durations_are_refused() {
    let zero = Duration::ZERO;
    let cases = [
        (
            RetentionPolicy::builder().offset_rewind(zero),
            "offset rewind",
        ),
        (
            RetentionPolicy::builder()
                .offset_rewind(DAY)
                .safety_margin(zero),
            "the safety margin",
        ),
        (
            RetentionPolicy::builder()
                .offset_rewind(DAY)
                .safety_margin(DAY)
                .window(zero),
            "the window",
        ),
        (
            RetentionPolicy::builder().custom("partner resend", zero),
            "partner resend",
        ),
    ];
    for (builder, what) in cases {
        let builder = if builder.margin.is_none() {
            builder.safety_margin(DAY)
        } else {
            builder
        };
        assert_eq!(
            builder.build().unwrap_err(),
            RetentionError::ZeroDuration(what.into())
        );
    }
}

#[test]
fn the_margin_is_required() {
    let err = RetentionPolicy::builder()
        .offset_rewind(DAY)
        .build()
        .unwrap_err();
    assert_eq!(err, RetentionError::NoSafetyMargin);
}

#[test]
fn outage_needs_a_retry_horizon() {
    let err = RetentionPolicy::builder()
        .outage_tolerance(DAY)
        .offset_rewind(DAY)
        .safety_margin(HOUR)
        .build()
        .unwrap_err();
    assert_eq!(err, RetentionError::OutageWithoutRetryHorizon);
}

#[test]
fn duplicates_and_bad_names_are_refused() {
    let twice = RetentionPolicy::builder()
        .offset_rewind(DAY)
        .offset_rewind(2 * DAY)
        .safety_margin(HOUR)
        .build()
        .unwrap_err();
    assert_eq!(
        twice,
        RetentionError::DuplicateScenario("offset rewind".into())
    );
    let shadowing = RetentionPolicy::builder()
        .offset_rewind(DAY)
        .custom("offset rewind", 2 * DAY)
        .safety_margin(HOUR)
        .build()
        .unwrap_err();
    assert_eq!(
        shadowing,
        RetentionError::DuplicateScenario("offset rewind".into())
    );
    for name in ["", "tab\there", &"x".repeat(101)] {
        let err = RetentionPolicy::builder()
            .custom(name, DAY)
            .safety_margin(HOUR)
            .build()
            .unwrap_err();
        assert_eq!(err, RetentionError::BadScenarioName, "{name:?}");
    }
}

#[test]
fn over_long_durations_are_refused_without_overflow() {
    let err = RetentionPolicy::builder()
        .offset_rewind(Duration::MAX)
        .safety_margin(HOUR)
        .build()
        .unwrap_err();
    assert_eq!(err, RetentionError::TooLong("offset rewind".into()));
    // Each part in range, the sum not.
    let err = RetentionPolicy::builder()
        .retry_horizon(MAX_HORIZON)
        .outage_tolerance(MAX_HORIZON)
        .safety_margin(MAX_HORIZON)
        .build()
        .unwrap_err();
    assert_eq!(err, RetentionError::TooLong("the required window".into()));
}

#[test]
fn the_report_lists_every_scenario_and_marks_the_dominant_one() {
    let report = full().build().unwrap().to_string();
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(
        lines[0],
        "retention window 31d: backup restore 30d + safety margin 1d"
    );
    assert_eq!(lines[1], "  retry horizon: 1d + outage tolerance 3d = 4d");
    assert_eq!(
        lines[2],
        "  outage tolerance: 3d (extends the retry horizon)"
    );
    assert_eq!(lines[5], "  backup restore: 30d  <- sets the window");
    assert_eq!(lines[7], "  partner resend: 2d");
    assert_eq!(lines[8], "  safety margin: 1d");
    assert_eq!(lines.len(), 9);
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.contains("sets the window"))
            .count(),
        1
    );
    let explicit = full().window(45 * DAY).build().unwrap().to_string();
    assert!(
        explicit.starts_with("retention window 45d (explicit; the scenarios require 31d: backup restore 30d + safety margin 1d)"),
        "{explicit}"
    );
}

#[test]
fn durations_read_like_people_write_them() {
    let cases = [
        (Duration::from_secs(90), "1m 30s"),
        (DAY + 6 * HOUR, "1d 6h"),
        (Duration::from_millis(250), "250ms"),
        (Duration::from_micros(5), "5us"),
    ];
    for (d, text) in cases {
        assert_eq!(HumanDuration(d).to_string(), text);
    }
}
