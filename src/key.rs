//! Parsing and validating the producer-assigned command ID (the `Idempotency-Key`).
//!
//! Two spellings are accepted, because clients in the wild send both:
//!
//! * a bare value: `Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`;
//! * an RFC 8941 sf-string, the form of the IETF Idempotency-Key draft:
//!   `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`.
//!
//! Both name the same key: the quotes are syntax, not part of the identity. The key itself
//! must be 1 to [`MAX_KEY_LEN`] (by default) visible ASCII characters (`!` to `~`).

use std::fmt;

/// The default and largest accepted key length, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// A validated message ID: 1 to `max_len` visible ASCII characters.
///
/// ```
/// use tower_inbox::MessageKey;
///
/// let bare = MessageKey::parse(b"order-42", 255).unwrap();
/// let quoted = MessageKey::parse(br#""order-42""#, 255).unwrap();
/// assert_eq!(bare, quoted);
/// assert_eq!(bare.as_str(), "order-42");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct MessageKey(String);

/// Why a key was refused. Each variant is a different thing for the client to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The value (or the sf-string's content) is empty.
    #[error("the key is empty")]
    Empty,
    /// The key is longer than the configured limit.
    #[error("the key has {len} characters; at most {max} are accepted")]
    TooLong {
        /// The key's length.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// A byte outside visible ASCII (`!`..=`~`) appears in the key.
    #[error("the key contains a character that is not visible ASCII at position {position}")]
    NotVisibleAscii {
        /// Zero-based byte offset in the header value.
        position: usize,
    },
    /// The value starts like an RFC 8941 sf-string but is not a valid one.
    #[error("the quoted key is not a valid RFC 8941 string: {0}")]
    BadSfString(&'static str),
    /// A bare key contains a character that only makes sense in a quoted one.
    #[error("a bare key may not contain '\"', '\\' or ','; quote it as an RFC 8941 string")]
    AmbiguousBareKey,
    /// The header was sent more than once.
    #[error("the header was sent more than once")]
    Repeated,
}

impl MessageKey {
    /// Parses a header value: a bare key or an RFC 8941 sf-string, surrounded by optional
    /// spaces.
    ///
    /// Parameters after an sf-string (`"k";a=1`) are refused rather than ignored: two
    /// requests that differ only in them would otherwise silently share an identity.
    pub fn parse(value: &[u8], max_len: usize) -> Result<Self, KeyError> {
        let value = trim_sp(value);
        let key = match value.first() {
            None => return Err(KeyError::Empty),
            Some(b'"') => parse_sf_string(value)?,
            Some(_) => parse_bare(value)?,
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > max_len {
            return Err(KeyError::TooLong {
                len: key.len(),
                max: max_len,
            });
        }
        Ok(Self(key))
    }

    /// Wraps an ID that comes from somewhere other than an HTTP header (a broker message, a
    /// migration step), applying the same rules as [`MessageKey::parse`] to the bare form.
    pub fn new(id: impl AsRef<str>) -> Result<Self, KeyError> {
        Self::parse(id.as_ref().as_bytes(), MAX_KEY_LEN)
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an RFC 8941 sf-string, ready for a request header.
    pub fn to_sf_string(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 2);
        out.push('"');
        for c in self.0.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }
}

impl fmt::Debug for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("MessageKey").field(&self.0).finish()
    }
}

impl fmt::Display for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for MessageKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

fn trim_sp(mut value: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    value
}

