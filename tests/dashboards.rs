//! `dashboards/grafana.json` and `dashboards/alerts.yml` against the crate's metric list: every
//! metric a query names is one the crate records (a histogram's `_bucket`, `_sum` and `_count`
//! series included), every label a query groups, filters or prints by is one of that metric's
//! labels, and the dashboard shows every metric. (`promtool` checks the rules' syntax and
//! their firing in CI: `promtool check rules` and `promtool test rules`.)

use std::collections::BTreeSet;

use serde_json::Value;
use tower_inbox::metrics::{MetricInfo, MetricKind, METRICS};

const DASHBOARD: &str = include_str!("../dashboards/grafana.json");
const ALERTS: &str = include_str!("../dashboards/alerts.yml");

/// What a query names: its metrics and the labels it uses.
#[derive(Debug, Default)]
struct Query {
    metrics: Vec<&'static MetricInfo>,
    labels: BTreeSet<String>,
}

fn identifiers(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let is_start = |c: char| c.is_ascii_alphabetic() || c == '_';
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in text.char_indices().chain([(text.len(), ' ')]) {
        match start {
            None if is_start(c) => start = Some(i),
            Some(s) if !(c.is_ascii_alphanumeric() || c == '_') => {
                out.push((s, &text[s..i]));
                start = None;
            }
            _ => {}
        }
    }
    out.into_iter()
}

/// The metric a series name belongs to, or `None` when it names none of the crate's.
fn metric_of(series: &str) -> Option<&'static MetricInfo> {
    if let Some(m) = METRICS.iter().find(|m| m.name == series) {
        return Some(m);
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let base = series.strip_suffix(suffix)?;
        METRICS
            .iter()
            .find(|m| m.name == base && m.kind == MetricKind::Histogram)
    })
}

/// Parses the PromQL in `expr`: names starting like the crate's metrics must be its
/// metrics; labels come from `by (...)`, `without (...)` and `{label=...}` matchers.
fn parse(expr: &str, context: &str) -> Query {
    let mut query = Query::default();
    for (at, word) in identifiers(expr) {
        let rest = expr[at + word.len()..].trim_start();
        if ["inbox_", "outbox_", "quarantine_"]
            .iter()
            .any(|p| word.starts_with(p))
        {
            let metric = metric_of(word)
                .unwrap_or_else(|| panic!("{context}: `{word}` is not a metric the crate records"));
            query.metrics.push(metric);
        } else if (word == "by" || word == "without") && rest.starts_with('(') {
            let inside = &rest[1..rest.find(')').expect("closing parenthesis")];
            query.labels.extend(
                inside
                    .split(',')
                    .map(|l| l.trim().to_owned())
                    .filter(|l| !l.is_empty()),
            );
        } else if rest.starts_with("=~") || rest.starts_with("!=") || rest.starts_with('=') {
            // A matcher inside `{...}`: the identifier is a label name.
            let before = expr[..at].trim_end();
            if before.ends_with('{') || before.ends_with(',') {
                query.labels.insert(word.to_owned());
            }
        }
    }
    assert!(
        !query.metrics.is_empty(),
        "{context}: the query names none of the crate's metrics: {expr}"
    );
    query
}

/// Labels printed with `{{label}}` (legends) or `$labels.label` (alert annotations).
fn printed_labels(text: &str) -> BTreeSet<String> {
    let mut labels = BTreeSet::new();
    for part in text.split("{{").skip(1) {
        let name = part.split("}}").next().unwrap_or("").trim();
        if let Some(label) = name.strip_prefix("$labels.") {
            labels.insert(label.to_owned());
        } else if !name.starts_with('$') && !name.contains(' ') && !name.is_empty() {
            labels.insert(name.to_owned());
        }
    }
    labels
}

/// The stats task's gauges describe the whole database, and every instance that runs it
/// reports them: summed across instances they would count each thing once per instance.
fn check_no_sum_of_gauges(query: &Query, expr: &str, context: &str) {
    let gauges: Vec<_> = query
        .metrics
        .iter()
        .filter(|m| m.kind == MetricKind::Gauge)
        .map(|m| m.name)
        .collect();
    assert!(
        gauges.is_empty() || !identifiers(expr).any(|(_, word)| word == "sum"),
        "{context}: sums the gauges {gauges:?} across instances; take the max: {expr}"
    );
}

