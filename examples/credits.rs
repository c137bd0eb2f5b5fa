//! The credits service: `POST /accounts/{id}/credits` behind the inbox layer.
//!
//! ```sh
//! cargo run --example credits
//! curl -i -X POST localhost:3000/accounts/a1/credits \
//!   -H 'Idempotency-Key: 7f1c' -H 'X-Producer: app' -H 'Content-Type: application/json' \
//!   -d '{"delta": 10}'
//! ```
//!
//! A Rust caller sends its commands through `tower_inbox::client` (feature `client`), which
//! makes each key and retries only what is safe to retry: `examples/client.rs` does, with
//! `cargo run --example client --features client` while this runs.
//!
//! `BIND_ADDR` (default `127.0.0.1:3000`) and `DATABASE_URL` configure it. With
//! `CREDITS_WEBHOOK_URL` set, every first-seen credit also enqueues a webhook effect that an
//! in-process dispatcher delivers (`CREDITS_WEBHOOK_TIMEOUT_MS`, default 5000). `GET /metrics`
//! serves every metric in the Prometheus text format; a stats task refreshes the inbox,
//! outbox and quarantine gauges every minute, and a purge task deletes what the retention
//! policies no longer need every ten minutes. `CREDITS_BASELINE_ROUTE=1` also serves
//! `POST /baseline/accounts/{id}/credits`, the same credit without the layer, to measure what
//! the layer costs (`benches/loadgen`), and `POST /minimal/accounts/{id}/credits`, the
//! fewest statements that claim and record it, written by hand (`credits/ceiling.rs`), to
//! measure the layer against that ceiling; never in production. The opt-in speed settings
//! can be turned on for such measurements: `CREDITS_CLAIM_AT_COMMIT=1`,
//! `CREDITS_LOOKUP_BEFORE_CLAIM=1` or `0` (always or never; decided from the traffic by default), and `CREDITS_REPLAY_CACHE=<entries>` (64 MiB at most).
//! Without `DATABASE_URL` it uses the local PostgreSQL on 127.0.0.1:5432, or starts a
//! throwaway one from the local binaries, like the tests.

// Shared with the tests, which use the parts this binary does not.
#[allow(dead_code)]
#[path = "credits/app.rs"]
mod app;
#[path = "credits/ceiling.rs"]
mod ceiling;

use std::net::SocketAddr;
use std::time::Duration;

use tower_inbox::inbox::ClaimMode;
use tower_inbox::metrics::StatsTask;
use tower_inbox::middleware::ReplayCache;
#[cfg(feature = "outbox-http")]
use tower_inbox::outbox::{Dispatcher, HttpTransport};
use tower_inbox::retention::{Purger, RetentionPolicy};
use tower_inbox::InboxLayer;

/// The example's inbox layer, with the opt-in speed settings taken from the environment.
fn layer(pool: &sqlx::PgPool) -> Result<InboxLayer, Error> {
    let mut builder = app::inbox_layer(pool.clone());
    if on("CREDITS_CLAIM_AT_COMMIT") {
        builder = builder.claim_mode(ClaimMode::AtCommit);
    }
    match std::env::var("CREDITS_LOOKUP_BEFORE_CLAIM").as_deref() {
        Ok("1") => builder = builder.lookup_before_claim(true),
        Ok("0") => builder = builder.lookup_before_claim(false),
        _ => {}
    }
    if let Ok(entries) = std::env::var("CREDITS_REPLAY_CACHE") {
        let entries = entries
            .parse()
            .map_err(|e| format!("CREDITS_REPLAY_CACHE: {e}"))?;
        builder = builder.replay_cache(ReplayCache::new(entries, 64 * 1024 * 1024)?);
    }
    Ok(builder.build()?)
}

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Whether the setting `name` is `1`.
fn on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// A startup failure is one line naming the culprit, then exit status 1.
#[tokio::main]
async fn main() -> std::process::ExitCode {
    app::main_of("credits", "info", run()).await
}

