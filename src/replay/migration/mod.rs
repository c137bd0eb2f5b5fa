//! Compensated migrations: corrections of past effects, each step claimed exactly once.
//!
//! (Over 400 lines: the step runner, its attempts and its conflict handling are one loop, read best in one place.)

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use metrics::Label;
use tracing::Instrument;

use crate::identity::{is_consumer_name, is_handler_version};
use crate::identity::{MessageIdentity, Producer};
use crate::inbox::RetryReason;
use crate::inbox::{Claim, ClaimedMessage, Inbox, InboxError, DEFAULT_IN_FLIGHT_WAIT};
use crate::key::{KeyError, MessageKey};
use crate::metrics::{count_with, MIGRATION_STEPS, TRANSACTION_RETRIES};
use crate::replay::transient::TransientError;
use crate::retry::TransientRetry;

mod report;
mod step;

pub use report::{MigrationError, MigrationReport, StepRecord};
pub use step::{MigrationStep, StepError, StepOutcome};

/// What the producer name of a migration's steps starts with: the steps of migration `name`
/// are claimed as producer `migration:<name>`.
pub const MIGRATION_PRODUCER_PREFIX: &str = crate::identity::RESERVED_PRODUCER_PREFIX;

/// A named, controlled correction of what a handler already did, run as steps that are each
/// exactly-once.
///
/// Each step has an operation ID chosen by the migration's author (stable across runs: derive
/// it from what the step corrects, such as the affected command's ID) and an input. A step is
/// claimed in the inbox as the message
///
/// | consumer | producer | message ID | payload fingerprint |
/// |---|---|---|---|
/// | the consumer given to [`builder`](Self::builder) (normally the one whose state the migration corrects) | `migration:<name>` | the operation ID | of the step's input |
///
/// in a transaction of its own. The step's function does its writes on that transaction, and
/// the claim commits with them: the step is applied completely and recorded, or not at all.
/// So:
///
/// * a step that already committed is skipped without running the function
///   ([`StepOutcome::AlreadyApplied`]): re-running a migration after a crash halfway applies
///   only the steps that did not commit, and re-running a finished one applies nothing,
///   however long after: the retention [purge](crate::retention::Purger) never deletes the
///   inbox rows of migration steps;
/// * the same operation ID with a different input is refused ([`StepError::Conflict`]),
///   the original untouched, and kept in the [quarantine](crate::quarantine) for a person to
///   look at: a migration whose steps changed after it started is a mistake to review, not
///   to apply;
/// * a step another runner is applying is refused after the wait ([`StepError::InProgress`]);
/// * a function that fails rolls the step back entirely, claim included, so it can be run
///   again ([`StepError::Failed`]);
/// * a serialization failure or deadlock, at the commit or returned by the function (see
///   [`TransientError`](super::TransientError)), re-runs the step from the start under the
///   [`TransientRetry`] policy, then fails.
///
/// The migration's producer is its own, so its steps never collide with the commands of real
/// producers, and the consumer's own records stay as they are. If producer names come from
/// clients and a client could pick `migration:<name>`, give the migration a consumer name of
/// its own instead.
///
/// ```no_run
/// use futures_util::FutureExt;
/// use serde::Serialize;
/// use tower_inbox::replay::{CompensatedMigration, MigrationStep};
/// use tower_inbox::inbox::Inbox;
///
/// #[derive(Serialize)]
/// struct MissingBonus {
///     account: String,
///     bonus: i64,
/// }
///
/// # async fn fix(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let migration = CompensatedMigration::builder(Inbox::new(pool), "credits", "bonus-fix-2026-12")
///     .build()?;
/// // One step per affected command, its operation ID derived from the command's.
/// let steps = vec![MigrationStep::new(
///     "bonus/app/7f1c",
///     MissingBonus { account: "a1".into(), bonus: 5 },
/// )?];
/// let report = migration
///     .run(steps, |tx, fix| {
///         async move {
///             sqlx::query("update credit_account set balance = balance + $1 where account_id = $2")
///                 .bind(fix.bonus)
///                 .bind(&fix.account)
///                 .execute(&mut *tx)
///                 .await?;
///             Ok::<(), sqlx::Error>(())
///         }
///         .boxed()
///     })
///     .await?;
/// println!("{} applied, {} already applied", report.applied(), report.skipped());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct CompensatedMigration {
    inbox: Inbox,
    name: Arc<str>,
    consumer: Arc<str>,
    producer: Producer,
    handler_version: Arc<str>,
    retry: TransientRetry,
    in_flight_wait: Duration,
}

/// A migration or step definition that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigrationDefinitionError {
    /// The migration name is empty, contains a control character, or is too long to fit a
    /// producer name (255 bytes with the `migration:` prefix).
    #[error("the migration name must be 1 to 245 bytes without control characters")]
    BadName,
    /// The consumer name is not 1 to 255 bytes of ASCII letters, digits and `-`, `_`, `.`,
    /// `:`, `/`, `@`.
    #[error("the consumer name must be 1 to 255 bytes of ASCII letters, digits and '-', '_', '.', ':', '/', '@'")]
    BadConsumerName,
    /// The handler version is not 1 to 255 visible ASCII characters.
    #[error("the handler version must be 1 to 255 visible ASCII characters ('!' to '~')")]
    BadHandlerVersion,
    /// The operation ID is not a valid message ID.
    #[error("bad operation ID: {0}")]
    BadOperationId(#[from] KeyError),
    /// The input could not be serialized to JSON (for example a map with non-string keys).
    #[error("the step input cannot be serialized to JSON: {0}")]
    UnserializableInput(String),
}

