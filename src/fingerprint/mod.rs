//! The payload fingerprint: SHA-256 over what makes two commands semantically the same.
//!
//! Same ID and same fingerprint is a retry; same ID and a different fingerprint is an
//! identity conflict. So the fingerprint must ignore what a retrying client may change
//! without changing its intent (JSON key order, whitespace) and include everything else: the
//! method, the path and query, and the body.
//!
//! # Canonical JSON
//!
//! [`FingerprintStrategy::CanonicalJson`] (the default) hashes a JSON body in one canonical
//! text, read from the body's bytes:
//!
//! - no insignificant whitespace;
//! - object members sorted by key, compared as decoded strings (Rust's `str` order); of
//!   duplicate keys the last one is kept, as serde_json's `Value` keeps it;
//! - strings decoded (escapes resolved) and written again as serde_json writes a `String`, so
//!   `"\u00e9"` and `"é"` are the same text;
//! - numbers by their exact decimal value, written from its sign, its significant digits `D`
//!   (without leading or trailing zeros) and the power of ten `E` with value = ±D × 10^E:
//!   zero, of either sign, is `0`; an integer from −2^63 to 2^64 − 1 is its plain decimal
//!   digits, `-` first if negative (as serde_json writes an `i64` or `u64`); any other number is
//!   `D`, `e` and `E`, `-` first if negative (`15e-1` for `1.5`, `-1e-1` for `-0.1`, `1e20`,
//!   `100000000000000000001e0`). So `1`, `1.0`, `1e0` and `10e-1` are one command, and
//!   `100000000000000000001` and `100000000000000000000`, which an `f64` cannot tell apart,
//!   are two.
//!
//! A body with a JSON content type is hashed as raw bytes instead, exactly like any other body,
//! when it is not JSON by RFC 8259 (invalid UTF-8, a lone surrogate in a `\u` escape, a
//! control character in a string, text after the value, ...), when its arrays and objects nest
//! 128 deep (serde_json's limit), or when a number's exponent has more than 30 digits after its
//! leading zeros. Raw bytes never make two different bodies one command; at worst a retry
//! that changed only its layout is refused as a conflict.
//!
//! For documents whose numbers are all written as plain integers in `i64` or `u64` range (no
//! fraction, no exponent, not `-0`) this is the canonical text of earlier versions, and so the
//! same fingerprints. Bodies with other numbers have new fingerprints: earlier versions read
//! those as `f64`s and wrote them in whatever text the serde_json in the build gave an `f64`.

mod canonical;

use std::fmt;
use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// A SHA-256 payload fingerprint, shown and stored as 64 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of arbitrary bytes, for custom strategies and non-HTTP consumers.
    ///
    /// ```
    /// use tower_inbox::Fingerprint;
    /// let a = Fingerprint::of_bytes(b"add 10 credits");
    /// assert_eq!(a, Fingerprint::of_bytes(b"add 10 credits"));
    /// assert_ne!(a, Fingerprint::of_bytes(b"add 11 credits"));
    /// assert_eq!(a.to_hex().len(), 64);
    /// ```
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// The fingerprint of a JSON value in canonical form: object keys sorted, no
    /// insignificant whitespace. Two values that differ only in key order have the same
    /// fingerprint; it equals [`of_bytes`](Self::of_bytes) of the canonical text.
    ///
    /// A [`Value`]'s numbers are what serde_json kept of the text it read: without its
    /// `arbitrary_precision` feature an `f64`, `i64` or `u64`, so numbers an `f64` cannot tell
    /// apart are already one number here, and a float is written as serde_json writes an `f64`
    /// (`1.0`), not by the exact rule of [`FingerprintStrategy::CanonicalJson`], which reads
    /// the body's bytes. Integers in `i64` or `u64` range are written the same way by both.
    ///
    /// ```
    /// use serde_json::json;
    /// use tower_inbox::Fingerprint;
    /// let a = Fingerprint::of_json(&json!({"account": "a1", "bonus": 5}));
    /// assert_eq!(a, Fingerprint::of_json(&json!({"bonus": 5, "account": "a1"})));
    /// assert_eq!(a, Fingerprint::of_bytes(br#"{"account":"a1","bonus":5}"#));
    /// assert_ne!(a, Fingerprint::of_json(&json!({"account": "a1", "bonus": 6})));
    /// ```
    pub fn of_json(value: &Value) -> Self {
        let mut canonical = String::new();
        write_canonical(value, &mut canonical);
        Self::of_bytes(canonical.as_bytes())
    }

    pub(crate) fn from_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, the form stored in `payload_sha256`.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(64);
        for b in self.0 {
            out.push(char::from(DIGITS[usize::from(b >> 4)]));
            out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
        }
        out
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// What a fingerprint is computed from; independent of any HTTP library.
#[derive(Debug, Clone, Copy)]
pub struct CommandPayload<'a> {
    /// The request method, e.g. `POST`.
    pub method: &'a str,
    /// The path and query as sent, e.g. `/accounts/a1/credits?dry=false`.
    pub path_and_query: &'a str,
    /// The `Content-Type` header, if any.
    pub content_type: Option<&'a str>,
    /// The complete body.
    pub body: &'a [u8],
}

