//! The real side of a case: two layers over one consumer and handler, the sessions' requests
//! in flight, and the operator's tools (quarantine decisions, the purge). It reports what
//! happened and leaves judging to the model.

use std::collections::HashMap;
use std::future::pending;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::{HeaderMap, Request, StatusCode};
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower_inbox::inbox::Inbox;
use tower_inbox::middleware::{MismatchStatus, ReplayCache};
use tower_inbox::producer::TrustedHeader;
use tower_inbox::quarantine::{DecisionError, Quarantine};
use tower_inbox::retention::{Purger, RetentionPolicy};
use tower_inbox::{InboxLayer, InboxTx};

use crate::common::{spawn_send, Reply};
use crate::facts::{self, Facts};
use crate::ops::{command_body, response_body, Behave, Ending, Settings, PATH};
use crate::spec::{self, DecisionAnswer, Via};

/// The longest any request may take to settle before the case is declared hung. Not a
/// timing assertion: a request that settles at all settles within milliseconds.
const HANG: Duration = Duration::from_secs(60);
/// How long the patient layer's duplicates wait for an original in flight: longer than any
/// case, so a waiter is settled by its original's release and never by the clock.
const PATIENT_WAIT: Duration = Duration::from_secs(120);
/// Moves every stored time of one key back, past the purge window.
const AGE: [&str; 3] = [
    "update tower_inbox.consumer_inbox
     set received_at = received_at - interval '10 days',
         processed_at = processed_at - interval '10 days'
     where consumer_name = $1 and message_id = $2",
    "update tower_inbox.consumer_inbox_failure
     set first_failed_at = first_failed_at - interval '10 days',
         last_failed_at = last_failed_at - interval '10 days'
     where consumer_name = $1 and message_id = $2",
    "update tower_inbox.inbox_quarantine
     set first_failed_at = first_failed_at - interval '10 days',
         last_failed_at = last_failed_at - interval '10 days',
         decided_at = decided_at - interval '10 days',
         recovered_at = recovered_at - interval '10 days'
     where consumer_name = $1 and message_id = $2",
];

/// The business writes of every run, by consumer (one per case), message ID and run.
pub const EFFECTS_TABLE: &str = "create table if not exists model_effect (
        consumer_name text not null, message_id text not null, run bigint not null);
    create index if not exists model_effect_key on model_effect (consumer_name, message_id);";

/// What a request did, as far as a client or the layer's waiting count can tell.
#[derive(Debug)]
pub enum Seen {
    Answered(Reply),
    /// Its handler claimed the key and waits for a release.
    Started,
    /// It waits in the patient layer for the original in flight.
    Waiting,
}

/// Held runs: the handler of run `n` takes gate `n`, says it started, and answers with the
/// status it is released with (500 if the test went away).
#[derive(Default)]
struct Gates(Mutex<HashMap<u64, Gate>>);

struct Gate {
    started: oneshot::Sender<()>,
    release: oneshot::Receiver<u16>,
}

impl Gates {
    async fn hold(&self, run: u64) -> u16 {
        let gate = self.0.lock().unwrap().remove(&run);
        let gate = gate.unwrap_or_else(|| panic!("no gate for run {run}"));
        let _ = gate.started.send(());
        gate.release.await.unwrap_or(500)
    }
}

/// One run of the handler: a business write in the claimed transaction, then an answer. The
/// write comes first, also for a held run, so that every rollback has a write to undo.
async fn handle(State(gates): State<Arc<Gates>>, headers: HeaderMap, mut tx: InboxTx) -> Response {
    let header = |name: &str| headers[name].to_str().expect("ASCII").to_owned();
    let run: u64 = header("x-run").parse().expect("a run");
    let identity = tx.identity().clone();
    sqlx::query("insert into model_effect (consumer_name, message_id, run) values ($1, $2, $3)")
        .bind(identity.consumer())
        .bind(identity.message_id().as_str())
        .bind(i64::try_from(run).expect("small"))
        .execute(&mut *tx)
        .await
        .expect("the business write");
    let status = match header("x-behave").as_str() {
        "hold" => gates.hold(run).await,
        status => status.parse().expect("a status"),
    };
    let status = StatusCode::from_u16(status).expect("a status");
    let content_type = [(http::header::CONTENT_TYPE, "application/json")];
    (status, content_type, response_body(run, status.as_u16())).into_response()
}

