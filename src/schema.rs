//! The PostgreSQL schema the crate's tables live in, and the migrations that create them.
//!
//! Every statement the crate sends names its tables with their schema and calls PostgreSQL's
//! functions as `pg_catalog.…`, so nothing a handler does to its session (`SET search_path`,
//! a table or function of the same name in `public`) can redirect or break the protocol. The
//! schema is `tower_inbox` unless a [`Schema`] of another name is given to the layer
//! ([`InboxLayerBuilder::schema`](crate::InboxLayerBuilder::schema)) and to the other
//! components, and [`migrate_schema`] creates the tables there. [`grant_statements`] gives
//! the service's role what it needs there and nothing else (least privilege: the tables stay
//! owned by the role that migrates).

mod grants;

pub use grants::{grant_statements, Access, RoleError};

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::{Arc, PoisonError, RwLock};

use sqlx::migrate::MigrateError;
use sqlx::{Connection, Executor, PgConnection, PgPool};

/// The schema's name unless another is chosen.
pub const DEFAULT_SCHEMA: &str = "tower_inbox";

/// How the crate's SQL text names the default schema; [`Schema::sql`] swaps it for another.
const TEMPLATE_PREFIX: &str = "tower_inbox.";

/// The embedded migrations that create the inbox, outbox and quarantine tables.
///
/// Their statements name no schema: run them on a connection whose `search_path` is the
/// inbox schema alone, which is what [`migrate`](crate::migrate) and [`migrate_schema`] do (they also keep
/// the `_sqlx_migrations` record of these migrations in that schema, apart from the
/// application's own). To run them with the `sqlx` command line instead, copy `migrations/`
/// and give that run `options=-csearch_path=tower_inbox` after creating the schema.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The migrations of the [partitioned layout](Layout::Partitioned): [`MIGRATOR`]'s, then
/// `migrations/partitioned/`'s. [`migrate_schema`] runs these for a schema of that layout.
/// Each migrator refuses a schema the other migrated (a migration it does not know was
/// applied there), so a layout cannot be changed by running the other one.
pub static PARTITIONED_MIGRATOR: std::sync::LazyLock<sqlx::migrate::Migrator> =
    std::sync::LazyLock::new(|| {
        static EXTRA: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/partitioned");
        let mut migrations = MIGRATOR.migrations.to_vec();
        migrations.extend(EXTRA.migrations.iter().cloned());
        // The fields `migrate!` fills; the settings are the embedded set's.
        sqlx::migrate::Migrator {
            migrations: migrations.into(),
            ignore_missing: MIGRATOR.ignore_missing,
            locking: MIGRATOR.locking,
            no_tx: MIGRATOR.no_tx,
        }
    });

/// A schema the crate's tables live in: 1 to 63 bytes of lowercase ASCII letters, digits
/// and `_`, starting with a letter or `_`, and not starting with `pg_` (PostgreSQL reserves
/// those).
///
/// ```
/// use tower_inbox::schema::Schema;
///
/// assert_eq!(Schema::default().name(), "tower_inbox");
/// assert_eq!(Schema::new("payments_inbox").unwrap().name(), "payments_inbox");
/// assert!(Schema::new("Payments").is_err());
/// assert!(Schema::new("pg_inbox").is_err());
/// ```
#[derive(Clone)]
pub struct Schema {
    /// The name and the statements made for it, shared by every clone (one pointer keeps
    /// the schema, and everything that holds one, small).
    named: Arc<Named>,
    layout: Layout,
    pooling: Pooling,
}

/// A schema's name, and the crate's statements with that name, made once per statement.
struct Named {
    name: Box<str>,
    statements: RwLock<Statements>,
}

/// Statement texts by their template's address and length.
type Statements = HashMap<(usize, usize), Arc<str>>;

/// A schema name [`Schema::new`] refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid schema name {0:?}: use 1 to 63 lowercase ASCII letters, digits and '_', \
     starting with a letter or '_' and not with 'pg_'"
)]
pub struct SchemaError(String);

