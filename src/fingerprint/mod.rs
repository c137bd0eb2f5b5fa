//! The payload fingerprint: SHA-256 over what makes two commands semantically the same.
//!
//! Same ID and same fingerprint is a retry; same ID and a different fingerprint is an
//! identity conflict. So the fingerprint must ignore what a retrying client may change
//! without changing its intent (JSON key order, whitespace) and include everything else: the
//! method, the path and query, and the body.
//!
//! # Canonical JSON
//!
//! [`FingerprintStrategy::Canonical`] (the default) and `CanonicalJson` hash a JSON body in one canonical
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
mod multipart;

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
    /// use tower_inbox::fingerprint::Fingerprint;
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
    /// use tower_inbox::fingerprint::Fingerprint;
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
    /// RFC 8259 JSON, nest 128 deep or have an exponent of more than 30 digits.
    ///
    /// This was the default before [`Canonical`](Self::Canonical); it hashes multipart
    /// bodies by their bytes, boundary included.
    CanonicalJson,
    /// Like [`CanonicalJson`](Self::CanonicalJson), and `multipart/form-data` bodies by their
    /// parts, whatever the boundary: each part's header lines (names lowercased, values
    /// trimmed, lines sorted) and its content. A retried upload whose client picked a new
    /// boundary is the same command; a changed field or file is another. A multipart body
    /// that is not well formed hashes its raw bytes. The default.
    #[default]
    Canonical,
    /// The body's bytes exactly as received.
    RawBytes,
    /// A user function over the whole payload.
    Custom(Arc<dyn Fn(&CommandPayload<'_>) -> Fingerprint + Send + Sync>),
}

impl FingerprintStrategy {
    /// A custom strategy from a function.
    ///
    /// ```
    /// use tower_inbox::fingerprint::{Fingerprint, FingerprintStrategy};
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
    /// use tower_inbox::fingerprint::{CommandPayload, FingerprintStrategy};
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
            Self::CanonicalJson => json_or_raw(payload),
            Self::Canonical => {
                let form = payload
                    .content_type
                    .and_then(|ct| multipart::canonicalise(ct, payload.body));
                match form {
                    Some(form) => hash_parts(payload, b"multipart", &form),
                    None => json_or_raw(payload),
                }
            }
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::CanonicalJson => "canonical-json",
            Self::Canonical => "canonical",
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

fn json_or_raw(payload: &CommandPayload<'_>) -> Fingerprint {
    let canonical = payload
        .content_type
        .filter(|ct| is_json_content_type(ct))
        .and_then(|_| canonical::canonicalise(payload.body));
    match canonical {
        Some(json) => hash_parts(payload, b"json", &json),
        None => hash_parts(payload, b"raw", payload.body),
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
mod tests;