/// Configures a [`CompensatedMigration`].
#[derive(Debug)]
#[must_use]
pub struct CompensatedMigrationBuilder {
    inbox: Inbox,
    consumer: String,
    name: String,
    handler_version: String,
    retry: TransientRetry,
    in_flight_wait: Duration,
}

impl CompensatedMigrationBuilder {
    /// The handler version stored with each step's claim (default `"1"`): the revision of
    /// the migration's code, for whoever reads the inbox later.
    pub fn handler_version(mut self, version: impl Into<String>) -> Self {
        self.handler_version = version.into();
        self
    }

    /// How often a step is re-run after a serialization failure or deadlock (default
    /// [`TransientRetry::default`]).
    pub fn retry(mut self, retry: TransientRetry) -> Self {
        self.retry = retry;
        self
    }

    /// How long a step waits for another runner that holds it before
    /// [`StepError::InProgress`] (default 2 s). The wait holds a pooled connection.
    pub fn in_flight_wait(mut self, wait: Duration) -> Self {
        self.in_flight_wait = wait;
        self
    }

    /// Checks the names and builds the migration.
    pub fn build(self) -> Result<CompensatedMigration, MigrationDefinitionError> {
        if !is_consumer_name(&self.consumer) {
            return Err(MigrationDefinitionError::BadConsumerName);
        }
        if !is_handler_version(&self.handler_version) {
            return Err(MigrationDefinitionError::BadHandlerVersion);
        }
        if self.name.is_empty() {
            return Err(MigrationDefinitionError::BadName);
        }
        let producer =
            Producer::migration(&self.name).map_err(|_| MigrationDefinitionError::BadName)?;
        Ok(CompensatedMigration {
            inbox: self.inbox,
            name: self.name.into(),
            consumer: self.consumer.into(),
            producer,
            handler_version: self.handler_version.into(),
            retry: self.retry,
            in_flight_wait: self.in_flight_wait,
        })
    }
}

/// One attempt's result: done (either way), or a transient failure that may be re-run.
enum Attempt<T, E> {
    Done(Result<StepOutcome<T>, StepError<E>>),
    Transient(RetryReason, StepError<E>),
}

impl CompensatedMigration {
    /// Starts the migration `name` (e.g. `"credits-bonus-fix-2026-12"`), whose steps are
    /// claimed under `consumer` in `inbox`.
    pub fn builder(
        inbox: Inbox,
        consumer: impl Into<String>,
        name: impl Into<String>,
    ) -> CompensatedMigrationBuilder {
        CompensatedMigrationBuilder {
            inbox,
            consumer: consumer.into(),
            name: name.into(),
            handler_version: "1".to_owned(),
            retry: TransientRetry::default(),
            in_flight_wait: DEFAULT_IN_FLIGHT_WAIT,
        }
    }

    /// The migration's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The identity a step with `operation_id` is claimed under, e.g. to look it up with
    /// [`Inbox::lookup`] or in the quarantine.
    pub fn identity(&self, operation_id: &MessageKey) -> MessageIdentity {
        MessageIdentity::new(
            self.consumer.clone(),
            self.producer.clone(),
            operation_id.clone(),
        )
    }

    /// Applies every step in order, skipping those applied before, and stops at the first
    /// that fails. `apply` makes a step's writes on the claimed transaction (it dereferences
    /// to the connection); it must not commit or roll back itself.
    pub async fn run<I, E, F>(
        &self,
        steps: impl IntoIterator<Item = MigrationStep<I>>,
        mut apply: F,
    ) -> Result<MigrationReport, MigrationError<E>>
    where
        F: for<'a> FnMut(&'a mut ClaimedMessage, &'a I) -> BoxFuture<'a, Result<(), E>>,
        E: TransientError,
    {
        let mut report = MigrationReport {
            migration: self.name.to_string(),
            steps: Vec::new(),
        };
        for step in steps {
            match self.apply_step(&step, &mut apply).await {
                Ok(outcome) => report.steps.push(StepRecord {
                    operation_id: step.operation_id,
                    outcome: outcome.without_value(),
                }),
                Err(error) => {
                    return Err(MigrationError {
                        report,
                        operation_id: step.operation_id,
                        error,
                    })
                }
            }
        }
        tracing::info!(
            migration = %self.name,
            applied = report.applied(),
            skipped = report.skipped(),
            "migration run finished"
        );
        Ok(report)
    }

