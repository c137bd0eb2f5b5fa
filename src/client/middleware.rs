//! The client as reqwest middleware (feature `client-reqwest`): the same retry loop as
//! [`RetryLayer`](super::RetryLayer), run over the rest of the middleware chain.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use http::Extensions;
use http_body::Body as _;
use http_body_util::Either;
use reqwest::{Body, ResponseBuilderExt, Url};
use reqwest_middleware::{Middleware, Next};
use tower::Service;

use super::key::is_command;
use super::run::run;
use super::{AttemptBody, ResponseBody, RetryPolicy};

/// The client as a [`reqwest_middleware::Middleware`]: the behaviour and the
/// [`RetryPolicy`] of [`RetryLayer`](super::RetryLayer), for a `reqwest` client.
///
/// The final answer is a `reqwest::Response` with the [`CommandReceipt`](super::CommandReceipt)
/// in its extensions. Giving up is a [`reqwest_middleware::Error::Middleware`] whose
/// `anyhow::Error` is a [`CommandError`](super::CommandError): `downcast_ref` it for the key,
/// the attempts and the last answer. A body reqwest cannot send twice (`Body::wrap_stream`)
/// is sent once, as with the layer.
///
/// Middlewares after this one run once per attempt, each attempt with a copy of the
/// request's extensions; what the last attempt left in them is kept.
///
/// ```no_run
/// use reqwest_middleware::ClientBuilder;
/// use tower_inbox::client::{CommandError, CommandReceipt, RetryMiddleware, RetryPolicy};
///
/// # async fn send() -> Result<(), Box<dyn std::error::Error>> {
/// let client = ClientBuilder::new(reqwest::Client::new())
///     .with(RetryMiddleware::new(RetryPolicy::default()))
///     .build();
/// let sent = client
///     .post("http://127.0.0.1:3000/accounts/alice/credits")
///     .header("content-type", "application/json")
///     .body(r#"{"delta": 5}"#)
///     .send()
///     .await;
/// match sent {
///     Ok(response) => {
///         let receipt = response.extensions().get::<CommandReceipt>().expect("a command");
///         println!("{}: {} after {} attempts", receipt.key(), response.status(), receipt.attempts());
///     }
///     Err(reqwest_middleware::Error::Middleware(e)) if e.is::<CommandError>() => {
///         let error = e.downcast_ref::<CommandError>().expect("checked");
///         println!("gave up on {:?} after {} attempts", error.key(), error.attempts());
///     }
///     Err(e) => return Err(e.into()),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RetryMiddleware {
    policy: Arc<RetryPolicy>,
}

impl RetryMiddleware {
    /// The middleware with `policy`.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }
}

#[async_trait::async_trait]
impl Middleware for RetryMiddleware {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        if !is_command(&self.policy, request.method(), request.headers()) {
            return next.run(request, extensions).await;
        }
        let request = http::Request::<Body>::try_from(request)?;
        let last = Arc::new(Mutex::new(None));
        let rest = Rest {
            next,
            extensions: extensions.clone(),
            last: last.clone(),
        };
        let answered = run(rest, self.policy.clone(), request).await;
        if let Some(left) = last.lock().ok().and_then(|mut last| last.take()) {
            extensions.extend(left);
        }
        match answered {
            Ok(response) => Ok(reqwest_response(response)),
            Err(e) => Err(reqwest_middleware::Error::middleware(e)),
        }
    }
}

/// The rest of the chain as the inner service of the retry loop: each call one attempt.
struct Rest<'a> {
    next: Next<'a>,
    /// The caller's extensions, copied into each attempt.
    extensions: Extensions,
    /// The extensions the latest attempt's chain left.
    last: Arc<Mutex<Option<Extensions>>>,
}

/// The URL an attempt's answer came from (after any redirect), kept across the loop.
#[derive(Clone)]
struct AnswerUrl(Url);

type Attempted<'a> =
    Pin<Box<dyn Future<Output = reqwest_middleware::Result<http::Response<Body>>> + Send + 'a>>;

impl<'a> Service<http::Request<AttemptBody<Body>>> for Rest<'a> {
    type Response = http::Response<Body>;
    type Error = reqwest_middleware::Error;
    type Future = Attempted<'a>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<AttemptBody<Body>>) -> Self::Future {
        let next = self.next.clone();
        let mut extensions = self.extensions.clone();
        let last = self.last.clone();
        Box::pin(async move {
            let request = reqwest::Request::try_from(request.map(reqwest_body))?;
            let answered = next.run(request, &mut extensions).await;
            if let Ok(mut last) = last.lock() {
                *last = Some(extensions);
            }
            let response = answered?;
            let url = AnswerUrl(response.url().clone());
            let mut response = http::Response::<Body>::from(response);
            response.extensions_mut().insert(url);
            Ok(response)
        })
    }
}

/// An attempt's body for reqwest: buffered bytes as a reusable body (which reqwest can also
/// send again after a 307 or 308), the caller's own as it is.
fn reqwest_body(body: AttemptBody<Body>) -> Body {
    match body {
        Either::Right(body) => body,
        Either::Left(mut full) => {
            // `Full` holds its bytes: its one frame is ready at once.
            let mut cx = Context::from_waker(Waker::noop());
            match Pin::new(&mut full).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(bytes) => Body::from(bytes),
                    Err(_) => Body::wrap(full),
                },
                Poll::Ready(None) => Body::from(Vec::new()),
                Poll::Ready(Some(Err(never))) => match never {},
                Poll::Pending => Body::wrap(full),
            }
        }
    }
}

/// The final answer as a `reqwest::Response`, with the URL it came from.
fn reqwest_response(response: http::Response<ResponseBody<Body>>) -> reqwest::Response {
    let (mut parts, body) = response.into_parts();
    let body = match body {
        Either::Right(body) => body,
        Either::Left(read) => Body::wrap(read),
    };
    if let Some(AnswerUrl(url)) = parts.extensions.remove::<AnswerUrl>() {
        // reqwest keeps a response's URL in an extension of its own, set through its builder.
        if let Ok(marker) = http::Response::builder().url(url).body(()) {
            parts.extensions.extend(marker.into_parts().0.extensions);
        }
    }
    reqwest::Response::from(http::Response::from_parts(parts, body))
}
