//! Fingerprinting alone, without a database: SHA-256 over the method, path and body, with the
//! body raw (`FingerprintStrategy::RawBytes`) or in canonical JSON form (the default, which
//! parses the body and writes it again with sorted keys before hashing).
//!
//! ```sh
//! cargo bench --bench fingerprint
//! ```
//!
//! The bodies are realistic order documents, compact JSON as a client sends it: nested
//! objects, strings (some with escapes and non-ASCII text), integers, decimals, booleans,
//! nulls and arrays, grown to about 1 KiB and 64 KiB. Throughput is in body bytes.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use serde_json::{json, Value};
use tower_inbox::fingerprint::{CommandPayload, FingerprintStrategy};

/// The body sizes measured, with their names.
const SIZES: [(&str, usize); 2] = [("1KiB", 1024), ("64KiB", 64 * 1024)];

/// The `i`th line item of an order.
fn line_item(i: usize) -> Value {
    let tags = &["gift", "fragile", "express"][..i % 3 + 1];
    json!({
        "sku": format!("SKU-{:06}", i * 7919 % 1_000_000),
        "name": format!("Widget \"{i}\" – größe {}", i % 13),
        "quantity": i % 5 + 1,
        "unit_price": { "amount": (i * 137 % 10_000) as f64 / 100.0, "currency": "EUR" },
        "discount": if i.is_multiple_of(3) { json!(0.1) } else { Value::Null },
        "tags": tags,
        "gift_wrap": i.is_multiple_of(4),
    })
}

/// A compact JSON order of about `target` bytes (at most one line item more).
fn order_body(target: usize) -> Vec<u8> {
    let mut items = Vec::new();
    loop {
        let order = json!({
            "order_id": "ord_01HZX3K9Q7M2T8V4N6B5C0D1E2",
            "customer": {
                "id": 48213,
                "email": "ada.lovelace@example.com",
                "name": "Ada Lovelace",
                "address": {
                    "street": "12 St James's Square",
                    "city": "London",
                    "postcode": "SW1Y 4JH",
                    "country": "GB",
                },
            },
            "items": items,
            "notes": "Leave at the door.\nRing twice.",
            "submitted_at": "2026-12-03T10:15:30Z",
        });
        let body = serde_json::to_vec(&order).expect("serialisable");
        if body.len() >= target {
            return body;
        }
        items.push(line_item(items.len()));
    }
}

fn fingerprint(c: &mut Criterion) {
    let strategies = [
        ("raw", FingerprintStrategy::RawBytes),
        ("canonical", FingerprintStrategy::default()),
    ];
    let mut group = c.benchmark_group("fingerprint");
    for (size_name, target) in SIZES {
        let body = order_body(target);
        let payload = CommandPayload {
            method: "POST",
            path_and_query: "/orders",
            content_type: Some("application/json"),
            body: &body,
        };
        group.throughput(Throughput::Bytes(body.len() as u64));
        for (strategy_name, strategy) in &strategies {
            group.bench_with_input(
                BenchmarkId::new(*strategy_name, size_name),
                &payload,
                |b, payload| b.iter(|| strategy.fingerprint(black_box(payload))),
            );
        }
    }
    group.finish();
}

criterion_group!(benches, fingerprint);
criterion_main!(benches);
