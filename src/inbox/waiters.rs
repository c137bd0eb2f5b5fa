//! Claims waiting for an original in flight, one poller per key.
//!
//! A duplicate of a command still in flight waits for it in this process. However many
//! duplicates of one key arrive, one of them polls the database (one pooled connection, and
//! only while a poll runs); the others follow its result. The number of keys polled at once
//! is capped, so a storm of retries cannot take the pool from other work: past the cap a
//! duplicate is told "in progress" at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

use super::{ClaimLock, InboxEntry};

/// Where a key stands after waiting for an original in flight.
#[derive(Debug, Clone)]
pub(crate) enum Settled {
    /// A committed row holds it.
    Held(InboxEntry),
    /// Nothing holds it: the original rolled back (or never was).
    Free,
    /// Still in flight when the wait ran out.
    Busy,
}

/// The keys being waited on, and how many claims wait.
#[derive(Debug)]
pub(crate) struct Waiters {
    polled: Mutex<HashMap<ClaimLock, watch::Receiver<Option<Settled>>>>,
    limit: usize,
    waiting: AtomicUsize,
}

/// What a claim that has to wait does.
pub(crate) enum Role {
    /// Another claim polls this key: wait for its result.
    Follow(watch::Receiver<Option<Settled>>),
    /// Poll the key, and publish the result through the guard.
    Poll(Poller),
    /// As many keys as allowed are polled already: do not wait.
    Full,
}

impl Waiters {
    /// At most `limit` keys polled at once (at least one).
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            polled: Mutex::new(HashMap::new()),
            limit: limit.max(1),
            waiting: AtomicUsize::new(0),
        }
    }

    /// The most keys polled at once.
    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Claims waiting right now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Counts a waiting claim until the guard is dropped.
    pub(crate) fn count(self: &Arc<Self>) -> Counted {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        Counted(self.clone())
    }

    /// The result of `lock`'s poller, if another claim polls it now.
    pub(crate) fn following(&self, lock: ClaimLock) -> Option<watch::Receiver<Option<Settled>>> {
        let polled = self.polled.lock().unwrap_or_else(PoisonError::into_inner);
        polled
            .get(&lock)
            .filter(|rx| rx.has_changed().is_ok())
            .cloned()
    }

    /// Follows `lock`'s poller, or becomes it if there is none and the cap allows.
    pub(crate) fn join(self: &Arc<Self>, lock: ClaimLock) -> Role {
        let mut polled = self.polled.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(rx) = polled.get(&lock) {
            // A poller that went away without a result leaves a closed channel behind.
            if rx.has_changed().is_ok() {
                return Role::Follow(rx.clone());
            }
            polled.remove(&lock);
        }
        if polled.len() >= self.limit {
            return Role::Full;
        }
        let (tx, rx) = watch::channel(None);
        polled.insert(lock, rx);
        Role::Poll(Poller {
            waiters: self.clone(),
            lock,
            tx,
        })
    }
}

/// The claim that polls a key. Dropped, it gives the key up: followers of a poller that
/// failed see its channel close and join again.
pub(crate) struct Poller {
    waiters: Arc<Waiters>,
    lock: ClaimLock,
    tx: watch::Sender<Option<Settled>>,
}

impl Poller {
    /// Tells the followers where the key stands.
    pub(crate) fn publish(self, settled: &Settled) {
        self.tx.send_replace(Some(settled.clone()));
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        let mut polled = self
            .waiters
            .polled
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Only this poller's own entry: a later poller of the key may have replaced it.
        if polled
            .get(&self.lock)
            .is_some_and(|rx| rx.same_channel(&self.tx.subscribe()))
        {
            polled.remove(&self.lock);
        }
    }
}

/// A claim counted as waiting while this lives.
pub(crate) struct Counted(Arc<Waiters>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lock(n: i32) -> ClaimLock {
        ClaimLock(n, n)
    }

    #[test]
    fn one_poller_per_key_and_followers_behind_it() {
        let waiters = Arc::new(Waiters::new(2));
        let Role::Poll(poller) = waiters.join(lock(1)) else {
            panic!("the first claim polls");
        };
        let Role::Follow(mut follower) = waiters.join(lock(1)) else {
            panic!("the second follows");
        };
        assert!(waiters.following(lock(1)).is_some());
        poller.publish(&Settled::Free);
        assert!(matches!(*follower.borrow_and_update(), Some(Settled::Free)));
        // The key is free again for a new poller.
        assert!(waiters.following(lock(1)).is_none());
        assert!(matches!(waiters.join(lock(1)), Role::Poll(_)));
    }

    #[test]
    fn past_the_cap_a_claim_does_not_wait() {
        let waiters = Arc::new(Waiters::new(1));
        let first = waiters.join(lock(1));
        assert!(matches!(first, Role::Poll(_)));
        assert!(matches!(waiters.join(lock(2)), Role::Full));
        // Duplicates of the polled key still follow: they add no connection.
        assert!(matches!(waiters.join(lock(1)), Role::Follow(_)));
        drop(first);
        assert!(matches!(waiters.join(lock(2)), Role::Poll(_)));
    }

    #[test]
    fn followers_of_a_poller_that_went_away_see_it_closed() {
        let waiters = Arc::new(Waiters::new(4));
        let poller = waiters.join(lock(1));
        let Role::Follow(follower) = waiters.join(lock(1)) else {
            panic!("follows");
        };
        drop(poller);
        assert!(follower.has_changed().is_err(), "closed");
        assert!(matches!(waiters.join(lock(1)), Role::Poll(_)));
    }

    #[test]
    fn waiting_claims_are_counted_while_they_wait() {
        let waiters = Arc::new(Waiters::new(4));
        let a = waiters.count();
        let b = waiters.count();
        assert_eq!(waiters.waiting(), 2);
        drop(a);
        drop(b);
        assert_eq!(waiters.waiting(), 0);
    }
}
