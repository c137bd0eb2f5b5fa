//! Every other row of the protocol table, each with the database state it must leave. The
//! service runs on `TestApp::pool`, a role that is neither superuser nor owner.
//! (Over 400 lines: one test per row of the protocol table, over one set of helpers.)

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Path;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{delete, post};
use axum::Router;
use common::{
    credit, credit_raw, gated_router, send, spawn_send, unreachable_pool, wait_until_waiting,
    TestApp, INSERT_REFUSED_AT_COMMIT,
};
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Notify;
use tower_inbox::middleware::{ProducerMissingStatus, ReplayHeaders};
use tower_inbox::producer::TrustedHeader;
use tower_inbox::{InboxLayer, InboxLayerBuilder, InboxTx};

fn layer(
    pool: &sqlx::PgPool,
    configure: impl FnOnce(InboxLayerBuilder) -> InboxLayerBuilder,
) -> InboxLayer {
    configure(InboxLayer::builder(pool.clone(), "test").producer(TrustedHeader::new("x-producer")))
        .build()
        .expect("layer")
}

fn counter() -> (Arc<AtomicUsize>, impl Fn() -> usize) {
    let calls = Arc::new(AtomicUsize::new(0));
    let read = {
        let calls = calls.clone();
        move || calls.load(Ordering::SeqCst)
    };
    (calls, read)
}

fn post_to(path: &str, key: Option<&str>, body: &'static str) -> Request<Body> {
    let mut b = Request::post(path)
        .header("content-type", "application/json")
        .header("x-producer", "app");
    if let Some(key) = key {
        b = b.header("idempotency-key", key);
    }
    b.body(Body::from(body)).expect("request")
}

#[tokio::test]
async fn unguarded_methods_pass_through_untouched() {
    let app = TestApp::new().await;
    let (calls, count) = counter();
    let router = Router::new()
        .route(
            "/things/{id}",
            delete(move || {
                calls.fetch_add(1, Ordering::SeqCst);
                async { (StatusCode::ACCEPTED, [("x-handler", "yes")], "deleted") }
            }),
        )
        .layer(layer(&app.pool, |b| b));
    // No key, no producer: the layer does not look at DELETE.
    let reply = send(
        &router,
        Request::delete("/things/1").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::ACCEPTED);
    assert_eq!(reply.headers["x-handler"], "yes");
    assert_eq!(&reply.body[..], b"deleted");
    assert_eq!(count(), 1);
    assert_eq!(app.inbox_rows().await, 0);

    // The example's GET beside the guarded POST.
    let credits = app.credits();
    let missing = send(
        &credits,
        Request::get("/accounts/nobody")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    send(&credits, credit("a1", Some("k"), Some("app"), 5)).await;
    let found = send(
        &credits,
        Request::get("/accounts/a1").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(found.status, StatusCode::OK);
    assert_eq!(
        found.json(),
        serde_json::json!({"account_id": "a1", "balance": 5})
    );
    assert_eq!(app.inbox_rows().await, 1);
}

#[tokio::test]
async fn a_missing_key_is_refused_before_the_handler() {
    let app = TestApp::new().await;
    let reply = send(&app.credits(), credit("a1", None, Some("app"), 5)).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.problem_type(), "key-missing");
    assert_eq!(app.balance("a1").await, None);
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn an_optional_key_lets_keyless_requests_through_unclaimed() {
    let app = TestApp::new().await;
    let router = Router::new()
        .route(
            "/cmd",
            post(|tx: Option<InboxTx>| async move {
                match tx {
                    Some(tx) => format!("claimed {}", tx.identity().message_id()),
                    None => "unclaimed".to_owned(),
                }
            }),
        )
        .layer(layer(&app.pool, |b| b.key_required(false)));
    let keyless = send(&router, post_to("/cmd", None, "{}")).await;
    assert_eq!(&keyless.body[..], b"unclaimed");
    assert_eq!(app.inbox_rows().await, 0);
    let keyed = send(&router, post_to("/cmd", Some("k9"), "{}")).await;
    assert_eq!(&keyed.body[..], b"claimed k9");
    assert_eq!(app.inbox_rows().await, 1);
}

#[tokio::test]
async fn malformed_keys_are_refused() {
    let app = TestApp::new().await;
    let router = app.credits();
    let too_long = "k".repeat(256);
    let cases: Vec<(&str, Vec<&[u8]>)> = vec![
        ("empty", vec![b""]),
        ("blank", vec![b"   "]),
        ("over 255", vec![too_long.as_bytes()]),
        ("space inside", vec![b"a b"]),
        ("non-ASCII", vec!["clé".as_bytes()]),
        ("unterminated sf-string", vec![b"\"abc"]),
        ("sf-string with parameters", vec![b"\"abc\";x=1"]),
        ("bad escape", vec![b"\"a\\nb\""]),
        ("repeated header", vec![b"k1", b"k1"]),
    ];
    for (case, values) in cases {
        let mut request = credit("a1", None, Some("app"), 5);
        for value in values {
            request.headers_mut().append(
                "idempotency-key",
                http::HeaderValue::from_bytes(value).expect("header value"),
            );
        }
        let reply = send(&router, request).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{case}");
        assert_eq!(reply.problem_type(), "key-malformed", "{case}");
    }
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.balance("a1").await, None);

    let exactly_255 = "k".repeat(255);
    let ok = send(&router, credit("a1", Some(&exactly_255), Some("app"), 5)).await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

#[tokio::test]
async fn bare_and_quoted_keys_are_the_same_command() {
    let app = TestApp::new().await;
    let router = app.credits();
    let bare = send(&router, credit("a1", Some("8e03978e-40d5"), Some("app"), 5)).await;
    assert_eq!(bare.status, StatusCode::CREATED);
    let quoted = send(
        &router,
        credit("a1", Some("\"8e03978e-40d5\""), Some("app"), 5),
    )
    .await;
    assert!(quoted.replayed());
    assert_eq!(quoted.body, bare.body);
    assert_eq!(app.ledger_rows("a1").await, 1);
}

#[tokio::test]
async fn a_missing_producer_scope_is_refused() {
    let app = TestApp::new().await;
    let reply = send(&app.credits(), credit("a1", Some("k"), None, 5)).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(reply.problem_type(), "producer-missing");

    let router = app.credits_with(|b| b.producer_missing_status(ProducerMissingStatus::BadRequest));
    let reply = send(&router, credit("a1", Some("k"), None, 5)).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.problem_type(), "producer-missing");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.balance("a1").await, None);
}

