//! `migrate [--dry-run]`: the crate's embedded migrations, applied or listed.

use std::collections::BTreeSet;

use tower_inbox::schema::{migrate_schema, MIGRATOR};

use crate::database::{Database, Failure};
use crate::render;

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

pub async fn run(db: &Database, dry_run: bool) -> Result<(), Failure> {
    let done = applied(db).await?;
    let pending: Vec<_> = MIGRATOR
        .iter()
        .filter(|m| m.migration_type.is_up_migration() && !done.contains(&m.version))
        .collect();
    let schema = db.schema.name();
    if pending.is_empty() {
        render::line(format_args!(
            "schema {schema}: up to date ({} migrations)",
            done.len()
        ));
        return Ok(());
    }
    let verb = if dry_run { "would apply" } else { "applying" };
    render::line(format_args!(
        "schema {schema}: {verb} {} migration(s)",
        pending.len()
    ));
    for m in &pending {
        render::line(format_args!("  {} {}", m.version, m.description));
    }
    if dry_run {
        return Ok(());
    }
    migrate_schema(&db.pool, &db.schema)
        .await
        .map_err(|e| db.failure("migrating", e))?;
    render::line(format_args!("schema {schema}: up to date"));
    Ok(())
}
