//! The crate's layout rules, checked on its sources: no import cycle between sibling modules,
//! and no source file longer than a reader can hold (ARCHITECTURE.md states both).
//!
//! The module graph is read from the `crate::` and `super::` paths in the code (comments
//! and doc comments are left out, so an intra-doc link is not a dependency). A module `a`
//! depends on its sibling `b` when code anywhere under `a` names something under `b`; each
//! module's children must form a graph without cycles.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The longest a file under `src/` may be.
const MAX_LINES: usize = 600;
/// The protocol core's front door is shorter still.
const MAX_INBOX_MOD_LINES: usize = 400;

type ModPath = Vec<String>;

fn sources() -> Vec<(PathBuf, ModPath)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(&root).expect("under src");
                let mut module: ModPath = rel
                    .with_extension("")
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                    module.pop();
                }
                out.push((path, module));
            }
        }
    }
    out.sort();
    out
}

/// The code of a file without its comments (line comments and doc comments).
fn code(text: &str) -> String {
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path the code names from `crate::` (or `$crate::`) or `super::`, as module-path
/// segments from the crate root; groups (`crate::{a::X, b}`) give one path per member.
fn named_paths(code: &str, module: &ModPath) -> Vec<ModPath> {
    let mut out = Vec::new();
    for (anchor, base) in [
        ("crate::", Vec::new()),
        ("super::", {
            let mut parent = module.clone();
            parent.pop();
            parent
        }),
    ] {
        let mut rest = code;
        while let Some(at) = rest.find(anchor) {
            let before = rest[..at].chars().next_back();
            let after = &rest[at + anchor.len()..];
            rest = after;
            if before.is_some_and(|c| is_ident(c) || c == ':') {
                continue;
            }
            collect(after, base.clone(), &mut out);
        }
    }
    out
}

fn collect(text: &str, mut prefix: ModPath, out: &mut Vec<ModPath>) {
    let mut text = text;
    loop {
        if let Some(group) = text.strip_prefix('{') {
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        collect(group[start..i].trim(), prefix.clone(), out);
                        return;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        collect(group[start..i].trim(), prefix.clone(), out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            return;
        }
        let len = text.find(|c: char| !is_ident(c)).unwrap_or(text.len());
        if len == 0 {
            break;
        }
        let segment = &text[..len];
        if segment == "super" {
            prefix.pop();
        } else if segment != "self" {
            prefix.push(segment.to_string());
        }
        text = &text[len..];
        match text.strip_prefix("::") {
            Some(next) => text = next.trim_start(),
            None => break,
        }
    }
    out.push(prefix);
}

#[test]
fn sibling_modules_do_not_import_each_other_in_a_cycle() {
    let files = sources();
    let modules: BTreeSet<ModPath> = files.iter().map(|(_, m)| m.clone()).collect();
    // parent module -> (child -> children it depends on)
    let mut graphs: BTreeMap<ModPath, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let mut edges = 0;
    for (path, module) in &files {
        let text = std::fs::read_to_string(path).expect("read source");
        for named in named_paths(&code(&text), module) {
            // The module the path leads into: its longest prefix that is a module.
            let target = (0..=named.len())
                .rev()
                .map(|n| named[..n].to_vec())
                .find(|p| modules.contains(p))
                .unwrap_or_default();
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if common < module.len() && common < target.len() {
                graphs
                    .entry(module[..common].to_vec())
                    .or_default()
                    .entry(module[common].clone())
                    .or_default()
                    .insert(target[common].clone());
                edges += 1;
            }
        }
    }
    assert!(
        edges > 50,
        "the checker found only {edges} dependencies: it reads nothing"
    );
    let mut cycles = Vec::new();
    for (parent, graph) in &graphs {
        if let Some(cycle) = find_cycle(graph) {
            cycles.push(format!(
                "in crate::{}: {}",
                parent.join("::"),
                cycle.join(" -> ")
            ));
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, stack, done) {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_checker_sees_a_cycle() {
    // Guards the checker itself: a two-module cycle and a group import are found.
    let a: ModPath = vec!["a".into()];
    let named = named_paths(
        "use crate::{b::X, c::{Y, Z}};\nfn f() { super::d::g() }",
        &vec!["x".into(), "y".into()],
    );
    assert!(named.contains(&vec!["b".into(), "X".into()]), "{named:?}");
    assert!(named.contains(&vec!["c".into(), "Z".into()]), "{named:?}");
    assert!(
        named.contains(&vec!["x".into(), "d".into(), "g".into()]),
        "{named:?}"
    );
    let graph: BTreeMap<String, BTreeSet<String>> = [
        (a[0].clone(), BTreeSet::from(["b".to_string()])),
        ("b".to_string(), BTreeSet::from(["a".to_string()])),
    ]
    .into();
    assert!(find_cycle(&graph).is_some());
    assert!(code("// crate::a::b\nlet x = 1; /// crate::c")
        .trim()
        .ends_with("let x = 1;"));
}

#[test]
fn no_source_file_is_too_long_to_read() {
    let mut long = Vec::new();
    for (path, module) in sources() {
        let lines = std::fs::read_to_string(&path)
            .expect("read")
            .lines()
            .count();
        let limit = if module == ["inbox"] {
            MAX_INBOX_MOD_LINES
        } else {
            MAX_LINES
        };
        if lines > limit {
            long.push(format!(
                "{} has {lines} lines (at most {limit})",
                path.display()
            ));
        }
    }
    assert!(long.is_empty(), "{}", long.join("\n"));
}
