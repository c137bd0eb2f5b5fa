//! Metrics through the [`metrics`](https://docs.rs/metrics) facade.
//!
//! (Over 400 lines: one list of every metric the crate records, each with its help text and labels.)
//!
//! Install any recorder (Prometheus, StatsD, OpenTelemetry, ...) and the layer, the protocol
//! core, the dispatcher, the quarantine and the retention purge report through it. Call
//! [`describe`] once after installing it to register units and help texts. With no recorder
//! installed every call is a no-op.
//!
//! Every name begins with `inbox_`, `outbox_` or `quarantine_`, and every label set is
//! bounded: consumer names, effect names, migration names, quarantine sources, table names
//! and stable reason codes come from code and configuration, never from requests. The
//! producer label is off by default (see [`MetricLabels`]) because producers can be many, one
//! per client.
//!
//! [`METRICS`] lists every metric with its kind, labels and meaning; the README's reference
//! table is checked against it by a test.
//!
//! A sudden drop of [`DUPLICATES`] to zero can mean the producers got better, or that they
//! stopped sending keys: [`KEY_MISSING`] counts the second case, so both can be watched.

mod stats;

use ::metrics::{counter, gauge, histogram, Label, SharedString, Unit};
use std::sync::Arc;

use crate::identity::MessageIdentity;
use crate::quarantine::QuarantineSource;

pub use stats::{ConsumerStats, Stats, StatsError, StatsTask, ZeroPeriod};

/// Commands (or messages) committed for the first time: claim, business change and record.
pub const FIRST_SEEN: &str = "inbox_first_seen_total";
/// Duplicates answered from the record (a replay), without running the handler.
pub const DUPLICATES: &str = "inbox_duplicates_total";
/// Duplicates (and conflicts) answered from the in-process
/// [`ReplayCache`](crate::middleware::ReplayCache), without the database.
pub const CACHE_HITS: &str = "inbox_replay_cache_hits_total";
/// Keys reused with a different payload fingerprint.
pub const IDENTITY_CONFLICTS: &str = "inbox_identity_conflicts_total";
/// Duplicates refused because the original was still in flight after the wait.
pub const IN_PROGRESS: &str = "inbox_in_progress_total";
/// Guarded requests that came without a key, refused or (with an optional key) passed
/// through unprotected.
pub const KEY_MISSING: &str = "inbox_key_missing_total";
/// Guarded requests refused before any claim, by problem type.
pub const REQUESTS_REFUSED: &str = "inbox_requests_refused_total";
/// Transactions rolled back and re-run after a serialization failure or deadlock, at the
/// handler's request, or after the connection was lost.
pub const TRANSACTION_RETRIES: &str = "inbox_transaction_retries_total";
/// The time a claim took, for each claim that ran its claim statement or waited for an
/// in-flight original (a duplicate answered by the first lookup is not timed).
pub const CLAIM_WAIT: &str = "inbox_claim_wait_seconds";
/// Attempts that rolled back and were counted as failed, by stable reason code.
pub const HANDLER_FAILURES: &str = "inbox_handler_failures_total";
/// Errors of the inbox's own database work, by kind (`unavailable` or `internal`);
/// serialization failures and deadlocks are counted in [`TRANSACTION_RETRIES`] instead.
pub const DATABASE_ERRORS: &str = "inbox_database_errors_total";
/// First-seen messages refused by the retention guard: older than the window, so the inbox
/// may have forgotten them.
pub const EXPIRED: &str = "inbox_expired_total";
/// Steps of a [compensated migration](crate::replay::CompensatedMigration), by migration and
/// outcome.
pub const MIGRATION_STEPS: &str = "inbox_migration_steps_total";
/// Inbox rows, per consumer (the stats task).
pub const INBOX_ROWS: &str = "inbox_rows";
/// Age of the oldest inbox row, per consumer (the stats task).
pub const INBOX_OLDEST_AGE: &str = "inbox_oldest_row_age_seconds";
/// On-disk size of the inbox table with its indexes and TOAST (the stats task).
pub const INBOX_TABLE_BYTES: &str = "inbox_table_bytes";
/// Transactions holding uncommitted inbox writes: claims in flight (the stats task).
pub const CLAIMS_IN_FLIGHT: &str = "inbox_claims_in_flight";
/// How long the oldest claim in flight has been open (the stats task).
pub const OLDEST_CLAIM_IN_FLIGHT_AGE: &str = "inbox_oldest_claim_in_flight_seconds";
/// Rows deleted by the retention purge, by table.
pub const INBOX_PURGED: &str = "inbox_purged_rows_total";
/// Effects committed and not yet delivered or dead (the stats task).
pub const OUTBOX_PENDING: &str = "outbox_pending";
/// Age of the oldest pending effect (the stats task).
pub const OUTBOX_OLDEST_PENDING_AGE: &str = "outbox_oldest_pending_age_seconds";
/// Delivery attempts, by outcome.
pub const OUTBOX_DELIVERIES: &str = "outbox_deliveries_total";
/// Effects moved to dead letters, by reason code.
pub const OUTBOX_DEAD_LETTERS: &str = "outbox_dead_letters_total";
/// Delivered or dead outbox rows deleted by the retention purge.
pub const OUTBOX_PURGED: &str = "outbox_purged_rows_total";
/// Items moved to the quarantine (opened), by source.
pub const QUARANTINE_MOVES: &str = "quarantine_moves_total";
/// Quarantined items recovered by a later success, by source.
pub const QUARANTINE_RECOVERIES: &str = "quarantine_recoveries_total";
/// Quarantined items with no decision yet, by source (the stats task).
pub const QUARANTINE_OPEN: &str = "quarantine_open";
/// Decided quarantine items deleted by the retention purge.
pub const QUARANTINE_PURGED: &str = "quarantine_purged_rows_total";

