//! The layer's shape as a user meets it: any Tower service (not only axum), the problem hook,
//! and retried multipart uploads.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body as AxumBody;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::{send, TestApp};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{ServiceBuilder, ServiceExt};
use tower_inbox::body::Body;
use tower_inbox::problem::{Problem, ProblemKind};
use tower_inbox::producer::TrustedHeader;
use tower_inbox::{InboxLayer, InboxTx};

fn builder(app: &TestApp, consumer: &str) -> tower_inbox::InboxLayerBuilder {
    InboxLayer::builder(app.pool.clone(), consumer).producer(TrustedHeader::new("x-producer"))
}

fn post_to(path: &str, key: &str, content_type: &str, body: Vec<u8>) -> Request<AxumBody> {
    Request::post(path)
        .header("idempotency-key", key)
        .header("x-producer", "p")
        .header("content-type", content_type)
        .body(AxumBody::from(body))
        .unwrap()
}

#[tokio::test]
async fn a_plain_tower_service_takes_the_transaction_from_the_extensions() {
    let app = TestApp::new().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        tower::service_fn(move |request: Request<Body>| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let mut tx = InboxTx::from_extensions(request.extensions())
                    .expect("not taken yet")
                    .expect("the layer claimed this request");
                let body = request.into_body().collect().await.unwrap().to_bytes();
                sqlx::query(
                    "insert into credit_account (account_id, balance) values ('plain', $1)",
                )
                .bind(body.len() as i64)
                .execute(&mut *tx)
                .await
                .unwrap();
                drop(tx);
                Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from("stored"))))
            }
        })
    };
    let service = ServiceBuilder::new()
        .layer(builder(&app, "plain").build().unwrap())
        .service(handler);
    // Any http_body::Body of Bytes goes in; the layer answers with its own Body.
    let request = || {
        Request::post("/")
            .header("idempotency-key", "k1")
            .header("x-producer", "p")
            .body(Full::new(Bytes::from_static(b"12345")))
            .unwrap()
    };
    for expected_replayed in [false, true] {
        let response = service.clone().oneshot(request()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers().contains_key("idempotent-replayed"),
            expected_replayed
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "stored");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the duplicate was replayed");
    assert_eq!(app.balance("plain").await, Some(5));
    // Unguarded requests pass through, and the handler sees no transaction.
    let get = Request::get("/").body(Full::new(Bytes::new())).unwrap();
    let passed =
        tower::service_fn(|request: Request<Body>| async move {
            let tx = InboxTx::from_extensions(request.extensions()).unwrap();
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
                if tx.is_none() { "none" } else { "some" },
            ))))
        });
    let service = ServiceBuilder::new()
        .layer(builder(&app, "plain").build().unwrap())
        .service(passed);
    let body = service
        .oneshot(get)
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap();
    assert_eq!(body.to_bytes(), "none");
}

#[tokio::test]
async fn the_problem_hook_shapes_the_layers_answers_and_the_kind_stays_in_the_extensions() {
    let app = TestApp::new().await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let layer = builder(&app, "hooked")
        .on_problem({
            let seen = seen.clone();
            move |problem: &Problem, default: Response<Body>| {
                seen.lock().unwrap().push(problem.kind());
                assert_eq!(default.extensions().get(), Some(&problem.kind()));
                let mut response = Response::new(Body::from(format!("E:{}", problem.kind())));
                *response.status_mut() = default.status();
                response
            }
        })
        .build()
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Body::from("ok")))
        }));
    // No key: the layer's own 400.
    let request = Request::post("/").body(Full::new(Bytes::new())).unwrap();
    let response = service.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        response.extensions().get::<ProblemKind>(),
        Some(&ProblemKind::KeyMissing)
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "E:key-missing");
    // The same key with another payload: the conflict goes through the hook too.
    let with = |body: &'static str| {
        Request::post("/")
            .header("idempotency-key", "k")
            .header("x-producer", "p")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap()
    };
    assert_eq!(
        service.clone().oneshot(with("a")).await.unwrap().status(),
        200
    );
    let conflict = service.clone().oneshot(with("b")).await.unwrap();
    assert_eq!(conflict.status(), StatusCode::CONFLICT);
    assert_eq!(
        *seen.lock().unwrap(),
        [ProblemKind::KeyMissing, ProblemKind::PayloadMismatch]
    );
}

#[tokio::test]
async fn a_retried_upload_with_a_new_boundary_is_the_same_command() {
    let app = TestApp::new().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route(
            "/uploads",
            post({
                let runs = runs.clone();
                move |mut tx: InboxTx| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    common::add_one(&mut tx, "uploads").await;
                    (StatusCode::CREATED, "uploaded")
                }
            }),
        )
        .layer(builder(&app, "uploads").build().unwrap());
    let form = |boundary: &str, file: &str| {
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"title\"\r\n\r\nreport\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"r.txt\"\r\n\
             Content-Type: text/plain\r\n\r\n{file}\r\n--{boundary}--\r\n"
        )
        .into_bytes()
    };
    let upload = |key: &str, boundary: &str, file: &str| {
        post_to(
            "/uploads",
            key,
            &format!("multipart/form-data; boundary={boundary}"),
            form(boundary, file),
        )
    };
    let first = send(
        &router,
        upload("u1", "------------------------a1b2", "line 1"),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    // curl picks a new boundary on every run: still a retry, replayed.
    let retry = send(
        &router,
        upload("u1", "------------------------ffee", "line 1"),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    // A changed file under the same key is another command: refused.
    let changed = send(
        &router,
        upload("u1", "------------------------ffee", "line 2"),
    )
    .await;
    assert_eq!(changed.status, StatusCode::CONFLICT);
    assert_eq!(changed.problem_type(), "payload-mismatch");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(app.balance("uploads").await, Some(1));
}
