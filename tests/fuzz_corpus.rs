//! The fuzz targets' committed corpus, replayed through the same property checks the targets
//! run (`tower_inbox::fuzzing`), so that `cargo test` holds every seed and every regression
//! the fuzzers found without cargo-fuzz or nightly. `fuzz/run.sh` does the fuzzing itself.

use std::collections::BTreeSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use tower_inbox::fuzzing::{check_record, TARGETS};
use tower_inbox::inbox::RecordedResponse;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The files of a target's corpus, sorted; fails if the directory is missing or empty, so
/// that the test never passes on nothing.
fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join("corpus").join(target);
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|err| panic!("the corpus of {target}, {}: {err}", dir.display()));
    let mut files: Vec<PathBuf> = entries
        .map(|entry| entry.expect("a corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no seed", dir.display());
    files
}

#[test]
fn every_seed_holds_its_targets_properties() {
    let mut failures = Vec::new();
    let mut seeds = 0;
    for (target, check) in TARGETS {
        for file in corpus(target) {
            let bytes = std::fs::read(&file).expect("a readable seed");
            seeds += 1;
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| check(&bytes))) {
                let message = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("a panic");
                failures.push(format!("{}: {message}", file.display()));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {seeds} seeds break their target's property:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A target without a property, a corpus or an entry in `fuzz/Cargo.toml`, or a property
/// without its target, would go unchecked.
#[test]
fn every_fuzz_target_has_its_property_and_its_corpus() {
    let registered: BTreeSet<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
    let sources: BTreeSet<String> = std::fs::read_dir(fuzz_dir().join("fuzz_targets"))
        .expect("fuzz/fuzz_targets")
        .map(|entry| entry.expect("a target file").path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        sources.iter().map(String::as_str).collect::<BTreeSet<_>>(),
        registered,
        "fuzz/fuzz_targets/*.rs and tower_inbox::fuzzing::TARGETS"
    );
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for name in &registered {
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] for {name}"
        );
        let source = std::fs::read_to_string(fuzz_dir().join(format!("fuzz_targets/{name}.rs")))
            .expect("the target's source");
        assert!(
            source.contains(&format!("check_{name}(")),
            "fuzz_targets/{name}.rs does not call fuzzing::check_{name}"
        );
        corpus(name);
    }
}

/// A record with more header names than an HTTP header map holds (a row written by hand, say)
/// is refused with a problem, not a panic. Too large for a corpus file, so built here.
#[test]
fn a_record_with_more_header_names_than_a_header_map_holds_is_refused() {
    let headers = (0..40_000)
        .map(|i| (format!("x-{i}"), b"v".to_vec()))
        .collect();
    check_record(RecordedResponse {
        status: 200,
        headers,
        body: "{}".into(),
    });
}
