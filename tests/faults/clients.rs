//! Clients that retry: each sends new commands one after another, and retries each with the
//! same key and body until it gets a 2xx (or a final answer, or runs out of time), as a
//! careful client of the service would. Some commands are sent once more after their 2xx,
//! to see that the answer replays.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// One command and everything its client saw.
#[derive(Debug, Clone)]
pub struct Record {
    /// The command ID, also the account it credits (one account per command, so the
    /// webhook's body names the command).
    pub key: String,
    /// Every HTTP answer, in order: status, body, whether it was marked replayed.
    pub answers: Vec<(u16, Bytes, bool)>,
    /// Attempts that got no HTTP answer (connection refused, reset, timed out).
    pub transport_errors: usize,
}

impl Record {
    pub fn acked(&self) -> bool {
        self.answers.iter().any(|(s, _, _)| (200..300).contains(s))
    }
}

/// The producer the clients send as.
pub const PRODUCER: &str = "faults";

/// Retrying clients sending new commands until [`stop`](Load::stop).
pub struct Load {
    stop: Arc<AtomicBool>,
    records: Arc<Mutex<Vec<Record>>>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// `workers` clients against the credits route at `base` (`http://host:port`), with keys
    /// that start with `run`.
    pub fn start(base: &str, run: &str, workers: usize) -> Self {
        Self::round_robin(&[base.to_owned()], run, workers)
    }

    /// As [`start`](Self::start), against several instances of the service: each attempt,
    /// a retry included, goes to the next one, as behind a round-robin balancer.
    pub fn round_robin(bases: &[String], run: &str, workers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let records = Arc::new(Mutex::new(Vec::new()));
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .build()
            .expect("an HTTP client");
        let workers = (0..workers)
            .map(|w| {
                let (stop, records, client) = (stop.clone(), records.clone(), client.clone());
                let (bases, run) = (bases.to_vec(), run.to_owned());
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        n += 1;
                        let key = format!("{run}-{w}-{n}");
                        // Every fourth command is sent again after its 2xx: a replay.
                        let successes = 1 + usize::from(n.is_multiple_of(4));
                        let record = send(&client, &bases, w, &key, successes).await;
                        records.lock().unwrap().push(record);
                    }
                })
            })
            .collect();
        Self {
            stop,
            records,
            workers,
        }
    }

    /// How many commands have had their final answer so far.
    pub fn finished(&self) -> usize {
        self.records.lock().unwrap().len()
    }

    /// Stops sending new commands, lets every client finish the one it is retrying, and
    /// returns what they saw.
    pub async fn stop(self) -> Vec<Record> {
        self.stop.store(true, Ordering::SeqCst);
        for worker in self.workers {
            worker.await.expect("a client panicked");
        }
        std::mem::take(&mut *self.records.lock().unwrap())
    }
}

/// How long one command is retried before its client gives up on it.
const GIVE_UP_AFTER: Duration = Duration::from_secs(120);

/// Sends the command `key` until `successes` 2xx answers, a final answer, or
/// [`GIVE_UP_AFTER`]; attempt `n` goes to `bases[(first + n) % len]`.
async fn send(
    client: &reqwest::Client,
    bases: &[String],
    first: usize,
    key: &str,
    successes: usize,
) -> Record {
    let mut record = Record {
        key: key.to_owned(),
        answers: Vec::new(),
        transport_errors: 0,
    };
    let started = Instant::now();
    let mut attempt = first;
    let mut pause = Duration::from_millis(20);
    let mut got = 0;
    while got < successes && started.elapsed() < GIVE_UP_AFTER {
        let base = &bases[attempt % bases.len()];
        attempt += 1;
        let sent = client
            .post(format!("{base}/accounts/{key}/credits"))
            .header("idempotency-key", key)
            .header("x-producer", PRODUCER)
            .header("content-type", "application/json")
            .body(r#"{"delta": 1}"#)
            .send()
            .await;
        let answer = match sent {
            Ok(response) => {
                let status = response.status().as_u16();
                let replayed = response
                    .headers()
                    .get("idempotent-replayed")
                    .is_some_and(|v| v == "true");
                let problem = response
                    .headers()
                    .get("content-type")
                    .is_some_and(|v| v == "application/problem+json");
                match response.bytes().await {
                    Ok(body) => Some((status, body, replayed, problem)),
                    Err(_) => None,
                }
            }
            Err(_) => None,
        };
        let Some((status, body, replayed, problem)) = answer else {
            record.transport_errors += 1;
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
            continue;
        };
        let in_progress = status == 409 && problem && contains(&body, b"in-progress");
        record.answers.push((status, body, replayed));
        if (200..300).contains(&status) {
            got += 1;
            pause = Duration::from_millis(20);
        } else if status >= 500 || in_progress {
            // The server rolled back or the original is still in flight: the same key
            // again, after a pause (shorter than the Retry-After a real client honours, to
            // keep the test short).
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        } else {
            // Final: a careful client does not retry it. The checker reports it.
            break;
        }
    }
    record
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
