//! The credits service: `POST /accounts/{id}/credits` behind the inbox layer.
//!
//! ```sh
//! cargo run --example credits
//! curl -i -X POST localhost:3000/accounts/a1/credits \
//!   -H 'Idempotency-Key: 7f1c' -H 'X-Producer: app' -H 'Content-Type: application/json' \
//!   -d '{"delta": 10}'
//! ```
//!
//! `BIND_ADDR` (default `127.0.0.1:3000`) and `DATABASE_URL` configure it. Without
//! `DATABASE_URL` it uses the local PostgreSQL on 127.0.0.1:5432, or starts a throwaway one
//! from the local binaries, like the tests.

#[path = "credits/app.rs"]
mod app;

use std::net::SocketAddr;
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();

    let bind: SocketAddr = std::env::var("BIND_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".to_owned())
        .parse()
        .map_err(|e| format!("BIND_ADDR: {e}"))?;
    let database_url = match std::env::var("DATABASE_URL") {
        Ok(url) => url,
        Err(_) => tower_inbox_testdb::app_database_url("tower_inbox_credits").await?,
    };

    // Each in-flight command holds one connection from the claim to the commit, and a
    // duplicate waiting for it holds another: size the pool for the concurrency you serve.
    let pool = PgPoolOptions::new()
        .max_connections(32)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&database_url)
        .await?;
    app::prepare(&pool).await?;
    let router = app::router(pool)?;

    let listener = tokio::net::TcpListener::bind(bind).await?;
    tracing::info!(address = %listener.local_addr()?, "credits service listening");
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
