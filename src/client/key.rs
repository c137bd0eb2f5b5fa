//! The command's key: the caller's, or one the policy generates.

use http::header::{HeaderName, HeaderValue};
use http::request::Parts;

use super::error::{CommandError, GiveUpReason};
use super::RetryPolicy;

const KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Whether a request is a command the client handles: it has a key, or a method that gets
/// one. Any other passes through once, untouched.
#[cfg(feature = "client-reqwest")]
pub(crate) fn is_command(
    policy: &RetryPolicy,
    method: &http::Method,
    headers: &http::HeaderMap,
) -> bool {
    headers.contains_key(&KEY) || policy.key_methods.contains(method)
}

/// The key every attempt carries: the caller's, or a generated one for the key methods.
/// `None` for a request that has neither.
pub(crate) fn command_key(
    parts: &mut Parts,
    policy: &RetryPolicy,
) -> Result<Option<String>, CommandError> {
    let invalid = |key| CommandError::before_sending(key, GiveUpReason::InvalidKey, None);
    let mut values = parts.headers.get_all(&KEY).iter();
    match (values.next(), values.next()) {
        (Some(_), Some(_)) => Err(invalid(None)),
        (Some(value), None) => match value.to_str() {
            Ok(key) if valid_key(key) => Ok(Some(key.to_owned())),
            _ => Err(invalid(None)),
        },
        (None, _) if policy.key_methods.contains(&parts.method) => {
            let key = (policy.key_generator)();
            let value = HeaderValue::from_str(&key)
                .ok()
                .filter(|_| valid_key(&key))
                .ok_or_else(|| invalid(Some(key.clone())))?;
            parts.headers.insert(KEY, value);
            Ok(Some(key))
        }
        (None, _) => Ok(None),
    }
}

/// What the crate's server accepts as a plain key (it refuses anything else as
/// `key-malformed`, an answer no retry changes).
fn valid_key(key: &str) -> bool {
    !key.is_empty() && key.len() <= crate::MAX_KEY_LEN && key.bytes().all(|b| b.is_ascii_graphic())
}
