//! Whether a claim reads its key before opening a transaction.
//!
//! The read answers a duplicate in one round trip, with no transaction and no write; it costs
//! a first-seen command one round trip more. Which is cheaper depends on how many messages
//! are duplicates, so by default the inbox watches: it keeps a moving share of the messages
//! whose key it found taken (a duplicate, a conflict, an original in flight), and reads first
//! while that share is above a fifth. A retry storm turns the reads on within a few requests;
//! a steady stream of new commands turns them off, and each first-seen command then costs the
//! same round trips as the protocol itself.

use std::sync::atomic::{AtomicU32, Ordering};

/// One, in the share's fixed point.
const ONE: u32 = 1 << 16;

/// Above this share of taken keys, claims read first: a duplicate met by the claim costs two
/// round trips more than one met by the read, a first-seen command met by the read one more,
/// and a duplicate's round trips are the cheaper ones (no write, no commit).
const THRESHOLD: u32 = ONE / 5;

/// How much each message moves the share: about the last 32 messages count.
const WEIGHT_SHIFT: u32 = 5;

/// When a claim reads its key first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum LookupFirst {
    /// Always.
    Always,
    /// Never.
    Never,
    /// While the share of taken keys is high (the default).
    #[default]
    Adaptive,
}

/// The moving share of messages whose key was found taken.
#[derive(Debug)]
pub(crate) struct TakenShare(AtomicU32);

impl TakenShare {
    /// Starts as if every key were taken: until first-seen commands show otherwise, reading
    /// first is the safe guess (a duplicate is cheap, a first-seen command pays one read).
    pub(crate) fn new() -> Self {
        Self(AtomicU32::new(ONE))
    }

    /// Counts one message.
    pub(crate) fn observe(&self, taken: bool) {
        let target = if taken { ONE } else { 0 };
        // A lost update under contention only delays the share by one message.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |share| {
                let moved = if target > share {
                    share + ((target - share) >> WEIGHT_SHIFT).max(1)
                } else {
                    share - ((share - target) >> WEIGHT_SHIFT).max(u32::from(share > 0))
                };
                Some(moved.min(ONE))
            });
    }

    /// Whether keys are taken often enough to read first.
    pub(crate) fn high(&self) -> bool {
        self.0.load(Ordering::Relaxed) > THRESHOLD
    }
}

impl LookupFirst {
    pub(crate) fn now(self, share: &TakenShare) -> bool {
        match self {
            Self::Always => true,
            Self::Never => false,
            Self::Adaptive => share.high(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_commands_turn_the_read_off_and_duplicates_turn_it_on_again() {
        let share = TakenShare::new();
        assert!(LookupFirst::Adaptive.now(&share), "reads first at start");
        let mut first_seen = 0;
        while LookupFirst::Adaptive.now(&share) {
            share.observe(false);
            first_seen += 1;
            assert!(first_seen < 100, "never turned off");
        }
        // About 32 × ln 5 messages.
        assert!((40..=60).contains(&first_seen), "{first_seen}");
        let mut duplicates = 0;
        while !LookupFirst::Adaptive.now(&share) {
            share.observe(true);
            duplicates += 1;
        }
        assert!(duplicates <= 2, "{duplicates}");
        for _ in 0..10_000 {
            share.observe(false);
        }
        assert_eq!(share.0.load(Ordering::Relaxed), 0, "reaches zero");
        for _ in 0..10_000 {
            share.observe(true);
        }
        assert_eq!(share.0.load(Ordering::Relaxed), ONE, "reaches one");
    }

    #[test]
    fn forced_settings_ignore_the_share() {
        let share = TakenShare::new();
        assert!(!LookupFirst::Never.now(&share));
        for _ in 0..1000 {
            share.observe(false);
        }
        assert!(LookupFirst::Always.now(&share));
        assert!(!LookupFirst::Adaptive.now(&share));
    }

    #[test]
    fn a_mixed_stream_settles_near_its_share() {
        let share = TakenShare::new();
        // One duplicate in three: reads first.
        for i in 0..3000 {
            share.observe(i % 3 == 0);
        }
        assert!(share.high());
        // One in ten: does not.
        for i in 0..3000 {
            share.observe(i % 10 == 0);
        }
        assert!(!share.high());
    }
}