#[tokio::test]
async fn the_same_key_from_two_producers_is_two_commands() {
    let app = TestApp::new().await;
    let router = app.credits();
    let a = send(&router, credit("shared", Some("k-1"), Some("client-a"), 10)).await;
    let b = send(&router, credit("shared", Some("k-1"), Some("client-b"), 10)).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(b.status, StatusCode::CREATED);
    assert!(
        !b.replayed(),
        "client-b must not receive client-a's response"
    );
    assert_ne!(a.body, b.body, "each saw its own balance");
    assert_eq!(app.ledger_rows("shared").await, 2);
    assert_eq!(app.balance("shared").await, Some(20));

    // Each producer replays only its own recorded response.
    let a_again = send(&router, credit("shared", Some("k-1"), Some("client-a"), 10)).await;
    let b_again = send(&router, credit("shared", Some("k-1"), Some("client-b"), 10)).await;
    assert!(a_again.replayed() && b_again.replayed());
    assert_eq!(a_again.body, a.body);
    assert_eq!(b_again.body, b.body);
    // And a different payload from one producer conflicts with its own command only.
    let a_conflict = send(&router, credit("shared", Some("k-1"), Some("client-a"), 99)).await;
    assert_eq!(a_conflict.problem_type(), "payload-mismatch");
    assert_eq!(app.inbox_rows().await, 2);
}

