//! Recorded responses replayed to a duplicate: a valid record comes back as it was, any
//! other is a 500 problem, never a panic.
//!
//! The property lives in `tower_inbox::fuzzing::check_replay`, which the corpus test also runs.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_inbox::fuzzing::check_replay(data));
