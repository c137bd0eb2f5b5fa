//! The [`Transport`] a dispatcher delivers through, and what a delivery came to.

use std::future::Future;
use std::time::Duration;

use super::Effect;

/// The most of a receiver's answer (or of an error text) kept with an effect: 64 KiB.
pub(super) const EXCERPT_LIMIT: usize = 64 * 1024;

/// What one delivery attempt came to.
///
/// The texts are recorded with the effect as excerpts: the dispatcher replaces NUL characters
/// (PostgreSQL `text` cannot hold them) and keeps at most 64 KiB of each, so a transport may
/// put anything there without making the outcome unrecordable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// The receiver accepted the effect.
    Delivered {
        /// Its status code, where the transport has one.
        status: Option<u16>,
        /// What it answered, recorded with the effect.
        result: String,
    },
    /// Failed or ambiguous (a timeout, a 5xx, a refused connection): the receiver may or may
    /// not have applied it, so try again later with the same key.
    Retry {
        /// The receiver's status code, if it answered.
        status: Option<u16>,
        /// What went wrong.
        error: String,
    },
    /// The receiver refused the effect for good: move it to dead letters.
    Permanent {
        /// The receiver's status code, if it answered.
        status: Option<u16>,
        /// A stable reason code for the quarantine, e.g. `http-404`; also the `reason` label
        /// of [`outbox_dead_letters_total`](crate::metrics::OUTBOX_DEAD_LETTERS), so it must
        /// come from a small fixed set, never from the receiver's answer text.
        reason_code: String,
        /// What went wrong.
        error: String,
    },
}

/// Delivers effects. Implementations must send [`Effect::effect_id`] as the idempotency key
/// so the receiver can deduplicate deliveries that are repeated after ambiguous outcomes.
///
/// The dispatcher calls it outside any database transaction and bounds each call with its
/// delivery timeout; a call that runs over counts as ambiguous. A call that panics counts as
/// a failed attempt, like [`Delivery::Retry`].
pub trait Transport: Send + Sync + 'static {
    /// Delivers one effect.
    fn deliver(&self, effect: &Effect) -> impl Future<Output = Delivery> + Send;

    /// The bound the transport itself puts on one [`deliver`](Self::deliver) call, if any.
    ///
    /// A transport that knows the outcome before its call ends (a status received while the
    /// answer is still being read) declares its bound here, and the dispatcher refuses a
    /// delivery timeout shorter than it: the dispatcher's timeout could otherwise cut off an
    /// accepted delivery and have it delivered again.
    fn call_timeout(&self) -> Option<Duration> {
        None
    }
}

/// The most of a reason code kept: it is a metric label and a quarantine column.
const REASON_CODE_LIMIT: usize = 128;

impl Delivery {
    /// The outcome with every text made [`storable`]: an answer the database cannot hold
    /// must not turn a finished delivery into an unrecorded one, which is delivered again.
    pub(crate) fn storable(self) -> Self {
        match self {
            Self::Delivered { status, result } => Self::Delivered {
                status,
                result: storable(result),
            },
            Self::Retry { status, error } => Self::Retry {
                status,
                error: storable(error),
            },
            Self::Permanent {
                status,
                reason_code,
                error,
            } => Self::Permanent {
                status,
                reason_code: storable_within(reason_code, REASON_CODE_LIMIT),
                error: storable(error),
            },
        }
    }
}

/// `text` as it can be stored: NUL characters replaced and at most [`EXCERPT_LIMIT`] bytes,
/// cut on a character boundary.
fn storable(text: String) -> String {
    storable_within(text, EXCERPT_LIMIT)
}

/// Like [`storable`], at most `limit` bytes.
fn storable_within(mut text: String, limit: usize) -> String {
    // Cut first so the replacement below never works on more than the limit.
    truncate(&mut text, limit);
    if text.contains('\0') {
        text = text.replace('\0', "\u{FFFD}");
        truncate(&mut text, limit);
    }
    text
}

fn truncate(text: &mut String, limit: usize) {
    if text.len() > limit {
        let mut end = limit;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_is_replaced_and_the_text_kept() {
        assert_eq!(storable("a\0b".to_owned()), "a\u{FFFD}b");
        assert_eq!(storable("plain".to_owned()), "plain");
    }

    #[test]
    fn long_text_is_cut_on_a_char_boundary() {
        // 'é' is two bytes: a cut at an odd limit falls inside one.
        let text = "é".repeat(EXCERPT_LIMIT);
        let kept = storable(text);
        assert_eq!(kept.len(), EXCERPT_LIMIT);
        assert_eq!(storable_within("éé".to_owned(), 3), "é");
        assert_eq!(storable_within("abc".to_owned(), 0), "");
    }

    #[test]
    fn replacing_nul_never_grows_past_the_limit() {
        // Each NUL becomes three bytes.
        let kept = storable_within("\0\0\0\0".to_owned(), 7);
        assert_eq!(kept, "\u{FFFD}\u{FFFD}");
        assert!(storable("\0".repeat(EXCERPT_LIMIT + 5)).len() <= EXCERPT_LIMIT);
    }
}