#[tokio::test]
async fn numbers_an_f64_cannot_tell_apart_are_different_payloads() {
    let app = TestApp::new().await;
    let router = app.credits();
    let note = |note: &str| {
        credit_raw(
            "a1",
            Some("k-note"),
            Some("app"),
            format!(r#"{{"delta":10,"note":{note}}}"#),
        )
    };
    let first = send(&router, note("100000000000000000001")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // As f64s both are 1e20; as commands they differ, so the key is reused for another one.
    let other = send(&router, note("100000000000000000000")).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.problem_type(), "payload-mismatch");
    assert!(!other.replayed());
    // The same number spelt another way is the same command: a retry, replayed.
    let retry = send(&router, note("1000000000000000000.01e2")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(app.ledger_rows("a1").await, 1);
    assert_eq!(app.balance("a1").await, Some(10));
}

#[tokio::test]
async fn bodies_over_the_limit_are_refused_unclaimed() {
    let app = TestApp::new().await;
    let router = app.credits_with(|b| b.body_limit(16));
    let declared = send(
        &router,
        credit_raw(
            "a1",
            Some("k"),
            Some("app"),
            r#"{"delta": 1, "pad": "xxxxxxxxxxxx"}"#,
        ),
    )
    .await;
    assert_eq!(declared.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(declared.problem_type(), "body-too-large");

    // A streamed body has no declared length; the limit applies while reading it.
    let chunks: Vec<Result<&'static str, std::io::Error>> =
        vec![Ok(r#"{"delta": 1, "#), Ok(r#""pad": "xxxxxxxxxxxxxx"}"#)];
    let streamed = credit_raw(
        "a1",
        Some("k"),
        Some("app"),
        Body::from_stream(futures_util::stream::iter(chunks)),
    );
    let streamed = send(&router, streamed).await;
    assert_eq!(streamed.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(streamed.problem_type(), "body-too-large");
    assert_eq!(app.inbox_rows().await, 0);

    // Within the limit the same key still works.
    let ok = send(
        &router,
        credit_raw("a1", Some("k"), Some("app"), r#"{"delta":1}"#),
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

#[tokio::test]
async fn a_rejected_request_shape_rolls_back_and_the_key_stays_usable() {
    let app = TestApp::new().await;
    let router = app.credits();
    let invalid = send(
        &router,
        credit_raw("a1", Some("k"), Some("app"), r#"{"delta": "ten"}"#),
    )
    .await;
    assert_eq!(invalid.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(!invalid.replayed());
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(
        app.failures("app", "k").await,
        None,
        "a rejection is not a failure"
    );

    let corrected = send(&router, credit("a1", Some("k"), Some("app"), 10)).await;
    assert_eq!(corrected.status, StatusCode::CREATED);
    assert!(!corrected.replayed());
    assert_eq!(app.balance("a1").await, Some(10));
}

#[tokio::test]
async fn a_business_4xx_is_committed_and_replayed() {
    let app = TestApp::new().await;
    let (calls, count) = counter();
    let router = Router::new()
        .route(
            "/withdraw",
            post(move |mut tx: InboxTx| {
                calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    // The refusal is itself a recorded decision, with its own audit row.
                    sqlx::query(
                        "insert into credit_account (account_id, balance) values ('refusals', 1)
                         on conflict (account_id) do update set balance = credit_account.balance + 1",
                    )
                    .execute(&mut *tx)
                    .await
                    .expect("audit");
                    (
                        StatusCode::CONFLICT,
                        [("content-type", "application/json")],
                        r#"{"error":"insufficient funds"}"#,
                    )
                }
            }),
        )
        .layer(layer(&app.pool, |b| b));
    let first = send(&router, post_to("/withdraw", Some("w1"), "{}")).await;
    assert_eq!(first.status, StatusCode::CONFLICT);
    let second = send(&router, post_to("/withdraw", Some("w1"), "{}")).await;
    assert_eq!(second.status, StatusCode::CONFLICT);
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(count(), 1);
    assert_eq!(app.balance("refusals").await, Some(1));
    let row = app.inbox_row("app", "w1").await.expect("row");
    assert_eq!(row.status, Some(409));
}

#[tokio::test]
async fn recorded_headers_replay_byte_for_byte() {
    let app = TestApp::new().await;
    let router = Router::new()
        .route(
            "/cmd",
            post(|| async {
                let mut response =
                    (StatusCode::ACCEPTED, vec![0u8, 159, 146, 150, 255]).into_response();
                let h = response.headers_mut();
                h.insert("content-type", "application/octet-stream".parse().unwrap());
                h.append("set-cookie", "a=1".parse().unwrap());
                h.append("set-cookie", "b=2".parse().unwrap());
                h.insert(
                    "x-opaque",
                    http::HeaderValue::from_bytes(b"\xe9t\xe9").unwrap(),
                );
                response
            }),
        )
        // Cookies are not replayed by default; allowed, they come back in order.
        .layer(layer(&app.pool, |b| {
            b.replay_headers(ReplayHeaders::default().allow(http::header::SET_COOKIE))
        }));
    let first = send(&router, post_to("/cmd", Some("h1"), "{}")).await;
    let replay = send(&router, post_to("/cmd", Some("h1"), "{}")).await;
    assert!(replay.replayed());
    assert_eq!(replay.status, StatusCode::ACCEPTED);
    assert_eq!(replay.body, first.body);
    let cookies: Vec<_> = replay.headers.get_all("set-cookie").iter().collect();
    assert_eq!(cookies, ["a=1", "b=2"]);
    assert_eq!(replay.headers["x-opaque"].as_bytes(), b"\xe9t\xe9");
    let mut headers = replay.headers.clone();
    headers.remove("idempotent-replayed");
    assert_eq!(headers, first.headers);
}

#[tokio::test]
async fn cookies_dates_and_denied_headers_are_not_recorded_or_replayed() {
    let app = TestApp::new().await;
    let handler = || async {
        let mut response = (StatusCode::CREATED, "made").into_response();
        let h = response.headers_mut();
        h.append("set-cookie", "session=secret".parse().unwrap());
        h.insert("date", "Tue, 01 Dec 2026 10:00:00 GMT".parse().unwrap());
        h.insert("x-request-id", "r-1".parse().unwrap());
        h.insert("x-kept", "k".parse().unwrap());
        response
    };
    let router = Router::new()
        .route("/cmd", post(handler))
        .layer(layer(&app.pool, |b| {
            b.replay_headers(
                ReplayHeaders::default().deny(http::HeaderName::from_static("x-request-id")),
            )
        }));
    let first = send(&router, post_to("/cmd", Some("c1"), "{}")).await;
    assert_eq!(
        first.headers["set-cookie"], "session=secret",
        "the first caller gets it"
    );
    let replay = send(&router, post_to("/cmd", Some("c1"), "{}")).await;
    assert!(replay.replayed());
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.headers["x-kept"], "k");
    for absent in ["set-cookie", "date", "x-request-id"] {
        assert!(
            !replay.headers.contains_key(absent),
            "{absent} was replayed"
        );
    }
    // Not stored either: no credential sits in the inbox.
    let names: Vec<String> =
        sqlx::query_scalar("select unnest(response_header_names) from tower_inbox.consumer_inbox")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert!(names.contains(&"x-kept".to_owned()), "{names:?}");
    assert!(!names
        .iter()
        .any(|n| n == "set-cookie" || n == "date" || n == "x-request-id"));
}

#[tokio::test]
async fn small_and_large_responses_replay_byte_for_byte_in_both_claim_modes() {
    // Small records travel with the commit as hex literals, large ones as bound parameters:
    // both must come back exactly, headers with odd bytes included.
    let app = TestApp::new().await;
    for mode in [
        tower_inbox::inbox::ClaimMode::First,
        tower_inbox::inbox::ClaimMode::AtCommit,
    ] {
        for size in [0usize, 1, 32 * 1024, 32 * 1024 + 1, 200_000] {
            let body: Vec<u8> = (0..size).map(|i| (i * 7 % 256) as u8).collect();
            let router = Router::new()
                .route(
                    "/cmd",
                    post(move || {
                        let body = body.clone();
                        async move {
                            let mut response = (StatusCode::CREATED, body).into_response();
                            response.headers_mut().insert(
                                "x-odd",
                                http::HeaderValue::from_bytes(b"'\\x00\xe9").unwrap(),
                            );
                            response
                        }
                    }),
                )
                .layer(layer(&app.pool, |b| b.claim_mode(mode)));
            let key = format!("{mode:?}-{size}");
            let first = send(&router, post_to("/cmd", Some(&key), "{}")).await;
            assert_eq!(first.status, StatusCode::CREATED, "{key}");
            assert_eq!(first.body.len(), size);
            let replay = send(&router, post_to("/cmd", Some(&key), "{}")).await;
            assert!(replay.replayed(), "{key}");
            assert_eq!(replay.body, first.body, "{key}");
            assert_eq!(replay.headers["x-odd"], first.headers["x-odd"], "{key}");
        }
    }
}

#[tokio::test]
async fn an_unreachable_database_answers_503_without_running_the_handler() {
    let (calls, count) = counter();
    let router = Router::new()
        .route(
            "/cmd",
            post(move || {
                calls.fetch_add(1, Ordering::SeqCst);
                async { "ran" }
            }),
        )
        .layer(layer(&unreachable_pool(), |b| b.retry_after(7)));
    let reply = send(&router, post_to("/cmd", Some("k"), "{}")).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "unavailable");
    assert_eq!(reply.headers["retry-after"], "7");
    assert_eq!(count(), 0);
}

#[tokio::test]
async fn an_exhausted_pool_answers_503_without_running_the_handler() {
    let app = TestApp::new().await;
    let small = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300))
        .connect_with(app.db.connect_options())
        .await
        .expect("pool");
    let (calls, count) = counter();
    let router = Router::new()
        .route(
            "/cmd",
            post(move || {
                calls.fetch_add(1, Ordering::SeqCst);
                async { "ran" }
            }),
        )
        .layer(layer(&small, |b| b));
    let held = small.acquire().await.expect("the only connection");
    let reply = send(&router, post_to("/cmd", Some("k"), "{}")).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "unavailable");
    assert!(reply.headers.contains_key("retry-after"));
    assert_eq!(count(), 0);
    assert_eq!(app.inbox_rows().await, 0);

    drop(held);
    let reply = send(&router, post_to("/cmd", Some("k"), "{}")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(count(), 1);
}

#[tokio::test]
async fn a_duplicate_of_an_in_flight_original_gets_409_after_the_wait() {
    let app = TestApp::new().await;
    let (router, gate, calls) = gated_router(&app, |b| {
        b.in_flight_wait(Duration::from_millis(100)).retry_after(2)
    });
    let original = spawn_send(&router, credit("a1", Some("k"), Some("app"), 1));
    gate.started.notified().await;

    let duplicate = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.problem_type(), "in-progress");
    assert_eq!(duplicate.headers["retry-after"], "2");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    gate.release.notify_one();
    let original = original.await.expect("original");
    assert_eq!(original.status, StatusCode::CREATED);
    let later = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert!(later.replayed());
    assert_eq!(later.body, original.body);
    assert_eq!(app.balance("a1").await, Some(1));
}

#[tokio::test]
async fn a_waiting_duplicate_replays_when_the_original_commits() {
    let app = TestApp::new().await;
    let (router, gate, calls) = gated_router(&app, |b| b.in_flight_wait(Duration::from_secs(30)));
    let original = spawn_send(&router, credit("a1", Some("k"), Some("app"), 1));
    gate.started.notified().await;
    let duplicate = spawn_send(&router, credit("a1", Some("k"), Some("app"), 1));
    wait_until_waiting(&gate.inbox, 1).await;
    gate.release.notify_one();

    let original = original.await.expect("original");
    let duplicate = duplicate.await.expect("duplicate");
    assert_eq!(original.status, StatusCode::CREATED);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, original.body);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(app.balance("a1").await, Some(1));
}

#[tokio::test]
async fn a_waiting_duplicate_runs_when_the_original_rolls_back() {
    let app = TestApp::new().await;
    let (router, gate, calls) = gated_router(&app, |b| b.in_flight_wait(Duration::from_secs(30)));
    *gate.status.lock().unwrap() = StatusCode::SERVICE_UNAVAILABLE;
    let original = spawn_send(&router, credit("a1", Some("k"), Some("app"), 1));
    gate.started.notified().await;
    let duplicate = spawn_send(&router, credit("a1", Some("k"), Some("app"), 1));
    wait_until_waiting(&gate.inbox, 1).await;
    // The original fails; the duplicate then owns the claim and runs (and succeeds).
    gate.release.notify_one();
    assert_eq!(
        original.await.expect("original").status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    *gate.status.lock().unwrap() = StatusCode::CREATED;
    gate.started.notified().await;
    gate.release.notify_one();
    let duplicate = duplicate.await.expect("duplicate");
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(!duplicate.replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        app.balance("a1").await,
        Some(1),
        "only the second attempt committed"
    );
    assert_eq!(app.failures("app", "k").await.map(|f| f.0), Some(1));
}

#[tokio::test]
async fn a_client_that_goes_away_mid_handler_rolls_back() {
    let app = TestApp::new().await;
    let (router, gate, _calls) = gated_router(&app, |b| b.in_flight_wait(Duration::from_secs(30)));
    let request = spawn_send(&router, credit("a1", Some("k"), Some("app"), 1));
    gate.started.notified().await;
    // The handler has written; the client disconnects, which drops the request future.
    request.abort();
    assert!(request.await.expect_err("aborted").is_cancelled());

    let (attempts, reason) = app.wait_for_failures("app", "k", 1).await;
    assert_eq!((attempts, reason.as_str()), (1, "client-gone"));
    // The retry is not blocked by the abandoned attempt: it rolled back.
    let retry = spawn_send(&router, credit("a1", Some("k"), Some("app"), 1));
    gate.started.notified().await;
    gate.release.notify_one();
    let retry = retry.await.expect("retry");
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(
        app.balance("a1").await,
        Some(1),
        "the abandoned write rolled back"
    );
    assert_eq!(app.inbox_rows().await, 1);
}

#[tokio::test]
async fn a_leaked_transaction_handle_is_rolled_back_with_500() {
    let app = TestApp::new().await;
    let release = Arc::new(Notify::new());
    let (calls, count) = counter();
    let router = Router::new()
        .route(
            "/accounts/{account}/credits",
            post({
                let release = release.clone();
                move |Path(account): Path<String>, mut tx: InboxTx| {
                    let release = release.clone();
                    let leak = calls.fetch_add(1, Ordering::SeqCst) == 0;
                    async move {
                        sqlx::query(
                            "insert into credit_account (account_id, balance) values ($1, 1)",
                        )
                        .bind(&account)
                        .execute(&mut *tx)
                        .await
                        .expect("write");
                        if leak {
                            // A bug: the transaction escapes into a task that outlives us.
                            tokio::spawn(async move {
                                release.notified().await;
                                drop(tx);
                            });
                        }
                        StatusCode::CREATED
                    }
                }
            }),
        )
        .layer(layer(&app.pool, |b| {
            b.in_flight_wait(Duration::from_secs(30))
        }));

    let leaked = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(leaked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(leaked.problem_type(), "transaction-leaked");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(
        app.failures("app", "k").await.map(|f| f.1),
        Some("transaction-leaked".to_owned())
    );

    // Once the handle is dropped the transaction rolls back and the key is free again.
    release.notify_one();
    let retry = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(count(), 2);
    assert_eq!(app.balance("a1").await, Some(1));
}

#[tokio::test]
async fn a_response_body_that_holds_the_transaction_is_a_leak_and_commits_nothing() {
    let app = TestApp::new().await;
    let router = Router::new()
        .route(
            "/accounts/{account}/credits",
            post(|Path(account): Path<String>, mut tx: InboxTx| async move {
                sqlx::query("insert into credit_account (account_id, balance) values ($1, 1)")
                    .bind(&account)
                    .execute(&mut *tx)
                    .await
                    .expect("write");
                // A bug: the body stream owns the transaction and, while it is read, writes
                // more and asks for a re-run. Nothing of it may commit.
                let stream = futures_util::stream::once(async move {
                    sqlx::query("update credit_account set balance = 100")
                        .execute(&mut *tx)
                        .await
                        .expect("late write");
                    tx.request_retry();
                    Ok::<_, std::convert::Infallible>(bytes::Bytes::from_static(b"streamed"))
                });
                (StatusCode::CREATED, Body::from_stream(stream))
            }),
        )
        .layer(layer(&app.pool, |b| b));
    let reply = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.problem_type(), "transaction-leaked");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.balance("a1").await, None, "the body's stream never ran");
    assert_eq!(
        app.failures("app", "k").await.map(|f| f.1),
        Some("transaction-leaked".to_owned())
    );
}

#[tokio::test]
async fn a_response_over_the_recording_limit_rolls_back() {
    let app = TestApp::new().await;
    let router = app.credits_with(|b| b.recorded_response_limit(8));
    let reply = send(&router, credit("a1", Some("k"), Some("app"), 1)).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.problem_type(), "response-too-large");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.balance("a1").await, None);
    assert_eq!(
        app.failures("app", "k").await.map(|f| f.1),
        Some("response-too-large".to_owned())
    );
}

#[tokio::test]
async fn inbox_tx_without_the_layer_is_a_clear_500() {
    let router: Router = Router::new().route("/cmd", post(|_tx: InboxTx| async { "unreachable" }));
    let reply = send(&router, post_to("/cmd", Some("k"), "{}")).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.problem_type(), "layer-missing");
    assert!(reply.json()["detail"]
        .as_str()
        .unwrap()
        .contains("InboxLayer"));
}

#[tokio::test]
async fn inbox_tx_taken_twice_is_a_clear_500_and_rolls_back() {
    let app = TestApp::new().await;
    let router = Router::new()
        .route(
            "/cmd",
            post(|_a: InboxTx, _b: InboxTx| async { "unreachable" }),
        )
        .layer(layer(&app.pool, |b| b));
    let reply = send(&router, post_to("/cmd", Some("k"), "{}")).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.problem_type(), "transaction-in-use");
    assert_eq!(app.inbox_rows().await, 0);
}

