//! Replay policies: what happens to old messages when the handler changes.
//!
//! After a bug fix a team may want old messages to go through the new handler. The inbox
//! rightly calls them duplicates. Pick one policy, on purpose:
//!
//! * [`ReplayPolicy::NoReapplication`] (the default): a duplicate stays a duplicate whatever
//!   handler version recorded it. Rebuild derived state elsewhere.
//! * [`ReplayPolicy::VersionedProjection`]: the handler version is part of the consumer
//!   identity, so a new version applies each message once more, exactly once.
//!
//! Never delete inbox rows to make a replay happen: that also reopens the door to ordinary
//! redelivery of those messages.

/// How the inbox treats a message that an earlier handler version already processed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayPolicy {
    /// A duplicate stays a duplicate whatever handler version recorded it (the default).
    #[default]
    NoReapplication,
    /// The handler version is part of the consumer identity: each version applies each
    /// message once. The stored consumer name is `<consumer>@<version>`; the version may not
    /// contain `@`, so the two parts always split apart again.
    VersionedProjection,
}

impl ReplayPolicy {
    /// The consumer name claims are made under for `consumer` running `handler_version`.
    ///
    /// ```
    /// use tower_inbox::replay::ReplayPolicy;
    /// assert_eq!(ReplayPolicy::NoReapplication.consumer_name("proj", "v2"), "proj");
    /// assert_eq!(ReplayPolicy::VersionedProjection.consumer_name("proj", "v2"), "proj@v2");
    /// ```
    pub fn consumer_name(self, consumer: &str, handler_version: &str) -> String {
        match self {
            Self::NoReapplication => consumer.to_owned(),
            Self::VersionedProjection => format!("{consumer}@{handler_version}"),
        }
    }

    /// Whether `handler_version` can be used with this policy.
    pub(crate) fn accepts_version(self, handler_version: &str) -> bool {
        match self {
            Self::NoReapplication => true,
            Self::VersionedProjection => !handler_version.contains('@'),
        }
    }
}
