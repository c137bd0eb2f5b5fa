//! Reading a guarded request: its key, its fingerprint, its body under the limit.

use crate::fingerprint::{CommandPayload, Fingerprint};
use crate::key::{KeyError, MessageKey};
use crate::middleware::config::InboxConfig;
use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::request::Parts;
use http::HeaderMap;
use http_body_util::{BodyExt, LengthLimitError, Limited};

pub(super) fn read_key(
    headers: &HeaderMap,
    config: &InboxConfig,
) -> Result<Option<MessageKey>, KeyError> {
    let mut values = headers.get_all(&config.key_header).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    MessageKey::parse(value.as_bytes(), config.max_key_len).map(Some)
}

pub(super) fn fingerprint(config: &InboxConfig, parts: &Parts, body: &[u8]) -> Fingerprint {
    let payload = CommandPayload {
        method: parts.method.as_str(),
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path(), |pq| pq.as_str()),
        content_type: parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
        body,
    };
    config.fingerprint.fingerprint(&payload)
}

pub(super) enum ReadError {
    TooLarge,
    Failed(crate::body::BoxError),
}

/// Buffers a body up to `limit` bytes; a declared length over it is refused unread.
pub(super) async fn read_limited<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<crate::body::BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => Err(ReadError::TooLarge),
        Err(err) => Err(ReadError::Failed(err)),
    }
}
