//! How things look for people: ages, aligned tables, times.

use std::io::{ErrorKind, Write};
use std::time::Duration;

use comfy_table::{presets, Table};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

/// Writes `text` to standard output. A reader that went away (`| head`) ends the program
/// quietly, as it does for any Unix tool; any other write error is one line and exit 1.
pub fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(err) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        if err.kind() == ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("tower-inbox: cannot write to standard output: {err}");
        std::process::exit(1);
    }
}

/// Writes `text` and a newline ([`emit`]).
pub fn line(text: impl std::fmt::Display) {
    emit(&format!("{text}\n"));
}

/// A duration as people say it: `45s`, `3m 12s`, `2h 5m`, `4d 3h`.
pub fn age(duration: Duration) -> String {
    let s = duration.as_secs();
    match s {
        0..=59 => format!("{s}s"),
        60..=3_599 => format!("{}m {}s", s / 60, s % 60),
        3_600..=86_399 => format!("{}h {}m", s / 3_600, s % 3_600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3_600),
    }
}

/// How long ago `at` was: `3m 12s ago`.
pub fn ago(at: OffsetDateTime) -> String {
    let elapsed = OffsetDateTime::now_utc() - at;
    let elapsed = Duration::try_from(elapsed).unwrap_or_default();
    format!("{} ago", age(elapsed))
}

/// Now, as RFC 3339.
pub fn now() -> String {
    rfc3339(OffsetDateTime::now_utc())
}

pub fn rfc3339(at: OffsetDateTime) -> String {
    at.format(&Rfc3339).unwrap_or_else(|_| at.to_string())
}

/// Named values, one per line, the values aligned.
pub fn fields(lines: &[(&str, String)]) -> String {
    let width = lines.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    lines
        .iter()
        .map(|(name, value)| format!("{name:<width$}  {value}\n"))
        .collect()
}

/// Rows under headers, columns aligned, plain ASCII (no colour: nothing to turn off).
pub fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut table = Table::new();
    table.load_preset(presets::ASCII_BORDERS_ONLY_CONDENSED);
    table.set_header(headers.to_vec());
    for row in rows {
        table.add_row(row);
    }
    table.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_people_say_them() {
        let s = Duration::from_secs;
        assert_eq!(age(s(0)), "0s");
        assert_eq!(age(s(59)), "59s");
        assert_eq!(age(s(192)), "3m 12s");
        assert_eq!(age(s(7_500)), "2h 5m");
        assert_eq!(age(s(356_400)), "4d 3h");
    }
}