/// A request outstanding on a session.
struct Live {
    reply: JoinHandle<Reply>,
    started: Option<oneshot::Receiver<()>>,
    release: Option<oneshot::Sender<u16>>,
    waiting: bool,
}

pub struct Harness {
    pool: PgPool,
    consumer: String,
    routers: [Router; 2],
    inboxes: [Inbox; 2],
    gates: Arc<Gates>,
    sessions: Vec<Option<Live>>,
    quarantine: Quarantine,
    purger: Purger,
}

impl Harness {
    /// Case `case`'s layers, under a consumer of its own so that nothing of another case
    /// (rows, claims in flight, late failure records) is ever in its view.
    pub fn new(pool: &PgPool, case: u32, settings: &Settings) -> Self {
        let consumer = format!("model-{case}");
        let gates = Arc::new(Gates::default());
        let layer = |wait: Duration| {
            let mut builder = InboxLayer::builder(pool.clone(), consumer.clone())
                .producer(TrustedHeader::new("x-producer"))
                .in_flight_wait(wait)
                .waiting_keys_limit(8)
                .quarantine_after(settings.quarantine_after);
            if settings.mismatch_422 {
                builder = builder.mismatch_status(MismatchStatus::UnprocessableContent);
            }
            if let Some(on) = settings.lookup {
                builder = builder.lookup_before_claim(on);
            }
            if settings.replay_cache {
                builder = builder.replay_cache(ReplayCache::new(1024, 16 << 20).expect("cache"));
            }
            builder.build().expect("layer")
        };
        let layers = [layer(Duration::ZERO), layer(PATIENT_WAIT)];
        let inboxes = layers.clone().map(|l| l.inbox().clone());
        let routers = layers.map(|layer| {
            Router::new()
                .route(PATH, post(handle))
                .route_layer(layer)
                .with_state(gates.clone())
        });
        // Two hours: the model's "past the window" is ten days back.
        let hour = Duration::from_secs(3600);
        let policy = || {
            RetentionPolicy::builder()
                .retry_horizon(hour)
                .safety_margin(hour)
                .build()
                .expect("policy")
        };
        let purger = Purger::builder(pool.clone())
            .inbox(policy())
            .quarantine(policy())
            .build()
            .expect("purger");
        Self {
            pool: pool.clone(),
            consumer,
            routers,
            inboxes,
            gates,
            sessions: (0..settings.sessions).map(|_| None).collect(),
            quarantine: Quarantine::new(pool.clone()),
            purger,
        }
    }

    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Sends a request on its session and returns once it is answered, holds its claim, or
    /// waits for an original.
    pub async fn send(&mut self, send: &spec::Send) -> Seen {
        let (started, release) = if send.behave == Behave::Hold {
            let (started_tx, started_rx) = oneshot::channel();
            let (release_tx, release_rx) = oneshot::channel();
            let gate = Gate {
                started: started_tx,
                release: release_rx,
            };
            self.gates.0.lock().unwrap().insert(send.run.id, gate);
            (Some(started_rx), Some(release_tx))
        } else {
            (None, None)
        };
        let behave = match send.behave {
            Behave::Hold => "hold".to_owned(),
            Behave::Answer(ending) => ending.status().to_string(),
        };
        let request = Request::post(PATH)
            .header("content-type", "application/json")
            .header("idempotency-key", format!("k{}", send.run.key))
            .header("x-producer", "model")
            .header("x-run", send.run.id.to_string())
            .header("x-behave", behave)
            .body(Body::from(command_body(send.run.payload, send.reordered)))
            .expect("request");
        let mut live = Live {
            reply: spawn_send(&self.routers[send.run.via as usize], request),
            started,
            release,
            waiting: false,
        };
        let waiting_before = self.sessions.iter().flatten().filter(|l| l.waiting).count();
        let watch = (send.run.via == Via::Patient).then_some(waiting_before);
        let seen = self.settle(&mut live, watch).await;
        match seen {
            // A gate it never took would wait for nobody.
            Seen::Answered(_) => drop(self.gates.0.lock().unwrap().remove(&send.run.id)),
            Seen::Waiting => live.waiting = true,
            Seen::Started => {}
        }
        if !matches!(seen, Seen::Answered(_)) {
            self.sessions[send.session] = Some(live);
        }
        seen
    }

