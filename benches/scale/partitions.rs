//! The `partitions` scenario: the inbox purge at `SCALE_PARTITION_ROWS` (10 million) rows,
//! by dropping partitions (`Layout::Partitioned`) against today's batched delete (the plain
//! layout), with first-seen latency during each purge against the same load without it, and
//! the table and index sizes of both layouts.
//!
//! Both layouts get the same rows: processed credits received uniformly over the 30 days
//! that ended a day ago, and the same 28-day window, so the oldest tenth (about a million
//! rows) is expired. The batched delete takes exactly those; the partitioned purge drops the
//! daily partitions whose whole range is past the cutoff (the one holding the cutoff waits
//! for its last row to expire), and the report says how many rows each took.

use std::time::Duration;

use sqlx::Connection;
use time::OffsetDateTime;
use tower_inbox::partition::PartitionPlan;
use tower_inbox::retention::{PurgedTable, Purger, RetentionPolicy};
use tower_inbox::schema::{Layout, Schema};

use super::{
    env_num, fill_rows, load_around_purge, support, us, BoxError, Config, Database, Feeds,
    Percentiles, Probe, Workspace, DAY, STREAM_PURGE,
};

/// The days the rows span, ending a day ago.
const SPAN_DAYS: u64 = 30;

pub(super) async fn run(config: &Config, db: &Database) -> Result<(), BoxError> {
    let rows: u64 = env_num("SCALE_PARTITION_ROWS", 10_000_000, 1000)?;
    let step_hours: u64 = env_num("SCALE_PARTITION_STEP_HOURS", 24, 1)?;
    let plan = PartitionPlan::new(Duration::from_secs(step_hours * 3600), 2)?;
    let layouts = match std::env::var("SCALE_PARTITION_LAYOUTS").as_deref() {
        Ok("plain") => vec![Layout::Plain],
        Ok("partitioned") => vec![Layout::Partitioned],
        Ok("plain,partitioned") | Err(_) => vec![Layout::Plain, Layout::Partitioned],
        Ok(other) => {
            return Err(format!(
                "SCALE_PARTITION_LAYOUTS={other:?}: plain, partitioned or plain,partitioned"
            )
            .into())
        }
    };
    let workers = config.purge_concurrency as usize;
    println!(
        "\n## partitions: the inbox purge at {rows} rows (received over the {SPAN_DAYS} days \
         ending a day ago, window 28 days, partitions of {step_hours} h), first-seen latency \
         at {workers} in flight"
    );
    println!(
        "{:>12}  {:>7}  {:>10}  {:>8}  {:>9}  {:>9}  {:>9}  {:>9}  {:>8}  {:>8}  {:>10}  {:>10}",
        "layout",
        "load s",
        "purged",
        "purge s",
        "table MB",
        "index MB",
        "base p50",
        "base p99",
        "p50",
        "p99",
        "p99 × base",
        "after MB"
    );
    for layout in layouts {
        let name = match layout {
            Layout::Plain => "scale_part_plain",
            Layout::Partitioned => "scale_part_partitioned",
        };
        let ws = db
            .workspace_of(
                Schema::new(name)?.with_layout(layout),
                support::pool_options(config.purge_concurrency + 2),
            )
            .await?;
        let line = measure(config, &ws, rows, workers, plan).await;
        // Gives the space back before the other layout loads its rows.
        let drop = format!("drop schema \"{name}\" cascade");
        ws.pool.close().await;
        let mut admin = sqlx::PgConnection::connect_with(&db.options).await?;
        sqlx::raw_sql(&drop).execute(&mut admin).await?;
        println!("{}", line?);
    }
    Ok(())
}

/// One layout's line of the table.
async fn measure(
    config: &Config,
    ws: &Workspace,
    rows: u64,
    workers: usize,
    plan: PartitionPlan,
) -> Result<String, BoxError> {
    if ws.schema.layout() == Layout::Partitioned {
        let since = OffsetDateTime::now_utc() - time::Duration::days(SPAN_DAYS as i64 + 2);
        plan.create_since(&ws.pool, &ws.schema, Some(since)).await?;
    }
    let load = fill(ws, rows).await?;
    let (table, index) = sizes(ws).await?;
    let policy = RetentionPolicy::builder()
        .retry_horizon(27 * DAY)
        .safety_margin(DAY)
        .build()?;
    let purger = Purger::builder(ws.pool.clone())
        .schema(ws.schema.clone())
        .inbox(policy)
        .batch_size(config.purge_batch)
        .pause_between_batches(config.purge_pause)
        .partitions(plan)
        .build()?;
    let router = ws.layered_router()?;
    let probe = Probe {
        stream: STREAM_PURGE,
        baseline: false,
        replayed: false,
    };
    let (base, during, report, took) = load_around_purge(
        &router,
        probe,
        workers,
        &purger,
        config.purge_base,
        &mut Feeds::default(),
    )
    .await?;
    let purged = report.rows(PurgedTable::ConsumerInbox);
    let (table_after, index_after) = sizes(ws).await?;
    let (base, during) = (Percentiles::of(&base), Percentiles::of(&during));
    let (_, p99) = during.over(base);
    let mb = |bytes: i64| bytes as f64 / (1024.0 * 1024.0);
    Ok(format!(
        "{:>12}  {:>7.1}  {:>10}  {:>8.1}  {:>9.0}  {:>9.0}  {:>9.0}  {:>9.0}  {:>8.0}  {:>8.0}  {:>10.2}  {:>10.0}",
        match ws.schema.layout() {
            Layout::Plain => "plain",
            Layout::Partitioned => "partitioned",
        },
        load.as_secs_f64(),
        purged,
        took.as_secs_f64(),
        mb(table),
        mb(index),
        us(base.p50),
        us(base.p99),
        us(during.p50),
        us(during.p99),
        p99,
        mb(table_after + index_after),
    ))
}

/// Adds `rows` processed rows received uniformly over the [`SPAN_DAYS`] days that ended a
/// day ago, oldest first, like the `purge` scenario's.
async fn fill(ws: &Workspace, rows: u64) -> Result<Duration, BoxError> {
    fill_rows(
        ws,
        rows,
        "now() - make_interval(secs => 86400 * (1 + $4 * ($3 - g)::float8 / $3))",
        SPAN_DAYS as f64,
    )
    .await
}

/// The inbox's table and index bytes, summed over its partitions (the table itself when it
/// has none).
async fn sizes(ws: &Workspace) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "select coalesce(sum(pg_table_size(t.relid)), 0)::int8,
                coalesce(sum(pg_indexes_size(t.relid)), 0)::int8
         from (select relid from pg_partition_tree($1::regclass) where isleaf
               union select $1::regclass where not exists (
                   select from pg_inherits where inhparent = $1::regclass)) t",
    )
    .bind(ws.table("consumer_inbox"))
    .fetch_one(&ws.pool)
    .await
}
