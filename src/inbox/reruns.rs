//! The bound on re-running one message: transient conflicts and lost connections.

use std::time::Duration;

use sqlx::PgPool;

use super::{RetryReason, TransientRetry};

/// Counts the re-runs of one message and says whether another is allowed, and after what
/// delay.
///
/// Serialization failures, deadlocks and requested re-runs get the [`TransientRetry`]'s
/// attempts. A lost connection gets the pool's size on top: after a restart every idle
/// connection of the pool is dead, and each fails (and is closed) once, however many a run
/// meets in a row.
#[derive(Debug, Clone)]
pub(crate) struct Reruns {
    retry: TransientRetry,
    connection_budget: u32,
    conflicts: u32,
    lost: u32,
}

impl Reruns {
    pub(crate) fn new(retry: TransientRetry, pool: &PgPool) -> Self {
        Self {
            retry,
            connection_budget: retry
                .max_attempts()
                .saturating_add(pool.options().get_max_connections()),
            conflicts: 0,
            lost: 0,
        }
    }

    /// Counts a run that ended for `reason`: the delay before the next run, or `None` when
    /// the budget for `reason` is spent.
    pub(crate) fn next(&mut self, reason: RetryReason) -> Option<Duration> {
        if reason == RetryReason::ConnectionLost {
            self.lost += 1;
            (self.lost < self.connection_budget)
                .then(|| self.retry.delay(self.lost.min(self.retry.max_attempts())))
        } else {
            self.conflicts += 1;
            (self.conflicts < self.retry.max_attempts()).then(|| self.retry.delay(self.conflicts))
        }
    }

    /// Runs that ended in a serialization failure, deadlock or requested re-run.
    pub(crate) fn conflicts(&self) -> u32 {
        self.conflicts
    }

    /// Runs that lost their connection.
    pub(crate) fn lost(&self) -> u32 {
        self.lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn conflicts_and_lost_connections_have_budgets_of_their_own() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy("postgres://nobody@127.0.0.1:1/x")
            .unwrap();
        let retry = TransientRetry::new(3, Duration::ZERO, Duration::ZERO);
        let mut reruns = Reruns::new(retry, &pool);
        assert!(reruns.next(RetryReason::Deadlock).is_some());
        assert!(reruns.next(RetryReason::SerializationFailure).is_some());
        assert!(
            reruns.next(RetryReason::Requested).is_none(),
            "3 attempts in all"
        );
        // 3 + 4 runs may lose their connection, whatever the conflicts did.
        for _ in 0..6 {
            assert!(reruns.next(RetryReason::ConnectionLost).is_some());
        }
        assert!(reruns.next(RetryReason::ConnectionLost).is_none());
        assert_eq!((reruns.conflicts(), reruns.lost()), (3, 7));
    }
}
