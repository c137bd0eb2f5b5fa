//! The model test's inputs: one case's layer settings and its list of operations, and how
//! proptest draws (and shrinks) them.
//!
//! An operation names what a client or an operator does, never what should come of it: the
//! model decides that. Indexes (session, key, item) are taken modulo what exists, so every
//! drawn list is runnable and shrinking never produces an invalid one.

use proptest::prelude::*;

/// Keys per case: few, so that duplicates, conflicts and in-flight retries are common.
pub const KEYS: usize = 3;

/// How a handler run answers once it has made its business write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// 201: committed and recorded.
    Commit,
    /// 409 from the handler itself, a business refusal ("insufficient funds"): the default
    /// outcome policy commits and records it like a success.
    Refuse,
    /// 422, a rejected request shape: rolled back, nothing counted, the key stays free.
    Reject,
    /// 500: rolled back and counted as a failed attempt.
    Fail,
}

impl Ending {
    /// The status the handler answers with.
    pub fn status(self) -> u16 {
        match self {
            Self::Commit => 201,
            Self::Refuse => 409,
            Self::Reject => 422,
            Self::Fail => 500,
        }
    }

    /// Whether the default outcome policy commits this status.
    pub fn commits(self) -> bool {
        matches!(self, Self::Commit | Self::Refuse)
    }
}

/// What the handler does if this request gets to run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behave {
    /// Answer at once.
    Answer(Ending),
    /// Keep the claim open (uncommitted, its key in flight) until a [`Op::Release`].
    Hold,
}

/// One step of a case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// A client sends command `payload` under key `key` on a free session (the first idle
    /// one from `session` on; skipped when none is idle). `patient` sends it through the
    /// layer whose duplicates wait for an original in flight instead of getting 409 at once
    /// (one waiter per key; a waiter that would commit at once holds instead, see
    /// `requests.rs`). `reordered` writes the same JSON with its members in another order and
    /// other whitespace: the same command.
    Send {
        session: usize,
        key: usize,
        payload: u8,
        behave: Behave,
        patient: bool,
        reordered: bool,
    },
    /// The held command of a session (the first holding one from `session` on; skipped when
    /// none holds) answers with `ending`.
    Release { session: usize, ending: Ending },
    /// An operator decides quarantine item `item` (of all the case's items, in the order
    /// they were opened, purged ones included).
    Decide { item: usize, repair: bool },
    /// Time passes for one key: everything stored about it moves ten days back.
    Age { key: usize },
    /// The retention purge runs, with a window of two hours.
    Purge,
}

/// The layer settings a case runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Concurrent clients: at most this many requests are outstanding at once.
    pub sessions: usize,
    /// `quarantine_after`.
    pub quarantine_after: u32,
    /// `lookup_before_claim`: decided from the traffic (`None`), always or never.
    pub lookup: Option<bool>,
    /// Each layer keeps an in-process replay cache.
    pub replay_cache: bool,
    /// `mismatch_status(UnprocessableContent)` instead of 409.
    pub mismatch_422: bool,
}

/// One case: settings and operations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scenario {
    pub settings: Settings,
    pub ops: Vec<Op>,
}

fn ending() -> impl Strategy<Value = Ending> {
    // Weighted toward the outcomes that move a key on; shrinks toward Commit.
    prop_oneof![
        3 => Just(Ending::Commit),
        1 => Just(Ending::Refuse),
        1 => Just(Ending::Reject),
        3 => Just(Ending::Fail),
    ]
}

fn behave() -> impl Strategy<Value = Behave> {
    prop_oneof![
        2 => ending().prop_map(Behave::Answer),
        1 => Just(Behave::Hold),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    // Mostly the first payload: a second or third one under the same key is a conflict.
    let payload = prop_oneof![4 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)];
    let send = (
        0..3usize,
        0..KEYS,
        payload,
        behave(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(session, key, payload, behave, patient, reordered)| Op::Send {
                session,
                key,
                payload,
                behave,
                patient,
                reordered,
            },
        );
    prop_oneof![
        8 => send,
        3 => (0..3usize, ending()).prop_map(|(session, ending)| Op::Release { session, ending }),
        2 => (0..8usize, any::<bool>()).prop_map(|(item, repair)| Op::Decide { item, repair }),
        2 => (0..KEYS).prop_map(|key| Op::Age { key }),
        2 => Just(Op::Purge),
    ]
}

fn settings() -> impl Strategy<Value = Settings> {
    (
        2..=3usize,
        1..=3u32,
        prop_oneof![Just(None), Just(Some(true)), Just(Some(false))],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(sessions, quarantine_after, lookup, replay_cache, mismatch_422)| Settings {
                sessions,
                quarantine_after,
                lookup,
                replay_cache,
                mismatch_422,
            },
        )
}

/// A case of 1 to `max_ops` operations.
pub fn scenario(max_ops: usize) -> impl Strategy<Value = Scenario> {
    (settings(), proptest::collection::vec(op(), 1..=max_ops))
        .prop_map(|(settings, ops)| Scenario { settings, ops })
}

/// The command's body: the same JSON either way, so the same command to the layer.
pub fn command_body(payload: u8, reordered: bool) -> String {
    if reordered {
        format!("{{ \"note\" : \"model\",\n  \"payload\" : {payload} }}")
    } else {
        format!(r#"{{"payload":{payload},"note":"model"}}"#)
    }
}

/// The payload hash the layer stores for `payload` (the default fingerprint strategy over the
/// method, path and body).
pub fn payload_sha256(payload: u8) -> String {
    use tower_inbox::fingerprint::{CommandPayload, FingerprintStrategy};
    let body = command_body(payload, false);
    FingerprintStrategy::default()
        .fingerprint(&CommandPayload {
            method: "POST",
            path_and_query: PATH,
            content_type: Some("application/json"),
            body: body.as_bytes(),
        })
        .to_hex()
}

/// The route every command goes to.
pub const PATH: &str = "/commands";

/// What the handler of run `run` answers with `status`: unique per run, so a replay is
/// known to be the recorded answer and not a new run's.
pub fn response_body(run: u64, status: u16) -> String {
    format!(r#"{{"run":{run},"status":{status}}}"#)
}
