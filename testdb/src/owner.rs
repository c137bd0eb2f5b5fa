//! Names that carry the pid of the process that made them, so that what a
//! killed process left behind (test databases, private clusters) can be
//! told from what live processes use, and removed.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A new name `<prefix><pid>_<counter>_<suffix>`, made of `prefix`, ASCII
/// digits, `_` and lowercase hex digits.
pub(crate) fn owned_name(prefix: &str) -> String {
    let counter = COUNTER.fetch_add(1, Ordering::Relaxed);
    // The pid and counter make names unique within a run; the time suffix
    // keeps a recycled pid from colliding with a leftover of an earlier run.
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.subsec_nanos());
    format!("{prefix}{}_{counter}_{nanos:08x}", std::process::id())
}

/// The pid in a name made by [`owned_name`] with `prefix`.
pub(crate) fn owner_pid(name: &str, prefix: &str) -> Option<u32> {
    name.strip_prefix(prefix)?.split('_').next()?.parse().ok()
}

/// Whether the process `pid` is gone, so that what it owned is left over.
/// A recycled pid counts as alive: a leftover stays until a later check.
pub(crate) fn is_gone(pid: u32) -> bool {
    pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
}

/// The entries of the temporary directory named by [`owned_name`] with
/// `prefix` whose process is gone: what killed runs left there.
pub(crate) fn left_over_in_temp_dir(prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|entry| {
            entry
                .file_name()
                .to_str()
                .and_then(|name| owner_pid(name, prefix))
                .is_some_and(is_gone)
        })
        .map(|entry| entry.path())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_carry_the_pid() {
        let a = owned_name("p_");
        let b = owned_name("p_");
        assert_ne!(a, b);
        for name in [&a, &b] {
            assert_eq!(owner_pid(name, "p_"), Some(std::process::id()));
        }
        assert!(!is_gone(std::process::id()));
    }

    #[test]
    fn parses_owner_pids() {
        assert_eq!(
            owner_pid("tower_inbox_t_123_4_abc", "tower_inbox_t_"),
            Some(123)
        );
        assert_eq!(owner_pid("tower_inbox_t_x_4_abc", "tower_inbox_t_"), None);
        assert_eq!(owner_pid("other_123", "tower_inbox_t_"), None);
        // Above any pid_max Linux allows (2^22), so never a live process.
        assert!(is_gone(999_999_999));
    }
}
