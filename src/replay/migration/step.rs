//! One step of a migration: its operation ID and input, and what came of it.

use super::MigrationDefinitionError;
use crate::fingerprint::Fingerprint;
use crate::inbox::InboxError;
use crate::inbox::RetryReason;
use crate::key::MessageKey;
use serde::Serialize;
use std::fmt;

/// One step of a migration: an operation ID and the input the step's function works from.
///
/// The input is fingerprinted: running the same operation ID again with an input that
/// fingerprints differently is a [conflict](StepError::Conflict).
#[derive(Debug, Clone)]
pub struct MigrationStep<I> {
    pub(super) operation_id: MessageKey,
    pub(super) input: I,
    pub(super) fingerprint: Fingerprint,
}

impl<I: Serialize> MigrationStep<I> {
    /// A step whose input is fingerprinted as canonical JSON (key order does not matter).
    ///
    /// ```
    /// use tower_inbox::replay::MigrationStep;
    /// let step = MigrationStep::new("bonus/app/7f1c", ("a1", 5)).unwrap();
    /// assert_eq!(step.operation_id().as_str(), "bonus/app/7f1c");
    /// assert!(MigrationStep::new("", ("a1", 5)).is_err());
    /// ```
    pub fn new(operation_id: impl AsRef<str>, input: I) -> Result<Self, MigrationDefinitionError> {
        let operation_id = MessageKey::new(operation_id)?;
        let json = serde_json::to_value(&input)
            .map_err(|e| MigrationDefinitionError::UnserializableInput(e.to_string()))?;
        Ok(Self {
            operation_id,
            fingerprint: Fingerprint::of_json(&json),
            input,
        })
    }
}

impl<I: AsRef<[u8]>> MigrationStep<I> {
    /// A step whose input is fingerprinted as the bytes it is.
    ///
    /// ```
    /// use tower_inbox::replay::MigrationStep;
    /// let step = MigrationStep::from_bytes("reindex/42", b"account=a1".to_vec()).unwrap();
    /// assert_eq!(step.input(), b"account=a1");
    /// ```
    pub fn from_bytes(
        operation_id: impl AsRef<str>,
        input: I,
    ) -> Result<Self, MigrationDefinitionError> {
        let operation_id = MessageKey::new(operation_id)?;
        Ok(Self {
            operation_id,
            fingerprint: Fingerprint::of_bytes(input.as_ref()),
            input,
        })
    }
}

impl<I> MigrationStep<I> {
    /// The operation ID: the message ID the step is claimed under.
    pub fn operation_id(&self) -> &MessageKey {
        &self.operation_id
    }

    /// The input.
    pub fn input(&self) -> &I {
        &self.input
    }

    /// The fingerprint of the input.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }
}

/// What happened to a step that did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepOutcome<T> {
    /// Committed now, with the function's writes.
    Applied {
        /// What the function returned.
        value: T,
        /// How many times the step ran, re-runs after transient failures included.
        attempts: u32,
    },
    /// Committed before (by an earlier or a concurrent run): skipped, the function not run.
    AlreadyApplied {
        /// The handler version that applied it.
        handler_version: String,
    },
}

impl<T> StepOutcome<T> {
    /// Whether the step was applied by this call.
    pub fn is_applied(&self) -> bool {
        matches!(self, Self::Applied { .. })
    }

    pub(super) fn label(&self) -> &'static str {
        match self {
            Self::Applied { .. } => "applied",
            Self::AlreadyApplied { .. } => "already-applied",
        }
    }

    pub(super) fn without_value(self) -> StepOutcome<()> {
        match self {
            Self::Applied { attempts, .. } => StepOutcome::Applied {
                value: (),
                attempts,
            },
            Self::AlreadyApplied { handler_version } => {
                StepOutcome::AlreadyApplied { handler_version }
            }
        }
    }
}

/// Why a step was not applied. Nothing of the step committed, except as said for
/// [`Inbox`](Self::Inbox).
#[derive(Debug)]
pub enum StepError<E> {
    /// The step's function returned an error (a transient one after the re-runs ran out);
    /// the step rolled back entirely and can be run again.
    Failed(E),
    /// The operation ID was applied before with a different input. The original is
    /// untouched; the conflict is kept in the [quarantine](crate::quarantine).
    Conflict {
        /// The fingerprint of the input that applied it, in hex.
        recorded_sha256: String,
        /// The fingerprint of the refused input, in hex.
        input_sha256: String,
    },
    /// The step's function returned normally, but a statement it ran through the claimed
    /// message failed with a serialization failure or deadlock (or it asked for a re-run with
    /// [`ClaimedMessage::request_retry`](crate::inbox::ClaimedMessage::request_retry)) on every attempt; the step rolled back entirely and
    /// can be run again.
    Rerun(RetryReason),
    /// Another runner holds the step and did not finish within the wait; run again later.
    InProgress,
    /// The inbox's own database work failed. If the commit failed the outcome is unknown
    /// (the server may have committed before the connection broke): run the migration again,
    /// and the step is either skipped or applied.
    Inbox(InboxError),
}

impl<E> StepError<E> {
    pub(super) fn label(&self) -> &'static str {
        match self {
            Self::Failed(_) => "failed",
            Self::Conflict { .. } => "conflict",
            Self::Rerun(_) => "rerun-exhausted",
            Self::InProgress => "in-progress",
            Self::Inbox(_) => "database-error",
        }
    }
}

impl<E: fmt::Display> fmt::Display for StepError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Failed(err) => write!(f, "the step failed and was rolled back: {err}"),
            Self::Conflict { .. } => f.write_str(
                "the operation ID was already applied with a different input; the original is untouched",
            ),
            Self::Rerun(reason) => write!(
                f,
                "the step kept failing with {reason} and was rolled back each time"
            ),
            Self::InProgress => f.write_str("another runner is applying the step"),
            Self::Inbox(err) => err.fmt(f),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for StepError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Inbox(err) => Some(err),
            _ => None,
        }
    }
}
