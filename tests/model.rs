//! A state-machine property test of the whole protocol against a real PostgreSQL: random
//! interleavings of commands over two or three concurrent sessions, checked step by step
//! against a plain in-memory model of what each should return and leave behind.
//!
//! A case is a few layer settings (`ops::Settings`) and up to 30 operations (`ops::Op`):
//! sending a command (new, duplicate, conflicting, in flight elsewhere; answered at once with
//! 201, a business 409, a 422 rejection or a 500 failure, or held open at a gate), releasing a
//! held command (commit, refusal, rejection, failure; a patient duplicate waiting for it is
//! then replayed, refused, or runs itself), deciding a quarantine item (repair or discard),
//! ageing a key past the retention window, and running the purge. Two layers share the
//! consumer and the handler: one answers a duplicate of a command in flight with 409
//! `in-progress` at once, the other makes it wait. The model (`spec.rs`, `lifecycle.rs`)
//! says what each request gets (status, problem type, `Idempotent-Replayed`, the exact
//! recorded body) and what the database must hold after each step (business writes per key,
//! the committed row, the failure record, the quarantine items with their decisions and
//! recoveries, the claims in flight and the waiting duplicates); `facts.rs` reads the same
//! from the database. At the end every held command is committed and each key's committed
//! row must have been written by exactly one committed run.
//!
//! Every case runs in one database, under a consumer of its own (`model-<case>`), so cases
//! are fast (no database per case) and never see each other.
//!
//! Cases: 64 by default, up to 30 operations each (a few seconds in all);
//! `PROPTEST_CASES=3000 cargo test --all-features --test model` runs more. A failing case is
//! shrunk and its seed saved in `tests/model.proptest-regressions` (proptest's `WithSource`
//! persistence), which is committed: every run replays the saved seeds first, so a failure
//! once found stays a test. A seed only means the same case while `ops.rs` draws the same
//! values from it, so each case found is also written out in `regressions.rs`
//! (`the_cases_it_found_still_hold`). `failure_race.rs` holds, made deterministic, the one
//! race whose two outcomes the model accepts (a failure counted before or after a waiting
//! duplicate claims the key).

mod common;
#[path = "model/facts.rs"]
mod facts;
#[path = "model/failure_race.rs"]
mod failure_race;
#[path = "model/harness.rs"]
mod harness;
#[path = "model/lifecycle.rs"]
mod lifecycle;
#[path = "model/ops.rs"]
mod ops;
#[path = "model/regressions.rs"]
mod regressions;
#[path = "model/requests.rs"]
mod requests;
#[path = "model/spec.rs"]
mod spec;

use std::sync::atomic::{AtomicU32, Ordering};

use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};

use common::TestApp;
use harness::Harness;
use ops::{Ending, Op, Scenario};
use spec::{Model, Step};

/// Cases per run unless `PROPTEST_CASES` says otherwise.
const DEFAULT_CASES: u32 = 64;
/// The longest operation list drawn.
const MAX_OPS: usize = 30;
/// Shrinking runs whole cases against the database; bounded unless
/// `PROPTEST_MAX_SHRINK_ITERS` says otherwise.
const DEFAULT_SHRINK_ITERS: u32 = 1024;

fn config() -> Config {
    let from_env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    Config {
        // An explicit count would override the variable, which proptest reads only into
        // its default count.
        cases: from_env("PROPTEST_CASES").unwrap_or(DEFAULT_CASES),
        max_shrink_iters: from_env("PROPTEST_MAX_SHRINK_ITERS").unwrap_or(DEFAULT_SHRINK_ITERS),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        source_file: Some(file!()),
        ..Config::default()
    }
}

/// The database every case of a test runs in, with the handler's table.
async fn database() -> TestApp {
    let app = TestApp::with_pool_size(16).await;
    sqlx::raw_sql(harness::EFFECTS_TABLE)
        .execute(&app.pool)
        .await
        .expect("effects table");
    app
}

