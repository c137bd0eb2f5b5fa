//! Idempotency-Key header values: MessageKey::parse never panics, accepted keys are 1 to
//! 255 visible ASCII characters and round-trip through their sf-string form.
//!
//! The property lives in `tower_inbox::fuzzing::check_key`, which the corpus test also runs.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_inbox::fuzzing::check_key(data));
