//! The handler's side: [`InboxTx`], the claimed transaction (an axum extractor with the `axum`
//! feature, taken from the request's extensions by any other Tower service).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use crate::identity::MessageIdentity;
use crate::inbox::{ClaimedMessage, RetryReason};
use crate::problem::{Problem, ProblemKind};

/// Where the layer parks the claimed transaction while the handler runs.
///
/// The handler borrows it through [`InboxTx`] (holding the mutex); afterwards the layer takes
/// it back with `try_lock`. A handle that outlives the handler keeps the mutex locked, which
/// is how the layer knows the transaction leaked and must not be committed.
#[derive(Clone)]
pub(crate) struct TxSlot(Arc<Mutex<Option<ClaimedMessage>>>);

impl TxSlot {
    pub(crate) fn new(message: ClaimedMessage) -> Self {
        Self(Arc::new(Mutex::new(Some(message))))
    }

    /// Takes the transaction back, or `None` when a handle to it is still alive.
    pub(crate) fn take(&self) -> Option<ClaimedMessage> {
        self.0.try_lock().ok()?.take()
    }

    /// Why the transaction must be re-run, if it must; `None` also when a handle to it is
    /// still alive (the leak is handled on its own).
    pub(crate) fn retry_reason(&self) -> Option<RetryReason> {
        self.0.try_lock().ok()?.as_ref()?.retry_reason()
    }
}

/// The transaction the inbox layer claimed the request's message in.
///
/// Run the business writes on it and they commit atomically with the claim and the recorded
/// response, or not at all. `&mut *tx` is an sqlx executor:
///
/// ```
/// use axum::{extract::Path, http::StatusCode, Json};
/// use tower_inbox::InboxTx;
///
/// async fn credit(
///     Path(account): Path<String>,
///     mut tx: InboxTx,
///     Json(delta): Json<i64>,
/// ) -> Result<StatusCode, StatusCode> {
///     sqlx::query("update account set balance = balance + $1 where id = $2")
///         .bind(delta)
///         .bind(&account)
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok(StatusCode::CREATED)
/// }
/// ```
///
/// Do not commit, roll back or keep it: the layer decides from the response status, and a
/// handle still alive after the handler answered makes the layer roll back and answer `500`.
///
/// **Serialization failures and deadlocks.** Statements run through `&mut *tx` are watched:
/// when one fails with `40001` or `40P01`, the layer rolls the transaction back and runs the
/// handler again with the same request (bounded by
/// [`transient_retry`](crate::InboxLayerBuilder::transient_retry)), whatever the handler
/// answered. Code that takes a plain [`PgConnection`](sqlx::PgConnection) gets it through
/// [`with_connection`](ClaimedMessage::with_connection), which watches the error it returns;
/// there is no other way to the connection. [`request_retry`](ClaimedMessage::request_retry)
/// asks for a re-run explicitly.
///
/// Extracting it on a request the layer did not claim (no layer, an unguarded method, an
/// optional key that was absent) is rejected with a `500` problem saying so. Use
/// `Option<InboxTx>` where that is expected.
pub struct InboxTx {
    guard: OwnedMappedMutexGuard<Option<ClaimedMessage>, ClaimedMessage>,
}

impl InboxTx {
    /// The identity of the claimed message, e.g. to store with a ledger row.
    pub fn identity(&self) -> &MessageIdentity {
        self.guard.identity()
    }

    fn from_slot(slot: &TxSlot) -> Result<Self, Problem> {
        let guard: OwnedMutexGuard<_> = slot.0.clone().try_lock_owned().map_err(|_| {
            Problem::new(
                ProblemKind::TransactionInUse,
                "the inbox transaction was already extracted for this request",
            )
        })?;
        let guard = OwnedMutexGuard::try_map(guard, Option::as_mut).map_err(|_| {
            Problem::new(
                ProblemKind::TransactionInUse,
                "the inbox transaction for this request has already ended",
            )
        })?;
        Ok(Self { guard })
    }
}

impl InboxTx {
    /// The claimed transaction from a request's extensions, for handlers that are plain
    /// Tower services rather than axum handlers: `Ok(None)` when the layer did not claim the
    /// request (an unguarded method, an optional key that was absent), an error when the
    /// transaction was taken already or has ended.
    ///
    /// ```
    /// use tower_inbox::InboxTx;
    ///
    /// let request = http::Request::new(());
    /// assert!(InboxTx::from_extensions(request.extensions()).unwrap().is_none());
    /// ```
    pub fn from_extensions(extensions: &http::Extensions) -> Result<Option<Self>, Problem> {
        match extensions.get::<TxSlot>() {
            None => Ok(None),
            Some(slot) => Self::from_slot(slot).map(Some),
        }
    }
}

impl std::fmt::Debug for InboxTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxTx")
            .field("identity", self.identity())
            .finish_non_exhaustive()
    }
}

impl Deref for InboxTx {
    type Target = ClaimedMessage;

    fn deref(&self) -> &ClaimedMessage {
        &self.guard
    }
}

impl DerefMut for InboxTx {
    fn deref_mut(&mut self) -> &mut ClaimedMessage {
        &mut self.guard
    }
}

#[cfg(feature = "axum")]
mod axum_extractor {
    //! `InboxTx` as an axum extractor.

    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use http::request::Parts;

    use super::InboxTx;
    use crate::problem::{Problem, ProblemKind};

    fn layer_missing() -> Problem {
        Problem::new(
            ProblemKind::LayerMissing,
            "this handler needs the inbox transaction, but the request was not claimed by \
             InboxLayer: install the layer on this route, guard this method, or require the \
             Idempotency-Key (or extract Option<InboxTx>)",
        )
    }

    impl<S: Send + Sync> FromRequestParts<S> for InboxTx {
        type Rejection = Problem;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            InboxTx::from_extensions(&parts.extensions)?.ok_or_else(layer_missing)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for InboxTx {
        type Rejection = Problem;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            InboxTx::from_extensions(&parts.extensions)
        }
    }
}