/// Every label is one some metric of the query carries (or the histogram's `le`).
fn check_labels(query: &Query, labels: &BTreeSet<String>, context: &str) {
    for label in labels {
        let known = label == "le"
            || query
                .metrics
                .iter()
                .any(|m| m.labels.contains(&label.as_str()));
        assert!(
            known,
            "{context}: label `{label}` is not a label of {:?}",
            query.metrics.iter().map(|m| m.name).collect::<Vec<_>>()
        );
    }
}

fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        all.push(panel);
        if let Some(inner) = panel["panels"].as_array() {
            all.extend(inner);
        }
    }
    all
}

#[test]
fn every_dashboard_query_names_the_crates_metrics_and_their_labels_and_shows_them_all() {
    let dashboard: Value = serde_json::from_str(DASHBOARD).expect("grafana.json is JSON");
    let mut shown = BTreeSet::new();
    let mut queries = 0;
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or("?");
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("every target has an expr");
            let context = format!("panel {title:?}");
            let query = parse(expr, &context);
            check_no_sum_of_gauges(&query, expr, &context);
            let mut labels = query.labels.clone();
            labels.extend(printed_labels(
                target["legendFormat"].as_str().unwrap_or(""),
            ));
            check_labels(&query, &labels, &context);
            shown.extend(query.metrics.iter().map(|m| m.name));
            queries += 1;
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if let Some(definition) = variable["definition"].as_str() {
            let query = parse(definition, "a variable");
            let label = definition
                .trim_end_matches(')')
                .rsplit(',')
                .next()
                .unwrap()
                .trim();
            check_labels(&query, &BTreeSet::from([label.to_owned()]), "a variable");
        }
    }
    let missing: Vec<_> = METRICS
        .iter()
        .map(|m| m.name)
        .filter(|name| !shown.contains(name))
        .collect();
    assert!(missing.is_empty(), "metrics with no panel: {missing:?}");
    println!("{queries} queries over {} metrics", shown.len());
}

#[test]
fn every_alert_names_the_crates_metrics_and_their_labels() {
    let mut alerts = 0;
    let mut current: Option<(String, Query)> = None;
    for line in ALERTS.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("- alert:") {
            alerts += 1;
            current = Some((name.trim().to_owned(), Query::default()));
        } else if let Some(expr) = line.strip_prefix("expr:") {
            let (name, _) = current.as_ref().expect("an expr belongs to an alert");
            let expr = expr.trim();
            assert!(
                !expr.starts_with('|') && !expr.starts_with('>') && !expr.is_empty(),
                "alert {name}: keep each expr on one line, the checks read it so"
            );
            let query = parse(expr, &format!("alert {name}"));
            check_no_sum_of_gauges(&query, expr, &format!("alert {name}"));
            let labels = query.labels.clone();
            check_labels(&query, &labels, &format!("alert {name}"));
            current = Some((name.clone(), query));
        } else if line.starts_with("summary:") || line.starts_with("description:") {
            let (name, query) = current.as_ref().expect("annotations belong to an alert");
            check_labels(query, &printed_labels(line), &format!("alert {name}"));
        }
    }
    assert_eq!(alerts, 5, "the five alerts the README describes");
}

#[test]
fn the_checker_refuses_what_it_should() {
    let refused = |expr: &'static str, legend: &'static str| {
        std::panic::catch_unwind(move || {
            let query = parse(expr, "test");
            let mut labels = query.labels.clone();
            labels.extend(printed_labels(legend));
            check_labels(&query, &labels, "test");
        })
        .is_err()
    };
    assert!(refused("rate(inbox_first_seen[5m])", ""), "unknown name");
    assert!(refused("sum by (effect) (inbox_rows)", ""), "foreign label");
    assert!(refused("inbox_rows{table=\"x\"}", ""), "foreign matcher");
    assert!(refused("inbox_rows", "{{source}}"), "foreign legend label");
    assert!(refused("inbox_rows_count", ""), "not a histogram");
    assert!(refused("up", ""), "none of the crate's metrics");
    let summed = std::panic::catch_unwind(|| {
        let expr = "sum by (consumer) (inbox_rows)";
        check_no_sum_of_gauges(&parse(expr, "test"), expr, "test");
    });
    assert!(summed.is_err(), "a sum of a gauge across instances");
    assert!(!refused(
        "histogram_quantile(0.99, sum by (le, consumer) (rate(inbox_claim_wait_seconds_bucket{consumer=~\"a\"}[5m])))",
        "{{consumer}}"
    ));
}
