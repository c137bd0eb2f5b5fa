//! The canonical JSON fingerprint's properties, checked against serde_json's reading of the
//! same bytes and against a second spelling of the same document.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde_json::Value;

use crate::fingerprint::{CommandPayload, Fingerprint, FingerprintStrategy};

/// A number whose exponent has more significant digits than this is refused by the canonical
/// form (the `fingerprint` module documents the limit), so its body is hashed as raw bytes.
const MAX_EXPONENT_DIGITS: usize = 30;

/// Canonical JSON fingerprints (`FingerprintStrategy::CanonicalJson` and the default
/// `Canonical`, which hashes a JSON body the same way): never a panic on any bytes, and
///
/// * one value, one fingerprint: a document that serde_json accepts is accepted (unless an
///   exponent is over the limit), and keeps its fingerprint when its object members are
///   reordered, its whitespace changed, every string character written as a `\u` escape and
///   every number spelt another way with the same exact value (`5` as `5.0e+0`, `1e5` as
///   `1.0E+05`);
///   Two documents that serde_json reads as one value with no `f64` in it have one
///   fingerprint too (`{"a":1,"a":2}` and `{"a":2}`);
/// * two values, two fingerprints: when serde_json reads two documents as different values
///   they have different fingerprints, and so do the two values with [`Fingerprint::of_json`].
///   Numbers count by their exact decimal value (`1`, `1.0` and `10e-1` are one number) and
///   serde_json keeps an `f64` of a number that is not a 64-bit integer, so two numbers whose
///   `f64`s are within a rounding error of each other may be one number and are not compared.
///
/// The bytes hold one document, or two separated by a NUL byte (which no JSON text holds).
pub fn check_fingerprint(data: &[u8]) {
    let (first, second) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], Some(&data[at + 1..])),
        None => (data, None),
    };
    // The multipart form never panics either, whatever the bytes.
    let _ = fingerprint(
        &FingerprintStrategy::Canonical,
        "multipart/form-data; boundary=b",
        data,
    );
    let first_value = check_one_value(first);
    let Some(second) = second else { return };
    let second_value = check_one_value(second);
    let (Some(a), Some(b)) = (first_value, second_value) else {
        return;
    };
    if a != b {
        assert_ne!(
            Fingerprint::of_json(&a),
            Fingerprint::of_json(&b),
            "of_json: {a} and {b} are different values with one fingerprint"
        );
    }
    // Without `f64`s serde_json kept every number exactly: equal values are one command.
    if a == b && is_exact(&a) && is_exact(&b) {
        assert_eq!(
            canonical(first).0,
            canonical(second).0,
            "{} and {} are one value with two fingerprints",
            String::from_utf8_lossy(first),
            String::from_utf8_lossy(second)
        );
    }
    if !may_be_equal(&a, &b) {
        assert_ne!(
            canonical(first).0,
            canonical(second).0,
            "{} and {} are different values with one fingerprint",
            String::from_utf8_lossy(first),
            String::from_utf8_lossy(second)
        );
    }
}