/// Attempts the client layer (`tower_inbox::client`, feature `client`) sent: first
/// attempts and retries.
pub const CLIENT_ATTEMPTS: &str = "inbox_client_attempts_total";
/// Attempts the client layer retried, by reason.
pub const CLIENT_RETRIES: &str = "inbox_client_retries_total";
/// Commands the client layer gave up on, by reason.
pub const CLIENT_GIVE_UPS: &str = "inbox_client_give_ups_total";

/// What kind of metric a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up.
    Counter,
    /// A current value.
    Gauge,
    /// A distribution of observations.
    Histogram,
}

/// One metric: name, kind, labels and meaning.
#[derive(Debug, Clone, Copy)]
pub struct MetricInfo {
    /// The name as recorded.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// The labels it carries (`producer` only when [`MetricLabels`] asks for it).
    pub labels: &'static [&'static str],
    /// The unit.
    pub unit: Unit,
    /// What it counts.
    pub description: &'static str,
}

const fn info(
    name: &'static str,
    kind: MetricKind,
    labels: &'static [&'static str],
    unit: Unit,
    description: &'static str,
) -> MetricInfo {
    MetricInfo {
        name,
        kind,
        labels,
        unit,
        description,
    }
}

use MetricKind::{Counter, Gauge, Histogram};

const IDENTITY: &[&str] = &["consumer", "producer"];

