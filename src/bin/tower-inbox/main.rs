//! `tower-inbox`: the operator's command line over the crate's tables (feature `cli`).
//!
//! ```sh
//! cargo run --features cli --bin tower-inbox -- status
//! cargo install --path . --features cli
//! ```
//!
//! Exit codes: 0 done; 1 refused (an unknown ID, an item already decided); 2 usage (clap's
//! own errors too); 3 the database cannot be reached or used. A failure is one line on
//! standard error, never a Debug dump, and never shows the database password.
#![forbid(unsafe_code)]

mod database;
mod grant;
mod inspect;
mod migrate;
mod outbox;
mod purge;
mod quarantine;
mod render;
mod status;

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use database::Failure;

/// The operator's command line for tower-inbox: migrations, status, keys, the quarantine
/// and the outbox. Every command but `migrate` works with the layout (plain or
/// partitioned) the schema's inbox has in the database.
#[derive(Debug, Parser)]
#[command(name = "tower-inbox", version)]
struct Cli {
    /// The PostgreSQL URL (postgres://user:password@host:port/database). Its password is
    /// never printed.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,
    /// The schema holding the crate's tables.
    #[arg(
        long,
        env = "TOWER_INBOX_SCHEMA",
        default_value = "tower_inbox",
        global = true
    )]
    schema: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Applies the crate's migrations, or lists the pending ones with --dry-run; a new
    /// schema gets the --layout asked for (plain unless told).
    Migrate(migrate::Migrate),
    /// Per consumer, the outbox and the quarantine: what is there now.
    Status {
        /// JSON instead of tables (keys documented in the README).
        #[arg(long)]
        json: bool,
        /// Again every SECONDS: redrawn in place on a terminal, a block per interval
        /// otherwise. Ctrl-C stops.
        #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=86_400))]
        watch: Option<u64>,
    },
    /// One key: its state, recorded response, failed attempts, quarantine item and effects.
    Inspect(inspect::Inspect),
    /// Quarantined items: list, show, repair, discard.
    #[command(subcommand)]
    Quarantine(quarantine::Command),
    /// Outbox effects: list, show, retry a dead one.
    #[command(subcommand)]
    Outbox(outbox::Command),
    /// The retention purge: what would go (--dry-run), or delete it (--yes); a partitioned
    /// inbox's expired partitions are dropped whole.
    Purge(purge::Purge),
    /// Grants a role what the service needs (--purge: and the purge), nothing else; run as
    /// the tables' owner, or print the statements with --dry-run.
    Grant(grant::Grant),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let origin = match matches.value_source("database_url") {
        Some(ValueSource::EnvVariable) => "DATABASE_URL",
        _ => "--database-url",
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(err) => err.exit(),
    };
    match run(cli, origin).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("tower-inbox: {failure}");
            ExitCode::from(failure.code())
        }
    }
}

async fn run(cli: Cli, origin: &'static str) -> Result<(), Failure> {
    // Usage errors first: a wrong argument is exit 2 even when the database is down.
    match &cli.command {
        Command::Purge(args) => purge::check(args)?,
        Command::Inspect(args) => inspect::check(args)?,
        Command::Quarantine(command) => quarantine::check(command)?,
        Command::Outbox(command) => outbox::check(command)?,
        Command::Migrate(_) | Command::Status { .. } | Command::Grant(_) => {}
    }
    // A dry run of `grant` only prints: no database needed.
    if let Command::Grant(args) = &cli.command {
        let statements = grant::statements(args, &cli.schema, args.layout.into())?;
        if args.dry_run {
            grant::print(&statements);
            return Ok(());
        }
    }
    let mut db = database::connect(cli.database_url.as_deref(), origin, &cli.schema).await?;
    // Every command but `migrate` (which creates the layout asked for) works with the layout
    // the schema has: a purge of a partitioned inbox drops partitions, a grant gives what
    // that layout needs.
    if !matches!(cli.command, Command::Migrate(_)) {
        if let Some(layout) = db.detected_layout().await? {
            db.schema = db.schema.clone().with_layout(layout);
        }
    }
    match cli.command {
        Command::Migrate(args) => migrate::run(&db, args).await,
        Command::Status { json, watch } => status::run(&db, json, watch).await,
        Command::Inspect(args) => inspect::run(&db, args).await,
        Command::Quarantine(command) => quarantine::run(&db, command).await,
        Command::Outbox(command) => outbox::run(&db, command).await,
        Command::Purge(args) => purge::run(&db, args).await,
        Command::Grant(args) => grant::run(&db, &args).await,
    }
}
