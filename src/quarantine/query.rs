//! The operator's reads of the quarantine: items by state, reason and consumer, with the
//! filters before the limit, and the latest item about an effect.

use super::{item_from_row, sql, Quarantine, QuarantineError, QuarantineItem};

/// Which items [`Quarantine::query`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantineQuery {
    /// Open, decided, or all.
    pub state: QuarantineState,
    /// Only items with this reason code (`payload-mismatch`, `http-404`, ...) or source
    /// (`identity-conflict`, ...).
    pub reason: Option<String>,
    /// Only items of this consumer.
    pub consumer: Option<String>,
}

/// An item's state, for [`QuarantineQuery`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuarantineState {
    /// No decision yet.
    Open,
    /// Repaired or discarded.
    Decided,
    /// Either.
    All,
}

impl Quarantine {
    /// The newest item about the effect `effect_id`, open or decided: for a dead effect,
    /// what [`repair`](Self::repair) sends back to the outbox, or who decided it before.
    pub async fn latest_for_effect(
        &self,
        effect_id: &str,
    ) -> Result<Option<QuarantineItem>, QuarantineError> {
        let sql = self.schema.sql(sql::LATEST_FOR_EFFECT);
        let row = sqlx::query(&sql)
            .bind(effect_id)
            .fetch_optional(self.db())
            .await
            .map_err(QuarantineError::from)?;
        row.as_ref().map(item_from_row).transpose()
    }

    /// Up to `limit` items matching `query`, the filters applied before the limit: open
    /// items oldest first, decided or all newest first.
    pub async fn query(
        &self,
        query: &QuarantineQuery,
        limit: i64,
    ) -> Result<Vec<QuarantineItem>, QuarantineError> {
        let sql = self.schema.sql(sql::LIST_MATCHING);
        let state = match query.state {
            QuarantineState::Open => "open",
            QuarantineState::Decided => "decided",
            QuarantineState::All => "all",
        };
        let rows = sqlx::query(&sql)
            .bind(limit)
            .bind(state)
            .bind(query.reason.as_deref())
            .bind(query.consumer.as_deref())
            .fetch_all(self.db())
            .await
            .map_err(QuarantineError::from)?;
        rows.iter().map(item_from_row).collect()
    }
}