/// How the body contributes to the fingerprint.
///
/// The method and the path and query always contribute: the same key sent to another
/// account or with another verb is a different command, hence a conflict.
#[derive(Clone, Default)]
pub enum FingerprintStrategy {
    /// JSON bodies (a `Content-Type` of `application/json` or `*/*+json`) hash their canonical
    /// form: object members sorted by decoded key (the last of duplicate keys kept), no
    /// insignificant whitespace, string escapes decoded and written one way, and numbers by
    /// their exact decimal value. A number ±D × 10^E, with D its significant digits (no
    /// leading or trailing zeros), is written `0` if zero, as plain digits if an integer from
    /// −2^63 to 2^64 − 1, and as `D`, `e`, `E` otherwise, `-` first if negative (`15e-1` for
    /// `1.5`, `1e20`). Other bodies hash their raw bytes, and so do JSON bodies that are not
    /// RFC 8259 JSON, nest 128 deep or have an exponent of more than 30 digits. The default.
    #[default]
    CanonicalJson,
    /// The body's bytes exactly as received.
    RawBytes,
    /// A user function over the whole payload.
    Custom(Arc<dyn Fn(&CommandPayload<'_>) -> Fingerprint + Send + Sync>),
}

impl FingerprintStrategy {
    /// A custom strategy from a function.
    ///
    /// ```
    /// use tower_inbox::{Fingerprint, FingerprintStrategy};
    /// // Only the body counts: the same key may be retried against another path.
    /// let body_only = FingerprintStrategy::custom(|p| Fingerprint::of_bytes(p.body));
    /// # let _ = body_only;
    /// ```
    pub fn custom(f: impl Fn(&CommandPayload<'_>) -> Fingerprint + Send + Sync + 'static) -> Self {
        Self::Custom(Arc::new(f))
    }

    /// Computes the fingerprint of a command.
    ///
    /// ```
    /// use tower_inbox::{CommandPayload, FingerprintStrategy};
    /// let payload = |body: &'static [u8]| CommandPayload {
    ///     method: "POST",
    ///     path_and_query: "/accounts/a1/credits",
    ///     content_type: Some("application/json"),
    ///     body,
    /// };
    /// let s = FingerprintStrategy::CanonicalJson;
    /// assert_eq!(
    ///     s.fingerprint(&payload(br#"{"delta": 10, "note": "x"}"#)),
    ///     s.fingerprint(&payload(br#"{"note":"x","delta":10}"#)),
    /// );
    /// assert_ne!(
    ///     s.fingerprint(&payload(br#"{"delta": 10}"#)),
    ///     s.fingerprint(&payload(br#"{"delta": 11}"#)),
    /// );
    /// // Numbers count by their exact value, however they are written.
    /// assert_eq!(
    ///     s.fingerprint(&payload(br#"{"delta": 10}"#)),
    ///     s.fingerprint(&payload(br#"{"delta": 1.0e1}"#)),
    /// );
    /// assert_ne!(
    ///     s.fingerprint(&payload(br#"{"delta": 10, "note": 100000000000000000001}"#)),
    ///     s.fingerprint(&payload(br#"{"delta": 10, "note": 100000000000000000000}"#)),
    /// );
    /// ```
    pub fn fingerprint(&self, payload: &CommandPayload<'_>) -> Fingerprint {
        match self {
            Self::Custom(f) => f(payload),
            Self::RawBytes => hash_parts(payload, b"raw", payload.body),
            Self::CanonicalJson => {
                let canonical = payload
                    .content_type
                    .filter(|ct| is_json_content_type(ct))
                    .and_then(|_| canonical::canonicalise(payload.body));
                match canonical {
                    Some(json) => hash_parts(payload, b"json", &json),
                    None => hash_parts(payload, b"raw", payload.body),
                }
            }
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::CanonicalJson => "canonical-json",
            Self::RawBytes => "raw-bytes",
            Self::Custom(_) => "custom",
        }
    }
}

impl fmt::Debug for FingerprintStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Length-prefixes every field so that no two different payloads hash the same input (a path
/// ending where a body begins, say), and tags the body form so a raw body never collides with
/// a canonical one.
fn hash_parts(payload: &CommandPayload<'_>, form: &[u8], body: &[u8]) -> Fingerprint {
    let mut hasher = Sha256::new();
    hasher.update(b"tower-inbox/fingerprint/v1");
    for field in [
        payload.method.as_bytes(),
        payload.path_and_query.as_bytes(),
        form,
        body,
    ] {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field);
    }
    Fingerprint(hasher.finalize().into())
}

fn is_json_content_type(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Writes a [`Value`] in canonical form, for [`Fingerprint::of_json`].
///
/// Keys are sorted here rather than relying on `serde_json::Map` being a `BTreeMap`: another
/// crate in the build enabling serde_json's `preserve_order` feature would silently change
/// that, and with it every fingerprint.
fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(value, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn payload<'a>(content_type: Option<&'a str>, body: &'a [u8]) -> CommandPayload<'a> {
        CommandPayload {
            method: "POST",
            path_and_query: "/accounts/a1/credits",
            content_type,
            body,
        }
    }

    const JSON: Option<&str> = Some("application/json");

    #[test]
    fn canonical_json_ignores_key_order_and_whitespace() {
        let s = FingerprintStrategy::CanonicalJson;
        let a = s.fingerprint(&payload(JSON, br#"{"b":[1, {"y":2,"x":1}],"a":"\u0041"}"#));
        let b = s.fingerprint(&payload(
            Some("application/json; charset=utf-8"),
            b" {\n \"a\" : \"A\", \"b\":[1,{\"x\":1,\"y\":2}] }",
        ));
        assert_eq!(a, b);
        assert_eq!(
            canonical::canonicalise(br#"{"b":[1, {"y":2,"x":1}],"a":"\u0041"}"#).unwrap(),
            br#"{"a":"A","b":[1,{"x":1,"y":2}]}"#
        );
    }

    #[test]
    fn canonical_json_keeps_meaningful_differences() {
        let s = FingerprintStrategy::CanonicalJson;
        let f = |body: &[u8]| s.fingerprint(&payload(JSON, body));
        assert_ne!(f(br#"{"delta":10}"#), f(br#"{"delta":"10"}"#));
        assert_ne!(f(br#"[1,2]"#), f(br#"[2,1]"#));
        assert_ne!(f(br#"{"a":null}"#), f(br#"{}"#));
    }

    #[test]
    fn vendor_json_types_are_canonicalised_and_others_are_not() {
        let s = FingerprintStrategy::CanonicalJson;
        let problem = Some("application/problem+json");
        assert_eq!(
            s.fingerprint(&payload(problem, br#"{"a":1, "b":2}"#)),
            s.fingerprint(&payload(problem, br#"{"b":2,"a":1}"#)),
        );
        let text = Some("text/plain");
        assert_ne!(
            s.fingerprint(&payload(text, br#"{"a":1, "b":2}"#)),
            s.fingerprint(&payload(text, br#"{"b":2,"a":1}"#)),
        );
        assert_ne!(
            s.fingerprint(&payload(None, br#"{"a":1, "b":2}"#)),
            s.fingerprint(&payload(None, br#"{"b":2,"a":1}"#)),
        );
    }

    #[test]
    fn invalid_json_falls_back_to_raw_bytes() {
        let s = FingerprintStrategy::CanonicalJson;
        let raw = |body: &[u8]| FingerprintStrategy::RawBytes.fingerprint(&payload(JSON, body));
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        let huge_exponent = format!(r#"{{"delta":1e{}}}"#, "1".repeat(31));
        for body in [
            &b"{not json"[..],
            br#"{"delta":1} trailing"#,
            br#"{"note":"\ud800"}"#,
            b"{\"note\":\"tab\there\"}",
            deep.as_bytes(),
            huge_exponent.as_bytes(),
        ] {
            assert_eq!(s.fingerprint(&payload(JSON, body)), raw(body));
        }
        // Still canonical just inside the limits.
        let deepest = format!("{}{}", "[".repeat(127), "]".repeat(127));
        let exponent = format!(r#"{{"delta":1e{}}}"#, "1".repeat(30));
        for body in [deepest.as_bytes(), exponent.as_bytes()] {
            assert_ne!(s.fingerprint(&payload(JSON, body)), raw(body));
        }
    }

    #[test]
    fn numbers_an_f64_cannot_tell_apart_are_different_commands() {
        let s = FingerprintStrategy::CanonicalJson;
        let f = |body: &[u8]| s.fingerprint(&payload(JSON, body));
        assert_ne!(
            f(br#"{"delta":10,"note":100000000000000000001}"#),
            f(br#"{"delta":10,"note":100000000000000000000}"#),
        );
        assert_ne!(
            f(br#"{"rate":0.10000000000000000001}"#),
            f(br#"{"rate":0.1}"#)
        );
        assert_ne!(f(b"18446744073709551617"), f(b"18446744073709551616"));
        assert_ne!(f(b"-9223372036854775810"), f(b"-9223372036854775809"));
    }

    #[test]
    fn one_number_written_differently_is_one_command() {
        let s = FingerprintStrategy::CanonicalJson;
        let f = |body: &str| s.fingerprint(&payload(JSON, body.as_bytes()));
        let one = f(r#"{"delta":1}"#);
        for number in ["1.0", "1e0", "10e-1", "0.1e1", "1E+0", "100e-2"] {
            assert_eq!(f(&format!(r#"{{"delta":{number}}}"#)), one, "{number}");
        }
        let zero = f(r#"{"delta":0}"#);
        for number in ["-0", "0.0", "-0.0e5"] {
            assert_eq!(f(&format!(r#"{{"delta":{number}}}"#)), zero, "{number}");
        }
        assert_eq!(f(r#"{"rate":0.25}"#), f(r#"{"rate":2.50e-1}"#));
        assert_eq!(f(r#"{"name":"\u00e9"}"#), f(r#"{"name":"é"}"#));
    }

    #[test]
    fn raw_bytes_sees_every_byte() {
        let s = FingerprintStrategy::RawBytes;
        assert_ne!(
            s.fingerprint(&payload(JSON, br#"{"a":1}"#)),
            s.fingerprint(&payload(JSON, br#"{"a": 1}"#)),
        );
    }

    #[test]
    fn method_and_path_are_part_of_the_fingerprint() {
        let s = FingerprintStrategy::default();
        let base = payload(JSON, br#"{"delta":1}"#);
        let other_path = CommandPayload {
            path_and_query: "/accounts/a2/credits",
            ..base
        };
        let other_method = CommandPayload {
            method: "PATCH",
            ..base
        };
        let query = CommandPayload {
            path_and_query: "/accounts/a1/credits?x=1",
            ..base
        };
        let fp = s.fingerprint(&base);
        assert_ne!(fp, s.fingerprint(&other_path));
        assert_ne!(fp, s.fingerprint(&other_method));
        assert_ne!(fp, s.fingerprint(&query));
    }

    #[test]
    fn fields_are_length_prefixed() {
        let s = FingerprintStrategy::RawBytes;
        let a = CommandPayload {
            method: "POST",
            path_and_query: "/ab",
            content_type: None,
            body: b"c",
        };
        let b = CommandPayload {
            path_and_query: "/a",
            body: b"bc",
            ..a
        };
        assert_ne!(s.fingerprint(&a), s.fingerprint(&b));
    }

    #[test]
    fn hex_form_is_64_lowercase_digits() {
        let hex = Fingerprint::of_bytes(b"").to_hex();
        assert_eq!(
            hex,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "[a-z\"\\\\ é]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z]{0,4}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Serialises with keys in reverse order and extra whitespace: a different text of the
    /// same document.
    fn scrambled(value: &Value) -> String {
        match value {
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_by(|a, b| b.0.cmp(a.0));
                let inner: Vec<String> = entries
                    .into_iter()
                    .map(|(k, v)| format!(" {} :\n{} ", Value::String(k.clone()), scrambled(v)))
                    .collect();
                format!("{{ {} }}", inner.join(" , "))
            }
            Value::Array(items) => {
                let inner: Vec<String> = items.iter().map(scrambled).collect();
                format!("[ {} ]", inner.join(",\t"))
            }
            scalar => scalar.to_string(),
        }
    }

    proptest! {
        #[test]
        fn canonical_form_is_independent_of_layout(value in json_value()) {
            let compact = serde_json::to_vec(&value).unwrap();
            let other = scrambled(&value);
            let s = FingerprintStrategy::CanonicalJson;
            prop_assert_eq!(
                s.fingerprint(&payload(JSON, &compact)),
                s.fingerprint(&payload(JSON, other.as_bytes()))
            );
        }

        #[test]
        fn canonical_form_parses_back_to_the_same_document(value in json_value()) {
            let text = canonical::canonicalise(&serde_json::to_vec(&value).unwrap()).unwrap();
            let back: Value = serde_json::from_slice(&text).unwrap();
            prop_assert_eq!(back, value);
        }

        #[test]
        fn different_documents_have_different_fingerprints(a in json_value(), b in json_value()) {
            prop_assume!(a != b);
            let s = FingerprintStrategy::CanonicalJson;
            prop_assert_ne!(
                s.fingerprint(&payload(JSON, &serde_json::to_vec(&a).unwrap())),
                s.fingerprint(&payload(JSON, &serde_json::to_vec(&b).unwrap()))
            );
        }
    }
}
