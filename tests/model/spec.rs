//! The model: a plain description of what the layer, the quarantine and the purge should do,
//! kept apart from the code under test. For each operation it says what the client or
//! operator gets back ([`Step`]) and what the database must hold afterwards
//! ([`Model::facts`]).
//!
//! Where the documentation promises something, the model says that (a commit recovers the
//! command's failure items, whatever else happened to its failure record); where it leaves a
//! choice to the implementation, the model follows the implementation (a discarded item is
//! stamped recovered only when the failure record still exists).

use tower_inbox::quarantine::Decision;

use crate::facts::{Facts, FailureFacts, ItemFacts, KeyFacts, RowFacts};
use crate::ops::{payload_sha256, Behave, Ending, Op, Settings, KEYS};

/// A committed command's recorded answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub payload: u8,
    pub status: u16,
    pub body: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    /// No committed row: the next claim runs the handler.
    Free,
    /// Claimed by a held request, uncommitted: invisible to every other transaction.
    InFlight,
    Committed(Recorded),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub state: KeyState,
    /// The committed row was moved past the purge window.
    pub row_old: bool,
    /// Business writes committed under this key (one per committed run).
    pub effects: i64,
    /// The purge deleted a committed row of this key at least once.
    pub ever_purged: bool,
    /// The failure record: failed attempts, and whether the last is past the window.
    pub failures: Option<FailureFacts>,
}

/// The two layers of a case: the same consumer, the same handler, different waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// `in_flight_wait` zero: a duplicate of a command in flight gets 409 at once.
    Impatient = 0,
    /// A long `in_flight_wait`: it waits for the original to finish.
    Patient = 1,
}

/// Whether a claim saw an earlier failure record of its key, which decides whether its
/// commit marks the failure items recovered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailedBefore {
    Yes,
    No,
    /// A waiter that claimed after its original failed: the original's failure is recorded
    /// after its rollback, in a transaction of its own, so the waiter's claim may or may not
    /// see it. When it does not, the failure is counted without opening an item (the count
    /// finds the key claimed), so the waiter's commit has nothing to recover. Both orders are
    /// correct and the model accepts either (see [`Race`]); `failure_race.rs` holds each
    /// deterministically.
    Racing,
}

impl From<bool> for FailedBefore {
    fn from(failed: bool) -> Self {
        if failed {
            Self::Yes
        } else {
            Self::No
        }
    }
}

/// How a failure counted while a duplicate waits for the key resolves: counted first
/// (`Recovers`: the duplicate's claim sees it, and its commit recovers the item), or after
/// the duplicate claimed (`Misses`: counted without opening an item, and the claim sees no
/// failure). The model is run both ways and the database may match either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Race {
    Recovers,
    Misses,
}

/// One request's command as the handler would see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub key: usize,
    pub payload: u8,
    /// Numbers the request within its case: its handler's answer names it.
    pub id: u64,
    /// The layer it went through.
    pub via: Via,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Session {
    Idle,
    /// Its request claimed its key and its handler waits for a release.
    Held {
        run: Run,
        failed_before: FailedBefore,
    },
    /// Its (patient) request waits for the command in flight under its key; if that rolls
    /// back it claims the key itself and behaves as `fallback`.
    Waiting {
        run: Run,
        fallback: Behave,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// An identity conflict, one item per conflicting payload.
    Conflict(u8),
    /// Repeated failed attempts.
    Failure,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub key: usize,
    pub source: Source,
    pub attempts: i32,
    pub decision: Option<Decision>,
    pub decided_old: bool,
    /// Recovered, and whether that is past the window.
    pub recovered: Option<bool>,
    pub purged: bool,
    /// Its id in the database, learnt after the step that opened it.
    pub id: Option<i64>,
}

/// What a request should get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// The handler's own answer of this run, not a replay.
    Fresh { status: u16, run: u64 },
    /// The recorded answer, marked replayed.
    Replayed(Recorded),
    /// A problem of the layer's.
    Problem { status: u16, kind: &'static str },
    /// Its handler runs and holds the claim.
    Started,
    /// It waits for the original in flight.
    Waiting,
}

/// What a quarantine decision should return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionAnswer {
    Done,
    AlreadyDecided,
    NotFound,
}

/// A request to send, as the model resolved the operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Send {
    pub session: usize,
    pub run: Run,
    pub reordered: bool,
    pub behave: Behave,
    pub expect: Expect,
}

