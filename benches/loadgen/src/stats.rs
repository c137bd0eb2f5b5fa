//! What the requests got: latency histograms and counts per kind, per route.

use std::time::Duration;

use hdrhistogram::Histogram;
use http::StatusCode;

/// Mismatch and error descriptions each connection keeps for the report.
const SAMPLES_PER_CONNECTION: usize = 3;
/// Mismatch and error descriptions the report prints.
pub(crate) const SAMPLES_PRINTED: usize = 10;

/// An empty histogram of microseconds: auto-resizing, 3 significant digits, small until long
/// latencies show up.
pub(crate) fn histogram() -> Histogram<u64> {
    Histogram::new(3).expect("3 significant digits are supported")
}

/// Records `duration` in microseconds into `histogram`, growing it where needed.
pub(crate) fn record_micros(histogram: &mut Histogram<u64>, duration: Duration) {
    // `record` grows the auto-resizing histogram; `saturating_record` would clamp to its
    // current range.
    let micros = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
    if histogram.record(micros).is_err() {
        histogram.saturating_record(micros);
    }
}

/// Adds what `other` recorded to `histogram`; `what` names them in the error.
pub(crate) fn add_histogram(
    histogram: &mut Histogram<u64>,
    other: &Histogram<u64>,
    what: &str,
) -> Result<(), String> {
    histogram
        .add(other)
        .map_err(|e| format!("merging {what} histograms: {e:?}"))
}

/// Why a request got no response.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Failure {
    Connect,
    Request,
    Body,
    Timeout,
}

pub(crate) const FAILURES: [Failure; 4] = [
    Failure::Connect,
    Failure::Request,
    Failure::Body,
    Failure::Timeout,
];

impl Failure {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Request => "request",
            Failure::Body => "body",
            Failure::Timeout => "timeout",
        }
    }
}

/// What one kind of request on one route got.
#[derive(Clone)]
pub(crate) struct KindStats {
    /// Latency of every response, in microseconds.
    pub(crate) latency: Histogram<u64>,
    pub(crate) responses: u64,
    pub(crate) mismatches: u64,
    /// Transport errors by [`Failure`].
    pub(crate) errors: [u64; 4],
    /// Responses by status code.
    pub(crate) statuses: Vec<(u16, u64)>,
    /// Responses marked `idempotent-replayed: true`.
    pub(crate) replayed: u64,
}

impl KindStats {
    pub(crate) fn new() -> KindStats {
        KindStats {
            latency: histogram(),
            responses: 0,
            mismatches: 0,
            errors: [0; 4],
            statuses: Vec::new(),
            replayed: 0,
        }
    }

    pub(crate) fn record(
        &mut self,
        latency: Duration,
        status: StatusCode,
        replayed: bool,
        mismatch: bool,
    ) {
        record_micros(&mut self.latency, latency);
        self.responses += 1;
        self.mismatches += u64::from(mismatch);
        self.replayed += u64::from(replayed);
        let status = status.as_u16();
        match self.statuses.iter_mut().find(|(s, _)| *s == status) {
            Some((_, n)) => *n += 1,
            None => self.statuses.push((status, 1)),
        }
    }

    /// Forgets what was recorded, keeping the histogram's grown range (no re-allocation in
    /// the next phase).
    pub(crate) fn clear(&mut self) {
        self.latency.reset();
        self.responses = 0;
        self.mismatches = 0;
        self.errors = [0; 4];
        self.statuses.clear();
        self.replayed = 0;
    }

    pub(crate) fn errors(&self) -> u64 {
        self.errors.iter().sum()
    }

    /// Requests sent: responses and transport errors.
    pub(crate) fn requests(&self) -> u64 {
        self.responses + self.errors()
    }

    pub(crate) fn merge(&mut self, other: &KindStats) -> Result<(), String> {
        add_histogram(&mut self.latency, &other.latency, "latency")?;
        self.responses += other.responses;
        self.mismatches += other.mismatches;
        for (mine, theirs) in self.errors.iter_mut().zip(other.errors) {
            *mine += theirs;
        }
        for &(status, n) in &other.statuses {
            match self.statuses.iter_mut().find(|(s, _)| *s == status) {
                Some((_, mine)) => *mine += n,
                None => self.statuses.push((status, n)),
            }
        }
        self.replayed += other.replayed;
        Ok(())
    }
}

/// What one route got, per kind, with the first mismatches and errors described.
#[derive(Clone)]
pub(crate) struct Stats {
    pub(crate) kinds: [KindStats; 3],
    pub(crate) samples: Vec<String>,
}

impl Stats {
    pub(crate) fn new() -> Stats {
        Stats {
            kinds: [KindStats::new(), KindStats::new(), KindStats::new()],
            samples: Vec::new(),
        }
    }

    pub(crate) fn requests(&self) -> u64 {
        self.kinds.iter().map(KindStats::requests).sum()
    }

    pub(crate) fn responses(&self) -> u64 {
        self.kinds.iter().map(|k| k.responses).sum()
    }

    pub(crate) fn mismatches(&self) -> u64 {
        self.kinds.iter().map(|k| k.mismatches).sum()
    }

    pub(crate) fn errors(&self) -> u64 {
        self.kinds.iter().map(KindStats::errors).sum()
    }

    /// All kinds together.
    pub(crate) fn all(&self) -> Result<KindStats, String> {
        let mut all = KindStats::new();
        for kind in &self.kinds {
            all.merge(kind)?;
        }
        Ok(all)
    }

    pub(crate) fn merge(&mut self, other: &Stats) -> Result<(), String> {
        for (mine, theirs) in self.kinds.iter_mut().zip(&other.kinds) {
            mine.merge(theirs)?;
        }
        for sample in &other.samples {
            if self.samples.len() < SAMPLES_PRINTED && !self.samples.contains(sample) {
                self.samples.push(sample.clone());
            }
        }
        Ok(())
    }

    pub(crate) fn clear(&mut self) {
        self.kinds.iter_mut().for_each(KindStats::clear);
        self.samples.clear();
    }

    pub(crate) fn sample(&mut self, describe: impl FnOnce() -> String) {
        if self.samples.len() < SAMPLES_PER_CONNECTION {
            let sample = describe();
            if !self.samples.contains(&sample) {
                self.samples.push(sample);
            }
        }
    }
}
