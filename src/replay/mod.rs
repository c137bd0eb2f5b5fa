//! Replay policies: what happens to old messages when the handler changes.
//!
//! After a bug fix a team may want old messages to go through the new handler. The inbox
//! rightly calls them duplicates: the identity `(consumer, producer, message ID)` was
//! claimed, and the invariant (at most one committed domain transition per consumer and
//! producer intent) forbids applying them again. Pick one of three policies, on purpose:
//!
//! | policy | what a new handler version does with old messages | use it for |
//! |---|---|---|
//! | [`ReplayPolicy::NoReapplication`] (default) | nothing: a duplicate stays a duplicate whatever version recorded it | commands and every consumer with side effects (money, stock, e-mails, outbox effects); rebuild derived state elsewhere |
//! | [`ReplayPolicy::VersionedProjection`] | applies each message once more, exactly once per version: the version is part of the consumer identity | idempotent derived read models (projections) that a new version rebuilds from the message history into its own tables |
//! | [`CompensatedMigration`] | nothing by itself; explicit compensation steps, each claimed under its own operation ID | correcting what a buggy version already did, with steps that can be reviewed and that apply exactly once |
//!
//! The first two are a setting of the consumer's identity, so they are a [`ReplayPolicy`]
//! (on the layer with [`InboxLayerBuilder::replay_policy`](crate::InboxLayerBuilder::replay_policy),
//! or through [`ReplayPolicy::consumer_name`] for a consumer that claims with [`Inbox`]
//! directly). The third is not a setting: it is a one-off operation someone runs, so it is a
//! type of its own, [`CompensatedMigration`].
//!
//! ## No reapplication (the default)
//!
//! A new handler version answers every redelivery of an old message from the record, and
//! processes only new messages. This is the only safe choice where applying a message has an
//! effect outside the consumer's own derived data: a command that credits an account must
//! never credit it again because the code changed. If a derived read model is wrong, rebuild
//! it elsewhere (from the source of truth, or with a versioned projection), and correct the
//! effects with a compensated migration.
//!
//! ```no_run
//! use tower_inbox::{producer::TrustedHeader, InboxLayer};
//!
//! # fn build(pool: sqlx::PgPool) -> Result<InboxLayer, tower_inbox::middleware::ConfigError> {
//! // Version 2 of the credits service: commands that version 1 processed stay answered
//! // from the record; new ones are processed (and recorded) by version 2.
//! let layer = InboxLayer::builder(pool, "credits")
//!     .producer(TrustedHeader::new("x-producer"))
//!     .handler_version("2")
//!     .build()?;
//! # Ok(layer) }
//! ```
//!
//! ## Versioned projection
//!
//! The consumer name claims are made under becomes `<consumer>@<version>`. A new version is a
//! new consumer: replaying the whole history through it applies each message once, and a
//! redelivery during or after that replay is a duplicate again, for that version. The old
//! version's rows are untouched, so both versions can run side by side during a deploy, each
//! writing its own projection (keep them apart: a table or a column per version).
//!
//! Only for idempotent derived data: every version applies every message, so any effect
//! beyond the projection would happen once per version.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_inbox::replay::ReplayPolicy;
//! use tower_inbox::{MessageIdentity, MessageKey, Producer};
//! use tower_inbox::inbox::{Claim, Inbox};
//! use tower_inbox::fingerprint::{Fingerprint};
//!
//! # async fn project(pool: sqlx::PgPool, id: &str, body: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! const VERSION: &str = "2";
//! // Checked once at start-up: "balance-projection@2".
//! let consumer = ReplayPolicy::VersionedProjection.consumer_name("balance-projection", VERSION)?;
//! let inbox = Inbox::new(pool);
//! let identity = MessageIdentity::new(
//!     consumer.as_str(),
//!     Producer::new("credits")?,
//!     MessageKey::new(id)?,
//! );
//! match inbox
//!     .claim(identity, Fingerprint::of_bytes(body), VERSION, Duration::from_secs(1))
//!     .await?
//! {
//!     Claim::Claimed(mut message) => {
//!         sqlx::query("insert into balance_projection_v2 (message_id) values ($1)")
//!             .bind(id)
//!             .execute(&mut message)
//!             .await?;
//!         message.commit(None).await?;
//!     }
//!     Claim::Duplicate(_) => { /* version 2 applied it already: acknowledge */ }
//!     Claim::Conflict(_) | Claim::InProgress => { /* as for any message */ }
//! }
//! # Ok(()) }
//! ```
//!
//! Through the layer: `.replay_policy(ReplayPolicy::VersionedProjection).handler_version("2")`.
//!
//! ## Compensated migration
//!
//! A buggy version already committed wrong effects, and its messages are (rightly)
//! duplicates. Do not replay them: write the correction as a [`CompensatedMigration`], a named
//! list of steps, each with an operation ID chosen by the author and an input. Each step is
//! claimed in the inbox under its own identity, in the transaction that makes its writes, so
//! a step is itself exactly-once: a run that stopped halfway is simply run again, and applies
//! only the steps that did not commit. See [`CompensatedMigration`] for an example.
//!
//! ## Never delete inbox rows to force a replay
//!
//! Deleting the inbox rows of old messages so that a new version processes them again looks
//! like a shortcut to a replay. It is wrong:
//!
//! * it reopens the door to ordinary redelivery: for as long as the rows are gone, any
//!   broker redelivery (a lost acknowledgement, an offset rewind, a dead-letter redrive) or
//!   client retry of those messages is new again, and is applied again on top of the effect
//!   that already happened;
//! * it is not exactly-once: the original effect stays, so each message is applied a second
//!   time under the same identity, by whichever of the replay or a redelivery comes first;
//!   and the recorded responses that clients retry against are gone;
//! * it leaves no record of what was re-applied, by which version, and why.
//!
//! Use a versioned projection (a new identity, so the old records stay) or a compensated
//! migration (new identities for the corrections) instead.
//!
//! [`Inbox`]: crate::inbox::Inbox

