//! One effect's delivery: the send under its own lease, and the recording of what came of it.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use sqlx::postgres::PgRow;
use sqlx::Row;
use tracing::Instrument;

use super::{DispatchReport, Dispatcher};
use crate::metrics as m;
use crate::metrics::{quarantine_moved, quarantine_recovered};
use crate::outbox::{sql, Effect, EffectId, OutboxError};
use crate::outbox::{Delivery, Transport};
use crate::quarantine::{effect_item_key, QuarantineSource};
use crate::retry::jittered;

impl<T: Transport> Dispatcher<T> {
    pub(super) async fn deliver_one(
        &self,
        mut effect: Effect,
        token: &str,
        stopping: &AtomicBool,
    ) -> DispatchReport {
        let mut report = DispatchReport::default();
        if stopping.load(Ordering::SeqCst) {
            match self
                .record(
                    &self.settings.schema.sql(sql::RELEASE),
                    &effect.effect_id,
                    token,
                    |q| q,
                )
                .await
            {
                Ok(1) => report.released = 1,
                _ => report.unrecorded = 1,
            }
            report.count_deliveries(&effect.effect_name);
            return report;
        }
        // The batch was leased before the deliveries queued ahead of this one: renew the lease
        // now so that it covers this send and its recording, unless another dispatcher took the
        // effect in the meantime.
        let started: Result<Option<i32>, _> =
            sqlx::query_scalar(&self.settings.schema.sql(sql::START))
                .bind(effect.effect_id.as_str())
                .bind(token)
                .bind(self.settings.lease.as_secs_f64())
                .fetch_optional(self.db())
                .await;
        match started {
            Ok(Some(attempt)) => effect.attempt = attempt,
            Ok(None) => {
                tracing::debug!(effect_id = %effect.effect_id, "lease lost before the send; another dispatcher delivers the effect");
                report.lost = 1;
            }
            Err(err) => {
                tracing::warn!(effect_id = %effect.effect_id, error = %err, "could not begin the delivery; the effect is due again when its lease runs out");
                report.unrecorded = 1;
            }
        }
        if report.lost + report.unrecorded > 0 {
            report.count_deliveries(&effect.effect_name);
            return report;
        }
        let span = tracing::debug_span!(
            "outbox.deliver",
            effect_id = %effect.effect_id,
            effect = %effect.effect_name,
            attempt = effect.attempt,
            outcome = tracing::field::Empty,
        );
        self.attempt(effect, token, report).instrument(span).await
    }

    pub(super) async fn attempt(
        &self,
        effect: Effect,
        token: &str,
        mut report: DispatchReport,
    ) -> DispatchReport {
        let span = tracing::Span::current();
        // The call is made inside the guarded future so that a transport panicking before it
        // returns its future is caught too.
        let call = AssertUnwindSafe(async { self.transport.deliver(&effect).await }).catch_unwind();
        let delivery = match tokio::time::timeout(self.settings.delivery_timeout, call).await {
            Ok(Ok(delivery)) => delivery.storable(),
            // The payload is not logged: a panic message can hold anything the transport had.
            Ok(Err(_panic)) => {
                tracing::warn!(effect_id = %effect.effect_id, "the transport panicked; counted as a failed attempt");
                Delivery::Retry {
                    status: None,
                    error: "the transport panicked".to_owned(),
                }
            }
            Err(_) => Delivery::Retry {
                status: None,
                error: format!(
                    "no answer within {:?}; the outcome is unknown",
                    self.settings.delivery_timeout
                ),
            },
        };
        let id = &effect.effect_id;
        // Quarantine items this delivery recovered: more than one when an earlier repair's
        // redelivery died again and opened a second item before this one succeeded.
        let mut recovered_items = 0;
        let recorded = match delivery {
            Delivery::Delivered { status, result } => {
                span.record("outcome", "delivered");
                let row = sqlx::query(&self.settings.schema.sql(sql::DELIVERED))
                    .bind(id.as_str())
                    .bind(token)
                    .bind(status.map(i32::from))
                    .bind(result)
                    .bind(effect_item_key(id.as_str()))
                    .fetch_one(self.db())
                    .await;
                match row {
                    Ok(row) => {
                        let delivered: i64 = row.try_get("delivered").unwrap_or(0);
                        let recovered: i64 = row.try_get("recovered").unwrap_or(0);
                        report.delivered = usize::from(delivered == 1);
                        report.recovered = usize::from(recovered > 0);
                        recovered_items = recovered.unsigned_abs();
                        Ok(delivered)
                    }
                    Err(err) => Err(err),
                }
            }
            Delivery::Retry { status, error } if effect.attempt < self.settings.max_attempts => {
                span.record("outcome", "retry");
                let delay = self.backoff(effect.attempt);
                tracing::info!(effect_id = %id, attempt = effect.attempt, ?delay, status, error = loggable(status, &error), "delivery failed; retrying");
                let done = self
                    .record(&self.settings.schema.sql(sql::RETRY), id, token, |q| {
                        q.bind(delay.as_secs_f64())
                            .bind(error)
                            .bind(status.map(i32::from))
                    })
                    .await;
                report.retried = usize::from(matches!(done, Ok(1)));
                done.map(|n| n as i64)
            }
            Delivery::Retry { status, error } => {
                span.record("outcome", "dead");
                let reason = "attempts-exhausted".to_owned();
                self.dead(&effect, token, status, error, reason, &mut report)
                    .await
            }
            Delivery::Permanent {
                status,
                reason_code,
                error,
            } => {
                span.record("outcome", "dead");
                self.dead(&effect, token, status, error, reason_code, &mut report)
                    .await
            }
        };
        match recorded {
            Ok(0) => {
                tracing::warn!(effect_id = %id, "lease expired before the outcome was recorded; another attempt follows");
                report.unrecorded = 1;
            }
            Ok(_) => {}
            Err(err) => {
                tracing::error!(effect_id = %id, error = %err, "could not record the delivery outcome; the lease will expire and it is retried");
                report.unrecorded = 1;
            }
        }
        report.count_deliveries(&effect.effect_name);
        quarantine_recovered(QuarantineSource::DeadEffect, recovered_items);
        report
    }

