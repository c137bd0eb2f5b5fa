//! `purge --dry-run | --yes`: the retention purge, with the policy from flags or a file, and
//! with a partitioned inbox its partitions created ahead and the expired ones dropped.
//!
//! (Over 400 lines: the purge's flags, their policy file, and the runs they drive, which
//! share those flags.)

use std::io::IsTerminal;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{ArgGroup, Args};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use tower_inbox::partition::{self, InboxPartition, Layout, PartitionPlan};
use tower_inbox::retention::{PurgedTable, Purger, RetentionPolicy, RetentionPolicyBuilder};

use crate::database::{Database, Failure};
use crate::render;

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("mode").required(true).args(["dry_run", "yes"])))]
pub struct Purge {
    /// Print what would be deleted, per table, with the cutoffs; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Delete. Ctrl-C stops after the batch in hand; every batch before it is committed.
    #[arg(long)]
    yes: bool,
    /// The policies from a TOML file (tables `[inbox]`, `[outbox]`, `[quarantine]`, each
    /// with scenario horizons or a `window`; see the README) instead of the flags below.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["inbox_scenarios", "outbox_window", "quarantine_window"])]
    policy: Option<PathBuf>,
    #[command(flatten)]
    inbox: Scenarios,
    /// Also purge delivered and discarded outbox effects older than this plus the
    /// --safety-margin (an audit window, the scenario `--outbox-window`).
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    outbox_window: Option<Duration>,
    /// Also purge decided quarantine items older than this plus the --safety-margin.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    quarantine_window: Option<Duration>,
    /// Rows per batch (the purger's default when not given).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    batch_size: Option<u32>,
    /// The pause between full batches (the purger's default when not given).
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pause: Option<Duration>,
    #[command(flatten)]
    partitions: Partitions,
}

/// The partitioned layout's partitions: created ahead by the purge, or by something else.
/// A plain schema refuses these flags.
#[derive(Debug, Args)]
struct Partitions {
    /// Partitioned layout: each partition's range, whole minutes (default 1d). Partitions
    /// are created ahead before the expired ones are dropped.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    partition_step: Option<Duration>,
    /// Partitioned layout: how many partitions past the current one to keep created
    /// (default 2).
    #[arg(long, value_name = "N")]
    partitions_ahead: Option<u32>,
    /// Partitioned layout: create no partitions, pg_partman (or another tool) does; the
    /// expired ones are still dropped, keeping what must be kept.
    #[arg(long, conflicts_with_all = ["partition_step", "partitions_ahead"])]
    partitions_created_elsewhere: bool,
}

impl Partitions {
    fn any(&self) -> bool {
        self.partition_step.is_some()
            || self.partitions_ahead.is_some()
            || self.partitions_created_elsewhere
    }

    /// The plan to create partitions by; `None` when they are created elsewhere.
    fn plan(&self) -> Result<Option<PartitionPlan>, Failure> {
        if self.partitions_created_elsewhere {
            return Ok(None);
        }
        let default = PartitionPlan::default();
        PartitionPlan::new(
            self.partition_step.unwrap_or(default.step()),
            self.partitions_ahead.unwrap_or(default.ahead()),
        )
        .map(Some)
        .map_err(|e| Failure::Usage(format!("--partition-step/--partitions-ahead: {e}")))
    }
}

/// The inbox's retention scenarios, as `RetentionPolicyBuilder` names them. Durations are
/// like `1d`, `12h`, `30m`, `1d 6h`.
#[derive(Debug, Args)]
#[group(id = "inbox_scenarios", multiple = true)]
struct Scenarios {
    /// How long producers (or the broker) keep retrying.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    retry_horizon: Option<Duration>,
    /// The longest outage to survive; extends the retry horizon.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    outage_tolerance: Option<Duration>,
    /// How far consumer offsets may be rewound.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    offset_rewind: Option<Duration>,
    /// How old a redriven dead letter can be.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    dead_letter_redrive: Option<Duration>,
    /// The age of the oldest backup you would restore and replay from.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    backup_restore: Option<Duration>,
    /// How old the messages of a planned replay can be.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    planned_replay: Option<Duration>,
    /// Added to the longest path.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    safety_margin: Option<Duration>,
    /// An explicit window (it must cover the scenarios given).
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    window: Option<Duration>,
    /// An audit window: only from a policy file (`audit = "30d"`).
    #[arg(skip)]
    audit: Option<Duration>,
}