mod migration;
mod transient;

pub use migration::{
    CompensatedMigration, CompensatedMigrationBuilder, MigrationDefinitionError, MigrationError,
    MigrationReport, MigrationStep, StepError, StepOutcome, StepRecord, MIGRATION_PRODUCER_PREFIX,
};
pub use transient::TransientError;

use crate::identity::{is_consumer_name, is_handler_version};

/// How the inbox treats a message that an earlier handler version already processed.
///
/// The third policy, the compensated migration, is not a variant: it is an operation run on
/// purpose, not a setting of a consumer. See [`CompensatedMigration`] and the
/// [module docs](self) for when to use which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayPolicy {
    /// A duplicate stays a duplicate whatever handler version recorded it (the default).
    #[default]
    NoReapplication,
    /// The handler version is part of the consumer identity: each version applies each
    /// message once. The stored consumer name is `<consumer>@<version>`; the version may not
    /// contain `@`, so the two parts always split apart again at the last `@`.
    VersionedProjection,
}

/// A consumer name or handler version that cannot make a consumer identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConsumerNameError {
    /// The consumer name is not 1 to 255 bytes of ASCII letters, digits and `-`, `_`, `.`,
    /// `:`, `/`, `@` (with the version, for a versioned projection: also at most 255 bytes).
    #[error("the consumer name must be 1 to 255 bytes of ASCII letters, digits and '-', '_', '.', ':', '/', '@' (with '@' and the version, for a versioned projection)")]
    BadConsumerName,
    /// The handler version is not 1 to 255 visible ASCII characters, or contains `@` under
    /// [`ReplayPolicy::VersionedProjection`].
    #[error("the handler version must be 1 to 255 visible ASCII characters ('!' to '~'), without '@' for a versioned projection")]
    BadHandlerVersion,
}

impl ReplayPolicy {
    /// The consumer name claims are made under for `consumer` running `handler_version`.
    ///
    /// A consumer that claims with [`Inbox`](crate::inbox::Inbox) directly calls this once at
    /// start-up and builds every [`MessageIdentity`](crate::MessageIdentity) with the result,
    /// exactly as the layer does.
    ///
    /// ```
    /// use tower_inbox::replay::{ConsumerNameError, ReplayPolicy};
    ///
    /// let plain = ReplayPolicy::NoReapplication.consumer_name("proj", "v2");
    /// assert_eq!(plain.as_deref(), Ok("proj"));
    /// let versioned = ReplayPolicy::VersionedProjection.consumer_name("proj", "v2");
    /// assert_eq!(versioned.as_deref(), Ok("proj@v2"));
    /// assert_eq!(
    ///     ReplayPolicy::VersionedProjection.consumer_name("proj", "v@2"),
    ///     Err(ConsumerNameError::BadHandlerVersion),
    /// );
    /// ```
    pub fn consumer_name(
        self,
        consumer: &str,
        handler_version: &str,
    ) -> Result<String, ConsumerNameError> {
        if !is_handler_version(handler_version) {
            return Err(ConsumerNameError::BadHandlerVersion);
        }
        if !is_consumer_name(consumer) {
            return Err(ConsumerNameError::BadConsumerName);
        }
        let name = match self {
            Self::NoReapplication => consumer.to_owned(),
            Self::VersionedProjection if handler_version.contains('@') => {
                return Err(ConsumerNameError::BadHandlerVersion);
            }
            Self::VersionedProjection => format!("{consumer}@{handler_version}"),
        };
        if name.len() <= 255 {
            Ok(name)
        } else {
            Err(ConsumerNameError::BadConsumerName)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_names_split_back_at_the_last_at_sign() {
        let name = ReplayPolicy::VersionedProjection
            .consumer_name("team@proj", "2026-12")
            .unwrap();
        assert_eq!(name.rsplit_once('@'), Some(("team@proj", "2026-12")));
    }

    #[test]
    fn bad_parts_are_refused_under_both_policies() {
        for policy in [
            ReplayPolicy::NoReapplication,
            ReplayPolicy::VersionedProjection,
        ] {
            assert_eq!(
                policy.consumer_name("", "1"),
                Err(ConsumerNameError::BadConsumerName)
            );
            assert_eq!(
                policy.consumer_name("c", ""),
                Err(ConsumerNameError::BadHandlerVersion)
            );
            assert_eq!(
                policy.consumer_name("c", "1\n"),
                Err(ConsumerNameError::BadHandlerVersion)
            );
            assert_eq!(
                policy.consumer_name("c", "version 2"),
                Err(ConsumerNameError::BadHandlerVersion)
            );
            for bad in ["credits service", "crédits", "a;b", "a\tb", "a'b"] {
                assert_eq!(
                    policy.consumer_name(bad, "1"),
                    Err(ConsumerNameError::BadConsumerName),
                    "{bad:?}"
                );
            }
            assert!(policy.consumer_name("team/credits.v2:eu-1_a", "1").is_ok());
        }
        // The plain policy never splits the name, so '@' is just a character there.
        assert_eq!(
            ReplayPolicy::NoReapplication.consumer_name("c", "v@2"),
            Ok("c".to_owned())
        );
        let long = "c".repeat(254);
        assert!(ReplayPolicy::NoReapplication
            .consumer_name(&long, "12")
            .is_ok());
        assert_eq!(
            ReplayPolicy::VersionedProjection.consumer_name(&long, "12"),
            Err(ConsumerNameError::BadConsumerName)
        );
    }
}