/// Checks one document: the same fingerprint by every JSON content type and the default
/// strategy, and by every spelling. Returns serde_json's value, if it reads one.
fn check_one_value(doc: &[u8]) -> Option<Value> {
    let (print, accepted) = canonical(doc);
    for (strategy, content_type) in [
        (FingerprintStrategy::Canonical, "application/json"),
        (
            FingerprintStrategy::CanonicalJson,
            "Application/JSON; charset=utf-8",
        ),
        (
            FingerprintStrategy::CanonicalJson,
            "application/vnd.api+json",
        ),
    ] {
        assert_eq!(
            fingerprint(&strategy, content_type, doc),
            print,
            "{strategy:?} with {content_type}"
        );
    }
    let value: Value = serde_json::from_slice(doc).ok()?;
    let text = std::str::from_utf8(doc).expect("serde_json read it, so it is UTF-8");
    let kept = Relayout::new(text, false)
        .document()
        .expect("a document serde_json reads can be laid out again");
    // The second spelling keeps the numbers' text, so serde_json reads the same value from it.
    assert_eq!(
        serde_json::from_str::<Value>(&kept.text).ok().as_ref(),
        Some(&value),
        "the fuzz check's own relayout changed {text} to {}",
        kept.text
    );
    if kept.long_exponent {
        assert!(
            !accepted,
            "an exponent over the limit is hashed raw: {text}"
        );
        return Some(value);
    }
    assert!(
        accepted,
        "canonical JSON refused what serde_json reads: {text}"
    );
    let respelt = Relayout::new(text, true)
        .document()
        .expect("a document serde_json reads can be respelt");
    for other in [&kept.text, &respelt.text] {
        assert_eq!(
            canonical(other.as_bytes()).0,
            print,
            "{text} and {other} are one value with two fingerprints"
        );
    }
    Some(value)
}

fn fingerprint(strategy: &FingerprintStrategy, content_type: &str, body: &[u8]) -> Fingerprint {
    strategy.fingerprint(&CommandPayload {
        method: "POST",
        path_and_query: "/fuzz",
        content_type: Some(content_type),
        body,
    })
}

/// The canonical JSON fingerprint of a body, and whether it was hashed in canonical form
/// rather than as raw bytes (a body that is not JSON hashes as `RawBytes` hashes it).
fn canonical(body: &[u8]) -> (Fingerprint, bool) {
    let json = fingerprint(
        &FingerprintStrategy::CanonicalJson,
        "application/json",
        body,
    );
    let raw = fingerprint(&FingerprintStrategy::RawBytes, "application/json", body);
    (json, json != raw)
}

/// Whether serde_json kept every number of `value` exactly: as an `i64` or `u64`, not an `f64`.
fn is_exact(value: &Value) -> bool {
    match value {
        Value::Number(n) => n.is_i64() || n.is_u64(),
        Value::Array(items) => items.iter().all(is_exact),
        Value::Object(members) => members.values().all(is_exact),
        _ => true,
    }
}

/// Whether two values may be one value by the canonical rules: equal, except that numbers
/// serde_json kept as `f64`s are compared within a relative rounding error.
fn may_be_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            if let (Some(i), Some(j)) = (x.as_i64(), y.as_i64()) {
                return i == j;
            }
            if let (Some(i), Some(j)) = (x.as_u64(), y.as_u64()) {
                return i == j;
            }
            let (Some(p), Some(q)) = (x.as_f64(), y.as_f64()) else {
                return false;
            };
            p == q || (p - q).abs() <= 1e-9 * p.abs().max(q.abs())
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| may_be_equal(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(key, p)| y.get(key).is_some_and(|q| may_be_equal(p, q)))
        }
        _ => a == b,
    }
}

/// A document serde_json accepted, written again: other whitespace, object members in reverse
/// order, every string character as a `\u` escape and, if asked, every number spelt another
/// way with the same exact value.
struct Relayout<'a> {
    text: &'a str,
    pos: usize,
    respell_numbers: bool,
    long_exponent: bool,
}

/// A document written again, and whether it has an exponent over the canonical form's limit.
struct Written {
    text: String,
    long_exponent: bool,
}

impl<'a> Relayout<'a> {
    fn new(text: &'a str, respell_numbers: bool) -> Self {
        Self {
            text,
            pos: 0,
            respell_numbers,
            long_exponent: false,
        }
    }

