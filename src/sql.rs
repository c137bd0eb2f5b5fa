//! SQL text shared by every component's statements: how a text value is bound (as UTF-8
//! bytes, so no session's `client_encoding` changes what it means) and how a row is found by
//! its message identity.

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
