//! The privileges the crate's work needs, as `GRANT` statements for a role of the
//! application's: least privilege for the service, with the tables owned by another role that
//! runs the migrations.

use super::{Layout, Schema};

/// Everything the running service does: `migrations/grants/service.sql`.
const SERVICE: &str = include_str!("../../migrations/grants/service.sql");

/// What the retention purge needs on top: `migrations/grants/purge.sql`.
const PURGE: &str = include_str!("../../migrations/grants/purge.sql");

/// What the purge needs on top with the partitioned layout:
/// `migrations/grants/partitioned_purge.sql`.
const PARTITIONED_PURGE: &str = include_str!("../../migrations/grants/partitioned_purge.sql");

/// The crate's work a role does, which decides what [`grant_statements`] grants it.
///
/// Neither includes the migrations: run [`migrate`](crate::migrate) (or `tower-inbox
/// migrate`) as the role that owns the schema and its tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The layer (claim, record, lookup, failure records), the outbox (enqueue, dispatcher,
    /// `LISTEN`), quarantine decisions, the stats task and the operator's reads: `USAGE` on
    /// the schema and `SELECT`, `INSERT`, `UPDATE` on its four tables. Nothing is deleted.
    Service,
    /// [`Access::Service`] and `DELETE` on the same four tables, for the retention purge: the
    /// role of a service that runs its own [`Purger`](crate::retention::Purger), or the one
    /// `tower-inbox purge --yes` connects as.
    ServiceAndPurge,
}

/// A role name [`grant_statements`] refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid role name {0:?}: use 1 to 63 bytes, no NUL")]
pub struct RoleError(String);

/// The `GRANT` statements that give `role` what `access` needs in `schema`, one statement a
/// string, to run as the owner of the schema's tables after the migrations (again after an
/// upgrade whose migrations add a table). With the [partitioned layout](Layout::Partitioned),
/// the purge's also grant `EXECUTE` on its partition functions and its rights on the
/// default partitions; the service needs nothing more (the outbox's enqueue function runs
/// with its caller's rights, and PUBLIC may call it).
///
/// `role` is the name as PostgreSQL stores it (an unquoted `CREATE ROLE App` is `app`); it is
/// quoted in the statements, so any name is safe to pass. Nothing is granted on
/// `_sqlx_migrations`, the sequences or the functions: the service never touches the first,
/// and PostgreSQL checks no privilege when an identity column draws from its sequence or a
/// trigger calls its function. `tower-inbox grant ROLE` (feature `cli`) prints or runs the
/// same statements.
///
/// ```
/// use tower_inbox::schema::{grant_statements, Access, Schema};
///
/// let grants = grant_statements(&Schema::new("payments_inbox")?, "payments", Access::Service)?;
/// assert_eq!(grants[0], r#"grant usage on schema "payments_inbox" to "payments""#);
/// assert!(grants.iter().all(|g| !g.contains("delete")));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn grant_statements(
    schema: &Schema,
    role: &str,
    access: Access,
) -> Result<Vec<String>, RoleError> {
    if role.is_empty() || role.len() > 63 || role.contains('\0') {
        return Err(RoleError(role.to_owned()));
    }
    let scripts: &[&str] = match (access, schema.layout()) {
        (Access::Service, _) => &[SERVICE],
        (Access::ServiceAndPurge, Layout::Plain) => &[SERVICE, PURGE],
        (Access::ServiceAndPurge, Layout::Partitioned) => &[SERVICE, PURGE, PARTITIONED_PURGE],
    };
    // The schema name is validated (lowercase letters, digits, '_'): quoting is enough.
    let schema = format!("\"{}\"", schema.name());
    let role = format!("\"{}\"", role.replace('"', "\"\""));
    Ok(scripts
        .iter()
        .flat_map(|script| statements(script))
        .map(|statement| {
            statement
                .replace("{schema}", &schema)
                .replace("{role}", &role)
        })
        .collect())
}

/// A script's statements without its comments, each on one line.
fn statements(script: &str) -> Vec<String> {
    let code: String = script
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join(" ");
    code.split(';')
        .map(|statement| statement.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|statement| !statement.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_grants_read_insert_update_and_purge_adds_delete() {
        let service = grant_statements(&Schema::default(), "app", Access::Service).unwrap();
        assert_eq!(
            service,
            [
                r#"grant usage on schema "tower_inbox" to "app""#,
                r#"grant select, insert, update on "tower_inbox".consumer_inbox, "tower_inbox".consumer_inbox_failure, "tower_inbox".message_outbox, "tower_inbox".inbox_quarantine to "app""#,
            ]
        );
        let purge = grant_statements(&Schema::default(), "app", Access::ServiceAndPurge).unwrap();
        assert_eq!(purge[..2], service[..]);
        assert_eq!(purge.len(), 3);
        assert!(purge[2].starts_with("grant delete on "), "{}", purge[2]);
    }

    #[test]
    fn the_partitioned_layout_adds_the_purges_functions_and_default_partition() {
        let schema = Schema::default().with_layout(Layout::Partitioned);
        let service = grant_statements(&schema, "app", Access::Service).unwrap();
        assert_eq!(
            service,
            grant_statements(&Schema::default(), "app", Access::Service).unwrap()
        );
        let purge = grant_statements(&schema, "app", Access::ServiceAndPurge).unwrap();
        for granted in [
            "inbox_drop_partition",
            "outbox_drop_partition",
            r#""tower_inbox".consumer_inbox_default"#,
            r#""tower_inbox".message_outbox_default"#,
        ] {
            assert!(purge.iter().any(|g| g.contains(granted)), "{granted}");
        }
    }

    #[test]
    fn role_names_are_quoted_and_bad_ones_refused() {
        let grants = grant_statements(&Schema::default(), r#"a"b; drop"#, Access::Service);
        assert!(grants.unwrap()[0].ends_with(r#" to "a""b; drop""#));
        for bad in ["", "a\0b", &"r".repeat(64)] {
            assert!(grant_statements(&Schema::default(), bad, Access::Service).is_err());
        }
    }
}
