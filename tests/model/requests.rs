//! The model's rules for requests: what a sent command gets, depending on its key's state
//! and the layer's cache, and what releasing a held command does to it and to the duplicate
//! waiting for it.

use crate::ops::{response_body, Behave, Ending, Op};
use crate::spec::{
    Expect, FailedBefore, KeyState, Model, Race, Recorded, Run, Send, Session, Step, Via,
};

impl Model {
    pub(crate) fn send(&mut self, op: &Op, race: Race) -> Step {
        let Op::Send {
            session,
            key,
            payload,
            behave,
            patient,
            reordered,
        } = *op
        else {
            unreachable!("a send")
        };
        let n = self.sessions.len();
        let Some(session) = (0..n)
            .map(|i| (session + i) % n)
            .find(|&s| self.sessions[s] == Session::Idle)
        else {
            return Step::Skip;
        };
        let in_flight = self.keys[key].state == KeyState::InFlight;
        // Two waiters for one key would race for it when the original rolls back; a second
        // patient duplicate goes through the impatient layer instead.
        let patient = patient && !(in_flight && self.waiter_of(key).is_some());
        // A waiter that commits at once would race its original's failure record (counted
        // after the rollback): it holds instead, and commits only when released.
        let behave = match behave {
            Behave::Answer(ending) if patient && in_flight && ending.commits() => Behave::Hold,
            other => other,
        };
        let run = Run {
            key,
            payload,
            id: self.next_run,
            via: if patient {
                Via::Patient
            } else {
                Via::Impatient
            },
        };
        self.next_run += 1;
        let cached = self.caches[run.via as usize][key].clone();
        let expect = match (cached, self.keys[key].state.clone()) {
            // The cache answers first, even for a key the purge has freed since.
            (Some(recorded), _) => self.duplicate(run, recorded, false),
            (None, KeyState::Committed(recorded)) => self.duplicate(run, recorded, true),
            (None, KeyState::InFlight) if patient => {
                self.sessions[session] = Session::Waiting {
                    run,
                    fallback: behave,
                };
                Expect::Waiting
            }
            (None, KeyState::InFlight) => Expect::Problem {
                status: 409,
                kind: "in-progress",
            },
            (None, KeyState::Free) => {
                let failed_before = self.keys[key].failures.is_some().into();
                self.run_handler(session, run, behave, failed_before, race)
            }
        };
        Step::Send(Send {
            session,
            run,
            reordered,
            behave,
            expect,
        })
    }

    pub(crate) fn release(&mut self, session: usize, ending: Ending, race: Race) -> Step {
        let n = self.sessions.len();
        let Some(session) = (0..n)
            .map(|i| (session + i) % n)
            .find(|&s| matches!(self.sessions[s], Session::Held { .. }))
        else {
            return Step::Skip;
        };
        let Session::Held { run, failed_before } =
            std::mem::replace(&mut self.sessions[session], Session::Idle)
        else {
            unreachable!("found holding")
        };
        let key = run.key;
        let recorded_before = self.keys[key].failures.is_some();
        // A waiting duplicate may claim the key before the failure is counted: then the count
        // opens no item ([`Race::Misses`]).
        let raced = ending == Ending::Fail && self.waiter_of(key).is_some() && race == Race::Misses;
        let expect = self.end_counting(run, ending, failed_before, race, !raced);
        let waiter = self.waiter_of(key).map(|waiter| {
            let Session::Waiting { run, fallback } =
                std::mem::replace(&mut self.sessions[waiter], Session::Idle)
            else {
                unreachable!("found waiting")
            };
            let expect = match self.keys[key].state.clone() {
                KeyState::Committed(recorded) => self.duplicate(run, recorded, true),
                KeyState::Free => {
                    let failed_before = if ending == Ending::Fail && !recorded_before {
                        FailedBefore::Racing
                    } else {
                        self.keys[key].failures.is_some().into()
                    };
                    self.run_handler(waiter, run, fallback, failed_before, race)
                }
                KeyState::InFlight => unreachable!("its original just finished"),
            };
            (waiter, expect)
        });
        Step::Release {
            session,
            ending,
            expect,
            waiter,
        }
    }

    /// A duplicate of a committed command, answered from the database or from its layer's
    /// cache.
    fn duplicate(&mut self, run: Run, recorded: Recorded, from_database: bool) -> Expect {
        if run.payload == recorded.payload {
            if from_database {
                self.cache(run.via, run.key, &recorded);
            }
            return Expect::Replayed(recorded);
        }
        self.conflict(run.key, run.payload);
        Expect::Problem {
            status: if self.settings.mismatch_422 { 422 } else { 409 },
            kind: "payload-mismatch",
        }
    }

    /// `run` claimed its key: its handler holds the claim or answers at once.
    fn run_handler(
        &mut self,
        session: usize,
        run: Run,
        behave: Behave,
        failed_before: FailedBefore,
        race: Race,
    ) -> Expect {
        match behave {
            Behave::Hold => {
                self.sessions[session] = Session::Held { run, failed_before };
                self.keys[run.key].state = KeyState::InFlight;
                Expect::Started
            }
            Behave::Answer(ending) => self.end(run, ending, failed_before, race),
        }
    }

    /// The handler of a claimed `run` answers with `ending`.
    fn end(&mut self, run: Run, ending: Ending, failed_before: FailedBefore, race: Race) -> Expect {
        self.end_counting(run, ending, failed_before, race, true)
    }

    /// [`end`](Self::end), where a failure may open a quarantine item only if `may_open`.
    fn end_counting(
        &mut self,
        run: Run,
        ending: Ending,
        failed_before: FailedBefore,
        race: Race,
        may_open: bool,
    ) -> Expect {
        let status = ending.status();
        if ending.commits() {
            let recorded = Recorded {
                payload: run.payload,
                status,
                body: response_body(run.id, status),
            };
            self.cache(run.via, run.key, &recorded);
            let k = &mut self.keys[run.key];
            k.state = KeyState::Committed(recorded);
            k.row_old = false;
            k.effects += 1;
            self.recover(run.key, failed_before, race);
        } else {
            self.keys[run.key].state = KeyState::Free;
            if ending == Ending::Fail {
                self.fail(run.key, may_open);
            }
        }
        Expect::Fresh {
            status,
            run: run.id,
        }
    }

    /// `via`'s replay cache keeps what it committed or replayed from the database.
    fn cache(&mut self, via: Via, key: usize, recorded: &Recorded) {
        if self.settings.replay_cache {
            self.caches[via as usize][key] = Some(recorded.clone());
        }
    }

    /// The session waiting for `key`'s command in flight, if any.
    fn waiter_of(&self, key: usize) -> Option<usize> {
        self.sessions
            .iter()
            .position(|s| matches!(s, Session::Waiting { run, .. } if run.key == key))
    }
}
