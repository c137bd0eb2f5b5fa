//! The model's rules for what outlives a request: failure records, quarantine items, their
//! decisions and recoveries, and what the retention purge deletes.

use tower_inbox::quarantine::Decision;

use crate::facts::FailureFacts;
use crate::spec::{DecisionAnswer, FailedBefore, Item, KeyState, Model, Race, Source, Step};

impl Model {
    /// A failed attempt of `key`: counted in its failure record; from `quarantine_after`
    /// failures on, the command has an open item carrying the count (a new one once the
    /// last was decided).
    ///
    /// Unless `may_open` (another attempt claimed the key before the failure was counted), an
    /// item already open is counted but none is opened.
    pub(crate) fn fail(&mut self, key: usize, may_open: bool) {
        let attempts = self.keys[key].failures.map_or(1, |f| f.attempts + 1);
        self.keys[key].failures = Some(FailureFacts {
            attempts,
            old: false,
        });
        let quarantined = attempts >= i32::try_from(self.settings.quarantine_after).expect("small");
        match self.open_item(key, Source::Failure) {
            Some(item) if quarantined || !may_open => item.attempts = attempts,
            None if quarantined && may_open => {
                self.items.push(Item::open(key, Source::Failure, attempts));
            }
            Some(_) | None => {}
        }
    }

    /// `key` reused with `payload`: one open item per conflicting payload, counted.
    pub(crate) fn conflict(&mut self, key: usize, payload: u8) {
        match self.open_item(key, Source::Conflict(payload)) {
            Some(item) => item.attempts += 1,
            None => self
                .items
                .push(Item::open(key, Source::Conflict(payload), 1)),
        }
    }

    fn open_item(&mut self, key: usize, source: Source) -> Option<&mut Item> {
        self.items
            .iter_mut()
            .find(|i| i.key == key && i.source == source && !i.purged && i.decision.is_none())
    }

    /// A commit of `key`: "a failing command is marked recovered when one of its retries
    /// commits". An open item is decided `repair` by the inbox itself.
    pub(crate) fn recover(&mut self, key: usize, failed_before: FailedBefore, race: Race) {
        let missed = failed_before == FailedBefore::Racing && race == Race::Misses;
        // The commit sends its recovery only when its claim saw a failure record. What
        // happens to a discarded item (closed on purpose) is the implementation's choice;
        // the model follows it.
        let recovery_sent = match failed_before {
            FailedBefore::Yes => true,
            FailedBefore::No => false,
            FailedBefore::Racing => race == Race::Recovers,
        };
        let items = self.items.iter_mut().filter(|i| {
            i.key == key && i.source == Source::Failure && !i.purged && i.recovered.is_none()
        });
        for item in items {
            let recovers = match item.decision {
                None | Some(Decision::Repair) => !missed,
                Some(Decision::Discard) => recovery_sent,
            };
            if !recovers {
                continue;
            }
            if item.decision.is_none() {
                item.decision = Some(Decision::Repair);
                item.decided_old = false;
            }
            item.recovered = Some(false);
        }
    }

    pub(crate) fn decide(&mut self, item: usize, repair: bool) -> Step {
        if self.items.is_empty() {
            return Step::Skip;
        }
        let n = self.items.len();
        let item = &mut self.items[item % n];
        let id = item
            .id
            .expect("every item's id is learnt in the step that opens it");
        let expect = if item.purged {
            DecisionAnswer::NotFound
        } else if item.decision.is_some() {
            DecisionAnswer::AlreadyDecided
        } else {
            item.decision = Some(if repair {
                Decision::Repair
            } else {
                Decision::Discard
            });
            item.decided_old = false;
            DecisionAnswer::Done
        };
        Step::Decide { id, repair, expect }
    }

    /// Ten days pass for `key`: every stored time about it is past the purge window. A claim
    /// in flight is not touched: its row is invisible until it commits, and then new.
    pub(crate) fn age(&mut self, key: usize) {
        let k = &mut self.keys[key];
        k.row_old = matches!(k.state, KeyState::Committed(_));
        if let Some(failures) = &mut k.failures {
            failures.old = true;
        }
        for item in self.items.iter_mut().filter(|i| i.key == key && !i.purged) {
            item.decided_old = item.decision.is_some();
            item.recovered = item.recovered.map(|_| true);
        }
    }

    /// The purge, as the retention docs state it: committed rows and failure records past the
    /// window unless an open item is about their command; decided items past the window,
    /// except a failing command decided `repair` whose retry has not committed yet, which
    /// also keeps the failure record its recovery needs. A purged key is first seen again;
    /// an in-flight claim is never purged.
    pub(crate) fn purge(&mut self) {
        for key in 0..self.keys.len() {
            let items = || self.items.iter().filter(|i| i.key == key && !i.purged);
            let open = items().any(|i| i.decision.is_none());
            let awaiting = items().any(Item::awaits_recovery);
            let k = &mut self.keys[key];
            if matches!(k.state, KeyState::Committed(_)) && k.row_old && !open {
                k.state = KeyState::Free;
                k.row_old = false;
                k.ever_purged = true;
            }
            if k.failures.is_some_and(|f| f.old) && !open && !awaiting {
                k.failures = None;
            }
        }
        for item in self.items.iter_mut().filter(|i| !i.purged) {
            item.purged = item.decision.is_some()
                && item.decided_old
                && item.recovered.unwrap_or(true)
                && !item.awaits_recovery();
        }
    }
}

impl Item {
    /// A failing command's item decided `repair` whose retry has not committed yet.
    fn awaits_recovery(&self) -> bool {
        self.source == Source::Failure
            && self.decision == Some(Decision::Repair)
            && self.recovered.is_none()
    }

    fn open(key: usize, source: Source, attempts: i32) -> Self {
        Self {
            key,
            source,
            attempts,
            decision: None,
            decided_old: false,
            recovered: None,
            purged: false,
            id: None,
        }
    }
}
