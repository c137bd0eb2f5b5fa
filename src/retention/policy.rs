//! The retention window, derived from the ways an old message can come back.

use std::fmt;
use std::time::Duration;

/// The longest horizon, margin or window a policy accepts: about a thousand years. Keeping
/// rows longer than that is keeping them forever; for that, run no purge.
pub const MAX_HORIZON: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

/// A way a copy of an already processed message can reach the consumer again.
///
/// Each scenario is declared on a [`RetentionPolicyBuilder`] with a horizon: how long after
/// the message was **first processed** a copy of it can still arrive through that path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scenario {
    /// The client's or the broker's retry horizon: the longest a producer keeps retrying a
    /// command, or a broker keeps redelivering an unacknowledged message (its retention).
    RetryHorizon,
    /// The longest outage the consumer must survive. Redeliveries held back by an outage
    /// arrive after it ends, so this is added to the [retry horizon](Self::RetryHorizon)
    /// rather than being a path of its own.
    OutageTolerance,
    /// How far back a consumer group's offsets may be rewound (by hand, or by a consumer
    /// that lost its committed offsets).
    OffsetRewind,
    /// How old a message in the dead-letter queue can be when it is redriven.
    DeadLetterRedrive,
    /// The age of the oldest backup you would restore and then replay the broker from: the
    /// replay re-delivers messages processed just before that backup, which are that old.
    BackupRestore,
    /// How old the messages of a planned replay (a re-publish, a migration) can be.
    PlannedReplay,
    /// Any other path, named.
    Custom(String),
}

