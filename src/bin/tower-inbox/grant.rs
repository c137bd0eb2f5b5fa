//! `grant ROLE [--purge] [--dry-run]`: the service role's privileges, printed or granted.

use tower_inbox::schema::{grant_statements, Access, Layout, Schema};

use crate::database::{Database, Failure, LayoutArg};
use crate::render;

/// The arguments of `grant`.
#[derive(Debug, clap::Args)]
pub struct Grant {
    /// The role to grant to, as PostgreSQL stores its name (unquoted names are lowercase).
    pub role: String,
    /// Also DELETE, for the role that runs the retention purge.
    #[arg(long)]
    pub purge: bool,
    /// Print the statements; connect to nothing, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run, which connects to no database: the layout to print the statements
    /// for, plain unless given (a grant without --dry-run uses the layout the schema has in
    /// the database).
    #[arg(long, value_enum, default_value_t, requires = "dry_run")]
    pub layout: LayoutArg,
}

/// The statements for `args` in `schema` of `layout`, or a usage failure naming the bad
/// argument.
pub fn statements(args: &Grant, schema: &str, layout: Layout) -> Result<Vec<String>, Failure> {
    let schema = Schema::new(schema)
        .map_err(|e| Failure::Usage(format!("--schema {schema:?}: {e}")))?
        .with_layout(layout);
    let access = if args.purge {
        Access::ServiceAndPurge
    } else {
        Access::Service
    };
    grant_statements(&schema, &args.role, access).map_err(|e| Failure::Usage(e.to_string()))
}

/// Prints the statements, one a line and each ending in `;`, for a DBA or a migration.
pub fn print(statements: &[String]) {
    for statement in statements {
        render::line(format_args!("{statement};"));
    }
}

/// Runs the statements in one transaction (all or none), as the connected role, which must
/// own the tables or hold the privileges with the grant option.
pub async fn run(db: &Database, args: &Grant) -> Result<(), Failure> {
    let statements = statements(args, db.schema.name(), db.schema.layout())?;
    let fail = |e| db.failure(&format!("granting to {:?} on", args.role), e);
    let mut tx = db.pool.begin().await.map_err(fail)?;
    for statement in &statements {
        sqlx::query(statement)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
    }
    tx.commit().await.map_err(fail)?;
    let what = if args.purge {
        "service and purge"
    } else {
        "service"
    };
    render::line(format_args!(
        "schema {} ({} layout): granted the {what} privileges to {}",
        db.schema.name(),
        db.schema.layout().as_str(),
        args.role
    ));
    Ok(())
}
