//! Unit tests of the parent module.
//!
//! (Over 400 lines: each test is a table of cases, and the cases are the specification.)

use super::*;
use proptest::prelude::*;

fn canonical(json: &str) -> Option<String> {
    canonicalise(json.as_bytes()).map(|text| String::from_utf8(text).expect("UTF-8"))
}

/// The canonical text of a JSON document, as serde_json's `Value` reads and writes it:
/// the form before exact numbers.
fn value_canonical(json: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(json).ok()?;
    let mut out = String::new();
    super::super::write_canonical(&value, &mut out);
    Some(out)
}

#[test]
fn numbers_beyond_f64_precision_stay_distinct() {
    let a = canonical(r#"{"delta":10,"note":100000000000000000001}"#).unwrap();
    let b = canonical(r#"{"delta":10,"note":100000000000000000000}"#).unwrap();
    assert_eq!(a, r#"{"delta":10,"note":100000000000000000001e0}"#);
    assert_eq!(b, r#"{"delta":10,"note":1e20}"#);
    assert_eq!(
        canonical("0.10000000000000000001").unwrap(),
        "10000000000000000001e-20"
    );
    assert_eq!(canonical("0.1").unwrap(), "1e-1");
}

#[test]
fn equal_values_share_one_text() {
    for spelling in [
        "1", "1.0", "1e0", "10e-1", "0.1e1", "1E+0", "100e-2", "0.001e3",
    ] {
        assert_eq!(canonical(spelling).unwrap(), "1", "{spelling}");
    }
    for spelling in ["0", "-0", "0.0", "-0.000e-7", "0e5", "0E+00"] {
        assert_eq!(canonical(spelling).unwrap(), "0", "{spelling}");
    }
    for spelling in ["-2.50", "-25e-1", "-0.025e2", "-250E-2"] {
        assert_eq!(canonical(spelling).unwrap(), "-25e-1", "{spelling}");
    }
}

#[test]
fn integers_in_i64_or_u64_range_are_plain_digits_and_others_are_digits_e_power() {
    for (number, text) in [
        ("18446744073709551615", "18446744073709551615"),
        ("18446744073709551616", "18446744073709551616e0"),
        ("1.8446744073709551615e19", "18446744073709551615"),
        ("-9223372036854775808", "-9223372036854775808"),
        ("-9223372036854775809", "-9223372036854775809e0"),
        ("1e19", "10000000000000000000"),
        ("1e20", "1e20"),
        ("-1.5e3", "-1500"),
        ("2.5e-3", "25e-4"),
        ("123.456", "123456e-3"),
        ("1e-1000", "1e-1000"),
    ] {
        assert_eq!(canonical(number).unwrap(), text, "{number}");
    }
}

#[test]
fn exponents_are_limited_by_their_significant_digits() {
    let nines = "9".repeat(MAX_EXPONENT_DIGITS);
    assert_eq!(
        canonical(&format!("1e{nines}")).unwrap(),
        format!("1e{nines}")
    );
    assert_eq!(
        canonical(&format!("-1e-{nines}")).unwrap(),
        format!("-1e-{nines}")
    );
    // Leading zeros do not count.
    assert_eq!(
        canonical(&format!("1e{}5", "0".repeat(100))).unwrap(),
        "100000"
    );
    assert_eq!(canonical(&format!("[1e{nines}9]")), None);
    assert_eq!(canonical(&format!("0e-{nines}9")), None);
}

#[test]
fn keys_are_sorted_by_their_decoded_text_and_the_last_duplicate_wins() {
    // Decoded, "\n" (0x0A) sorts before "A"; escaped, `\n` (0x5C...) would sort after.
    let json = r#" { "b" : [1, {"y":2,"x":1}], "A" : true, "\n" : null, "b" : false } "#;
    let text = canonical(json).unwrap();
    assert_eq!(text, r#"{"\n":null,"A":true,"b":false}"#);
    assert_eq!(Some(text), value_canonical(json));
    assert_eq!(
        canonical(r#"{"a":1,"a":{"c":1,"b":2}}"#).unwrap(),
        r#"{"a":{"b":2,"c":1}}"#
    );
}

#[test]
fn strings_are_decoded_and_escaped_one_way() {
    assert_eq!(canonical(r#""\u00e9""#), canonical(r#""é""#));
    assert_eq!(canonical(r#""\u00E9""#).unwrap(), r#""é""#);
    assert_eq!(canonical(r#""\/\u0041\ud83d\ude00""#).unwrap(), r#""/A😀""#);
    assert_eq!(
        canonical(r#""\u001f\u0008\t\"\\""#).unwrap(),
        r#""\u001f\b\t\"\\""#
    );
    assert_eq!(canonical(r#"{"\u00e9":1}"#), canonical(r#"{"é":1}"#));
}

#[test]
fn what_is_not_json_is_refused() {
    for json in [
        "",
        "  ",
        "nul",
        "truee",
        "NaN",
        "Infinity",
        "+1",
        "01",
        "-01",
        "1.",
        ".5",
        "1e",
        "1e+",
        "-",
        "[1,]",
        "[1 2]",
        "[,1]",
        "{\"a\":1,}",
        "{\"a\" 1}",
        "{1:2}",
        "{\"a\"}",
        "[",
        "{\"a\":[}",
        "[}",
        "{]",
        "{} x",
        "{}{}",
        "\u{feff}{}",
        "\u{b}1",
        "\"a",
        "\"\\x\"",
        "\"\\u12\"",
        "\"\\u12g4\"",
        "\"\\ud800\"",
        "\"\\udc00\"",
        "\"\\ud800\\u0041\"",
        "\"\\ud800\\ud800\"",
        "\"\\udc00\\ud800\"",
        "\"tab\there\"",
        "\"\u{0}\"",
    ] {
        assert_eq!(canonical(json), None, "{json:?}");
        assert!(
            serde_json::from_str::<serde_json::Value>(json).is_err(),
            "{json:?}"
        );
    }
    assert_eq!(canonicalise(b"\"\xff\""), None);
    assert_eq!(canonicalise(b"[\"\xc3\"]"), None);
}

#[test]
fn nesting_is_limited_where_serde_json_limits_it() {
    let nested =
        |depth: usize, inner: &str| format!("{}{inner}{}", "[".repeat(depth), "]".repeat(depth));
    for inner in ["", "1", "{}", "{\"a\":1}"] {
        // `{}` and `{"a":1}` are one level more.
        let extra = usize::from(inner.starts_with('{'));
        let deepest = nested(DEPTH_LIMIT - 1 - extra, inner);
        assert_eq!(canonical(&deepest), Some(deepest.clone()));
        assert_eq!(value_canonical(&deepest), Some(deepest.clone()));
        let too_deep = nested(DEPTH_LIMIT - extra, inner);
        assert_eq!(canonical(&too_deep), None);
        assert_eq!(value_canonical(&too_deep), None);
    }
    let objects = format!(
        "{}1{}",
        "{\"a\":".repeat(DEPTH_LIMIT),
        "}".repeat(DEPTH_LIMIT)
    );
    assert_eq!(canonical(&objects), None);
    // Far deeper costs no stack.
    assert_eq!(canonical(&nested(1_000_000, "")), None);
}

/// A JSON text of an integer-only document, spelt in one of many equivalent ways: random
/// whitespace, escapes for any character, duplicate keys, keys in any order.
fn integer_document() -> impl Strategy<Value = String> {
    let whitespace = "[ \t\n\r]{0,2}";
    let character = prop_oneof![
        4 => any::<char>().prop_map(|c| match c {
            '"' => "\\\"".to_owned(),
            '\\' => "\\\\".to_owned(),
            c if u32::from(c) < 0x20 => format!("\\u{:04x}", u32::from(c)),
            c => c.to_string(),
        }),
        1 => any::<char>().prop_map(|c| {
            let mut units = [0; 2];
            c.encode_utf16(&mut units)
                .iter()
                .map(|unit| format!("\\u{unit:04X}"))
                .collect::<String>()
        }),
        1 => prop::sample::select(&["\\/", "\\b", "\\f", "\\n", "\\r", "\\t"][..])
            .prop_map(str::to_owned),
    ];
    let string = prop::collection::vec(character, 0..6)
        .prop_map(|characters| format!("\"{}\"", characters.concat()));
    let key = prop_oneof![
        3 => "[a-d]".prop_map(|k| format!("\"{k}\"")),
        1 => string.clone(),
    ];
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        string,
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        let item = (whitespace, inner.clone(), whitespace)
            .prop_map(|(before, value, after)| format!("{before}{value}{after}"));
        let member = (key.clone(), whitespace, inner, whitespace)
            .prop_map(|(key, ws, value, after)| format!("{key}{ws}:{ws}{value}{after}"));
        prop_oneof![
            prop::collection::vec(item, 0..6).prop_map(|items| format!("[{}]", items.join(","))),
            prop::collection::vec(member, 0..6)
                .prop_map(|members| format!("{{{}}}", members.join(","))),
        ]
    })
}

/// A number's value: negative, its digits (no leading zeros), and a power of ten.
type Decimal = (bool, String, i32);

fn decimal() -> impl Strategy<Value = Decimal> {
    (any::<bool>(), "0|[1-9][0-9]{0,21}", -4i32..4)
}

/// The value with no trailing zeros in its digits, and zero as `(false, "0", 0)`.
fn normalised((negative, digits, power): &Decimal) -> Decimal {
    let significant = digits.trim_end_matches('0');
    if significant.is_empty() {
        return (false, "0".to_owned(), 0);
    }
    let power = power + (digits.len() - significant.len()) as i32;
    (*negative, significant.to_owned(), power)
}

/// How to spell a number: leading zeros, trailing zeros, where the point goes, and how
/// the exponent is written.
type Spelling = (usize, usize, usize, &'static str);

fn spelling() -> impl Strategy<Value = Spelling> {
    (
        0usize..3,
        0usize..3,
        0usize..6,
        prop::sample::select(&["e", "E", "e+", "E+"][..]),
    )
}

/// The value written as its digits with `padding` leading and `zeros` trailing zeros, a
/// point `point` digits from the end, and the exponent that makes up for both.
fn spell((negative, digits, power): &Decimal, (padding, zeros, point, e): Spelling) -> String {
    let digits = format!("{}{digits}{}", "0".repeat(padding), "0".repeat(zeros));
    let point = point.min(digits.len() - 1);
    let (int, fraction) = digits.split_at(digits.len() - point);
    let int = match int.trim_start_matches('0') {
        "" => "0",
        int => int,
    };
    let sign = if *negative { "-" } else { "" };
    let fraction = if fraction.is_empty() {
        String::new()
    } else {
        format!(".{fraction}")
    };
    let exponent = match power - zeros as i32 + point as i32 {
        0 if point % 2 == 0 => String::new(),
        exponent if exponent >= 0 => format!("{e}{exponent}"),
        exponent => format!("e{exponent}"),
    };
    format!("{sign}{int}{fraction}{exponent}")
}

/// Text made of JSON tokens and near misses: often JSON, often just not.
fn json_like() -> impl Strategy<Value = String> {
    const TOKENS: &[&str] = &[
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        " ",
        "\n",
        "\"k\"",
        "\"\\u00e9\"",
        "\"\\ud83d\\ude00\"",
        "0",
        "-12",
        "1.5e-3",
        "1E+2",
        "1e400",
        "true",
        "null",
    ];
    const NEAR_MISSES: &[&str] = &[
        "\"\\ud800\"",
        "\"\\udc00\"",
        "01",
        "1.",
        ".5",
        "+1",
        "1e",
        "-",
        "\"\\x\"",
        "\"",
        "\"\u{1}\"",
        "tru",
        "\u{b}",
    ];
    let token = prop_oneof![
        12 => prop::sample::select(TOKENS),
        1 => prop::sample::select(NEAR_MISSES),
    ];
    let soup = prop::collection::vec(token.clone(), 0..10).prop_map(|tokens| tokens.concat());
    // A document with a token put in somewhere.
    let spliced =
        (integer_document(), any::<prop::sample::Index>(), token).prop_map(|(json, at, token)| {
            let at = json
                .char_indices()
                .map(|(i, _)| i)
                .nth(at.index(json.chars().count().max(1)))
                .unwrap_or(json.len());
            format!("{}{token}{}", &json[..at], &json[at..])
        });
    prop_oneof![soup, spliced]
}

proptest! {
    #[test]
    fn integer_documents_keep_their_earlier_canonical_text(json in integer_document()) {
        let text = canonical(&json);
        prop_assert!(text.is_some(), "refused {json:?}");
        prop_assert_eq!(text, value_canonical(&json), "{:?}", json);
    }

    #[test]
    fn one_value_spelt_two_ways_has_one_text(
        value in decimal(),
        a in spelling(),
        b in spelling(),
    ) {
        let (a, b) = (spell(&value, a), spell(&value, b));
        let text = canonical(&a).unwrap();
        prop_assert_eq!(canonical(&b), Some(text.clone()), "{} {}", a, b);
        prop_assert_eq!(canonical(&text), Some(text), "not a fixed point");
    }

    #[test]
    fn different_values_have_different_texts(
        a in decimal(),
        b in decimal(),
        a_spelling in spelling(),
        b_spelling in spelling(),
    ) {
        let a_text = canonical(&spell(&a, a_spelling)).unwrap();
        let b_text = canonical(&spell(&b, b_spelling)).unwrap();
        prop_assert_eq!(a_text == b_text, normalised(&a) == normalised(&b));
        // A neighbour: one more digit, worth a tenth of the last one.
        let (negative, digits, power) = &a;
        let neighbour = (*negative, format!("{digits}1"), power - 1);
        prop_assert_ne!(canonical(&spell(&neighbour, b_spelling)).unwrap(), a_text);
    }

    #[test]
    fn any_bytes_are_canonicalised_or_refused_without_panicking(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        if let Some(text) = canonicalise(&bytes) {
            prop_assert_eq!(canonicalise(&text), Some(text));
        }
    }
}

proptest! {
    // Most of these texts are near misses; more cases, more of them JSON.
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn json_like_text_is_accepted_where_serde_json_accepts_it(json in json_like()) {
        let ours = canonical(&json);
        match serde_json::from_str::<serde_json::Value>(&json) {
            Ok(_) => prop_assert!(ours.is_some(), "refused {json:?}"),
            // serde_json refuses what overflows an f64; an exact value has no such limit.
            Err(e) if e.to_string().starts_with("number out of range") => {}
            Err(e) => prop_assert!(ours.is_none(), "accepted {json:?} ({e})"),
        }
        if let Some(text) = ours {
            prop_assert_eq!(canonical(&text), Some(text), "not a fixed point");
        }
    }
}
