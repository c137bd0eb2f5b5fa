//! `status [--json] [--watch SECONDS]`: per consumer, the outbox and the quarantine.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::Duration;

use serde::Serialize;
use time::OffsetDateTime;
use tower_inbox::inbox::Inbox;
use tower_inbox::metrics::StatsTask;
use tower_inbox::partition::{self, InboxPartition, Layout};

use crate::database::{Database, Failure};
use crate::render::{self, age, table};

/// What `status` reports; the JSON keys are these names (see the README).
#[derive(Debug, Serialize)]
pub struct Status {
    /// The inbox's layout: `plain` or `partitioned`.
    pub layout: &'static str,
    /// The inbox's range partitions; absent with the plain layout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partitions: Option<PartitionsStatus>,
    pub consumers: Vec<ConsumerStatus>,
    pub in_flight: InFlight,
    pub outbox: OutboxStatus,
    pub quarantine: QuarantineStatus,
}

/// The partitioned layout's range partitions (the default partition is not one).
#[derive(Debug, Serialize)]
pub struct PartitionsStatus {
    pub count: usize,
    pub oldest: Option<PartitionRange>,
    pub newest: Option<PartitionRange>,
    /// Whether one covers now; if none does, claims land in the default partition.
    pub covers_now: bool,
}

/// One partition: its table and its range, RFC 3339.
#[derive(Debug, Serialize)]
pub struct PartitionRange {
    pub name: String,
    pub from: String,
    pub to: String,
}

impl From<&InboxPartition> for PartitionRange {
    fn from(p: &InboxPartition) -> Self {
        Self {
            name: p.name.clone(),
            from: render::rfc3339(p.from),
            to: render::rfc3339(p.to),
        }
    }
}

impl std::fmt::Display for PartitionRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} to {})", self.name, self.from, self.to)
    }
}

#[derive(Debug, Serialize)]
pub struct ConsumerStatus {
    pub consumer: String,
    /// The planner's estimate (exact for a table never analyzed).
    pub rows: i64,
    pub oldest_row_seconds: f64,
    pub completed_last_hour: i64,
    pub conflicts_last_hour: i64,
    /// Claims in flight, from their advisory locks (their rows are not committed yet).
    pub in_progress: i64,
    pub oldest_in_progress_seconds: f64,
}

#[derive(Debug, Serialize)]
pub struct InFlight {
    /// Transactions holding uncommitted inbox writes, all consumers together.
    pub claims: i64,
    pub oldest_seconds: f64,
}

#[derive(Debug, Serialize)]
pub struct OutboxStatus {
    pub pending: i64,
    pub leased: i64,
    pub dead: i64,
    pub oldest_pending_seconds: f64,
}

#[derive(Debug, Serialize)]
pub struct QuarantineStatus {
    pub open: i64,
    /// Open items by `source/reason_code`.
    pub open_by_reason: BTreeMap<String, i64>,
}

/// A count per consumer, from `sql` selecting the consumer and the count.
async fn per_consumer(db: &Database, sql: &str) -> Result<BTreeMap<String, i64>, Failure> {
    let rows: Vec<(String, i64)> = sqlx::query_as(sql)
        .fetch_all(&db.pool)
        .await
        .map_err(|e| db.failure("reading the status from", e))?;
    Ok(rows.into_iter().collect())
}

async fn read(db: &Database) -> Result<Status, Failure> {
    let stats = StatsTask::new(db.pool.clone())
        .with_schema(db.schema.clone())
        .collect()
        .await
        .map_err(|e| db.failure("reading the status from", e))?;
    let failed = |e: sqlx::Error| db.failure("reading the status from", e);
    let s = db.schema.name();
    // Bounded by an hour of traffic: the received_at index.
    let completed = per_consumer(
        db,
        &format!(
            "select consumer_name, pg_catalog.count(*)::int8 from \"{s}\".consumer_inbox \
             where received_at > pg_catalog.now() - interval '1 hour' group by consumer_name"
        ),
    )
    .await?;
    let conflicts = per_consumer(
        db,
        &format!(
            "select consumer_name, pg_catalog.count(*)::int8 from \"{s}\".inbox_quarantine \
             where source = 'identity-conflict' and consumer_name is not null \
               and last_failed_at > pg_catalog.now() - interval '1 hour' group by consumer_name"
        ),
    )
    .await?;
    // Pending rows through their partial index; dead ones are counted over the table.
    let (leased, dead): (i64, i64) = sqlx::query_as(&format!(
        "select (select pg_catalog.count(*) from \"{s}\".message_outbox \
                 where status = 'pending' and lease_until > pg_catalog.now())::int8, \
                (select pg_catalog.count(*) from \"{s}\".message_outbox \
                 where status = 'dead')::int8"
    ))
    .fetch_one(&db.pool)
    .await
    .map_err(failed)?;
    let open: Vec<(String, String, i64)> = sqlx::query_as(&format!(
        "select source, reason_code, pg_catalog.count(*)::int8 from \"{s}\".inbox_quarantine \
         where decision is null group by source, reason_code"
    ))
    .fetch_all(&db.pool)
    .await
    .map_err(failed)?;

    let names: Vec<&str> = stats.inbox.iter().map(|c| c.consumer.as_str()).collect();
    let in_flight = Inbox::new(db.pool.clone())
        .with_schema(db.schema.clone())
        .claims_in_flight(&names)
        .await
        .map_err(|e| db.failure("reading the claims in flight from", e))?;
    let consumers = stats
        .inbox
        .iter()
        .zip(in_flight)
        .map(|(c, flight)| ConsumerStatus {
            consumer: c.consumer.clone(),
            rows: c.rows,
            oldest_row_seconds: c.oldest_row_age.as_secs_f64(),
            completed_last_hour: completed.get(&c.consumer).copied().unwrap_or(0),
            conflicts_last_hour: conflicts.get(&c.consumer).copied().unwrap_or(0),
            in_progress: flight.claims,
            oldest_in_progress_seconds: flight.oldest.as_secs_f64(),
        })
        .collect();
    let partitions = match db.schema.layout() {
        Layout::Plain => None,
        Layout::Partitioned => {
            let all = partition::list(&db.pool, &db.schema)
                .await
                .map_err(|e| db.failure("listing the inbox partitions in", e))?;
            // Claims stamp received_at with the server's clock, not this machine's.
            let now: OffsetDateTime = sqlx::query_scalar("select pg_catalog.now()")
                .fetch_one(&db.pool)
                .await
                .map_err(|e| db.failure("reading the clock of", e))?;
            Some(PartitionsStatus {
                count: all.len(),
                oldest: all.first().map(PartitionRange::from),
                newest: all.last().map(PartitionRange::from),
                covers_now: all.iter().any(|p| p.from <= now && now < p.to),
            })
        }
    };
    Ok(Status {
        layout: db.schema.layout().as_str(),
        partitions,
        consumers,
        in_flight: InFlight {
            claims: stats.claims_in_flight,
            oldest_seconds: stats.oldest_claim_in_flight_age.as_secs_f64(),
        },
        outbox: OutboxStatus {
            pending: stats.outbox_pending,
            leased,
            dead,
            oldest_pending_seconds: stats.outbox_oldest_pending_age.as_secs_f64(),
        },
        quarantine: QuarantineStatus {
            open: open.iter().map(|(_, _, n)| n).sum(),
            open_by_reason: open
                .into_iter()
                .map(|(source, reason, n)| (format!("{source}/{reason}"), n))
                .collect(),
        },
    })
}