    pub(super) async fn dead(
        &self,
        effect: &Effect,
        token: &str,
        status: Option<u16>,
        error: String,
        reason_code: String,
        report: &mut DispatchReport,
    ) -> Result<i64, sqlx::Error> {
        let id = &effect.effect_id;
        tracing::warn!(effect_id = %id, %reason_code, status, error = loggable(status, &error), "effect moved to dead letters");
        let item: Option<(i64, bool)> = sqlx::query_as(&self.settings.schema.sql(sql::DEAD))
            .bind(id.as_str())
            .bind(token)
            .bind(error)
            .bind(status.map(i32::from))
            .bind(effect_item_key(id.as_str()))
            .bind(&reason_code)
            .fetch_optional(self.db())
            .await?;
        if let Some((_, opened)) = item {
            ::metrics::counter!(m::OUTBOX_DEAD_LETTERS, "effect" => effect.effect_name.clone(), "reason" => reason_code)
                .increment(1);
            if opened {
                quarantine_moved(QuarantineSource::DeadEffect);
            }
        }
        report.dead = usize::from(item.is_some());
        Ok(i64::from(item.is_some()))
    }

    /// Runs an outcome statement guarded by the lease (`$1` effect, `$2` lease owner).
    pub(super) async fn record<'q, F>(
        &self,
        statement: &'q str,
        id: &'q EffectId,
        token: &'q str,
        bind: F,
    ) -> Result<u64, sqlx::Error>
    where
        F: FnOnce(
            sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    {
        let query = bind(sqlx::query(statement).bind(id.as_str()).bind(token));
        Ok(query.execute(self.db()).await?.rows_affected())
    }

    pub(super) fn backoff(&self, attempt: i32) -> Duration {
        let retry = u32::try_from(attempt).unwrap_or(0);
        jittered(self.settings.backoff_base, self.settings.backoff_cap, retry)
    }
}

/// What a log line may say about a failure. With a status the error text carries the
/// receiver's answer, which is recorded with the effect but never logged.
pub(super) fn loggable(status: Option<u16>, error: &str) -> &str {
    match status {
        Some(_) => "see the effect's last_error",
        None => error,
    }
}

pub(super) fn effect_from_row(row: &PgRow) -> Result<Effect, OutboxError> {
    let get = OutboxError::Database;
    let names: Vec<String> = row.try_get("header_names").map_err(get)?;
    let values: Vec<String> = row.try_get("header_values").map_err(get)?;
    let payload: Vec<u8> = row.try_get("payload").map_err(get)?;
    Ok(Effect {
        effect_id: EffectId(row.try_get("effect_id").map_err(get)?),
        effect_name: row.try_get("effect_name").map_err(get)?,
        destination: row.try_get("destination").map_err(get)?,
        payload: payload.into(),
        headers: names.into_iter().zip(values).collect(),
        attempt: row.try_get("attempts").map_err(get)?,
    })
}
