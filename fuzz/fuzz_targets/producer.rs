//! Producer names from a gateway header and from code: never a panic, accepted exactly
//! when they follow the documented rules.
//!
//! The property lives in `tower_inbox::fuzzing::check_producer`, which the corpus test also runs.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_inbox::fuzzing::check_producer(data));