impl Schema {
    /// A schema of that name; see the type's docs for what is accepted.
    pub fn new(name: &str) -> Result<Self, SchemaError> {
        let valid = !name.is_empty()
            && name.len() <= 63
            && !name.starts_with("pg_")
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && !name.as_bytes()[0].is_ascii_digit();
        if !valid {
            return Err(SchemaError(name.to_owned()));
        }
        Ok(Self {
            named: Arc::new(Named {
                name: name.into(),
                statements: RwLock::default(),
            }),
            layout: Layout::Plain,
            pooling: Pooling::default(),
        })
    }

    /// The same schema with its tables in `layout` (the default is [`Layout::Plain`]).
    /// Give every component the same value: [`migrate_schema`] creates that layout, and the
    /// layer, the inbox and the purger send its statements.
    ///
    /// ```
    /// use tower_inbox::schema::{Layout, Schema};
    ///
    /// let schema = Schema::default().with_layout(Layout::Partitioned);
    /// assert_eq!(schema.layout(), Layout::Partitioned);
    /// assert_eq!(schema.name(), "tower_inbox");
    /// ```
    pub fn with_layout(self, layout: Layout) -> Self {
        Self { layout, ..self }
    }

    /// How the schema's tables are laid out.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.named.name
    }

    /// This schema, reached through `pooling`: give the result to every component (the layer,
    /// consumers, dispatchers, the purger, the quarantine, the stats task), as the schema is.
    ///
    /// ```
    /// use tower_inbox::schema::{Pooling, Schema};
    ///
    /// // The service connects to PgBouncer 1.18 in transaction mode.
    /// let schema = Schema::default().with_pooling(Pooling::Transaction);
    /// assert_eq!(schema.pooling(), Pooling::Transaction);
    /// ```
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// What the connections reach PostgreSQL through ([`Pooling::Session`] unless
    /// [set](Self::with_pooling)).
    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    fn is_default(&self) -> bool {
        &*self.named.name == DEFAULT_SCHEMA
    }

    /// `template`, a statement of the crate that names its tables `tower_inbox.<table>`, with
    /// this schema's name instead. Made once per schema value and statement, so the text (and
    /// with it sqlx's prepared statement) stays the same from call to call.
    pub(crate) fn sql(&self, template: &'static str) -> Sql {
        if self.is_default() {
            return Sql::Static(template);
        }
        let key = (template.as_ptr() as usize, template.len());
        if let Some(sql) = self
            .named
            .statements
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
        {
            return Sql::Shared(sql.clone());
        }
        let sql: Arc<str> = template
            .replace(TEMPLATE_PREFIX, &format!("\"{}\".", self.named.name))
            .into();
        self.named
            .statements
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, sql.clone());
        Sql::Shared(sql)
    }

    /// [`sql`](Self::sql) of the statement this schema's layout sends: `plain` or
    /// `partitioned` (the statements the [partitioned layout](crate::partition) sends
    /// differently).
    pub(crate) fn sql_for(&self, plain: &'static str, partitioned: &'static str) -> Sql {
        self.sql(match self.layout {
            Layout::Plain => plain,
            Layout::Partitioned => partitioned,
        })
    }
}

/// How a schema's tables are laid out; see [`crate::partition`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// One table each (the default).
    #[default]
    Plain,
    /// `consumer_inbox` partitioned by range of `received_at` and `message_outbox` by range
    /// of `created_at`; `READ COMMITTED` claims and enqueues only.
    Partitioned,
}

impl Layout {
    /// `plain` or `partitioned`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Partitioned => "partitioned",
        }
    }
}

impl Default for Schema {
    fn default() -> Self {
        Self::new(DEFAULT_SCHEMA).expect("the default schema name is valid")
    }
}

impl PartialEq for Schema {
    fn eq(&self, other: &Self) -> bool {
        self.named.name == other.named.name
            && self.layout == other.layout
            && self.pooling == other.pooling
    }
}

impl Eq for Schema {}

impl std::fmt::Debug for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut debug = f.debug_tuple("Schema");
        debug.field(&format_args!("{}", self.named.name));
        if self.layout == Layout::Partitioned {
            debug.field(&format_args!("partitioned"));
        }
        if self.pooling == Pooling::Transaction {
            debug.field(&format_args!("transaction pooling"));
        }
        debug.finish()
    }
}