async fn run() -> Result<(), Error> {
    let bind: SocketAddr = std::env::var("BIND_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".to_owned())
        .parse()
        .map_err(|e| format!("BIND_ADDR is not an address like 127.0.0.1:3000: {e}"))?;
    // Bound before anything touches the database: a taken port changes nothing there.
    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .map_err(|e| format!("cannot listen on {bind} (BIND_ADDR): {e}"))?;
    let pool = app::connect(32).await?;

    app::prepare(&pool).await?;

    let webhook = std::env::var("CREDITS_WEBHOOK_URL").ok();
    let (stop_dispatcher, dispatcher_stopped) = tokio::sync::oneshot::channel::<()>();
    let dispatcher: Option<tokio::task::JoinHandle<Result<(), tower_inbox::outbox::OutboxError>>> =
        match &webhook {
            #[cfg(not(feature = "outbox-http"))]
            Some(_) => {
                drop(dispatcher_stopped);
                return Err("CREDITS_WEBHOOK_URL needs the outbox's HTTP transport: run with --features outbox-http".into());
            }
            #[cfg(feature = "outbox-http")]
            Some(url) => {
                let timeout_ms: u64 = match std::env::var("CREDITS_WEBHOOK_TIMEOUT_MS") {
                    Ok(v) => v
                        .parse()
                        .map_err(|e| format!("CREDITS_WEBHOOK_TIMEOUT_MS: {e}"))?,
                    Err(_) => 5000,
                };
                let timeout = Duration::from_millis(timeout_ms);
                let dispatcher = Dispatcher::builder(pool.clone(), HttpTransport::new(timeout)?)
                    // At least the transport's own timeout (the builder refuses less): the
                    // transport then always returns an answer it has before the dispatcher gives up.
                    .delivery_timeout(timeout)
                    // A killed process's leases expire well within a minute.
                    .lease(timeout + Duration::from_secs(10))
                    // First retry after 0.5-1 s, doubling up to 30 s.
                    .backoff(Duration::from_secs(1), Duration::from_secs(30))
                    .build()?;
                tracing::info!(%url, "delivering credit webhooks through the outbox");
                Some(tokio::spawn(dispatcher.run(async {
                    let _ = dispatcher_stopped.await;
                })))
            }
            None => None,
        };
    let router = app::routes_with_webhook(pool.clone(), layer(&pool)?, webhook);

    // The unprotected baseline route and the hand-written minimal protocol's, for measuring
    // the layer's cost and its ceiling (benches/loadgen).
    let router = if on("CREDITS_BASELINE_ROUTE") {
        tracing::warn!(
            "serving the UNPROTECTED routes /baseline/accounts/{{id}}/credits and /minimal/accounts/{{id}}/credits"
        );
        router
            .merge(app::baseline_routes(pool.clone()))
            .merge(ceiling::minimal_routes(
                pool.clone(),
                on("CREDITS_CLAIM_AT_COMMIT"),
            ))
    } else {
        router
    };
    // GET /metrics in the Prometheus text format; the exporter's upkeep drains histograms.
    let prometheus = app::install_prometheus()?;
    let router = app::with_metrics_route(router, prometheus.clone());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            prometheus.run_upkeep();
        }
    });
    // Retention from the ways a command can come back, not a TTL: clients retry for up to a
    // day, and an outage of up to a day holds their retries back. Delivered webhooks and
    // decided quarantine items are kept for audits. The purge runs every ten minutes.
    const DAY: Duration = Duration::from_secs(24 * 3600);
    let inbox_retention = RetentionPolicy::builder()
        .retry_horizon(DAY)
        .outage_tolerance(DAY)
        .safety_margin(DAY)
        .build()?;
    let audit = |days: u32| {
        RetentionPolicy::builder()
            .custom("audit", DAY * days)
            .safety_margin(DAY)
            .build()
    };
    tracing::info!("inbox retention:\n{inbox_retention}");
    let purger = Purger::builder(pool.clone())
        .inbox(inbox_retention)
        .outbox(audit(7)?)
        .quarantine(audit(30)?)
        .build()?;
    tokio::spawn(purger.run(Duration::from_secs(600), std::future::pending::<()>()));
    // Inbox size and age, outbox backlog and open quarantine items, every minute. Its reads
    // do not grow with the inbox (see StatsTask).
    tokio::spawn(
        StatsTask::new(pool.clone()).run(Duration::from_secs(60), std::future::pending::<()>()),
    );

    let address = listener.local_addr()?;
    tracing::info!(%address, "credits service listening on {address}");
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    if let Some(dispatcher) = dispatcher {
        let _ = stop_dispatcher.send(());
        dispatcher.await??;
    }
    Ok(())
}