#[tokio::test]
async fn migrations_run_twice_and_the_config_is_checked() {
    let app = TestApp::new().await;
    // Migrations are the owner's (the service's role may not create tables).
    tower_inbox::migrate(&app.owner)
        .await
        .expect("second run is a no-op");
    // A missing producer scope and a status outside the protocol cannot be written (see the
    // compile_fail example of InboxLayer::builder); the limits are checked at build.
    let bad_limit = InboxLayer::builder(app.pool.clone(), "c")
        .producer(TrustedHeader::new("x-producer"))
        .quarantine_after(0)
        .build();
    let Err(tower_inbox::middleware::ConfigError::BadLimit(why)) = bad_limit else {
        panic!("a zero quarantine_after was accepted");
    };
    assert!(why.contains("quarantine_after"), "{why}");
    let bad_consumer = InboxLayer::builder(app.pool.clone(), "")
        .producer(TrustedHeader::new("x-producer"))
        .build();
    assert_eq!(
        bad_consumer.err(),
        Some(tower_inbox::middleware::ConfigError::BadConsumerName)
    );
}

#[tokio::test]
async fn a_commit_refused_by_a_deferred_constraint_answers_500_and_commits_nothing() {
    // One connection: the one whose COMMIT the server refused.
    let app = TestApp::with_pool_size(1).await;
    app.create_refused_at_commit().await;
    let backend = || async {
        sqlx::query_scalar::<_, i32>("select pg_backend_pid()")
            .fetch_one(&app.pool)
            .await
            .expect("backend")
    };
    let before = backend().await;
    let router = Router::new()
        .route(
            "/cmd",
            post(|mut tx: InboxTx| async move {
                // Accepted now, refused at COMMIT.
                sqlx::query(INSERT_REFUSED_AT_COMMIT)
                    .execute(&mut *tx)
                    .await
                    .expect("deferred check");
                StatusCode::CREATED
            }),
        )
        .layer(layer(&app.pool, |b| b));
    let reply = send(&router, post_to("/cmd", Some("k"), "{}")).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.problem_type(), "internal");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.refused_at_commit_rows().await, 1);
    // The server answered the COMMIT, so the connection was idle again: it went back to
    // the pool rather than being closed as one in an unknown state.
    assert_eq!(backend().await, before, "the connection was closed");
}