fn human(status: &Status) -> String {
    let seconds = |s: f64| age(Duration::from_secs_f64(s.max(0.0)));
    let rows = status
        .consumers
        .iter()
        .map(|c| {
            vec![
                c.consumer.clone(),
                c.rows.to_string(),
                seconds(c.oldest_row_seconds),
                c.completed_last_hour.to_string(),
                c.conflicts_last_hour.to_string(),
                match c.in_progress {
                    0 => "0".to_owned(),
                    n => format!("{n}, oldest {}", seconds(c.oldest_in_progress_seconds)),
                },
            ]
        })
        .collect::<Vec<_>>();
    let mut out = String::from(
        "Inbox (rows: the planner's estimate; oldest row: exact among the 10 000 oldest)\n",
    );
    if rows.is_empty() {
        out.push_str("  no rows\n");
    } else {
        out.push_str(&table(
            &[
                "consumer",
                "rows",
                "oldest row",
                "completed (1h)",
                "conflicts (1h)",
                "in progress",
            ],
            rows,
        ));
        out.push('\n');
    }
    if let Some(partitions) = &status.partitions {
        out.push_str(&format!("Inbox partitions: {}", partitions.count));
        if let (Some(oldest), Some(newest)) = (&partitions.oldest, &partitions.newest) {
            out.push_str(&format!(", oldest {oldest}, newest {newest}"));
        }
        if !partitions.covers_now {
            out.push_str("; none covers now: claims land in the default partition");
        }
        out.push('\n');
    }
    let flight = &status.in_flight;
    out.push_str(&format!(
        "Claims in flight (all consumers, from pg_stat_activity and pg_locks): {}{}\n",
        flight.claims,
        if flight.claims > 0 {
            format!(", the oldest open for {}", seconds(flight.oldest_seconds))
        } else {
            String::new()
        }
    ));
    let outbox = &status.outbox;
    out.push_str(&format!(
        "Outbox: {} pending ({} leased){}; {} dead\n",
        outbox.pending,
        outbox.leased,
        if outbox.pending > 0 {
            format!(
                ", the oldest for {}",
                seconds(outbox.oldest_pending_seconds)
            )
        } else {
            String::new()
        },
        outbox.dead
    ));
    let quarantine = &status.quarantine;
    out.push_str(&format!("Quarantine: {} open", quarantine.open));
    if quarantine.open > 0 {
        let reasons: Vec<String> = quarantine
            .open_by_reason
            .iter()
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect();
        out.push_str(&format!(" ({})", reasons.join(", ")));
    }
    out.push('\n');
    out
}

pub async fn run(db: &Database, json: bool, watch: Option<u64>) -> Result<(), Failure> {
    let Some(every) = watch else {
        let status = read(db).await?;
        print(&status, json, false);
        return Ok(());
    };
    let redraw = std::io::stdout().is_terminal() && !json;
    let mut ticks = tokio::time::interval(Duration::from_secs(every));
    // One listener for the whole watch: Ctrl-C ends it during a read as well as between.
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = &mut interrupted => return Ok(()),
        }
        let status = tokio::select! {
            status = read(db) => status?,
            _ = &mut interrupted => return Ok(()),
        };
        if redraw {
            // Clear the screen and go home: the picture is redrawn in place.
            render::emit("\x1b[2J\x1b[H");
        }
        print(&status, json, !redraw);
    }
}

fn print(status: &Status, json: bool, stamped: bool) {
    if json {
        // One line per reading, so that a watch is a stream of JSON lines.
        render::line(serde_json::to_string(status).expect("the status is JSON"));
        return;
    }
    if stamped {
        render::line(format_args!("-- {}", render::now()));
    }
    render::emit(&human(status));
}
