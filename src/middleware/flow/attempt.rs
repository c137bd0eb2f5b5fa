//! Attempts that roll back: counted toward the quarantine, even when the client left.

use super::Command;
use crate::extract::TxSlot;
use crate::fingerprint::Fingerprint;
use crate::identity::MessageIdentity;
use crate::inbox::{ClaimedMessage, Inbox};
use std::sync::Arc;

/// Counts a failed attempt unless it is finished normally; dropped unfinished (the client
/// went away mid-handler), it counts one from a spawned task.
pub(super) struct Attempt {
    inbox: Inbox,
    identity: MessageIdentity,
    fingerprint: Fingerprint,
    handler_version: Arc<str>,
    quarantine_after: u32,
    armed: bool,
    /// The attempt's transaction, rolled back before a drop counts the failure: the count
    /// finds the key's claim lock held while the transaction is open, and then opens no
    /// quarantine item (`Inbox::record_failure`).
    slot: Option<TxSlot>,
}

impl Attempt {
    pub(super) fn new(command: &Command) -> Self {
        Self {
            inbox: command.config.inbox.clone(),
            identity: command.identity.clone(),
            fingerprint: command.fingerprint,
            handler_version: command.config.handler_version.clone(),
            quarantine_after: command.config.quarantine_after,
            armed: true,
            slot: None,
        }
    }

    /// An attempt running on `slot`'s transaction.
    pub(super) fn on(mut self, slot: &TxSlot) -> Self {
        self.slot = Some(slot.clone());
        self
    }

    pub(super) fn finish(mut self) {
        self.armed = false;
    }

    /// What a failure of this attempt is recorded with, without counting one on drop.
    pub(super) fn disarm(mut self) -> FailedAttempt {
        self.armed = false;
        self.failure()
    }

    pub(super) async fn failed(mut self, reason: &'static str) {
        self.armed = false;
        record_failure(self.failure(), reason).await;
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let failure = self.failure();
        let slot = self.slot.take();
        runtime.spawn(async move {
            if let Some(slot) = slot {
                roll_back(&slot).await;
            }
            record_failure(failure, "client-gone").await;
        });
    }
}

/// What a failed attempt is recorded with; owned, so a spawned task can take it.
pub(super) struct FailedAttempt {
    inbox: Inbox,
    identity: MessageIdentity,
    fingerprint: Fingerprint,
    handler_version: Arc<str>,
    quarantine_after: u32,
}

impl Attempt {
    pub(super) fn failure(&self) -> FailedAttempt {
        FailedAttempt {
            inbox: self.inbox.clone(),
            identity: self.identity.clone(),
            fingerprint: self.fingerprint,
            handler_version: self.handler_version.clone(),
            quarantine_after: self.quarantine_after,
        }
    }
}

pub(super) async fn record_failure(f: FailedAttempt, reason: &'static str) {
    let (consumer, message_id) = (f.identity.consumer(), f.identity.message_id());
    tracing::warn!(consumer, %message_id, reason, "attempt rolled back");
    let recorded = f
        .inbox
        .record_failure(
            &f.identity,
            f.fingerprint,
            &f.handler_version,
            reason,
            f.quarantine_after,
        )
        .await;
    match recorded {
        Ok(Some(item)) => {
            tracing::warn!(consumer, %message_id, item, "command quarantined after repeated failures");
        }
        Ok(None) => {}
        Err(err) => {
            tracing::error!(consumer, %message_id, error = %err, "could not count the failed attempt");
        }
    }
}

pub(super) async fn roll_back(slot: &TxSlot) {
    // None means a leaked handle still holds the transaction; it rolls back when dropped.
    if let Some(message) = slot.take() {
        discard(message).await;
    }
}

pub(super) async fn discard(message: ClaimedMessage) {
    if let Err(err) = message.rollback().await {
        // The connection is discarded by the pool; the server rolls back on its own.
        tracing::warn!(error = %err, "rollback failed");
    }
}
