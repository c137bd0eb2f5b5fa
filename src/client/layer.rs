//! The Tower layer and service.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower::{Layer, Service};

use super::error::{CommandError, GiveUpReason};
use super::run::run;
use super::{AttemptBody, ResponseBody, RetryPolicy};
use crate::body::BoxError;

/// Wraps an HTTP client service in a [`RetryService`].
///
/// ```
/// use tower::Layer;
/// use tower_inbox::client::{RetryLayer, RetryPolicy};
///
/// # fn wrap<S>(client: S) {
/// let layer = RetryLayer::new(RetryPolicy::default().max_attempts(5));
/// let client = layer.layer(client);
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct RetryLayer {
    policy: Arc<RetryPolicy>,
}

impl RetryLayer {
    /// A layer with `policy`.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = RetryService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryService {
            inner,
            policy: self.policy.clone(),
        }
    }
}

/// An HTTP client service that sends each command with one `Idempotency-Key` and retries
/// what the [`RetryPolicy`] retries.
///
/// It takes `Request<B>` and hands the inner service `Request<AttemptBody<B>>`: the buffered
/// body on every attempt of a replayable request, the caller's own body on the single
/// attempt of any other. Its responses carry a [`CommandReceipt`](super::CommandReceipt) in
/// their extensions.
#[derive(Debug, Clone)]
pub struct RetryService<S> {
    inner: S,
    policy: Arc<RetryPolicy>,
}

impl<S> RetryService<S> {
    /// Wraps `inner` with `policy`.
    pub fn new(inner: S, policy: RetryPolicy) -> Self {
        Self {
            inner,
            policy: Arc::new(policy),
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// The future of a [`RetryService`] call.
pub type ResponseFuture<ResBody> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<ResBody>>, CommandError>> + Send>>;

impl<S, B, ResBody> Service<Request<B>> for RetryService<S>
where
    S: Service<Request<AttemptBody<B>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = CommandError;
    type Future = ResponseFuture<ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(|e| {
            CommandError::before_sending(None, GiveUpReason::NotRetried, Some(e.into()))
        })
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone driven to readiness serves this command (polled ready again before each
        // later attempt); a fresh clone stays for the next call.
        let fresh = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, fresh);
        Box::pin(run(ready, self.policy.clone(), request))
    }
}
