//! The examples' binaries, for tests that run them as a user would.

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The example `name`'s binary, built with every feature (as the README's test command
/// builds the tests): a fresh build when the test build made it already.
pub fn binary(name: &str) -> PathBuf {
    let output = Command::new(env!("CARGO"))
        .args(["build", "--example", name, "--all-features"])
        .args(["--message-format", "json-render-diagnostics"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run cargo build");
    assert!(
        output.status.success(),
        "cargo build --example {name} failed"
    );
    let stdout = String::from_utf8(output.stdout).expect("cargo's JSON is UTF-8");
    stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|msg| msg["reason"] == "compiler-artifact" && msg["target"]["name"] == name)
        .find_map(|msg| msg["executable"].as_str().map(Into::into))
        .unwrap_or_else(|| panic!("cargo names no executable for the example {name}"))
}
