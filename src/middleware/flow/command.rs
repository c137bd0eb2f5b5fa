//! A command that passed the checks: claimed, run, and re-run after transient failures.

use crate::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use tower::Service;

use super::answer::{database_problem, replay};
use super::attempt::discard;
use super::handler::Services;
use super::{consumer_labels, Command, Step};
use crate::extract::TxSlot;
use crate::inbox::{Claim, ClaimMode, InboxEntry, Reruns, RetryReason};
use crate::metrics as m;
use crate::problem::{Problem, ProblemKind};

impl Command {
    /// Claims and runs the command, re-running the whole transaction after transient
    /// failures within the configured bound.
    pub(super) async fn claim_and_run<S, ResBody>(
        self,
        inner: S,
    ) -> Result<Response<Body>, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Clone,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<crate::body::BoxError>,
    {
        if let Some(Step::Answer(outcome, response)) = self.answer_cached().await {
            tracing::Span::current().record("outcome", outcome);
            return Ok(response);
        }
        let mut reruns = Reruns::new(self.config.transient_retry, self.config.inbox.pool());
        let mut services = Services::new(inner);
        let mut attempt = 1;
        loop {
            let (reason, ran_handler, commit_in_flight) = match self.attempt(&mut services).await? {
                Step::Answer(outcome, response) => {
                    tracing::Span::current().record("outcome", outcome);
                    return Ok(response);
                }
                Step::Rerun {
                    reason,
                    ran_handler,
                    commit_in_flight,
                } => (reason, ran_handler, commit_in_flight),
            };
            let Some(delay) = reruns.next(reason) else {
                return Ok(if reason == RetryReason::ConnectionLost {
                    self.connection_lost(reruns.lost(), commit_in_flight)
                } else {
                    self.conflicts_exhausted(reason, reruns.conflicts(), ran_handler)
                        .await
                });
            };
            m::count_with(
                m::TRANSACTION_RETRIES,
                &consumer_labels(&self.config),
                "reason",
                reason.as_str(),
            );
            tracing::info!(%reason, attempt, ?delay, "transaction rolled back; running it again");
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    pub(super) async fn attempt<S, ResBody>(
        &self,
        services: &mut Services<S>,
    ) -> Result<Step, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>> + Clone,
        ResBody: http_body::Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<crate::body::BoxError>,
    {
        let config = &self.config;
        // A re-run waits for the inner service to be ready before it claims, so that a
        // concurrency limit or load shedder inside does not hold a claim (a pooled connection
        // and the key's lock) while it waits. The first run's service is ready already.
        services.ready().await?;
        let claim = match config.claim_mode {
            ClaimMode::First => {
                config
                    .inbox
                    .claim(
                        self.identity.clone(),
                        self.fingerprint,
                        &config.handler_version,
                        config.in_flight_wait,
                    )
                    .await
            }
            // Nothing is claimed yet: the claim is the commit's last statement. A finished
            // (or in-flight) duplicate is still answered before the handler runs.
            ClaimMode::AtCommit => {
                let inbox = &config.inbox;
                let started = std::time::Instant::now();
                let mut waited = false;
                match inbox
                    .answer_before_claim(
                        &self.identity,
                        &self.fingerprint,
                        started + config.in_flight_wait,
                        &mut waited,
                    )
                    .await
                {
                    Ok(Some(answer)) => {
                        inbox.observe_taken(true);
                        crate::inbox::count_claim(&answer, || {
                            inbox.metric_labels().of(&self.identity)
                        });
                        if waited {
                            m::observe_seconds(
                                m::CLAIM_WAIT,
                                &consumer_labels(config),
                                started.elapsed().as_secs_f64(),
                            );
                        }
                        Ok(answer)
                    }
                    Ok(None) => inbox
                        .begin_at_commit(
                            self.identity.clone(),
                            self.fingerprint,
                            &config.handler_version,
                            config.in_flight_wait,
                        )
                        .await
                        .map(Claim::Claimed),
                    Err(err) => Err(err),
                }
            }
        };
        let step = match claim {
            Ok(Claim::Claimed(message)) => {
                return self
                    .run_handler(services.for_call(), TxSlot::new(message))
                    .await;
            }
            Ok(seen) => self.answer_seen(seen).await,
            Err(err) => match err.retry_reason() {
                Some(reason) => Step::Rerun {
                    reason,
                    ran_handler: false,
                    commit_in_flight: false,
                },
                None => Step::Answer("database-error", database_problem(config, &err)),
            },
        };
        Ok(step)
    }

    /// The answer when the key was claimed before: by the claim, or (claim at commit) by the
    /// commit, after this transaction rolled back.
    pub(super) async fn answer_seen(&self, claim: Claim) -> Step {
        match claim {
            Claim::Duplicate(entry) => {
                let step = self.replayed(&entry);
                if let Some(cache) = &self.config.replay_cache {
                    cache.insert(&self.identity, self.fingerprint, entry);
                }
                step
            }
            Claim::Conflict(entry) => self.conflict(&entry).await,
            Claim::InProgress => {
                let problem = Problem::new(
                    ProblemKind::InProgress,
                    "a request with this key is still being processed; retry later",
                )
                .retry_after(self.config.retry_after_secs);
                Step::Answer("in-progress", self.config.problem(problem))
            }
            Claim::Claimed(message) => {
                // Only a claim that found the key taken gets here; never commit this one.
                tracing::error!("a claimed message reached the answer for a taken key");
                discard(message).await;
                let problem = Problem::new(
                    ProblemKind::Internal,
                    "the inbox could not process the request; nothing was committed",
                );
                Step::Answer("internal", self.config.problem(problem))
            }
        }
    }

    /// Replays the recorded response of a finished command.
    pub(super) fn replayed(&self, entry: &InboxEntry) -> Step {
        let span = tracing::debug_span!(
            "inbox.replay",
            consumer = %self.identity.consumer(),
            message_id = %self.identity.message_id(),
            status = entry.response.as_ref().map(|r| r.status),
        );
        Step::Answer("replayed", span.in_scope(|| replay(&self.config, entry)))
    }

    /// Refuses a key reused with a different payload, and quarantines the conflict.
    pub(super) async fn conflict(&self, entry: &InboxEntry) -> Step {
        let config = &self.config;
        tracing::warn!(
            recorded_sha256 = %entry.payload_sha256,
            sha256 = %self.fingerprint,
            "idempotency key reused with a different payload"
        );
        // The answer does not depend on keeping the record; a failure is logged.
        if let Err(err) = config
            .inbox
            .record_conflict(&self.identity, self.fingerprint, &config.handler_version)
            .await
        {
            tracing::error!(error = %err, "could not quarantine the identity conflict");
        }
        let detail = format!(
            "this {} was already used for a different request; use a new key for a new command",
            config.key_header
        );
        let problem =
            Problem::new(ProblemKind::PayloadMismatch, detail).with_status(config.mismatch_status);
        Step::Answer("conflict", self.config.problem(problem))
    }

    /// Answers a command this process finished from the replay cache, if it holds it: the
    /// recorded response, or the conflict if the payload differs; `None` to claim.
    pub(super) async fn answer_cached(&self) -> Option<Step> {
        let config = &self.config;
        let hit = config.replay_cache.as_ref()?.get(&self.identity)?;
        let labels = config.inbox.metric_labels();
        m::count(
            m::CACHE_HITS,
            &labels.of_consumer_shared(&config.consumer),
            1,
        );
        if hit.fingerprint != self.fingerprint {
            m::count(m::IDENTITY_CONFLICTS, &labels.of(&self.identity), 1);
            return Some(self.conflict(&hit.entry).await);
        }
        m::count(m::DUPLICATES, &labels.of(&self.identity), 1);
        Some(self.replayed(&hit.entry))
    }
}
