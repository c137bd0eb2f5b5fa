//! What the client's receipts must say, shared by the tests of its two front ends.

use tower_inbox::client::{CommandError, CommandReceipt, GiveUpReason};

/// A duplicate that waited out an in-flight original got the replay, after one attempt per
/// 409 `in-progress` it was answered (at least one) and one more.
pub fn assert_waited_out(receipt: &CommandReceipt, conflicts: usize) {
    assert!(receipt.replayed(), "{receipt:?}");
    assert!(receipt.attempts() >= 2, "{receipt:?}");
    assert_eq!(receipt.attempts() as usize, conflicts + 1, "{receipt:?}");
}

/// A streamed body's one attempt was refused: the error says it was not retried, and why.
pub fn assert_streamed_and_refused(error: &CommandError) {
    assert_eq!(
        (error.reason(), error.attempts()),
        (GiveUpReason::BodyStreamed, 1),
        "{error}"
    );
    assert!(error.key().is_some(), "the key is reported: {error}");
    assert!(
        !error.reached_server(),
        "the connection was refused: {error}"
    );
    let line = error.to_string();
    assert!(
        line.contains("stream") && line.contains("not retried"),
        "{line}"
    );
}
