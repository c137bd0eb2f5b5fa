//! The cases the model test found, written out. The seeds proptest saved in
//! `tests/model.proptest-regressions` replay them only as long as the strategies in `ops.rs`
//! draw the same values from a seed; these hold whatever becomes of the strategies.

use crate::ops::{Behave, Ending, Op, Scenario, Settings};

fn send(key: usize, behave: Behave) -> Op {
    Op::Send {
        session: 0,
        key,
        payload: 0,
        behave,
        patient: false,
        reordered: false,
    }
}

/// Each found case, with what went wrong.
pub fn found() -> Vec<(&'static str, Scenario)> {
    let settings = Settings {
        sessions: 2,
        quarantine_after: 1,
        lookup: None,
        replay_cache: false,
        mismatch_422: false,
    };
    vec![(
        "a failing command decided `repair` must be recovered by the retry that commits, even \
         after its failure record aged past the window (the purge deleted the record, so the \
         commit did not know to recover the item, and the quarantine purge kept it for ever)",
        Scenario {
            settings,
            ops: vec![
                send(0, Behave::Answer(Ending::Fail)),
                Op::Decide {
                    item: 0,
                    repair: true,
                },
                Op::Age { key: 0 },
                Op::Purge,
                send(0, Behave::Answer(Ending::Commit)),
            ],
        },
    )]
}
