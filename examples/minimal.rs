//! The smallest real service: one route behind the inbox layer.
//!
//! ```sh
//! cargo run --example minimal   # 127.0.0.1:3001; DATABASE_URL, else the tests' database
//! curl -i -X POST localhost:3001/orders -H 'Idempotency-Key: o-1' -H 'X-Producer: shop' -d 'book'
//! ```
//! Send it twice: the second answer is the first one replayed, and one order exists.

use axum::{http::StatusCode, routing::post, Router};
use tower_inbox::{producer::TrustedHeader, InboxLayer, InboxTx};

/// The business write goes through the claimed transaction: it commits with the claim.
async fn create_order(mut tx: InboxTx, item: String) -> Result<(StatusCode, String), StatusCode> {
    let id: i64 = sqlx::query_scalar("insert into orders (item) values ($1) returning id")
        .bind(item)
        .fetch_one(&mut *tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, format!("order {id}\n")))
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("minimal: {err}"); // one line, then a non-zero exit
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let url = match std::env::var("DATABASE_URL") {
        Ok(url) => url,
        Err(_) => tower_inbox_testdb::app_database_url("tower_inbox_minimal").await?,
    };
    let pool = sqlx::PgPool::connect(&url)
        .await
        .map_err(|e| format!("cannot connect to the database of DATABASE_URL: {e}"))?;
    tower_inbox::migrate(&pool).await?;
    sqlx::query("create table if not exists orders (id bigserial primary key, item text not null)")
        .execute(&pool)
        .await?;

    // X-Producer stands in for your authentication (producer::FromExtension in production).
    let inbox = InboxLayer::builder(pool, "orders")
        .producer(TrustedHeader::new("x-producer"))
        .build()?;
    let app = Router::new()
        .route("/orders", post(create_order))
        .route_layer(inbox);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001")
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:3001: {e}"))?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