#[tokio::test]
async fn a_database_without_the_migrations_answers_500_internal() {
    let db = tower_inbox_testdb::TestDatabase::create()
        .await
        .expect("db");
    let pool = db.pool(2).await;
    let (calls, count) = counter();
    let router = Router::new()
        .route(
            "/cmd",
            post(move || {
                calls.fetch_add(1, Ordering::SeqCst);
                async { "ran" }
            }),
        )
        .layer(layer(&pool, |b| b));
    let reply = send(&router, post_to("/cmd", Some("k"), "{}")).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.problem_type(), "internal");
    assert_eq!(count(), 0);
}

#[tokio::test]
async fn a_failure_record_that_cannot_be_written_leaves_the_rollback_intact() {
    let app = TestApp::new().await;
    // Every write of a failure record is refused.
    sqlx::raw_sql(
        "create function public.refuse() returns trigger language plpgsql as
             $$ begin raise exception 'refused' using errcode = 'P0001'; end $$;
         create trigger refuse before insert or update on tower_inbox.consumer_inbox_failure
             for each row execute function public.refuse();",
    )
    // A trigger on the crate's table is the owner's to create.
    .execute(&app.owner)
    .await
    .expect("trigger");
    let router = Router::new()
        .route(
            "/cmd",
            post(|mut tx: InboxTx| async move {
                sqlx::query("insert into credit_account values ('a1', 1)")
                    .execute(&mut *tx)
                    .await
                    .expect("write");
                (StatusCode::BAD_GATEWAY, "upstream down")
            }),
        )
        .layer(layer(&app.pool, |b| b));
    let reply = send(&router, post_to("/cmd", Some("k"), "{}")).await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    assert_eq!(&reply.body[..], b"upstream down");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.balance("a1").await, None);
}