impl Scenario {
    /// The name shown in reports and errors.
    pub fn name(&self) -> &str {
        match self {
            Self::RetryHorizon => "retry horizon",
            Self::OutageTolerance => "outage tolerance",
            Self::OffsetRewind => "offset rewind",
            Self::DeadLetterRedrive => "dead-letter redrive",
            Self::BackupRestore => "backup restore",
            Self::PlannedReplay => "planned replay",
            Self::Custom(name) => name,
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A retention policy that cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RetentionError {
    /// No scenario was declared: a window without one would be a bare TTL.
    #[error("no failure scenario declared: a retention window must come from the ways a message can come back, not be a bare TTL")]
    NoScenario,
    /// Outage tolerance without a retry horizon: there is nothing for it to extend.
    #[error("outage tolerance extends the retry horizon; declare the retry horizon too")]
    OutageWithoutRetryHorizon,
    /// No safety margin was given.
    #[error("no safety margin: declare one for what the estimates miss (clock skew, late purge runs, optimistic horizons)")]
    NoSafetyMargin,
    /// A horizon, margin, window, period or timeout is zero.
    #[error("{0} must be longer than zero")]
    ZeroDuration(String),
    /// A horizon, margin or window is over [`MAX_HORIZON`], or they add up to more.
    #[error("{0} is longer than a thousand years; to keep rows forever, run no purge")]
    TooLong(String),
    /// The same scenario (or custom name) was declared twice.
    #[error("scenario {0:?} is declared twice")]
    DuplicateScenario(String),
    /// A custom scenario's name is empty, over 100 bytes or has control characters.
    #[error("a custom scenario needs a name of 1 to 100 bytes without control characters")]
    BadScenarioName,
    /// The explicit window is shorter than a declared scenario requires.
    #[error("the window {window} is shorter than the {required} that {scenario} requires (its latest redelivery plus the safety margin); a shorter window makes those redeliveries new again")]
    WindowTooShort {
        /// The window asked for.
        window: HumanDuration,
        /// What the scenarios require.
        required: HumanDuration,
        /// The scenario that requires it (the longest path).
        scenario: String,
    },
    /// A purge setting is out of range.
    #[error("bad purge setting: {0}")]
    BadLimit(&'static str),
    /// A purger without any policy would delete nothing.
    #[error("the purger has no retention policy: give it one for the inbox, the outbox or the quarantine")]
    NothingToPurge,
}

/// One path by which a copy of a processed message can arrive again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedeliveryPath {
    scenario: Scenario,
    horizon: Duration,
    latest_arrival: Duration,
}

impl RedeliveryPath {
    /// The scenario.
    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    /// The horizon it was declared with.
    pub fn horizon(&self) -> Duration {
        self.horizon
    }

    /// How long after first processing a copy can still arrive this way: the horizon, plus
    /// the outage tolerance for the retry horizon.
    pub fn latest_arrival(&self) -> Duration {
        self.latest_arrival
    }
}

/// How long processed rows must be remembered, and why.
///
/// The model: every declared [`Scenario`] is a path by which a copy of a message can arrive
/// again, at the latest its horizon after the message was first processed. The outage
/// tolerance is added to the retry horizon (redeliveries held back by an outage arrive after
/// it ends). The policy requires **the longest path plus the safety margin**, and
/// [`window`](Self::window) is that, or a longer explicit window.
///
/// The safety margin has no default: it covers what the horizons miss (clock skew between
/// producer, application and database; purge runs that start late; horizons that were
/// estimated optimistically), and how much that is depends on how well the horizons are
/// known.
///
/// ```
/// use std::time::Duration;
/// use tower_inbox::retention::{RetentionPolicy, Scenario};
///
/// const DAY: Duration = Duration::from_secs(24 * 3600);
/// let policy = RetentionPolicy::builder()
///     .retry_horizon(DAY)
///     .outage_tolerance(3 * DAY)
///     .dead_letter_redrive(14 * DAY)
///     .backup_restore(7 * DAY)
///     .safety_margin(DAY)
///     .build()?;
/// assert_eq!(policy.window(), 15 * DAY);
/// assert_eq!(policy.dominant().scenario(), &Scenario::DeadLetterRedrive);
/// println!("{policy}"); // every scenario, the one that sets the window marked
/// # Ok::<(), tower_inbox::retention::RetentionError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionPolicy {
    declared: Vec<(Scenario, Duration)>,
    paths: Vec<RedeliveryPath>,
    dominant: usize,
    margin: Duration,
    required: Duration,
    window: Duration,
    explicit_window: bool,
}

impl RetentionPolicy {
    /// Starts a policy with no scenarios.
    pub fn builder() -> RetentionPolicyBuilder {
        RetentionPolicyBuilder::default()
    }

    /// How long processed rows are kept: [`required`](Self::required), or the longer
    /// explicit window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// What the scenarios require: the longest path plus the safety margin.
    pub fn required(&self) -> Duration {
        self.required
    }

    /// The safety margin.
    pub fn safety_margin(&self) -> Duration {
        self.margin
    }

    /// Whether the window was set explicitly (longer than required) rather than derived.
    pub fn is_explicit(&self) -> bool {
        self.explicit_window
    }

    /// The path that sets the requirement: the one whose copies can arrive latest (the
    /// first declared of equals).
    pub fn dominant(&self) -> &RedeliveryPath {
        &self.paths[self.dominant]
    }

    /// Every path, in the order declared (outage tolerance is folded into the retry
    /// horizon's).
    pub fn paths(&self) -> &[RedeliveryPath] {
        &self.paths
    }

    /// Every scenario with the horizon it was declared with, in order.
    pub fn scenarios(&self) -> impl Iterator<Item = (&Scenario, Duration)> {
        self.declared.iter().map(|(s, d)| (s, *d))
    }
}

/// Lists every scenario and marks the one that sets the window.
impl fmt::Display for RetentionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dominant = self.dominant();
        let why = format!(
            "{} {} + safety margin {}",
            dominant.scenario,
            HumanDuration(dominant.latest_arrival),
            HumanDuration(self.margin)
        );
        if self.explicit_window {
            writeln!(
                f,
                "retention window {} (explicit; the scenarios require {}: {why})",
                HumanDuration(self.window),
                HumanDuration(self.required)
            )?;
        } else {
            writeln!(f, "retention window {}: {why}", HumanDuration(self.window))?;
        }
        let outage = self.declared_horizon(&Scenario::OutageTolerance);
        for (scenario, horizon) in &self.declared {
            write!(f, "  {scenario}: {}", HumanDuration(*horizon))?;
            match (scenario, outage) {
                (Scenario::OutageTolerance, _) => write!(f, " (extends the retry horizon)")?,
                (Scenario::RetryHorizon, Some(outage)) => write!(
                    f,
                    " + outage tolerance {} = {}",
                    HumanDuration(outage),
                    HumanDuration(horizon.saturating_add(outage))
                )?,
                _ => {}
            }
            if *scenario == dominant.scenario {
                write!(f, "  <- sets the window")?;
            }
            writeln!(f)?;
        }
        write!(f, "  safety margin: {}", HumanDuration(self.margin))
    }
}

impl RetentionPolicy {
    fn declared_horizon(&self, scenario: &Scenario) -> Option<Duration> {
        self.declared
            .iter()
            .find(|(s, _)| s == scenario)
            .map(|(_, d)| *d)
    }
}

/// Builds a [`RetentionPolicy`] from failure scenarios.
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct RetentionPolicyBuilder {
    declared: Vec<(Scenario, Duration)>,
    margin: Option<Duration>,
    window: Option<Duration>,
}

impl RetentionPolicyBuilder {
    /// Declares `scenario` with its horizon: how long after first processing a copy can
    /// still arrive through it.
    pub fn scenario(mut self, scenario: Scenario, horizon: Duration) -> Self {
        self.declared.push((scenario, horizon));
        self
    }

    /// The client's or broker's retry horizon ([`Scenario::RetryHorizon`]).
    pub fn retry_horizon(self, horizon: Duration) -> Self {
        self.scenario(Scenario::RetryHorizon, horizon)
    }

    /// The longest outage to survive, added to the retry horizon
    /// ([`Scenario::OutageTolerance`]).
    pub fn outage_tolerance(self, outage: Duration) -> Self {
        self.scenario(Scenario::OutageTolerance, outage)
    }

    /// How far offsets may be rewound ([`Scenario::OffsetRewind`]).
    pub fn offset_rewind(self, horizon: Duration) -> Self {
        self.scenario(Scenario::OffsetRewind, horizon)
    }