/// Every metric this crate records.
pub const METRICS: &[MetricInfo] = &[
    info(
        FIRST_SEEN,
        Counter,
        IDENTITY,
        Unit::Count,
        "commands committed for the first time (claim, business change and recorded response)",
    ),
    info(
        DUPLICATES,
        Counter,
        IDENTITY,
        Unit::Count,
        "duplicates answered from the record without running the handler",
    ),
    info(
        CACHE_HITS,
        Counter,
        &["consumer"],
        Unit::Count,
        "duplicates and conflicts answered from the in-process replay cache, without the database",
    ),
    info(
        IDENTITY_CONFLICTS,
        Counter,
        IDENTITY,
        Unit::Count,
        "keys reused with a different payload fingerprint",
    ),
    info(
        IN_PROGRESS,
        Counter,
        IDENTITY,
        Unit::Count,
        "duplicates refused because the original was still in flight after the wait",
    ),
    info(
        KEY_MISSING,
        Counter,
        &["consumer", "action"],
        Unit::Count,
        "guarded requests without a key: action=refused, or passed (optional key, unprotected)",
    ),
    info(
        REQUESTS_REFUSED,
        Counter,
        &["consumer", "reason"],
        Unit::Count,
        "guarded requests refused before any claim, by problem type",
    ),
    info(
        TRANSACTION_RETRIES,
        Counter,
        &["consumer", "reason"],
        Unit::Count,
        "transactions rolled back and re-run: reason=serialization-failure, deadlock, requested or connection-lost",
    ),
    info(
        CLAIM_WAIT,
        Histogram,
        &["consumer"],
        Unit::Seconds,
        "time a claim took, for claims that ran the claim statement or waited for an in-flight original",
    ),
    info(
        HANDLER_FAILURES,
        Counter,
        &["consumer", "reason"],
        Unit::Count,
        "attempts rolled back and counted as failed, by stable reason code",
    ),
    info(
        DATABASE_ERRORS,
        Counter,
        &["consumer", "kind"],
        Unit::Count,
        "errors of the inbox's own database work: kind=unavailable or internal (serialization failures and deadlocks count as retries)",
    ),
    info(
        EXPIRED,
        Counter,
        &["consumer"],
        Unit::Count,
        "first-seen messages older than the retention window, refused by the guard",
    ),
    info(
        MIGRATION_STEPS,
        Counter,
        &["migration", "outcome"],
        Unit::Count,
        "compensated migration steps: outcome=applied, already-applied, conflict, in-progress, failed, rerun-exhausted or database-error",
    ),
    info(
        INBOX_ROWS,
        Gauge,
        &["consumer"],
        Unit::Count,
        "inbox rows per consumer, estimated from the planner's statistics (stats task)",
    ),
    info(
        INBOX_OLDEST_AGE,
        Gauge,
        &["consumer"],
        Unit::Seconds,
        "age of the oldest inbox row per consumer (stats task; exact among the 10 000 oldest rows, else an upper bound)",
    ),
    info(
        INBOX_TABLE_BYTES,
        Gauge,
        &[],
        Unit::Bytes,
        "on-disk size of consumer_inbox with indexes and TOAST (stats task)",
    ),
    info(
        CLAIMS_IN_FLIGHT,
        Gauge,
        &[],
        Unit::Count,
        "transactions holding uncommitted inbox writes: claims in flight, all consumers (stats task, from pg_stat_activity and pg_locks)",
    ),
    info(
        OLDEST_CLAIM_IN_FLIGHT_AGE,
        Gauge,
        &[],
        Unit::Seconds,
        "how long the oldest claim in flight has been open, 0 when none is (stats task)",
    ),
    info(
        INBOX_PURGED,
        Counter,
        &["table"],
        Unit::Count,
        "inbox and failure rows deleted by the retention purge",
    ),
    info(
        OUTBOX_PENDING,
        Gauge,
        &[],
        Unit::Count,
        "effects committed and not yet delivered or dead (stats task)",
    ),
    info(
        OUTBOX_OLDEST_PENDING_AGE,
        Gauge,
        &[],
        Unit::Seconds,
        "age of the oldest pending effect (stats task)",
    ),
    info(
        OUTBOX_DELIVERIES,
        Counter,
        &["effect", "outcome"],
        Unit::Count,
        "delivery attempts: outcome=delivered, retry, dead, unrecorded, released or lost",
    ),
    info(
        OUTBOX_DEAD_LETTERS,
        Counter,
        &["effect", "reason"],
        Unit::Count,
        "effects moved to dead letters, by reason code",
    ),
    info(
        OUTBOX_PURGED,
        Counter,
        &[],
        Unit::Count,
        "delivered or dead outbox rows deleted by the retention purge",
    ),
    info(
        QUARANTINE_MOVES,
        Counter,
        &["source"],
        Unit::Count,
        "items moved to the quarantine (opened), by source",
    ),
    info(
        QUARANTINE_RECOVERIES,
        Counter,
        &["source"],
        Unit::Count,
        "quarantined items recovered by a later success, by source",
    ),
    info(
        QUARANTINE_OPEN,
        Gauge,
        &["source"],
        Unit::Count,
        "quarantined items with no decision yet (stats task)",
    ),
    info(
        QUARANTINE_PURGED,
        Counter,
        &[],
        Unit::Count,
        "decided quarantine items deleted by the retention purge",
    ),
    info(
        CLIENT_ATTEMPTS,
        Counter,
        &[],
        Unit::Count,
        "attempts the client layer sent, first attempts and retries (feature client)",
    ),
    info(
        CLIENT_RETRIES,
        Counter,
        &["reason"],
        Unit::Count,
        "attempts the client layer retried: reason=refused, transport, timeout, status-<code> or a problem type",
    ),
    info(
        CLIENT_GIVE_UPS,
        Counter,
        &["reason"],
        Unit::Count,
        "commands the client layer gave up on: reason=attempts, deadline, not-replayable or body-unreadable",
    ),
];