    /// Applies one step, unless it was applied before. See [`run`](Self::run).
    pub async fn apply_step<I, T, E, F>(
        &self,
        step: &MigrationStep<I>,
        mut apply: F,
    ) -> Result<StepOutcome<T>, StepError<E>>
    where
        F: for<'a> FnMut(&'a mut ClaimedMessage, &'a I) -> BoxFuture<'a, Result<T, E>>,
        E: TransientError,
    {
        let identity = self.identity(&step.operation_id);
        let span = tracing::info_span!(
            "inbox.migration_step",
            migration = %self.name,
            consumer = %identity.consumer(),
            operation_id = %identity.message_id(),
            outcome = tracing::field::Empty,
            attempts = tracing::field::Empty,
        );
        async move {
            let mut attempts = 1;
            let result = loop {
                let (kind, error) = match self.attempt(&identity, step, &mut apply).await {
                    Attempt::Done(Ok(StepOutcome::Applied { value, .. })) => {
                        break Ok(StepOutcome::Applied { value, attempts })
                    }
                    Attempt::Done(result) => break result,
                    Attempt::Transient(kind, error) => (kind, error),
                };
                if attempts >= self.retry.max_attempts() {
                    tracing::warn!(attempts, reason = %kind, "transient failures ran out of re-runs");
                    break Err(error);
                }
                let labels = self.inbox.metric_labels().of_consumer(&self.consumer);
                count_with(TRANSACTION_RETRIES, &labels, "reason", kind.as_str());
                tokio::time::sleep(self.retry.delay(attempts)).await;
                attempts += 1;
            };
            let outcome = match &result {
                Ok(outcome) => outcome.label(),
                Err(error) => error.label(),
            };
            let span = tracing::Span::current();
            span.record("outcome", outcome);
            span.record("attempts", attempts);
            tracing::info!(outcome, "migration step finished");
            count_with(
                MIGRATION_STEPS,
                &[Label::new("migration", self.name.to_string())],
                "outcome",
                outcome,
            );
            result
        }
        .instrument(span)
        .await
    }

    async fn attempt<I, T, E, F>(
        &self,
        identity: &MessageIdentity,
        step: &MigrationStep<I>,
        apply: &mut F,
    ) -> Attempt<T, E>
    where
        F: for<'a> FnMut(&'a mut ClaimedMessage, &'a I) -> BoxFuture<'a, Result<T, E>>,
        E: TransientError,
    {
        let claim = self
            .inbox
            .claim(
                identity.clone(),
                step.fingerprint,
                &self.handler_version,
                self.in_flight_wait,
            )
            .await;
        let mut message = match claim {
            Ok(Claim::Claimed(message)) => message,
            Ok(Claim::Duplicate(entry)) => {
                return Attempt::Done(Ok(StepOutcome::AlreadyApplied {
                    handler_version: entry.handler_version,
                }))
            }
            Ok(Claim::Conflict(entry)) => {
                return Attempt::Done(Err(self
                    .conflict(identity, step, entry.payload_sha256)
                    .await))
            }
            Ok(Claim::InProgress) => return Attempt::Done(Err(StepError::InProgress)),
            Err(err) => return inbox_failure(err),
        };
        let applied = apply(&mut message, &step.input).await;
        // A statement run through `message` that failed with 40001/40P01 aborted the
        // transaction even if the function went on and returned Ok.
        let watched = message.retry_reason();
        let err = match (applied, watched) {
            (Ok(value), None) => {
                return match message.commit(None).await {
                    Ok(()) => Attempt::Done(Ok(StepOutcome::Applied { value, attempts: 1 })),
                    Err(err) => inbox_failure(err),
                };
            }
            (Ok(_), Some(reason)) => StepError::Rerun(reason),
            (Err(err), _) => StepError::Failed(err),
        };
        if let Err(rollback) = message.rollback().await {
            // The pool discards the connection; the server rolls back on its own.
            tracing::warn!(error = %rollback, "rollback of a failed step failed");
        }
        let reason = match &err {
            StepError::Failed(failed) => failed.retry_reason().or(watched),
            _ => watched,
        };
        match reason {
            Some(reason) => Attempt::Transient(reason, err),
            None => Attempt::Done(Err(err)),
        }
    }

    async fn conflict<I, E>(
        &self,
        identity: &MessageIdentity,
        step: &MigrationStep<I>,
        recorded_sha256: String,
    ) -> StepError<E> {
        tracing::warn!(
            recorded_sha256 = %recorded_sha256,
            sha256 = %step.fingerprint,
            "migration step reused with a different input"
        );
        // The refusal does not depend on keeping the record; a failure to keep it is logged.
        if let Err(err) = self
            .inbox
            .record_conflict(identity, step.fingerprint, &self.handler_version)
            .await
        {
            tracing::error!(error = %err, "could not quarantine the migration step conflict");
        }
        StepError::Conflict {
            recorded_sha256,
            input_sha256: step.fingerprint.to_hex(),
        }
    }
}

fn inbox_failure<T, E>(err: InboxError) -> Attempt<T, E> {
    match err.retry_reason() {
        Some(kind) => Attempt::Transient(kind, StepError::Inbox(err)),
        None => Attempt::Done(Err(StepError::Inbox(err))),
    }
}
