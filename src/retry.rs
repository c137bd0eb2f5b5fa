//! Bounded re-runs of a transaction after a transient failure.

use std::time::Duration;

/// How often, and how far apart, a transaction is re-run after a serialization failure
/// (`40001`) or a deadlock (`40P01`), or after its connection was lost. Lost connections get
/// the pool's size on top of `max_attempts`: after a restart every idle connection of the
/// pool is dead, and a run may meet several of them in a row (each fails once and is closed).
///
/// Each re-run starts a new transaction from scratch. The delay before re-run `n` (from 1)
/// is drawn between half and all of `base * 2^(n-1)`, capped at `cap`, so transactions that
/// collided do not collide again in lockstep.
///
/// ```
/// use std::time::Duration;
/// use tower_inbox::inbox::TransientRetry;
///
/// let retry = TransientRetry::new(4, Duration::from_millis(10), Duration::from_millis(100));
/// assert_eq!(retry.max_attempts(), 4);
/// let d = retry.delay(3);
/// assert!(d >= Duration::from_millis(20) && d <= Duration::from_millis(40));
/// assert_eq!(TransientRetry::never().max_attempts(), 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransientRetry {
    max_attempts: u32,
    base: Duration,
    cap: Duration,
}

impl Default for TransientRetry {
    /// Three attempts in all, re-run after 5–10 ms and then 10–20 ms.
    fn default() -> Self {
        Self::new(3, Duration::from_millis(10), Duration::from_millis(250))
    }
}

impl TransientRetry {
    /// At most `max_attempts` attempts in all (at least 1), backing off from `base` up to
    /// `cap`. Both are clamped to [`MAX_DELAY`](Self::MAX_DELAY): a re-run waits while its
    /// client does.
    pub fn new(max_attempts: u32, base: Duration, cap: Duration) -> Self {
        let base = base.min(Self::MAX_DELAY);
        Self {
            max_attempts: max_attempts.max(1),
            base,
            cap: cap.clamp(base, Self::MAX_DELAY),
        }
    }

    /// The longest delay between two runs: one minute.
    pub const MAX_DELAY: Duration = Duration::from_secs(60);

    /// One attempt, no re-run.
    pub fn never() -> Self {
        Self::new(1, Duration::ZERO, Duration::ZERO)
    }

    /// The most attempts, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The delay before re-run `rerun` (1 for the first re-run), with jitter.
    pub fn delay(&self, rerun: u32) -> Duration {
        jittered(self.base, self.cap, rerun)
    }
}

/// The delay before retry `n` (from 1) of anything the crate retries: drawn between half and
/// all of `base * 2^(n-1)`, capped at `cap`, so that what failed together does not retry in
/// lockstep.
pub(crate) fn jittered(base: Duration, cap: Duration, n: u32) -> Duration {
    let doublings = n.saturating_sub(1).min(30);
    let full = base.saturating_mul(1 << doublings).min(cap);
    full.mul_f64(0.5 + fastrand::f64() * 0.5)
}
