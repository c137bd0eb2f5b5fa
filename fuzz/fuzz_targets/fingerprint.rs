//! Canonical JSON fingerprints: never a panic; one value, one fingerprint, however it is
//! spelt; two values, two fingerprints.
//!
//! The property lives in `tower_inbox::fuzzing::check_fingerprint`, which the corpus test also runs.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_inbox::fuzzing::check_fingerprint(data));
