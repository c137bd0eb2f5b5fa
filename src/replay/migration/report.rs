//! What a whole migration did, and where it stopped.

use super::step::{StepError, StepOutcome};
use crate::key::MessageKey;
use std::fmt;

/// One step of a run, as the [`MigrationReport`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRecord {
    /// The step's operation ID.
    pub operation_id: MessageKey,
    /// Applied now or skipped.
    pub outcome: StepOutcome<()>,
}

/// What a run of a migration did, step by step, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    pub(super) migration: String,
    pub(super) steps: Vec<StepRecord>,
}

impl MigrationReport {
    /// The migration's name.
    pub fn migration(&self) -> &str {
        &self.migration
    }

    /// Every step the run went through, in order.
    pub fn steps(&self) -> &[StepRecord] {
        &self.steps
    }

    /// How many steps this run applied.
    pub fn applied(&self) -> usize {
        self.steps.iter().filter(|s| s.outcome.is_applied()).count()
    }

    /// How many steps this run skipped because they were applied before.
    pub fn skipped(&self) -> usize {
        self.steps.len() - self.applied()
    }
}

/// A run that stopped at a step: the steps before it are in `report` (they stay applied),
/// the steps after it did not run. Fix the cause and run the migration again.
#[derive(Debug)]
pub struct MigrationError<E> {
    /// The steps that went through before the failing one.
    pub report: MigrationReport,
    /// The failing step's operation ID.
    pub operation_id: MessageKey,
    /// Why it failed.
    pub error: StepError<E>,
}

impl<E: fmt::Display> fmt::Display for MigrationError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "migration {} stopped at step {} after {} steps: {}",
            self.report.migration,
            self.operation_id,
            self.report.steps.len(),
            self.error
        )
    }
}

impl<E: fmt::Debug + fmt::Display + 'static> std::error::Error for MigrationError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}
