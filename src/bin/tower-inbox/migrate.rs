//! `migrate [--layout plain|partitioned] [--dry-run]`: the crate's embedded migrations,
//! applied or listed, for a new schema of the layout asked for or an existing one of its own.

use std::collections::BTreeSet;

use sqlx::migrate::{MigrateError, Migrator};
use tower_inbox::schema::{migrate_schema, Layout, MIGRATOR, PARTITIONED_MIGRATOR};

use crate::database::{Database, Failure, LayoutArg};
use crate::render;

/// The arguments of `migrate`.
#[derive(Debug, clap::Args)]
pub struct Migrate {
    /// List what would be applied; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// The layout of a new schema: `plain` (the default), or `partitioned` (the inbox and
    /// the outbox partitioned by time, for very large tables: see the README's "Partitioned
    /// inbox").
    /// An existing schema keeps its own; naming another is refused.
    #[arg(long, value_enum)]
    layout: Option<LayoutArg>,
}

/// The versions recorded as applied in the schema (none when it has no migration table).
async fn applied(db: &Database) -> Result<BTreeSet<i64>, Failure> {
    let table = format!("\"{}\"._sqlx_migrations", db.schema.name());
    let exists: bool = sqlx::query_scalar("select pg_catalog.to_regclass($1) is not null")
        .bind(&table)
        .fetch_one(&db.pool)
        .await
        .map_err(|e| db.failure("reading the migrations from", e))?;
    if !exists {
        return Ok(BTreeSet::new());
    }
    let versions: Vec<i64> =
        sqlx::query_scalar(&format!("select version from {table} where success"))
            .fetch_all(&db.pool)
            .await
            .map_err(|e| db.failure("reading the migrations from", e))?;
    Ok(versions.into_iter().collect())
}

/// The layout to migrate: the one asked for, which must be the schema's if it has one.
async fn layout(db: &Database, asked: Option<LayoutArg>) -> Result<Layout, Failure> {
    let found = db.detected_layout().await?;
    match (asked.map(Layout::from), found) {
        (Some(asked), Some(found)) if asked != found => Err(Failure::Refused(format!(
            "schema {}: its inbox has the {} layout, not {}: an inbox's layout is not changed \
             in place (migrate a new schema with --layout {} and move the rows, see \
             docs/scaling.md), or run migrate --layout {} to bring this one up to date",
            db.schema.name(),
            found.as_str(),
            asked.as_str(),
            asked.as_str(),
            found.as_str(),
        ))),
        (Some(layout), _) | (None, Some(layout)) => Ok(layout),
        (None, None) => Ok(Layout::Plain),
    }
}

pub async fn run(db: &Database, args: Migrate) -> Result<(), Failure> {
    let layout = layout(db, args.layout).await?;
    let migrator: &Migrator = match layout {
        Layout::Plain => &MIGRATOR,
        Layout::Partitioned => &PARTITIONED_MIGRATOR,
    };
    let done = applied(db).await?;
    let pending: Vec<_> = migrator
        .iter()
        .filter(|m| m.migration_type.is_up_migration() && !done.contains(&m.version))
        .collect();
    let schema = format!("{} ({} layout)", db.schema.name(), layout.as_str());
    if pending.is_empty() {
        render::line(format_args!(
            "schema {schema}: up to date ({} migrations)",
            done.len()
        ));
        return Ok(());
    }
    let verb = if args.dry_run {
        "would apply"
    } else {
        "applying"
    };
    render::line(format_args!(
        "schema {schema}: {verb} {} migration(s)",
        pending.len()
    ));
    for m in &pending {
        render::line(format_args!("  {} {}", m.version, m.description));
    }
    if args.dry_run {
        return Ok(());
    }
    migrate_schema(&db.pool, &db.schema.clone().with_layout(layout))
        .await
        .map_err(|e| refusal(db, layout, &e).unwrap_or_else(|| db.failure("migrating", e)))?;
    // The layout was read before the migration's lock: a migrate of the other layout that
    // ran meanwhile on the same new schema may have had the last word. Say so rather than
    // report a layout the schema does not have.
    if let Some(now) = db.detected_layout().await? {
        if now != layout {
            return Err(Failure::Refused(format!(
                "schema {}: another migrate gave it the {} layout meanwhile",
                db.schema.name(),
                now.as_str()
            )));
        }
    }
    render::line(format_args!("schema {schema}: up to date"));
    if layout == Layout::Partitioned && done.is_empty() {
        // Until partitions exist every claim lands in the default partition, which the
        // purge cannot drop: say who creates them.
        render::line(
            "partitions: none yet; `tower-inbox purge --yes` with an inbox or outbox policy \
             creates them ahead (or PartitionPlan::create, or pg_partman: see \
             docs/scaling.md)",
        );
    }
    Ok(())
}

/// The migrations' own refusals, as one line and exit 1: the schema was migrated with the
/// other layout (a migration applied there is not one of this layout's), or the partitioned
/// migration's exception (an inbox with rows).
fn refusal(db: &Database, layout: Layout, err: &MigrateError) -> Option<Failure> {
    let schema = db.schema.name();
    match err {
        MigrateError::VersionMissing(version) => Some(Failure::Refused(format!(
            "schema {schema}: migration {version} applied there is not one of the {} \
             layout's: the schema has the other layout",
            layout.as_str()
        ))),
        MigrateError::ExecuteMigration(sqlx::Error::Database(raised), version)
            if raised.code().as_deref() == Some("P0001") =>
        {
            // The migration's hint says what to do instead: keep it on the one line.
            let hint = raised
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .and_then(|pg| pg.hint())
                .map(|hint| format!(" ({hint})"))
                .unwrap_or_default();
            Some(Failure::Refused(format!(
                "schema {schema}: migration {version} refused: {}{hint}",
                raised.message()
            )))
        }
        _ => None,
    }
}
