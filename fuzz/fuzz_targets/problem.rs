//! problem+json answers: valid JSON whose detail is the given text, with the right content
//! type, status and Retry-After.
//!
//! The property lives in `tower_inbox::fuzzing::check_problem`, which the corpus test also runs.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_inbox::fuzzing::check_problem(data));
