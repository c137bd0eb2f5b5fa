use std::sync::Arc;
use std::task::{Context, Poll};

use crate::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use tower::Service;

use super::config::InboxConfig;
use super::flow;
use super::future::ResponseFuture;

/// The service [`InboxLayer`](crate::InboxLayer) wraps around the handler.
///
/// The inner service receives the request with its body buffered (it was read for the
/// fingerprint), and the claimed transaction in its extensions for
/// [`InboxTx`](crate::InboxTx).
pub struct InboxService<S> {
    inner: S,
    config: Arc<InboxConfig>,
}

impl<S> InboxService<S> {
    pub(crate) fn new(inner: S, config: Arc<InboxConfig>) -> Self {
        Self { inner, config }
    }
}

impl<S: Clone> Clone for InboxService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for InboxService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxService")
            .field("inner", &self.inner)
            .field("consumer", &self.config.consumer)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for InboxService<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<crate::body::BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<crate::body::BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone that was driven to readiness serves this call; the fresh clone waits for
        // the next poll_ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(flow::run(self.config.clone(), inner, request))
    }
}