/// One table's policy in the TOML file: the same names as the flags, durations as strings.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileScenarios {
    retry_horizon: Option<String>,
    outage_tolerance: Option<String>,
    offset_rewind: Option<String>,
    dead_letter_redrive: Option<String>,
    backup_restore: Option<String>,
    planned_replay: Option<String>,
    safety_margin: Option<String>,
    window: Option<String>,
    /// How long to keep rows for audits: a scenario named `audit`.
    audit: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    inbox: Option<FileScenarios>,
    outbox: Option<FileScenarios>,
    quarantine: Option<FileScenarios>,
}

/// `1d`, `12h`, `30m`, `45s`, `250ms`, or several: `1d 6h`.
pub fn duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration (like 1d, 12h, 30m, 45s, 1d 6h)");
    let mut total = Duration::ZERO;
    let mut any = false;
    for part in text.split_whitespace() {
        let split = part.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let (number, unit) = part.split_at(split);
        let n: u64 = number.parse().map_err(|_| bad())?;
        let unit = match unit {
            "d" => Duration::from_secs(86_400),
            "h" => Duration::from_secs(3_600),
            "m" => Duration::from_secs(60),
            "s" => Duration::from_secs(1),
            "ms" => Duration::from_millis(1),
            _ => return Err(bad()),
        };
        total = unit
            .checked_mul(u32::try_from(n).map_err(|_| bad())?)
            .and_then(|d| total.checked_add(d))
            .ok_or_else(bad)?;
        any = true;
    }
    if any {
        Ok(total)
    } else {
        Err(bad())
    }
}

/// `d` as [`duration`] reads it: `1d`, `6h`, `1d 6h`, `90s` (whole seconds).
fn written(d: Duration) -> String {
    let mut left = d.as_secs();
    let mut parts = Vec::new();
    for (unit, secs) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
        if left >= secs {
            parts.push(format!("{}{unit}", left / secs));
            left %= secs;
        }
    }
    if parts.is_empty() {
        "0s".to_owned()
    } else {
        parts.join(" ")
    }
}

impl Scenarios {
    /// Whether a scenario or a window is given: the safety margin alone is no policy (it
    /// also serves the outbox and quarantine windows).
    fn any(&self) -> bool {
        self.declared()
            .iter()
            .any(|(name, d)| *name != "safety_margin" && d.is_some())
    }