/// What one operation does and should return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing applies (no idle session, nothing held, no item).
    Skip,
    Send(Send),
    /// The held request of `session` answers with `ending`; then the patient duplicate
    /// waiting for it, if any, is answered or starts.
    Release {
        session: usize,
        ending: Ending,
        expect: Expect,
        waiter: Option<(usize, Expect)>,
    },
    Decide {
        id: i64,
        repair: bool,
        expect: DecisionAnswer,
    },
    Age {
        key: usize,
    },
    Purge,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Model {
    pub settings: Settings,
    pub keys: Vec<Key>,
    pub sessions: Vec<Session>,
    pub items: Vec<Item>,
    /// What each layer's replay cache holds, per key (indexed by [`Via`]).
    pub caches: [Vec<Option<Recorded>>; 2],
    pub next_run: u64,
}

impl Model {
    pub fn new(settings: Settings) -> Self {
        let key = Key {
            state: KeyState::Free,
            row_old: false,
            effects: 0,
            ever_purged: false,
            failures: None,
        };
        Self {
            settings,
            keys: vec![key; KEYS],
            sessions: vec![Session::Idle; settings.sessions],
            items: Vec::new(),
            caches: [vec![None; KEYS], vec![None; KEYS]],
            next_run: 0,
        }
    }

    /// The step `op` makes, and every state the database may be in afterwards: one, or two
    /// when a failure is counted while a duplicate waits for the key (see [`Race`]).
    pub fn plan(&self, op: &Op) -> (Step, Vec<Model>) {
        let mut recovers = self.clone();
        let step = recovers.apply(op, Race::Recovers);
        let mut misses = self.clone();
        misses.apply(op, Race::Misses);
        if misses == recovers {
            (step, vec![recovers])
        } else {
            (step, vec![recovers, misses])
        }
    }

    /// A session holding a claim, if any.
    pub fn held_session(&self) -> Option<usize> {
        self.sessions
            .iter()
            .position(|s| matches!(s, Session::Held { .. }))
    }

    fn apply(&mut self, op: &Op, race: Race) -> Step {
        match *op {
            Op::Send { .. } => self.send(op, race),
            Op::Release { session, ending } => self.release(session, ending, race),
            Op::Decide { item, repair } => self.decide(item, repair),
            Op::Age { key } => {
                self.age(key);
                Step::Age { key }
            }
            Op::Purge => {
                self.purge();
                Step::Purge
            }
        }
    }

    /// What the database must hold now.
    pub fn facts(&self) -> Facts {
        let keys = (0..KEYS)
            .map(|key| {
                let k = &self.keys[key];
                let row = match &k.state {
                    KeyState::Committed(recorded) => Some(RowFacts {
                        payload_sha256: payload_sha256(recorded.payload),
                        processed: true,
                        status: Some(recorded.status),
                        body: Some(recorded.body.clone()),
                        old: k.row_old,
                    }),
                    KeyState::Free | KeyState::InFlight => None,
                };
                let items = self
                    .items
                    .iter()
                    .filter(|i| i.key == key && !i.purged)
                    .map(|i| ItemFacts {
                        source: match i.source {
                            Source::Conflict(_) => "identity-conflict",
                            Source::Failure => "handler-failure",
                        }
                        .to_owned(),
                        reason_code: match i.source {
                            Source::Conflict(_) => "payload-mismatch",
                            Source::Failure => "handler-error-status",
                        }
                        .to_owned(),
                        conflict_sha256: match i.source {
                            Source::Conflict(payload) => Some(payload_sha256(payload)),
                            Source::Failure => None,
                        },
                        attempts: i.attempts,
                        decision: i.decision.map(|d| d.as_str().to_owned()),
                        decided_old: i.decided_old,
                        recovered: i.recovered,
                    })
                    .collect();
                KeyFacts {
                    effects: k.effects,
                    row,
                    failures: k.failures,
                    items,
                }
            })
            .collect();
        let count = |f: fn(&Session) -> bool| self.sessions.iter().filter(|s| f(s)).count();
        Facts {
            keys,
            waiting: count(|s| matches!(s, Session::Waiting { .. })),
            in_flight: count(|s| matches!(s, Session::Held { .. })),
        }
    }

    /// Takes the ids the database gave the items, per key in the order they were opened.
    pub fn learn_ids(&mut self, ids: &[Vec<i64>]) {
        for (key, ids) in ids.iter().enumerate() {
            let live = self.items.iter_mut().filter(|i| i.key == key && !i.purged);
            for (item, id) in live.zip(ids) {
                item.id = Some(*id);
            }
        }
    }
}