    fn document(mut self) -> Option<Written> {
        let value = self.value()?;
        self.skip_whitespace();
        (self.pos == self.text.len()).then(|| Written {
            text: format!("\r\n{value}\t"),
            long_exponent: self.long_exponent,
        })
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.pos += 1;
        Some(byte)
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    /// Recursive: serde_json refuses documents nested 128 deep, so the depth is bounded.
    fn value(&mut self) -> Option<String> {
        self.skip_whitespace();
        match self.peek()? {
            b'{' => self.object(),
            b'[' => self.array(),
            b'"' => self.string().map(|s| escaped(&s)),
            b'-' | b'0'..=b'9' => Some(self.number()),
            _ => {
                let literal = ["true", "false", "null"].into_iter().find(|literal| {
                    self.text
                        .get(self.pos..)
                        .is_some_and(|r| r.starts_with(literal))
                })?;
                self.pos += literal.len();
                Some(literal.to_owned())
            }
        }
    }

    fn object(&mut self) -> Option<String> {
        self.pos += 1;
        self.skip_whitespace();
        let mut members = Vec::new();
        if self.peek() == Some(b'}') {
            self.pos += 1;
        } else {
            loop {
                self.skip_whitespace();
                let key = self.string()?;
                self.skip_whitespace();
                (self.next()? == b':').then_some(())?;
                members.push((key, self.value()?));
                self.skip_whitespace();
                match self.next()? {
                    b',' => {}
                    b'}' => break,
                    _ => return None,
                }
            }
        }
        // Of equal keys the last one counts, so an object with a repeated key keeps its order.
        let keys: BTreeSet<&String> = members.iter().map(|(key, _)| key).collect();
        if keys.len() == members.len() {
            members.reverse();
        }
        let members: Vec<String> = members
            .iter()
            .map(|(key, value)| format!("{}\n:\t{value}", escaped(key)))
            .collect();
        Some(format!("{{ {} }}", members.join(" ,\r\n")))
    }

    fn array(&mut self) -> Option<String> {
        self.pos += 1;
        self.skip_whitespace();
        let mut items = Vec::new();
        if self.peek() == Some(b']') {
            self.pos += 1;
        } else {
            loop {
                items.push(self.value()?);
                self.skip_whitespace();
                match self.next()? {
                    b',' => {}
                    b']' => break,
                    _ => return None,
                }
            }
        }
        Some(format!("[\t{}\n]", items.join("\t,  ")))
    }

    /// The decoded string at the cursor, which is on its opening quote.
    fn string(&mut self) -> Option<String> {
        let start = self.pos;
        self.pos += 1;
        loop {
            match self.next()? {
                b'"' => break,
                b'\\' => {
                    self.next()?;
                }
                _ => {}
            }
        }
        serde_json::from_str(self.text.get(start..self.pos)?).ok()
    }

    /// The number at the cursor, as written or respelt: a fraction digit more (`.0` or `0`)
    /// and an exponent with an explicit sign and a leading zero (`e+0` where there was none).
    fn number(&mut self) -> String {
        let start = self.pos;
        while matches!(
            self.peek(),
            Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
        ) {
            self.pos += 1;
        }
        // The cursor moved over ASCII bytes only: both ends are character boundaries.
        let number = self.text.get(start..self.pos).unwrap_or_default();
        let (mantissa, exponent) = match number.split_once(['e', 'E']) {
            Some((mantissa, exponent)) => (mantissa, Some(exponent)),
            None => (number, None),
        };
        let (sign, digits) = match exponent {
            Some(e) => match e.strip_prefix('-') {
                Some(digits) => ("-", digits),
                None => ("+", e.strip_prefix('+').unwrap_or(e)),
            },
            None => ("+", "0"),
        };
        if digits.trim_start_matches('0').len() > MAX_EXPONENT_DIGITS {
            self.long_exponent = true;
        }
        if !self.respell_numbers {
            return number.to_owned();
        }
        let point = if mantissa.contains('.') { "0" } else { ".0" };
        format!("{mantissa}{point}E{sign}0{digits}")
    }
}

/// A JSON string of `text` with every character written as `\u` escapes (UTF-16 units).
fn escaped(text: &str) -> String {
    let mut out = String::from('"');
    for unit in text.encode_utf16() {
        let _ = write!(out, "\\u{unit:04X}");
    }
    out.push('"');
    out
}
