//! SQL text for the messages that carry several statements: the `BEGIN` with the claim, and
//! the record with its `COMMIT`.
//!
//! Bound parameters need the extended protocol, one statement per round trip; statements
//! can only share a message as a simple query, which has no parameters. So the values travel
//! as literals, written so that no value can end its literal whatever it holds and whatever
//! the server's `standard_conforming_strings` says: text as an escape string (`E'…'`, where
//! a backslash is always an escape) with every backslash and quote doubled, bytes as hex
//! (`E'\\x…'::bytea`). A NUL, which no PostgreSQL text can hold, is written as the escape
//! `\000`, which the server refuses with an error rather than the message ending early.
//!
//! The literals are plain constants to the parser: no function call, so no overload
//! resolution on every message (an earlier `convert_from(decode('…', 'hex'), 'UTF8')` form
//! cost about twice the parse and plan time, and took the `"C"` collation of its `name`
//! argument, which turned primary-key lookups into sequential scans).

use std::fmt::Write;

use crate::identity::MessageIdentity;

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

    /// The identity's primary-key values, as four `text` arguments.
    pub(crate) fn identity(self, identity: &MessageIdentity) -> Self {
        identity
            .key_parts()
            .into_iter()
            .fold(self, |call, part| call.text(part))
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

    /// `…)`: the call alone.
    pub(crate) fn finish(mut self) -> String {
        self.sql.push(')');
        self.sql
    }

    /// `…); commit; begin`: the call, the commit, and an empty transaction for the caller's
    /// transaction handle to roll back (quietly) when it is dropped.
    pub(crate) fn then_commit(self) -> String {
        let mut sql = self.finish();
        sql.push_str("; commit; begin");
        sql
    }
}

/// `<select> where <column> = <value> and …`, every value a `text` literal.
pub(crate) fn select_where(select: &str, equal: &[(&str, &str)]) -> String {
    let mut sql = String::with_capacity(select.len() + 256);
    sql.push_str(select);
    for (i, (column, value)) in equal.iter().enumerate() {
        sql.push_str(if i == 0 { " where " } else { " and " });
        sql.push_str(column);
        sql.push_str(" = ");
        text(&mut sql, value);
    }
    sql
}

fn hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for &b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0xf)] as char);
    }
}

/// Bytes from lowercase or uppercase hex, as `encode(…, 'hex')` writes them; `None` for
/// anything else.
pub(crate) fn from_hex(hex: &str) -> Option<Vec<u8>> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let bytes = hex.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    bytes
        .chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

fn bytea(out: &mut String, value: &[u8]) {
    out.push_str("E'\\\\x");
    hex(out, value);
    out.push_str("'::bytea");
}

fn text(out: &mut String, value: &str) {
    out.reserve(value.len() + 3);
    out.push_str("E'");
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("''"),
            '\0' => out.push_str("\\000"),
            c => out.push(c),
        }
    }
    out.push('\'');
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads the escape-string literals back out of `sql` the way PostgreSQL does (an `E'`,
    /// then `''` for a quote and `\` escapes, up to the lone closing quote), and returns
    /// them with the text between them, each literal replaced by `L`.
    fn split_literals(sql: &str) -> (Vec<String>, String) {
        let mut literals = Vec::new();
        let mut outside = String::new();
        let mut chars = sql.chars().peekable();
        while let Some(c) = chars.next() {
            if c == 'E' && chars.peek() == Some(&'\'') {
                chars.next();
                let mut literal = String::new();
                loop {
                    match chars.next().expect("every literal is closed") {
                        '\'' if chars.peek() == Some(&'\'') => {
                            chars.next();
                            literal.push('\'');
                        }
                        '\'' => break,
                        '\\' => match chars.next().expect("an escape has a second char") {
                            '0' => {
                                assert_eq!((chars.next(), chars.next()), (Some('0'), Some('0')));
                                literal.push('\0');
                            }
                            c => literal.push(c),
                        },
                        c => literal.push(c),
                    }
                }
                literals.push(literal);
                outside.push('L');
            } else {
                outside.push(c);
            }
        }
        (literals, outside)
    }

    #[test]
    fn every_value_stays_inside_its_literal() {
        let hostile = "x'); drop table consumer_inbox; --\\'\\\\''\0é";
        let sql = Call::new("f")
            .text(hostile)
            .bytea(Some(b"\x00'\\"))
            .int(Some(201), "smallint")
            .int(None, "integer")
            .text_array(Some(["content-type", "a'b\\"].into_iter()))
            .bytea_array(Some([&b"v"[..]].into_iter()))
            .bytea(None)
            .text_array(None::<std::iter::Empty<&str>>)
            .then_commit();
        let (literals, outside) = split_literals(&sql);
        assert_eq!(
            literals,
            [hostile, "\\x00275c", "content-type", "a'b\\", "\\x76"]
        );
        assert_eq!(
            outside,
            "select f(L, L::bytea, 201::smallint, null::integer, array[L, L]::text[], \
             array[L::bytea]::bytea[], null::bytea, null::text[]); commit; begin"
        );
    }

    #[test]
    fn a_select_compares_each_column_with_a_literal() {
        let sql = select_where("select a from t", &[("x", "'"), ("y", "")]);
        assert_eq!(sql, "select a from t where x = E'''' and y = E''");
        assert_eq!(
            Call::new("f").int(Some(1), "integer").finish(),
            "select f(1::integer)"
        );
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
            "select f(E'', array[]::text[], array[]::bytea[]); commit; begin"
        );
    }

    #[test]
    fn hex_reads_back_and_refuses_anything_else() {
        let mut sql = String::new();
        hex(&mut sql, &[0, 0x7f, 0xff, 0x10]);
        assert_eq!(from_hex(&sql), Some(vec![0, 0x7f, 0xff, 0x10]));
        assert_eq!(from_hex("ABcd"), Some(vec![0xab, 0xcd]));
        assert_eq!(from_hex(""), Some(vec![]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
        assert_eq!(from_hex("é1"), None);
    }

    proptest::proptest! {
        #[test]
        fn any_text_reads_back_unchanged(value in "\\PC*|[\\\\'\\x00E]*") {
            let mut sql = String::new();
            text(&mut sql, &value);
            let (literals, outside) = split_literals(&sql);
            proptest::prop_assert_eq!(literals, vec![value]);
            proptest::prop_assert_eq!(outside, "L");
        }
    }
}