    fn declared(&self) -> [(&'static str, Option<Duration>); 9] {
        [
            ("audit", self.audit),
            ("retry_horizon", self.retry_horizon),
            ("outage_tolerance", self.outage_tolerance),
            ("offset_rewind", self.offset_rewind),
            ("dead_letter_redrive", self.dead_letter_redrive),
            ("backup_restore", self.backup_restore),
            ("planned_replay", self.planned_replay),
            ("safety_margin", self.safety_margin),
            ("window", self.window),
        ]
    }

    fn policy(&self, what: &str) -> Result<RetentionPolicy, Failure> {
        let mut builder = RetentionPolicy::builder();
        for (name, value) in self.declared() {
            if let Some(d) = value {
                builder = set(builder, name, d);
            }
        }
        builder
            .build()
            .map_err(|e| Failure::Usage(format!("the {what} policy: {e}")))
    }
}

fn set(builder: RetentionPolicyBuilder, name: &str, d: Duration) -> RetentionPolicyBuilder {
    match name {
        "retry_horizon" => builder.retry_horizon(d),
        "outage_tolerance" => builder.outage_tolerance(d),
        "offset_rewind" => builder.offset_rewind(d),
        "dead_letter_redrive" => builder.dead_letter_redrive(d),
        "backup_restore" => builder.backup_restore(d),
        "planned_replay" => builder.planned_replay(d),
        "safety_margin" => builder.safety_margin(d),
        "audit" => builder.custom("audit", d),
        _ => builder.window(d),
    }
}

impl FileScenarios {
    fn scenarios(&self, table: &str) -> Result<Scenarios, Failure> {
        let parse = |name: &str, value: &Option<String>| -> Result<Option<Duration>, Failure> {
            value
                .as_deref()
                .map(|v| duration(v).map_err(|e| Failure::Usage(format!("[{table}] {name}: {e}"))))
                .transpose()
        };
        Ok(Scenarios {
            audit: parse("audit", &self.audit)?,
            retry_horizon: parse("retry_horizon", &self.retry_horizon)?,
            outage_tolerance: parse("outage_tolerance", &self.outage_tolerance)?,
            offset_rewind: parse("offset_rewind", &self.offset_rewind)?,
            dead_letter_redrive: parse("dead_letter_redrive", &self.dead_letter_redrive)?,
            backup_restore: parse("backup_restore", &self.backup_restore)?,
            planned_replay: parse("planned_replay", &self.planned_replay)?,
            safety_margin: parse("safety_margin", &self.safety_margin)?,
            window: parse("window", &self.window)?,
        })
    }
}

/// The policies per table: inbox, outbox, quarantine.
type Policies = (
    Option<RetentionPolicy>,
    Option<RetentionPolicy>,
    Option<RetentionPolicy>,
);

fn policies(args: &Purge) -> Result<Policies, Failure> {
    if let Some(path) = &args.policy {
        let shown = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Failure::Usage(format!("--policy {shown}: {e}")))?;
        let file: PolicyFile = toml::from_str(&text).map_err(|e| {
            let why = e.message().to_owned();
            Failure::Usage(format!("--policy {shown}: {why}"))
        })?;
        let table = |name: &str, scenarios: &Option<FileScenarios>| {
            scenarios
                .as_ref()
                .map(|s| s.scenarios(name)?.policy(name))
                .transpose()
        };
        return Ok((
            table("inbox", &file.inbox)?,
            table("outbox", &file.outbox)?,
            table("quarantine", &file.quarantine)?,
        ));
    }
    // An audit window, as a named scenario with the flags' safety margin: the policy
    // refuses a bare TTL.
    let margin = args.inbox.safety_margin;
    let window = |d: Option<Duration>, what: &str| {
        d.map(|d| {
            let margin = margin
                .ok_or_else(|| Failure::Usage(format!("--{what} needs a --safety-margin too")))?;
            RetentionPolicy::builder()
                .custom(format!("--{what}"), d)
                .safety_margin(margin)
                .build()
                .map_err(|e| Failure::Usage(format!("--{what}: {e}")))
        })
        .transpose()
    };
    Ok((
        if args.inbox.any() {
            Some(args.inbox.policy("inbox")?)
        } else {
            None
        },
        window(args.outbox_window, "outbox-window")?,
        window(args.quarantine_window, "quarantine-window")?,
    ))
}

/// The usage errors `run` would find, without a database.
pub fn check(args: &Purge) -> Result<(), Failure> {
    args.partitions.plan()?;
    match policies(args)? {
        (None, None, None) => Err(Failure::Usage(
            "nothing to purge: give the inbox's scenarios, --outbox-window, --quarantine-window \
             or --policy"
                .to_owned(),
        )),
        _ => Ok(()),
    }
}