#[test]
fn the_layer_does_what_the_model_says() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let app = runtime.block_on(database());
    let cases = AtomicU32::new(0);
    let mut runner = TestRunner::new(config());
    let result = runner.run(&ops::scenario(MAX_OPS), |scenario| {
        let case = cases.fetch_add(1, Ordering::Relaxed);
        runtime.block_on(run_case(&app, case, &scenario))
    });
    runtime.block_on(app.pool.close());
    drop(app);
    if let Err(err) = result {
        panic!("{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cases_it_found_still_hold() {
    let app = database().await;
    for (case, (what, scenario)) in (0..).zip(regressions::found()) {
        if let Err(err) = run_case(&app, case, &scenario).await {
            panic!("{what}: {err}\n{scenario:#?}");
        }
    }
}

async fn run_case(app: &TestApp, case: u32, scenario: &Scenario) -> Result<(), TestCaseError> {
    let mut harness = Harness::new(&app.pool, case, &scenario.settings);
    let mut model = Model::new(scenario.settings);
    let result = run_ops(&mut harness, &mut model, &scenario.ops).await;
    harness.shutdown().await;
    result.map_err(TestCaseError::fail)
}

async fn run_ops(harness: &mut Harness, model: &mut Model, ops: &[Op]) -> Result<(), String> {
    for (n, op) in ops.iter().enumerate() {
        step(harness, model, op)
            .await
            .map_err(|e| format!("operation {n}, {op:?}: {e}"))?;
    }
    // Every held command commits, so that each key ends committed or free.
    while let Some(session) = model.held_session() {
        let op = Op::Release {
            session,
            ending: Ending::Commit,
        };
        step(harness, model, &op)
            .await
            .map_err(|e| format!("final release of session {session}: {e}"))?;
    }
    one_committed_run_per_row(harness, model).await
}

/// Runs one operation on both sides and compares answers, then facts.
async fn step(harness: &mut Harness, model: &mut Model, op: &Op) -> Result<(), String> {
    let (step, candidates) = model.plan(op);
    match &step {
        Step::Skip => return Ok(()),
        Step::Send(send) => {
            let seen = harness.send(send).await;
            facts::answer(&send.expect, &seen).map_err(|e| format!("{send:?}: {e}"))?;
        }
        Step::Release {
            session,
            ending,
            expect,
            waiter,
        } => {
            let (seen, waited) = harness
                .release(*session, *ending, waiter.as_ref().map(|w| w.0))
                .await;
            facts::answer(expect, &seen).map_err(|e| format!("the released request: {e}"))?;
            if let (Some((session, expect)), Some(seen)) = (waiter, waited) {
                facts::answer(expect, &seen)
                    .map_err(|e| format!("the request of session {session} waiting: {e}"))?;
            }
        }
        Step::Decide { id, repair, expect } => {
            facts::decision(*expect, harness.decide(*id, *repair).await)?;
        }
        Step::Age { key } => harness.age(*key).await,
        Step::Purge => harness.purge().await,
    }
    let held = candidates[0].facts().in_flight;
    let (facts, ids) = harness.facts(held).await;
    *model = facts::choose(candidates, &facts)?;
    model.learn_ids(&ids);
    Ok(())
}

/// The invariant, read from the database alone but for which keys were ever purged: each
/// committed row was written by exactly one committed run (the run its recorded body names),
/// and a key never purged has exactly one business write if committed and none otherwise. A
/// purged key may have run again, once per time it was first seen.
async fn one_committed_run_per_row(harness: &Harness, model: &Model) -> Result<(), String> {
    let runs = facts::committed_runs(harness.pool(), harness.consumer()).await;
    let (rows, _) = facts::read(harness.pool(), harness.consumer()).await;
    for (key, row) in rows.iter().enumerate() {
        let runs = runs.get(&key).cloned().unwrap_or_default();
        let recorded_run = row.row.as_ref().map(|row| {
            let body = row.body.as_deref().expect("a committed row has a response");
            let body: serde_json::Value = serde_json::from_str(body).expect("the handler's JSON");
            body["run"].as_i64().expect("a run")
        });
        let consistent = match recorded_run {
            Some(run) if model.keys[key].ever_purged => runs.contains(&run),
            Some(run) => runs == [run],
            None if model.keys[key].ever_purged => true,
            None => runs.is_empty(),
        };
        if !consistent {
            return Err(format!(
                "k{key}: committed runs {runs:?}, recorded run {recorded_run:?}"
            ));
        }
    }
    Ok(())
}
