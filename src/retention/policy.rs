//! The retention window, derived from the ways an old message can come back.
//!
//! (Over 400 lines: the policy, its builder and the scenario table it documents belong together.)

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
mod tests;
