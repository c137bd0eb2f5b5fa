//! The HTTP adapter: [`InboxLayer`](crate::InboxLayer), a thin Tower layer over the [protocol core](crate::inbox).
//!
//! ```no_run
//! use axum::{routing::post, Router};
//! use tower_inbox::{producer::TrustedHeader, InboxLayer, InboxTx};
//!
//! async fn create_order(mut tx: InboxTx) -> &'static str {
//!     sqlx::query("insert into orders default values")
//!         .execute(&mut *tx)
//!         .await
//!         .expect("insert");
//!     "created"
//! }
//!
//! # async fn app(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! tower_inbox::migrate(&pool).await?;
//! let inbox = InboxLayer::builder(pool, "orders")
//!     .producer(TrustedHeader::new("x-producer"))
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/orders", post(create_order))
//!     .route_layer(inbox);
//! # let _ = app; Ok(()) }
//! ```

mod cache;
mod config;
mod flow;
mod future;
pub(crate) mod layer;
mod outcome;
mod replay_headers;
mod service;

pub use cache::{EmptyCache, ReplayCache};
pub use config::{
    MakeProblem, DEFAULT_BODY_LIMIT, DEFAULT_RESPONSE_LIMIT, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED,
};
pub use future::ResponseFuture;
pub use layer::{ConfigError, HasProducer, MismatchStatus, NeedsProducer, ProducerMissingStatus};
pub use outcome::{Outcome, OutcomePolicy, DEFAULT_REJECTIONS};
pub use replay_headers::ReplayHeaders;
pub use service::InboxService;