fn is_visible(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

fn parse_bare(value: &[u8]) -> Result<String, KeyError> {
    if let Some(position) = value.iter().position(|&b| !is_visible(b)) {
        return Err(KeyError::NotVisibleAscii { position });
    }
    if value.iter().any(|&b| matches!(b, b'"' | b'\\' | b',')) {
        return Err(KeyError::AmbiguousBareKey);
    }
    // Every byte is ASCII, so this cannot fail; the fallback keeps the function total.
    String::from_utf8(value.to_vec()).map_err(|_| KeyError::NotVisibleAscii { position: 0 })
}

/// RFC 8941 section 4.2.5, restricted to what a key may hold: the unescaped content must be
/// visible ASCII, so a space inside the quotes is refused too.
fn parse_sf_string(value: &[u8]) -> Result<String, KeyError> {
    let mut out = String::with_capacity(value.len());
    let mut iter = value.iter().copied().enumerate().skip(1);
    while let Some((position, b)) = iter.next() {
        match b {
            b'\\' => match iter.next() {
                Some((_, c @ (b'"' | b'\\'))) => out.push(char::from(c)),
                Some(_) => return Err(KeyError::BadSfString("only \\\" and \\\\ are escapes")),
                None => return Err(KeyError::BadSfString("the string ends inside an escape")),
            },
            b'"' => {
                if iter.next().is_some() {
                    return Err(KeyError::BadSfString(
                        "characters follow the closing quote (parameters are not accepted)",
                    ));
                }
                return Ok(out);
            }
            b if is_visible(b) => out.push(char::from(b)),
            _ => return Err(KeyError::NotVisibleAscii { position }),
        }
    }
    Err(KeyError::BadSfString("the closing quote is missing"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(v: &str) -> Result<MessageKey, KeyError> {
        MessageKey::parse(v.as_bytes(), MAX_KEY_LEN)
    }

    #[test]
    fn bare_and_quoted_forms_name_the_same_key() {
        assert_eq!(parse("abc-1").unwrap().as_str(), "abc-1");
        assert_eq!(parse("\"abc-1\"").unwrap().as_str(), "abc-1");
        assert_eq!(parse("  abc-1\t").unwrap().as_str(), "abc-1");
        assert_eq!(parse(r#""a\"b\\c""#).unwrap().as_str(), r#"a"b\c"#);
    }

    #[test]
    fn refuses_malformed_keys_with_a_reason() {
        assert_eq!(parse(""), Err(KeyError::Empty));
        assert_eq!(parse("   "), Err(KeyError::Empty));
        assert_eq!(parse("\"\""), Err(KeyError::Empty));
        assert_eq!(parse("a b"), Err(KeyError::NotVisibleAscii { position: 1 }));
        assert_eq!(
            parse("\"a b\""),
            Err(KeyError::NotVisibleAscii { position: 2 })
        );
        assert_eq!(
            MessageKey::parse("é".as_bytes(), MAX_KEY_LEN),
            Err(KeyError::NotVisibleAscii { position: 0 })
        );
        assert_eq!(parse("a,b"), Err(KeyError::AmbiguousBareKey));
        assert_eq!(parse("a\"b"), Err(KeyError::AmbiguousBareKey));
        assert!(matches!(parse("\"abc"), Err(KeyError::BadSfString(_))));
        assert!(matches!(
            parse("\"abc\";p=1"),
            Err(KeyError::BadSfString(_))
        ));
        assert!(matches!(parse(r#""a\nb""#), Err(KeyError::BadSfString(_))));
        assert!(matches!(parse("\"abc\\"), Err(KeyError::BadSfString(_))));
    }

    #[test]
    fn length_limit_counts_the_unquoted_key() {
        let max = "k".repeat(MAX_KEY_LEN);
        assert!(parse(&max).is_ok());
        assert!(parse(&format!("\"{max}\"")).is_ok());
        assert_eq!(
            parse(&format!("{max}k")),
            Err(KeyError::TooLong {
                len: MAX_KEY_LEN + 1,
                max: MAX_KEY_LEN
            })
        );
        assert_eq!(
            MessageKey::parse(b"abcd", 3),
            Err(KeyError::TooLong { len: 4, max: 3 })
        );
    }

    #[test]
    fn a_value_in_quotes_is_an_sf_string_and_a_key_with_quotes_round_trips() {
        // Found by the round-trip property: a bare value that starts with a quote is read
        // as an sf-string, while the key `"#"` (quotes included) survives its quoted form.
        assert_eq!(parse("\"#\"").unwrap().as_str(), "#");
        let with_quotes = MessageKey("\"#\"".to_owned());
        let sent = with_quotes.to_sf_string();
        assert_eq!(parse(&sent).unwrap(), with_quotes);
    }

    proptest! {
        #[test]
        fn never_panics_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = MessageKey::parse(&bytes, MAX_KEY_LEN);
        }

        #[test]
        fn sf_string_form_round_trips(key in "[!-~]{1,255}") {
            let parsed = MessageKey::parse(key.as_bytes(), MAX_KEY_LEN);
            let quoted = MessageKey::parse(
                MessageKey(key.clone()).to_sf_string().as_bytes(),
                MAX_KEY_LEN,
            ).unwrap();
            prop_assert_eq!(quoted.as_str(), key.as_str());
            // A bare key, when accepted, is the same key as its quoted form. A value that
            // starts with a quote is not bare: it is read as an sf-string (`"#"` is the key
            // `#`), whatever the key it was generated from.
            if let (Ok(bare), false) = (parsed, key.starts_with('"')) {
                prop_assert_eq!(bare, quoted);
            }
        }

        #[test]
        fn accepted_keys_are_visible_ascii_within_the_limit(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(key) = MessageKey::parse(&bytes, MAX_KEY_LEN) {
                prop_assert!(!key.as_str().is_empty() && key.as_str().len() <= MAX_KEY_LEN);
                prop_assert!(key.as_str().bytes().all(is_visible));
            }
        }
    }
}
