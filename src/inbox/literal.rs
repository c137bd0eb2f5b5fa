//! SQL text for the one message that records and commits together.
//!
//! Bound parameters need the extended protocol, one statement per round trip; the record
//! and its `COMMIT` can only share a message as a simple query, which has no parameters. So
//! the values travel as literals, and every one that comes from a request is hex-encoded and
//! decoded on the server (`decode('…', 'hex')`): the text holds nothing but hex digits,
//! numbers and fixed SQL, whatever the request carried and whatever the server's
//! `standard_conforming_strings` says.

use std::fmt::Write;

/// Responses larger than this are recorded with bound parameters instead: a literal is
/// twice the body's size and is parsed on every call.
pub(crate) const MAX_LITERAL_BODY: usize = 32 * 1024;

/// Builds the argument list of one function call.
pub(crate) struct Call {
    sql: String,
    first: bool,
}

impl Call {
    /// `select <function>(` …
    pub(crate) fn new(function: &str) -> Self {
        let mut sql = String::with_capacity(512);
        sql.push_str("select ");
        sql.push_str(function);
        sql.push('(');
        Self { sql, first: true }
    }

    fn next(&mut self) -> &mut String {
        if !self.first {
            self.sql.push_str(", ");
        }
        self.first = false;
        &mut self.sql
    }

    /// A `text` argument.
    pub(crate) fn text(mut self, value: &str) -> Self {
        text(self.next(), value);
        self
    }

    /// A `bytea` argument, `null` for none.
    pub(crate) fn bytea(mut self, value: Option<&[u8]>) -> Self {
        match value {
            Some(value) => bytea(self.next(), value),
            None => self.next().push_str("null::bytea"),
        }
        self
    }

    /// An integer argument of the given SQL type (`smallint`, `integer`), `null` for none.
    pub(crate) fn int(mut self, value: Option<i64>, sql_type: &str) -> Self {
        let out = self.next();
        match value {
            Some(value) => {
                let _ = write!(out, "{value}::{sql_type}");
            }
            None => {
                let _ = write!(out, "null::{sql_type}");
            }
        }
        self
    }

    /// A `text[]` argument, `null` for none.
    pub(crate) fn text_array<'a>(mut self, values: Option<impl Iterator<Item = &'a str>>) -> Self {
        let out = self.next();
        match values {
            None => out.push_str("null::text[]"),
            Some(values) => {
                out.push_str("array[");
                for (i, value) in values.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    text(out, value);
                }
                out.push_str("]::text[]");
            }
        }
        self
    }

    /// A `bytea[]` argument, `null` for none.
    pub(crate) fn bytea_array<'a>(
        mut self,
        values: Option<impl Iterator<Item = &'a [u8]>>,
    ) -> Self {
        let out = self.next();
        match values {
            None => out.push_str("null::bytea[]"),
            Some(values) => {
                out.push_str("array[");
                for (i, value) in values.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    bytea(out, value);
                }
                out.push_str("]::bytea[]");
            }
        }
        self
    }

    /// `…); commit; begin`: the call, the commit, and an empty transaction for the caller's
    /// transaction handle to roll back (quietly) when it is dropped.
    pub(crate) fn then_commit(mut self) -> String {
        self.sql.push_str("); commit; begin");
        self.sql
    }
}

fn hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for &b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0xf)] as char);
    }
}

fn bytea(out: &mut String, value: &[u8]) {
    out.push_str("decode('");
    hex(out, value);
    out.push_str("', 'hex')");
}

/// `convert_from` takes its encoding as a `name`, whose collation is `"C"`, and its result
/// inherits it: without `COLLATE "default"` a comparison with an indexed column no longer
/// matches the index's collation, and the primary-key lookup becomes a sequential scan.
fn text(out: &mut String, value: &str) {
    out.push_str("(convert_from(decode('");
    hex(out, value.as_bytes());
    out.push_str("', 'hex'), 'UTF8') collate \"default\")");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_data_reaches_the_text_only_as_hex() {
        let hostile = "x'); drop table consumer_inbox; --\\";
        let sql = Call::new("f")
            .text(hostile)
            .bytea(Some(b"\x00'\\"))
            .int(Some(201), "smallint")
            .int(None, "integer")
            .text_array(Some(["content-type", "a'b"].into_iter()))
            .bytea_array(Some([&b"v"[..]].into_iter()))
            .bytea(None)
            .text_array(None::<std::iter::Empty<&str>>)
            .then_commit();
        assert_eq!(
            sql,
            "select f((convert_from(decode('7827293b2064726f70207461626c6520636f6e73756d65725f\
             696e626f783b202d2d5c', 'hex'), 'UTF8') collate \"default\"), \
             decode('00275c', 'hex'), 201::smallint, null::integer, \
             array[(convert_from(decode('636f6e74656e742d74797065', 'hex'), 'UTF8') collate \"default\"), \
             (convert_from(decode('612762', 'hex'), 'UTF8') collate \"default\")]::text[], \
             array[decode('76', 'hex')]::bytea[], null::bytea, null::text[]); commit; begin"
        );
        // Only hex digits ever sit between the quotes.
        for quoted in sql.split('\'').skip(1).step_by(2) {
            assert!(
                quoted == "hex"
                    || quoted == "UTF8"
                    || quoted.chars().all(|c| c.is_ascii_hexdigit()),
                "{quoted}"
            );
        }
    }

    #[test]
    fn empty_arrays_and_values_are_well_formed() {
        let sql = Call::new("f")
            .text("")
            .text_array(Some(std::iter::empty()))
            .bytea_array(Some(std::iter::empty()))
            .then_commit();
        assert_eq!(
            sql,
            "select f((convert_from(decode('', 'hex'), 'UTF8') collate \"default\"), \
             array[]::text[], array[]::bytea[]); commit; begin"
        );
    }
}
