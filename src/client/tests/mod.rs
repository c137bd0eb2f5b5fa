//! The retry logic against a scripted inner service, on tokio's paused clock: waits pass
//! instantly and every duration read is the virtual clock's.

mod budget;
mod retry_after;
mod transport;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full, StreamBody};
use tokio::time::Instant;
use tower::{service_fn, Layer, Service, ServiceExt};

use super::*;
use crate::body::BoxError;
use crate::problem::ProblemKind;

/// The key and body of one attempt.
type Seen = (Option<String>, Bytes);

enum Step {
    Answer(Response<Full<Bytes>>),
    Fail(&'static str),
    /// Fails as a client does when nothing listens: a refused connection deep in the
    /// error's sources.
    Refused,
    Hang,
}

/// The inner service: answers the scripted steps in turn and records each attempt's key
/// and body.
#[derive(Clone)]
struct Script {
    steps: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Script {
    fn new(steps: impl IntoIterator<Item = Step>) -> Self {
        Self {
            steps: Arc::new(Mutex::new(steps.into_iter().collect())),
            seen: Arc::default(),
        }
    }

    fn client<B>(
        &self,
        policy: RetryPolicy,
    ) -> impl Service<
        Request<B>,
        Response = Response<ResponseBody<Full<Bytes>>>,
        Error = CommandError,
        Future: Send,
    > + Clone
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let script = self.clone();
        let inner = service_fn(move |request: Request<AttemptBody<B>>| {
            let script = script.clone();
            async move {
                let key = request
                    .headers()
                    .get("idempotency-key")
                    .map(|v| v.to_str().unwrap().to_owned());
                let body = request.into_body().collect().await.map(|c| c.to_bytes());
                script
                    .seen
                    .lock()
                    .unwrap()
                    .push((key, body.unwrap_or_default()));
                let step = script.steps.lock().unwrap().pop_front();
                match step.expect("the script ran out") {
                    Step::Answer(response) => Ok::<_, BoxError>(response),
                    Step::Fail(e) => Err(e.into()),
                    Step::Refused => Err(refused()),
                    Step::Hang => std::future::pending().await,
                }
            }
        });
        RetryLayer::new(policy).layer(inner)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn status(code: u16) -> Step {
    let mut response = Response::new(Full::new(Bytes::from_static(b"answer")));
    *response.status_mut() = StatusCode::from_u16(code).unwrap();
    Step::Answer(response)
}

fn replayed(code: u16) -> Step {
    let Step::Answer(mut response) = status(code) else {
        unreachable!()
    };
    response
        .headers_mut()
        .insert("idempotent-replayed", "true".parse().unwrap());
    Step::Answer(response)
}

fn problem(kind: ProblemKind, code: u16, retry_after: Option<u64>) -> Step {
    let body =
        serde_json::json!({"type": kind.type_uri(), "title": "t", "status": code, "detail": "d"});
    let mut builder = Response::builder()
        .status(code)
        .header("content-type", "application/problem+json");
    if let Some(seconds) = retry_after {
        builder = builder.header("retry-after", seconds);
    }
    Step::Answer(
        builder
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap(),
    )
}

/// A client error wrapping a connect error wrapping the refusal, as hyper-util's does.
fn refused() -> BoxError {
    #[derive(Debug)]
    struct Wrapper(&'static str, std::io::Error);
    impl std::fmt::Display for Wrapper {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for Wrapper {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.1)
        }
    }
    let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    Box::new(Wrapper("client error (Connect)", io))
}

fn command(key: Option<&str>) -> Request<Full<Bytes>> {
    let mut builder = Request::post("http://server/accounts/a/credits");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder
        .body(Full::new(Bytes::from_static(b"{\"delta\":1}")))
        .unwrap()
}

async fn send<S>(mut client: S, request: Request<Full<Bytes>>) -> Result<S::Response, S::Error>
where
    S: Service<Request<Full<Bytes>>>,
{
    client.ready().await?.call(request).await
}

fn receipt<B>(response: &Response<B>) -> CommandReceipt {
    response
        .extensions()
        .get::<CommandReceipt>()
        .unwrap()
        .clone()
}

#[tokio::test(start_paused = true)]
async fn every_attempt_carries_the_generated_key_and_the_same_body() {
    let script = Script::new([status(503), Step::Fail("connection reset"), status(201)]);
    let policy = RetryPolicy::default().key_generator(|| "generated-1".to_owned());
    let response = send(script.client(policy), command(None)).await.unwrap();
    assert_eq!(response.status(), 201);
    let receipt = receipt(&response);
    assert_eq!(
        (receipt.key(), receipt.attempts(), receipt.replayed()),
        ("generated-1", 3, false)
    );
    let seen = script.seen();
    assert_eq!(seen.len(), 3);
    for (key, body) in seen {
        assert_eq!(key.as_deref(), Some("generated-1"));
        assert_eq!(body, "{\"delta\":1}");
    }
}

#[tokio::test(start_paused = true)]
async fn the_callers_key_is_kept_and_a_replay_is_reported() {
    let script = Script::new([status(502), replayed(201)]);
    let response = send(script.client(RetryPolicy::default()), command(Some("mine")))
        .await
        .unwrap();
    let receipt = receipt(&response);
    assert_eq!(
        (receipt.key(), receipt.attempts(), receipt.replayed()),
        ("mine", 2, true)
    );
    assert!(script
        .seen()
        .iter()
        .all(|(key, _)| key.as_deref() == Some("mine")));
}

#[tokio::test(start_paused = true)]
async fn in_progress_waits_at_least_its_retry_after() {
    let script = Script::new([
        problem(ProblemKind::InProgress, 409, Some(3)),
        replayed(201),
    ]);
    let started = Instant::now();
    let response = send(script.client(RetryPolicy::default()), command(None))
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(receipt(&response).attempts(), 2);
    assert!(receipt(&response).replayed());
}

#[tokio::test(start_paused = true)]
async fn final_answers_are_returned_at_once_with_their_body() {
    for (step, code) in [
        (problem(ProblemKind::PayloadMismatch, 409, None), 409),
        (problem(ProblemKind::KeyMalformed, 400, None), 400),
        (status(422), 422),
        (status(404), 404),
        (status(501), 501),
        (replayed(503), 503),
    ] {
        let script = Script::new([step]);
        let response = send(script.client(RetryPolicy::default()), command(None))
            .await
            .unwrap();
        assert_eq!(response.status(), code);
        assert_eq!(receipt(&response).attempts(), 1, "{code}");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(!body.is_empty(), "{code}: the body reaches the caller");
    }
}

#[tokio::test(start_paused = true)]
async fn the_retry_table_can_be_changed() {
    let script = Script::new([status(500)]);
    let policy = RetryPolicy::default().retry_500(false);
    let response = send(script.client(policy), command(None)).await.unwrap();
    assert_eq!(response.status(), 500);

    let script = Script::new([problem(ProblemKind::InProgress, 409, None)]);
    let policy = RetryPolicy::default().retry_problem(ProblemKind::InProgress, false);
    let response = send(script.client(policy), command(None)).await.unwrap();
    assert_eq!(response.status(), 409);

    let script = Script::new([status(418), status(201)]);
    let policy = RetryPolicy::default().retry_status(StatusCode::IM_A_TEAPOT, true);
    let response = send(script.client(policy), command(None)).await.unwrap();
    assert_eq!(receipt(&response).attempts(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_streamed_body_is_sent_once_and_the_error_says_why() {
    let script = Script::new([status(503)]);
    let stream =
        futures_util::stream::iter([Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"x")))]);
    let request = Request::post("http://server/c")
        .body(StreamBody::new(stream))
        .unwrap();
    let mut client = script.client(RetryPolicy::default());
    let error = client
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap_err();
    assert_eq!(
        (error.reason(), error.attempts()),
        (GiveUpReason::BodyStreamed, 1)
    );
    assert!(error.to_string().contains("stream"), "{error}");
    assert_eq!(script.seen().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_limit_is_sent_once() {
    let script = Script::new([status(503)]);
    let policy = RetryPolicy::default().body_limit(4);
    let error = send(script.client(policy), command(None))
        .await
        .unwrap_err();
    assert_eq!(
        (error.reason(), error.attempts()),
        (GiveUpReason::BodyOverLimit, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_bad_key_fails_before_anything_is_sent() {
    for key in [None, Some("spaced key")] {
        let script = Script::new([]);
        let policy = RetryPolicy::default().key_generator(String::new);
        let error = send(script.client(policy), command(key)).await.unwrap_err();
        assert_eq!(
            (error.reason(), error.attempts()),
            (GiveUpReason::InvalidKey, 0)
        );
        assert!(script.seen().is_empty());
    }
}

#[tokio::test(start_paused = true)]
async fn a_read_without_a_key_passes_through_once() {
    let script = Script::new([status(503)]);
    let request = Request::get("http://server/accounts/a")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = send(script.client(RetryPolicy::default()), request)
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert!(response.extensions().get::<CommandReceipt>().is_none());
    assert_eq!(script.seen(), vec![(None, Bytes::new())]);
}
