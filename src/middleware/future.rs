use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::body::Body;
use http::Response;

type BoxedFlow<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

/// The response future of [`InboxService`](super::InboxService).
///
/// Dropping it (the client went away) drops the claimed transaction, which rolls back, and
/// counts the attempt as failed.
pub struct ResponseFuture<E> {
    inner: BoxedFlow<E>,
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(
        inner: impl Future<Output = Result<Response<Body>, E>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(inner),
        }
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<Body>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<E> fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
