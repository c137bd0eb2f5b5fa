//! What the inbox holds for a message, and what a claim answers with it.

use bytes::Bytes;
use sqlx::postgres::PgRow;
use sqlx::Row;

use super::{ClaimedMessage, InboxError};
use crate::fingerprint::Fingerprint;

/// A response (or any outcome) recorded with the claim, replayed byte for byte to duplicates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedResponse {
    /// The status code.
    pub status: u16,
    /// Header names and values in the order they were sent; names in lowercase.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The complete body.
    pub body: Bytes,
}

impl RecordedResponse {
    /// The bytes it takes to record: the body plus every header name and value. A
    /// response's recording limit counts all of them.
    ///
    /// ```
    /// use tower_inbox::inbox::RecordedResponse;
    /// let r = RecordedResponse {
    ///     status: 201,
    ///     headers: vec![("location".into(), b"/a/1".to_vec())],
    ///     body: "{}".into(),
    /// };
    /// assert_eq!(r.recorded_len(), 2 + 8 + 4);
    /// ```
    pub fn recorded_len(&self) -> usize {
        self.body.len() + headers_len(&self.headers)
    }
}

/// The bytes header names and values take when recorded.
pub(crate) fn headers_len(headers: &[(String, Vec<u8>)]) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum()
}

/// What the inbox holds for a message that was claimed before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxEntry {
    /// The fingerprint of the payload that claimed it, in hex.
    pub payload_sha256: String,
    /// The handler version that processed (or is processing) it.
    pub handler_version: String,
    /// Whether the outcome is recorded. A committed claim always is.
    pub processed: bool,
    /// The recorded response, if the consumer recorded one.
    pub response: Option<RecordedResponse>,
}

/// The result of a claim attempt.
#[derive(Debug)]
pub enum Claim {
    /// This transaction owns first processing: do the business writes on it, then
    /// [`ClaimedMessage::commit`].
    Claimed(ClaimedMessage),
    /// A duplicate with the same fingerprint; its recorded outcome.
    Duplicate(InboxEntry),
    /// The same identity was claimed with a different fingerprint: a producer contract
    /// violation. The original is untouched.
    Conflict(InboxEntry),
    /// The original is still being processed and did not finish within the wait.
    InProgress,
}

/// What a claim that found the key taken answers, from the row that holds it.
pub(crate) fn seen(entry: InboxEntry, fingerprint: &Fingerprint) -> Claim {
    if entry.payload_sha256 != fingerprint.to_hex() {
        Claim::Conflict(entry)
    } else if entry.processed {
        Claim::Duplicate(entry)
    } else {
        Claim::InProgress
    }
}

/// The entry in a row of the `entry_columns!` of `sql.rs`, `None` where the row's left join
/// found no inbox row.
pub(crate) fn entry_from_row(row: &PgRow) -> Result<Option<InboxEntry>, InboxError> {
    let get = |e| InboxError::Database(e);
    let Some(payload_sha256) = row
        .try_get::<Option<String>, _>("payload_sha256")
        .map_err(get)?
    else {
        return Ok(None);
    };
    let status: Option<i16> = row.try_get("response_status").map_err(get)?;
    let response = match status {
        None => None,
        Some(status) => {
            let names: Vec<String> = row
                .try_get::<Option<Vec<String>>, _>("response_header_names")
                .map_err(get)?
                .unwrap_or_default();
            let values: Vec<Vec<u8>> = row
                .try_get::<Option<Vec<Vec<u8>>>, _>("response_header_values")
                .map_err(get)?
                .unwrap_or_default();
            if names.len() != values.len() {
                return Err(InboxError::Database(sqlx::Error::Decode(
                    "the recorded response has a different number of header names and values"
                        .into(),
                )));
            }
            let body: Vec<u8> = row
                .try_get::<Option<Vec<u8>>, _>("response_body")
                .map_err(get)?
                .unwrap_or_default();
            Some(RecordedResponse {
                status: u16::try_from(status).unwrap_or(500),
                headers: names.into_iter().zip(values).collect(),
                body: Bytes::from(body),
            })
        }
    };
    Ok(Some(InboxEntry {
        payload_sha256,
        handler_version: row.try_get("handler_version").map_err(get)?,
        processed: row.try_get("processed").map_err(get)?,
        response,
    }))
}

/// The response columns as the statements bind them: status, header names, header values,
/// body; all null for no response.
pub(crate) type ResponseBinds<'a> = (
    Option<i16>,
    Option<Vec<&'a str>>,
    Option<Vec<&'a [u8]>>,
    Option<&'a [u8]>,
);

pub(crate) fn response_binds(response: Option<&RecordedResponse>) -> ResponseBinds<'_> {
    match response {
        Some(r) => (
            Some(i16::try_from(r.status).unwrap_or(i16::MAX)),
            Some(r.headers.iter().map(|(n, _)| n.as_str()).collect()),
            Some(r.headers.iter().map(|(_, v)| v.as_slice()).collect()),
            Some(&r.body[..]),
        ),
        None => (None, None, None, None),
    }
}