/// What the service's connections reach PostgreSQL through, as far as the crate's statements
/// care: whether a statement prepared in one transaction can be run in the next.
///
/// Set it on the [`Schema`] ([`Schema::with_pooling`]) that every component is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Pooling {
    /// PostgreSQL itself; a pooler that gives a client one server connection for its whole
    /// session (PgBouncer's `pool_mode = session`); or one in transaction mode that keeps
    /// prepared statements across server connections (PgBouncer 1.21 and later with
    /// `max_prepared_statements` above 0). Each statement is prepared once per connection,
    /// named, and run from sqlx's statement cache afterwards: one round trip a statement.
    #[default]
    Session,
    /// A pooler in transaction mode that does not keep prepared statements (PgBouncer before
    /// 1.21, or with `max_prepared_statements = 0`): a client holds a server connection only
    /// while a transaction is open, and its next transaction may run on another one.
    ///
    /// Every statement the crate sends, and every one a handler sends through the
    /// [`ClaimedMessage`](crate::inbox::ClaimedMessage) (the layer's [`InboxTx`](crate::InboxTx)),
    /// is unnamed (sqlx's `persistent(false)`): parsed and run in two round trips, which
    /// PostgreSQL ties to nothing past the transaction. A statement that would autocommit runs
    /// between `BEGIN` and `COMMIT` of its own, so its parse and its run cannot be split
    /// across server connections. Dispatchers poll for due effects instead of `LISTEN`ing,
    /// which a transaction-mode pooler cannot carry. Migrations need a session: run them on
    /// a direct connection or through session mode ([`migrate_schema`]).
    Transaction,
}

impl Pooling {
    /// Whether statements must be unnamed and wrapped in transactions.
    pub(crate) fn per_transaction(self) -> bool {
        self == Self::Transaction
    }
}

impl std::fmt::Display for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.named.name)
    }
}

/// The text of one statement for one schema.
#[derive(Debug, Clone)]
pub(crate) enum Sql {
    Static(&'static str),
    Shared(Arc<str>),
}

impl Deref for Sql {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            Self::Static(sql) => sql,
            Self::Shared(sql) => sql,
        }
    }
}

/// Runs the embedded migrations into `schema`, creating it first if it is missing: those of
/// its [layout](Schema::layout) ([`MIGRATOR`] or [`PARTITIONED_MIGRATOR`]).
///
/// The migrations run on a connection of their own (with the pool's connect options and
/// `search_path` set to the schema), never on a pooled one, so no setting outlives them.
/// Several processes may run this at once: they take turns.
///
/// The schema is set with `SET search_path` once connected, not with the `options` startup
/// parameter, which PgBouncer refuses. Through PgBouncer, run migrations in session pooling
/// mode (or on a direct connection): they hold a session-level advisory lock, which
/// transaction pooling does not keep.
pub async fn migrate_schema(pool: &PgPool, schema: &Schema) -> Result<(), MigrateError> {
    let mut conn = PgConnection::connect_with(pool.connect_options().as_ref()).await?;
    // The name is validated: lowercase letters, digits and '_' only.
    let set = format!("set search_path to \"{}\"", schema.name());
    let result = match conn.execute(set.as_str()).await {
        Ok(_) => run_migrations(&mut conn, schema).await,
        Err(err) => Err(err.into()),
    };
    // Closing also releases the advisory lock, whatever happened.
    let _ = conn.close().await;
    result
}

async fn run_migrations(conn: &mut PgConnection, schema: &Schema) -> Result<(), MigrateError> {
    // Two processes creating one schema at once collide on its name; take turns. The key is
    // this crate's (an arbitrary constant in the two-key space, apart from sqlx's own lock).
    sqlx::query("select pg_catalog.pg_advisory_lock(1953066594, 1)")
        .execute(&mut *conn)
        .await?;
    let exists: bool = sqlx::query_scalar(
        "select exists (select 1 from pg_catalog.pg_namespace where nspname = $1)",
    )
    .bind(schema.name())
    .fetch_one(&mut *conn)
    .await?;
    if !exists {
        // The name is validated: lowercase letters, digits and '_' only.
        conn.execute(format!("create schema \"{}\"", schema.name()).as_str())
            .await?;
    }
    match schema.layout() {
        Layout::Plain => MIGRATOR.run(&mut *conn).await,
        Layout::Partitioned => PARTITIONED_MIGRATOR.run(&mut *conn).await,
    }
}