    /// Releases the held request of `session` with `ending`; then settles the request that
    /// waited for it, if the model says one did.
    pub async fn release(
        &mut self,
        session: usize,
        ending: Ending,
        waiter: Option<usize>,
    ) -> (Seen, Option<Seen>) {
        let mut held = self.sessions[session].take().expect("a held session");
        let release = held.release.take().expect("held at its gate");
        // An error means the handler is gone already; its answer tells what happened.
        let _ = release.send(ending.status());
        let seen = self.settle(&mut held, None).await;
        let Some(waiter) = waiter else {
            return (seen, None);
        };
        let mut live = self.sessions[waiter].take().expect("a waiting session");
        live.waiting = false;
        let settled = self.settle(&mut live, None).await;
        if matches!(settled, Seen::Started) {
            self.sessions[waiter] = Some(live);
        }
        (seen, Some(settled))
    }

    /// Waits until `live` is answered or its handler starts, or (with `watch`, the patient
    /// layer's waiting count before it was sent) until it waits.
    async fn settle(&self, live: &mut Live, watch: Option<usize>) -> Seen {
        let patient = &self.inboxes[Via::Patient as usize];
        let waits = async {
            match watch {
                Some(before) => {
                    while patient.waiting_claims() <= before {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                }
                None => pending::<()>().await,
            }
        };
        let Live { reply, started, .. } = live;
        let starts = async {
            match started.as_mut() {
                Some(started) => drop(started.await),
                None => pending::<()>().await,
            }
        };
        let seen = tokio::time::timeout(HANG, async {
            tokio::select! {
                biased;
                reply = reply => Seen::Answered(reply.expect("the request's task")),
                () = starts => Seen::Started,
                () = waits => Seen::Waiting,
            }
        })
        .await
        .expect("a request neither answered, nor started, nor waited");
        if matches!(seen, Seen::Started) {
            live.started = None;
        }
        seen
    }

    pub async fn decide(&self, id: i64, repair: bool) -> DecisionAnswer {
        let (who, why) = ("model", "the model test decided");
        let decided = if repair {
            self.quarantine.repair(id, who, why).await
        } else {
            self.quarantine.discard(id, who, why).await
        };
        match decided {
            Ok(()) => DecisionAnswer::Done,
            Err(DecisionError::AlreadyDecided(_)) => DecisionAnswer::AlreadyDecided,
            Err(DecisionError::NotFound(_)) => DecisionAnswer::NotFound,
            Err(err) => panic!("decision on item {id}: {err}"),
        }
    }

    pub async fn age(&self, key: usize) {
        for statement in AGE {
            sqlx::query(statement)
                .bind(&self.consumer)
                .bind(format!("k{key}"))
                .execute(&self.pool)
                .await
                .expect("age");
        }
    }

    pub async fn purge(&self) {
        self.purger.purge().await.expect("purge");
    }

    /// What the database and the layers hold now, with the ids of each key's items.
    /// `held` is how many claims should be in flight.
    pub async fn facts(&self, held: usize) -> (Facts, Vec<Vec<i64>>) {
        let (keys, ids) = facts::read(&self.pool, &self.consumer).await;
        let facts = Facts {
            keys,
            waiting: self.inboxes[Via::Patient as usize].waiting_claims(),
            in_flight: self.in_flight(held).await,
        };
        (facts, ids)
    }

    /// The claims in flight, from their advisory locks, once no more than `held` are seen
    /// (or after a bound, to report the difference). A duplicate's claim transaction takes
    /// the key's lock and is dropped once the duplicate is answered; sqlx rolls it back when
    /// the connection returns to the pool, in a task of its own, so for a moment after the
    /// answer it can still hold the lock and count as a claim in flight.
    async fn in_flight(&self, held: usize) -> usize {
        let mut polls = 0;
        loop {
            let seen = self.inboxes[0]
                .claims_in_flight(&[&self.consumer])
                .await
                .expect("claims in flight")[0]
                .claims;
            let seen = usize::try_from(seen).expect("a count");
            polls += 1;
            if seen <= held || polls == 500 {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Ends every request still outstanding, whatever state the case left it in: with their
    /// release senders dropped, held handlers (and waiters that claim after them) fail at
    /// once; every task is awaited, so nothing of this case outlives it.
    pub async fn shutdown(mut self) {
        let replies: Vec<_> = (self.sessions.iter_mut())
            .filter_map(Option::take)
            .map(|live| live.reply)
            .collect();
        for reply in replies {
            let _ = tokio::time::timeout(HANG, reply).await;
        }
    }
}
