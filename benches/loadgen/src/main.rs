//! A load generator for the credits service: what the inbox layer costs over real HTTP/1.1.
//!
//! It drives a **running** `examples/credits.rs` over keep-alive connections and runs the
//! unprotected baseline route (`POST /baseline/accounts/{id}/credits`, the same credit in its
//! own transaction) and the layered route (`POST /accounts/{id}/credits`) **in the same run,
//! interleaved**: `--rounds R` alternates phases baseline → layered → baseline → layered …, so
//! that machine noise hits both, and each route's figures are aggregated over its phases.
//!
//! ```sh
//! # terminal 1: the service, with the baseline route
//! CREDITS_BASELINE_ROUTE=1 cargo run --release --example credits
//! # terminal 2: 3 rounds of 10 s per route, 32 connections, new keys only
//! cargo run --release -p tower-inbox-loadgen -- --connections 32 --duration 10 --rounds 3
//! # half of the requests repeat a key this run already got an answer for
//! cargo run --release -p tower-inbox-loadgen -- --connections 32 --duration 10 --rounds 3 --duplicates 0.5
//! # replays only, no baseline (e.g. to try a response cache)
//! cargo run --release -p tower-inbox-loadgen -- --routes layered --duplicates 1 --duration 10
//! # the layer against the hand-written minimal protocol (`/minimal`), baseline included
//! cargo run --release -p tower-inbox-loadgen -- --routes ceiling --duration 10 --rounds 3
//! # open loop: 500 requests per second on each route, whatever the answers' pace
//! cargo run --release -p tower-inbox-loadgen -- --rate 500 --duration 10 --rounds 3
//! ```
//!
//! `--routes ceiling` adds a third route between them in every round: the example's
//! `/minimal/accounts/{id}/credits` (`examples/credits/ceiling.rs`), the fewest statements that
//! claim and record a credit, written by hand without the layer and without its safety (a
//! reused key gets 409, expected for duplicates and conflicts there). It prints, besides
//! layered / baseline, **minimal / baseline** (the ceiling over HTTP on this machine) and
//! **layered / minimal** (what the layer costs beyond the protocol itself).
//!
//! `benches/http.sh [loadgen arguments]` does all of it in one command: it builds both in
//! release, starts the service with the baseline route on a free port, waits for it to listen,
//! runs the load generator against it and stops the service again.
//!
//! # What it sends
//!
//! By default each of `--connections` connections is one task that sends its requests back
//! to back (**closed loop**: a new request as soon as the previous response has been read), for
//! `--duration` seconds or until the phase's `--requests` are sent. With `--rate` the requests
//! follow a fixed schedule instead (**open loop**, below). Before the measured rounds,
//! each route gets `--warmup` seconds whose figures are discarded (their errors are still
//! reported). Every request credits one of `--accounts` accounts (`lg-0` … `lg-9999`), chosen at
//! random, so that one account's row lock does not serialise the run; both routes credit the
//! same accounts. Each request is one of three kinds:
//!
//! | kind | share | request | expected on the layered route | expected on the baseline |
//! |---|---|---|---|---|
//! | new | the rest | a key never sent before, `{"delta":1}` | 201, no `idempotent-replayed` | 201 |
//! | duplicate | `--duplicates` | a key of the same route already answered with 201, the same account and body | 201 with `idempotent-replayed: true` | 201 (it credits again) |
//! | conflict | `--conflicts` | such a key with `{"delta":2}` | 409 | 201 (it credits again) |
//!
//! Duplicates and conflicts pick from the last 1024 keys the same connection got answered, so a
//! connection's first requests are new until it has one (the warmup fills them). Keys are
//! `lg-<run id>-<route><connection>-<n>`, with a time-based run id, so a re-run against the
//! same database never reuses a key. The producer is `--producer` (header `X-Producer`, default
//! `loadgen`). Before any load, one new request per route (on account `lg-0`) checks that the
//! route answers 201.
//!
//! # Open loop
//!
//! A closed loop measures what the service answers at the pace it sets itself: when a
//! response is slow, the next request waits for it, and the time it waited is in no latency
//! (coordinated omission). `--rate REQ_PER_SEC` sends instead on a fixed schedule, over all
//! connections of the route: request *i* of a phase is due `i / rate` seconds after the
//! phase's start, however fast the answers come. Each phase sends every request due within
//! `--duration` (`ceil(duration × rate)` of them), or `--requests` of them.
//!
//! A due request goes out on a free connection, the most recently freed one, so the run uses
//! as few of the `--connections` as the load needs (all are opened up front). When every
//! connection is busy, it waits for the first to be free, and is counted **late**. Its
//! latency is measured from the time it was due, not from when it went out: the wait for a
//! connection is in it, and so is the scheduler's own wake-up (tens of microseconds: a thread
//! of its own sleeps until each due time; more when the client's runtime is busy). A service
//! that cannot keep up makes the schedule fall behind: the phase then runs past `--duration`,
//! until every due request has been sent and answered.
//!
//! Besides the figures below, each route then reports its target and **achieved rate**
//! (requests sent per second from the phase's start to its last send, plus one interval of
//! the schedule: the target when every request went out on time), how many requests were
//! late, the send delay (from the due time to the send: p50, p99, max) and how many
//! connections were busy at once at the most.
//!
//! # What it prints
//!
//! Per route and per kind (and all kinds together): requests sent (responses and transport
//! errors), throughput (responses per second of the route's measured time, so the kinds add up
//! to the route's throughput), p50, p99, p999 and max latency in milliseconds, mismatches (a
//! response that is not the expected one above) and transport errors (connect, request, body,
//! no response within `--timeout`); each route's throughput per phase; its responses by status
//! and how many were replayed; in open loop, its schedule (above); then the ratios
//! **layered / baseline**: throughput (layered
//! req/s ÷ baseline req/s), p50 and p99, and the p99 of each layered kind against the
//! baseline's, and the throughput ratio of each round (its layered phase over its baseline
//! phase). `--json` prints the same as one JSON object instead. The first distinct
//! mismatches and errors are printed with their key and the start of the body. Latencies are
//! recorded for every response, expected or not; a transport error has none, and its
//! connection is closed and opened again.
//!
//! # Over uptime
//!
//! `--report-every SECS` prints, on stderr as the measured rounds go, the responses per second
//! of each interval (all routes and kinds together: use one route, `--routes layered`, for a
//! soak), and with `--server-pid PID` the server's resident memory (`VmRSS` in
//! `/proc/PID/status`, Linux) at each interval's end. At the end the report compares the
//! first tenth of the intervals with the last tenth: is throughput flat, is memory flat?
//! `benches/http.sh` passes the server's pid itself, so only `--report-every` is needed:
//!
//! ```sh
//! benches/http.sh --routes layered --rounds 1 --requests 1000000 --report-every 10
//! ```
//!
//! On a shared machine the intervals swing with other load. Many short interleaved rounds of
//! both routes give a measure that does not: the throughput ratio of each round, and its first
//! fifth of the rounds against its last fifth. A trend in that ratio is the layer's own:
//!
//! ```sh
//! benches/http.sh --rounds 30 --duration 10
//! ```
//!
//! Exit status: 0 when every response was the expected one; 3 when the run completed but saw
//! mismatches or transport errors (the figures are printed all the same, with a warning on
//! stderr); 1 when it could not run (bad URL, server unreachable, or a route that does not
//! answer a first request with 201, such as a service started without the baseline route);
//! 2 for bad arguments.
//!
//! # Client cost
//!
//! The load generator shares the machine with the service and PostgreSQL, so it stays lean:
//! one task per connection on a plain `hyper` HTTP/1.1 connection (no pool, no retries; hyper's
//! connection driver is a task beside it); the bodies, request URIs and constant headers are
//! built once and shared by reference count; keys are written into one buffer and split off,
//! not allocated one by one; latencies go into an HDR histogram per connection and kind
//! (3 significant digits, grown during the warmup and reset in place), merged at the end.
//! In open loop a thread of its own wakes at each due time and one more task, the scheduler,
//! hands the due request to a connection's task.
//!
//! It does not send through `tower_inbox::client`, and has no retries of its own to replace
//! with it: each request is sent once and its answer, or its failure, is what is measured.
//! A retrying client would fold a failed attempt and its retry into one slower success (the
//! transport errors and the latency of each attempt are the figures), and the `duplicate`
//! and `conflict` kinds are raw on purpose: they send an answered key again, with the same
//! or another body, to measure the server's replay and mismatch paths, which the client
//! would keep from happening (it returns a replay or a conflict at once and never resends an
//! answered command). A reconnect after a failed connect is not a retry of a command: the
//! request that found no connection is counted as a connect error and not sent.
//!
//! It runs on a **current-thread** runtime by default. Measured on a busy 2-core machine at
//! 1,000–3,000 req/s: about 35–55 µs of client CPU per request, about half of it in the kernel
//! (socket reads and writes, wake-ups), i.e. under 10% of one core; a 2-worker runtime
//! (`--threads 2`) reached no more requests and spent as much or more CPU per request (threads
//! waking each other). One thread is far from its limit here, and a second one would only take
//! CPU from the server and PostgreSQL. `--threads N` is there for a bigger machine. The report
//! gives the client's own CPU time per request and its share of one core (`getrusage`, on
//! Unix), and says so when the client was near a full core, i.e. the bottleneck itself.