/// The first of the schema's partitioned tables pg_partman's configuration lists, if it is
/// installed and this role may read that: the purge must not create partitions beside it.
/// Unknown (None) when the configuration cannot be read; the drops stay safe either way.
async fn managed_by_pg_partman(db: &Database) -> Option<String> {
    let extension_schema: String = sqlx::query_scalar(
        "select n.nspname::text from pg_catalog.pg_extension e \
         join pg_catalog.pg_namespace n on n.oid = e.extnamespace \
         where e.extname = 'pg_partman'",
    )
    .fetch_optional(&db.pool)
    .await
    .ok()??;
    let quoted = format!("\"{}\"", extension_schema.replace('"', "\"\""));
    let tables = ["consumer_inbox", "message_outbox"].map(|t| format!("{}.{t}", db.schema.name()));
    sqlx::query_scalar(&format!(
        "select parent_table from {quoted}.part_config \
         where parent_table = any($1) order by parent_table limit 1"
    ))
    .bind(&tables[..])
    .fetch_optional(&db.pool)
    .await
    .ok()
    .flatten()
}

pub async fn run(db: &Database, args: Purge) -> Result<(), Failure> {
    let (inbox, outbox, quarantine) = policies(&args)?;
    let partitioned = db.schema.layout() == Layout::Partitioned;
    if args.partitions.any() && !partitioned {
        return Err(Failure::Usage(format!(
            "--partition-step, --partitions-ahead and --partitions-created-elsewhere are for \
             the partitioned layout; schema {} is plain",
            db.schema.name()
        )));
    }
    // Partitions are created and dropped by the inbox's and the outbox's purges; the
    // quarantine is not partitioned.
    let maintains = partitioned && (inbox.is_some() || outbox.is_some());
    if args.partitions.any() && !maintains {
        return Err(Failure::Usage(
            "--partition-step, --partitions-ahead and --partitions-created-elsewhere act \
             through the inbox's or the outbox's purge: give its policy too"
                .to_owned(),
        ));
    }
    let plan = args.partitions.plan()?;
    if let (true, Some(_)) = (maintains, plan) {
        if let Some(parent) = managed_by_pg_partman(db).await {
            return Err(Failure::Usage(format!(
                "pg_partman creates the partitions of {parent}: give \
                 --partitions-created-elsewhere (this purge would create overlapping ones)"
            )));
        }
    }
    let mut builder = Purger::builder(db.pool.clone()).schema(db.schema.clone());
    builder = match plan {
        Some(plan) => builder.partitions(plan),
        None => builder.partitions_created_elsewhere(),
    };
    for (name, policy) in [
        ("inbox", &inbox),
        ("outbox", &outbox),
        ("quarantine", &quarantine),
    ] {
        if let Some(policy) = policy {
            render::line(format_args!("{name}: {}", policy.to_string().trim_end()));
        }
    }
    if maintains {
        render::line(match plan {
            Some(plan) => format!(
                "partitions: {} each, {} ahead, created by this purge; expired ones dropped \
                 whole",
                written(plan.step()),
                plan.ahead()
            ),
            None => {
                "partitions: created elsewhere (pg_partman); expired ones dropped whole".to_owned()
            }
        });
    }
    // The dry run's per-partition lines and the created/dropped lists are the inbox's.
    let partitioned = partitioned && inbox.is_some();
    if let Some(policy) = inbox {
        builder = builder.inbox(policy);
    }
    if let Some(policy) = outbox {
        builder = builder.outbox(policy);
    }
    if let Some(policy) = quarantine {
        builder = builder.quarantine(policy);
    }
    if let Some(rows) = args.batch_size {
        builder = builder.batch_size(rows);
    }
    if let Some(pause) = args.pause {
        builder = builder.pause_between_batches(pause);
    }
    let purger = builder.build().map_err(|e| {
        Failure::Usage(format!(
            "{e}: give the inbox's scenarios, --outbox-window, --quarantine-window or --policy"
        ))
    })?;
    if args.dry_run {
        let report = purger
            .dry_run()
            .await
            .map_err(|e| db.failure("counting what to purge in", e))?;
        render::line(&report);
        if let (true, Some(inbox)) = (partitioned, report.table(PurgedTable::ConsumerInbox)) {
            preview_drops(db, inbox.cutoff).await?;
        }
        return Ok(());
    }
    let before = if partitioned {
        partitions(db).await?
    } else {
        Vec::new()
    };

    let interrupted = Arc::new(AtomicBool::new(false));
    let watch = {
        let interrupted = interrupted.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                interrupted.store(true, Ordering::Relaxed);
            }
        })
    };
    let terminal = std::io::stderr().is_terminal();
    let bar = terminal.then(|| {
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        bar
    });
    let mut last_line = std::time::Instant::now();
    let report = purger
        .purge_observed(|table| {
            let progress = format!(
                "{}: {} rows deleted in {} batches",
                table.table, table.rows, table.batches
            );
            match &bar {
                Some(bar) => bar.set_message(progress),
                // Not a terminal: a plain line now and then, not one per batch.
                None if last_line.elapsed() >= Duration::from_secs(5) => {
                    eprintln!("{progress}");
                    last_line = std::time::Instant::now();
                }
                None => {}
            }
            if interrupted.load(Ordering::Relaxed) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .await;
    watch.abort();
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let report = report.map_err(|e| db.failure("purging", e))?;
    render::line(&report);
    if partitioned {
        let after = partitions(db).await?;
        let missing = |from: &[InboxPartition], to: &[InboxPartition]| -> Vec<String> {
            from.iter()
                .filter(|p| !to.contains(p))
                .map(|p| p.name.clone())
                .collect()
        };
        for (verb, names) in [
            ("dropped", missing(&before, &after)),
            ("created", missing(&after, &before)),
        ] {
            if !names.is_empty() {
                render::line(format_args!("partitions {verb}: {}", names.join(", ")));
            }
        }
    }
    if report.stopped {
        return Err(Failure::Interrupted);
    }
    Ok(())
}

/// The inbox's range partitions.
async fn partitions(db: &Database) -> Result<Vec<InboxPartition>, Failure> {
    partition::list(&db.pool, &db.schema)
        .await
        .map_err(|e| db.failure("listing the inbox partitions in", e))
}

/// Per partition a purge at `cutoff` would drop: its range, and the rows the drop would take
/// and keep.
async fn preview_drops(db: &Database, cutoff: time::OffsetDateTime) -> Result<(), Failure> {
    let expired: Vec<_> = partitions(db)
        .await?
        .into_iter()
        .filter(|p| p.expired_at(cutoff))
        .collect();
    if expired.is_empty() {
        render::line("  no partition to drop: none ends before the cutoff");
    }
    for p in expired {
        let preview = p
            .drop_preview(&db.pool, &db.schema, cutoff)
            .await
            .map_err(|e| db.failure("counting what to purge in", e))?;
        render::line(format_args!(
            "  would drop partition {} ({} to {}): {} rows, keeping {} (moved to the default \
             partition)",
            p.name,
            render::rfc3339(p.from),
            render::rfc3339(p.to),
            preview.dropped,
            preview.kept
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::duration;
    use std::time::Duration;

    #[test]
    fn durations_read_as_people_write_them() {
        let s = Duration::from_secs;
        assert_eq!(duration("1d"), Ok(s(86_400)));
        assert_eq!(duration("1d 6h"), Ok(s(108_000)));
        assert_eq!(duration("30m"), Ok(s(1_800)));
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        for bad in ["", "banana", "1", "1w", "d", "-1d", "99999999999d"] {
            assert!(duration(bad).is_err(), "{bad:?}");
        }
        for text in ["1d", "6h", "1d 6h", "2d 3h 4m 5s", "90m"] {
            let d = duration(text).unwrap();
            assert_eq!(duration(&super::written(d)), Ok(d), "{text}");
        }
        assert_eq!(super::written(s(86_400)), "1d");
        assert_eq!(super::written(s(5_400)), "1h 30m");
    }
}
