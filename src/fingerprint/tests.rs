//! Unit tests of the parent module.

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