/// Registers the unit and help text of every metric in [`METRICS`] with the installed
/// recorder. Call it once, after installing the recorder.
pub fn describe() {
    for m in METRICS {
        match m.kind {
            Counter => ::metrics::describe_counter!(m.name, m.unit, m.description),
            Gauge => ::metrics::describe_gauge!(m.name, m.unit, m.description),
            Histogram => ::metrics::describe_histogram!(m.name, m.unit, m.description),
        }
    }
}

/// Which identity labels the per-message metrics carry.
///
/// The consumer label is on by default: consumers are few and named in code. The producer
/// label is off by default: with one producer per authenticated client it would make one
/// time series per client. Turn it on where producers are a handful of services.
///
/// ```
/// use tower_inbox::metrics::MetricLabels;
/// assert_eq!(MetricLabels::default(), MetricLabels::consumer());
/// let both = MetricLabels::consumer().with_producer(true);
/// assert!(both.has_producer());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricLabels {
    consumer: bool,
    producer: bool,
}

impl Default for MetricLabels {
    fn default() -> Self {
        Self::consumer()
    }
}

impl MetricLabels {
    /// The consumer label only (the default).
    pub const fn consumer() -> Self {
        Self {
            consumer: true,
            producer: false,
        }
    }

    /// No identity labels at all: one series per metric.
    pub const fn none() -> Self {
        Self {
            consumer: false,
            producer: false,
        }
    }

    /// Adds or removes the producer label.
    pub const fn with_producer(mut self, on: bool) -> Self {
        self.producer = on;
        self
    }

    /// Adds or removes the consumer label.
    pub const fn with_consumer(mut self, on: bool) -> Self {
        self.consumer = on;
        self
    }

    /// Whether the producer label is recorded.
    pub const fn has_producer(self) -> bool {
        self.producer
    }

    /// Whether the consumer label is recorded.
    pub const fn has_consumer(self) -> bool {
        self.consumer
    }

    /// The labels of a message: consumer and, if asked for, producer.
    pub(crate) fn of(self, identity: &MessageIdentity) -> Vec<Label> {
        let mut labels = self.of_consumer_shared(identity.consumer_shared());
        if self.producer {
            labels.push(Label::new(
                "producer",
                identity.producer().name().to_owned(),
            ));
        }
        labels
    }

    /// The labels of a consumer-level metric.
    pub(crate) fn of_consumer(self, consumer: &str) -> Vec<Label> {
        self.consumer_label(|| consumer.to_owned().into())
    }

    /// [`of_consumer`](Self::of_consumer) for a name already shared: the label points at it
    /// instead of copying it, and so does every copy the `metrics` facade makes of the label
    /// (on a request's path these copies cost about 7 heap allocations, counted with
    /// `benches/instructions.sh`).
    pub(crate) fn of_consumer_shared(self, consumer: &Arc<str>) -> Vec<Label> {
        self.consumer_label(|| consumer.clone().into())
    }

    fn consumer_label(self, name: impl FnOnce() -> SharedString) -> Vec<Label> {
        let mut labels = Vec::with_capacity(2);
        if self.consumer {
            labels.push(Label::new("consumer", name()));
        }
        labels
    }
}

/// Adds one to a counter with the given labels and one more `key=value`.
pub(crate) fn count_with(
    name: &'static str,
    labels: &[Label],
    key: &'static str,
    value: impl Into<SharedString>,
) {
    let mut all = Vec::with_capacity(labels.len() + 1);
    all.extend_from_slice(labels);
    all.push(Label::new(key, value));
    counter!(name, all).increment(1);
}

/// Adds `n` to a counter with the given labels.
pub(crate) fn count(name: &'static str, labels: &[Label], n: u64) {
    counter!(name, labels.iter()).increment(n);
}

/// Records one observation of a histogram, in seconds.
pub(crate) fn observe_seconds(name: &'static str, labels: &[Label], seconds: f64) {
    histogram!(name, labels.iter()).record(seconds);
}

/// Sets a gauge.
pub(crate) fn set(name: &'static str, labels: &[Label], value: f64) {
    gauge!(name, labels.iter()).set(value);
}

/// Counts an item newly opened in the quarantine.
pub(crate) fn quarantine_moved(source: QuarantineSource) {
    count_with(QUARANTINE_MOVES, &[], "source", source.as_str());
}

/// Counts quarantined items a later success recovered.
pub(crate) fn quarantine_recovered(source: QuarantineSource, n: u64) {
    if n > 0 {
        ::metrics::counter!(QUARANTINE_RECOVERIES, "source" => source.as_str()).increment(n);
    }
}
