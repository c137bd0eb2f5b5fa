//! SQL text shared by every component's statements: how a text value is bound (as UTF-8
//! bytes, so no session's `client_encoding` changes what it means) and how a row is found by
//! its message identity; and [`query`], which the statements that bind an identity start
//! from.

/// A `bytea` parameter holding UTF-8 as `text`, in the default collation (the collation
/// `convert_from` would otherwise take from its `name` argument is `"C"`, under which the
/// primary key cannot be used).
macro_rules! utf8 {
    ($param:literal) => {
        concat!(
            "pg_catalog.convert_from(",
            $param,
            ", 'UTF8') collate pg_catalog.\"default\""
        )
    };
}
pub(crate) use utf8;

/// `<alias>.<key column> = <parameter>` for the four key columns, bound as
/// [`bind_identity!`](crate::identity::bind_identity) binds them: `$1` to `$4`.
macro_rules! key_is {
    ($alias:literal) => {
        concat!(
            $alias,
            ".consumer_name = ",
            $crate::sql::utf8!("$1"),
            " and ",
            $alias,
            ".producer_name = ",
            $crate::sql::utf8!("$2"),
            " and ",
            $alias,
            ".tenant_id = ",
            $crate::sql::utf8!("$3"),
            " and ",
            $alias,
            ".message_id = $4"
        )
    };
}
pub(crate) use key_is;

/// Arguments room enough for the protocol's statements: the claim at commit binds the most
/// (twelve: the identity, fingerprint, version, lock keys and the response), and the bytes
/// cover its names, hex digests and a small recorded response.
const RESERVED_PARAMETERS: usize = 12;
const RESERVED_BYTES: usize = 512;

/// [`sqlx::query`] with its arguments' room reserved up front ([`Arguments::reserve`]):
/// binding a statement's parameters one by one grows the argument buffers several times, and
/// reserving them first saves about eleven allocations and reallocations per guarded request
/// on the claim's path (counted with `benches/instructions.sh`).
///
/// [`Arguments::reserve`]: sqlx::Arguments::reserve
pub(crate) fn query(
    sql: &str,
) -> sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let mut arguments = sqlx::postgres::PgArguments::default();
    sqlx::Arguments::reserve(&mut arguments, RESERVED_PARAMETERS, RESERVED_BYTES);
    sqlx::query_with(sql, arguments)
}
