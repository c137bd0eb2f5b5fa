//! The tracing spans: each protocol step and each delivery runs in a span named for it, with
//! the message identity and the outcome as fields, and no span or event ever carries the
//! payload.
//!
//! The subscriber is global, not `set_default`: the dispatcher's deliveries and the loopback
//! receiver run on other tasks, which a thread-local default would miss. So this binary holds
//! one test, and that test drives every path.

mod common;

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::{credit_raw, send, TestApp};
use tower_inbox::outbox::{Dispatcher, HttpTransport};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// A span or an event, with every field it was given, rendered as text.
#[derive(Debug, Clone)]
struct Captured {
    is_span: bool,
    name: String,
    fields: BTreeMap<String, String>,
}

#[derive(Default)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

/// Records every span (with the fields recorded on it later) and every event, at all levels.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Captured>>>);

/// Where a span's record sits in the capture, kept in the span's extensions.
struct Slot(usize);

impl<S> Layer<S> for Capture
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let mut captured = self.0.lock().unwrap();
        captured.push(Captured {
            is_span: true,
            name: attrs.metadata().name().to_owned(),
            fields: fields.0,
        });
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Slot(captured.len() - 1));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        values.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            if let Some(Slot(slot)) = span.extensions().get::<Slot>() {
                self.0.lock().unwrap()[*slot].fields.extend(fields.0);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        self.0.lock().unwrap().push(Captured {
            is_span: false,
            name: event.metadata().name().to_owned(),
            fields: fields.0,
        });
    }
}

impl Capture {
    fn spans(&self, name: &str) -> Vec<BTreeMap<String, String>> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.is_span && c.name == name)
            .map(|c| c.fields.clone())
            .collect()
    }

    fn all(&self) -> Vec<Captured> {
        self.0.lock().unwrap().clone()
    }
}

/// The fields a span must carry, with their values.
fn fields(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Distinctive pieces of the request body: neither may reach a span or an event.
const DELTA_MARKER: &str = "424242";
const NOTE_MARKER: &str = "acct-note-SECRET-7Q9X";
/// The producer (the client's identity): it may not reach a span or an event either.
const PRODUCER_MARKER: &str = "client-SECRET-P7K2";

#[tokio::test]
async fn spans_carry_identity_and_outcome_and_never_the_payload_or_the_producer() {
    let capture = Capture::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
        .expect("the only subscriber in this test binary");

    let app = TestApp::new().await;
    let hook = Router::new().route("/hook", post(|| async { StatusCode::OK }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, hook).await });
    let layer = common::credits::inbox_layer(app.pool.clone())
        .build()
        .unwrap();
    let router = common::credits::routes_with_webhook(app.pool.clone(), layer, Some(url));

    // Every body carries both markers; the webhook payload carries the delta again.
    let body = |delta: &str| format!(r#"{{"delta": {delta}, "note": "{NOTE_MARKER}"}}"#);
    let credit = |key: &str, body: String| credit_raw("a1", Some(key), Some(PRODUCER_MARKER), body);
    let first = send(&router, credit("trace-1", body(DELTA_MARKER))).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let duplicate = send(&router, credit("trace-1", body(DELTA_MARKER))).await;
    assert!(duplicate.replayed());
    // The same key with another payload: refused, and logged with both fingerprints.
    let conflict = send(&router, credit("trace-1", body("424243"))).await;
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    // A delta that is not a number: the handler rejects the shape (422) and it rolls back.
    let rejected = send(
        &router,
        credit("trace-2", body(&format!("\"{DELTA_MARKER}\""))),
    )
    .await;
    assert_eq!(rejected.status, StatusCode::UNPROCESSABLE_ENTITY);
    let dispatcher = Dispatcher::builder(
        app.pool.clone(),
        HttpTransport::new(Duration::from_secs(5)).unwrap(),
    )
    .build()
    .unwrap();
    assert_eq!(dispatcher.dispatch_due().await.unwrap().delivered, 1);
    let effect_id: String = sqlx::query_scalar("select effect_id from tower_inbox.message_outbox")
        .fetch_one(&app.pool)
        .await
        .unwrap();

    // The identity of `key` and the fields given.
    let of = |key: &str, extra: &[(&str, &str)]| {
        let mut all = fields(&[("consumer", "credits"), ("message_id", key)]);
        all.extend(fields(extra));
        all
    };
    // One span per request, in order: (key, outcome).
    let outcomes = |spans: [(&str, &str); 4]| spans.map(|(key, o)| of(key, &[("outcome", o)]));
    assert_eq!(
        capture.spans("inbox.command"),
        outcomes([
            ("trace-1", "committed"),
            ("trace-1", "replayed"),
            ("trace-1", "conflict"),
            ("trace-2", "rejected"),
        ])
    );
    assert_eq!(
        capture.spans("inbox.claim"),
        outcomes([
            ("trace-1", "claimed"),
            ("trace-1", "duplicate"),
            ("trace-1", "conflict"),
            ("trace-2", "claimed"),
        ])
    );
    assert_eq!(
        capture.spans("inbox.handler"),
        [
            of("trace-1", &[("status", "201")]),
            of("trace-2", &[("status", "422")]),
        ]
    );
    assert_eq!(
        capture.spans("inbox.commit"),
        [of(
            "trace-1",
            &[("status", "201"), ("outcome", "committed")]
        )]
    );
    assert_eq!(
        capture.spans("inbox.replay"),
        [of("trace-1", &[("status", "201")])]
    );
    assert_eq!(
        capture.spans("outbox.deliver"),
        [fields(&[
            ("effect_id", &effect_id),
            ("effect", "credit-webhook"),
            ("attempt", "1"),
            ("outcome", "delivered"),
        ])]
    );

    let captured = capture.all();
    // The conflict is logged, by fingerprint: the events below are really checked.
    let logged = captured.iter().find(|c| {
        !c.is_span
            && c.fields.get("message").map(String::as_str)
                == Some("idempotency key reused with a different payload")
    });
    let logged = logged.expect("the conflict is logged");
    assert_eq!(logged.fields["sha256"].len(), 64, "{logged:?}");
    assert_eq!(logged.fields["recorded_sha256"].len(), 64, "{logged:?}");
    for record in &captured {
        for (field, value) in &record.fields {
            assert!(
                !value.contains(DELTA_MARKER)
                    && !value.contains(NOTE_MARKER)
                    && !value.contains(PRODUCER_MARKER),
                "{} `{}` carries the payload or the producer in its field {field}: {value}",
                if record.is_span { "span" } else { "event" },
                record.name
            );
        }
    }
}