mod args;
mod client;
mod closed;
mod cpu;
mod figures;
mod open;
mod plan;
mod report;
mod run;
mod stats;
mod uptime;

use std::process::ExitCode;

use crate::args::Args;
use crate::figures::RouteFigures;

fn main() -> ExitCode {
    let args = Args::parse_checked();
    let runtime = if args.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads as usize)
            .enable_all()
            .build()
    };
    let runtime_name = if args.threads == 1 {
        "current-thread".to_owned()
    } else {
        format!("multi-thread ({} workers)", args.threads)
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("loadgen: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (run_id, reports, uptime) = match runtime.block_on(run::run(&args)) {
        Ok(done) => done,
        Err(e) => {
            eprintln!("loadgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    let figures = match reports
        .iter()
        .map(RouteFigures::of)
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(figures) => figures,
        Err(e) => {
            eprintln!("loadgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.json {
        let mut report = report::json(&args, &run_id, &figures, &runtime_name);
        if let Some(uptime) = &uptime {
            report["uptime"] = uptime.json();
        }
        println!("{report:#}");
    } else {
        report::print_text(&args, &run_id, &figures, &runtime_name);
        if let Some(uptime) = &uptime {
            uptime.print();
        }
    }
    let (mismatches, errors) = reports.iter().fold((0, 0), |(m, e), r| {
        (
            m + r.stats.mismatches() + r.warmup.mismatches(),
            e + r.stats.errors() + r.warmup.errors(),
        )
    });
    if mismatches + errors > 0 {
        eprintln!(
            "loadgen: WARNING: {mismatches} unexpected responses and {errors} transport errors \
             (warmup included): the figures include them"
        );
        return ExitCode::from(3);
    }
    ExitCode::SUCCESS
}