    /// How old a redriven dead letter can be ([`Scenario::DeadLetterRedrive`]).
    pub fn dead_letter_redrive(self, horizon: Duration) -> Self {
        self.scenario(Scenario::DeadLetterRedrive, horizon)
    }

    /// The age of the oldest backup you would restore and replay the broker from
    /// ([`Scenario::BackupRestore`]).
    pub fn backup_restore(self, oldest_backup: Duration) -> Self {
        self.scenario(Scenario::BackupRestore, oldest_backup)
    }

    /// How old the messages of a planned replay can be ([`Scenario::PlannedReplay`]).
    pub fn planned_replay(self, horizon: Duration) -> Self {
        self.scenario(Scenario::PlannedReplay, horizon)
    }

    /// Any other path, under its own name ([`Scenario::Custom`]).
    pub fn custom(self, name: impl Into<String>, horizon: Duration) -> Self {
        self.scenario(Scenario::Custom(name.into()), horizon)
    }

    /// Added to the longest path. Required.
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.margin = Some(margin);
        self
    }

    /// An explicit window, e.g. a storage budget. It may be longer than the scenarios
    /// require, never shorter: [`build`](Self::build) refuses that, naming the scenario.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = Some(window);
        self
    }

    /// Checks the scenarios and derives the window.
    pub fn build(self) -> Result<RetentionPolicy, RetentionError> {
        if self.declared.is_empty() {
            return Err(RetentionError::NoScenario);
        }
        for (i, (scenario, horizon)) in self.declared.iter().enumerate() {
            if let Scenario::Custom(name) = scenario {
                if name.is_empty() || name.len() > 100 || name.chars().any(char::is_control) {
                    return Err(RetentionError::BadScenarioName);
                }
            }
            check_duration(scenario.name(), *horizon)?;
            if self.declared[..i]
                .iter()
                .any(|(earlier, _)| earlier.name() == scenario.name())
            {
                return Err(RetentionError::DuplicateScenario(
                    scenario.name().to_owned(),
                ));
            }
        }
        let margin = self.margin.ok_or(RetentionError::NoSafetyMargin)?;
        check_duration("the safety margin", margin)?;

        let outage = self
            .declared
            .iter()
            .find(|(s, _)| *s == Scenario::OutageTolerance)
            .map(|(_, d)| *d);
        let retried = self
            .declared
            .iter()
            .any(|(s, _)| *s == Scenario::RetryHorizon);
        if outage.is_some() && !retried {
            return Err(RetentionError::OutageWithoutRetryHorizon);
        }
        let paths: Vec<RedeliveryPath> = self
            .declared
            .iter()
            .filter(|(s, _)| *s != Scenario::OutageTolerance)
            .map(|(scenario, horizon)| {
                let extra = match scenario {
                    Scenario::RetryHorizon => outage.unwrap_or(Duration::ZERO),
                    _ => Duration::ZERO,
                };
                RedeliveryPath {
                    scenario: scenario.clone(),
                    horizon: *horizon,
                    latest_arrival: *horizon + extra,
                }
            })
            .collect();
        // Ties go to the first declared: `max_by_key` would pick the last.
        let dominant = paths.iter().enumerate().fold(0, |best, (i, path)| {
            if path.latest_arrival > paths[best].latest_arrival {
                i
            } else {
                best
            }
        });
        let required = paths[dominant].latest_arrival + margin;
        check_duration("the required window", required)?;
        let (window, explicit_window) = match self.window {
            None => (required, false),
            Some(window) => {
                check_duration("the window", window)?;
                if window < required {
                    return Err(RetentionError::WindowTooShort {
                        window: HumanDuration(window),
                        required: HumanDuration(required),
                        scenario: paths[dominant].scenario.name().to_owned(),
                    });
                }
                (window, window > required)
            }
        };
        Ok(RetentionPolicy {
            declared: self.declared,
            paths,
            dominant,
            margin,
            required,
            window,
            explicit_window,
        })
    }
}

/// Refuses zero and over-long durations; `what` names it in the error.
pub(crate) fn check_duration(what: &str, d: Duration) -> Result<(), RetentionError> {
    if d.is_zero() {
        return Err(RetentionError::ZeroDuration(what.to_owned()));
    }
    if d > MAX_HORIZON {
        return Err(RetentionError::TooLong(what.to_owned()));
    }
    Ok(())
}

/// A duration written for people: `15d`, `1d 6h`, `1m 30s`, `250ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0.as_secs();
        let millis = self.0.subsec_millis();
        let parts = [
            (secs / 86_400, "d"),
            (secs / 3600 % 24, "h"),
            (secs / 60 % 60, "m"),
            (secs % 60, "s"),
            (u64::from(millis), "ms"),
        ];
        let mut written = false;
        for (value, unit) in parts {
            if value > 0 {
                if written {
                    f.write_str(" ")?;
                }
                write!(f, "{value}{unit}")?;
                written = true;
            }
        }
        if !written {
            // Below a millisecond: say so rather than print nothing.
            write!(f, "{}us", self.0.as_micros())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
}
