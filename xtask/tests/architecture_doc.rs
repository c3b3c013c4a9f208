//! `docs/ARCHITECTURE.md` names types, functions and paths of the code in
//! code font; this test fails when one of those names no longer exists
//! anywhere in the sources, so the map cannot quietly drift from the
//! territory (a renamed error, a removed constant, a moved function).
//!
//! A span is checked when it is a Rust-like path (`A::b`, `A::{B, C}`,
//! `Foo { .. }`, `f(..)`, `m!`) or a single identifier that is CamelCase,
//! SCREAMING_CASE or snake_case with an underscore; each of its segments
//! must appear as a whole word in a source file (`.rs`, `.cu`, `.cuh`,
//! `.proto`, `.py`, `.sh`, `.toml`, `.html`) of the repository outside
//! `docs/` and `target/`. Spans with spaces, slashes, dots or dashes
//! (commands, files, flags, expressions) are prose, not names, and are
//! skipped. Reads a few hundred files: well under a second.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the repository root")
        .to_path_buf()
}

const SOURCE_EXTENSIONS: &[&str] = &["rs", "cu", "cuh", "proto", "py", "sh", "toml", "html"];

/// Every identifier-like word of every source file below `dir`.
fn collect_words(dir: &Path, words: &mut HashSet<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !(name.starts_with('.') || name == "target" || name == "docs") {
                collect_words(&path, words);
            }
            continue;
        }
        let is_source = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| SOURCE_EXTENSIONS.contains(&e));
        if !is_source {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for w in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if !w.is_empty() {
                words.insert(w.to_string());
            }
        }
    }
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Whether a lone identifier is a name of the code rather than a word:
/// capitalized (a type, a variant), SCREAMING_CASE or snake_case.
fn is_code_name(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_uppercase()) || s.contains('_')
}

/// The names a code span stands for, or none when it is not a name.
fn names_in(span: &str) -> Vec<String> {
    let span = span.split_whitespace().collect::<Vec<_>>().join(" ");
    // `Foo { .. }`, `Resume(n)`, `Foo::bar(x, y)`: the path before them.
    let head = span.split([' ', '(']).next().unwrap_or_default();
    let head = head.strip_suffix('!').unwrap_or(head);
    let (head, list) = match head.split_once("::{") {
        // `EngineError::{Fatal, RequestFailed}`
        Some((prefix, _)) => {
            let inner = span
                .split_once("::{")
                .map(|(_, rest)| rest.trim_end_matches('}'))
                .unwrap_or_default();
            (prefix.to_string(), Some(inner.to_string()))
        }
        None => (head.to_string(), None),
    };
    let mut segments: Vec<String> = head.split("::").map(str::to_string).collect();
    if let Some(list) = list {
        segments.extend(list.split(',').map(|s| s.trim().to_string()));
    }
    if segments.iter().any(|s| !is_ident(s)) {
        return Vec::new();
    }
    // A span that was prose past its head (`a + b`) is not a name.
    let rest = &span[head.len().min(span.len())..];
    let called = ["!", "(", " {"].iter().any(|p| rest.starts_with(p));
    if !(rest.is_empty() || called || rest.starts_with("::{")) {
        return Vec::new();
    }
    if segments.len() == 1 && !(called || is_code_name(&segments[0])) {
        return Vec::new();
    }
    segments
}

/// The code spans of a Markdown text (inline ones; fenced blocks skipped).
fn code_spans(text: &str) -> Vec<String> {
    let mut prose = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            prose.push_str(line);
            prose.push('\n');
        }
    }
    prose
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

#[test]
fn every_name_the_architecture_doc_gives_exists_in_the_code() {
    let root = repo_root();
    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let mut words = HashSet::new();
    for dir in ["crates", "xtask", "proto", "scripts", "tests", ".ci"] {
        collect_words(&root.join(dir), &mut words);
    }
    assert!(words.contains("EngineLoop"), "the sources were not read");
    let mut checked = 0;
    let mut missing = Vec::new();
    for span in code_spans(&doc) {
        let names = names_in(&span);
        checked += usize::from(!names.is_empty());
        for name in names {
            if !words.contains(&name) {
                missing.push(format!("`{span}`: `{name}`"));
            }
        }
    }
    assert!(checked > 200, "only {checked} names were checked");
    assert!(
        missing.is_empty(),
        "docs/ARCHITECTURE.md names what the code no longer has:\n{}",
        missing.join("\n")
    );
}

#[test]
fn names_are_told_from_prose() {
    assert_eq!(names_in("SeqBook::plan_step"), ["SeqBook", "plan_step"]);
    assert_eq!(
        names_in("EngineError::{Fatal, RequestFailed}"),
        ["EngineError", "Fatal", "RequestFailed"]
    );
    assert_eq!(
        names_in("RuntimeError::Fault { step,\nsource: CpuError }"),
        ["RuntimeError", "Fault"]
    );
    assert_eq!(names_in("Resume(n)"), ["Resume"]);
    assert_eq!(names_in("executor_kv_queries!"), ["executor_kv_queries"]);
    assert_eq!(names_in("LedgerError"), ["LedgerError"]);
    for prose in [
        "llama",
        "grow",
        "1 + w",
        "kind=prefill",
        "--numerics exact",
        "src/lib.rs",
        "general.architecture",
        "w + offset",
    ] {
        assert!(names_in(prose).is_empty(), "{prose}");
    }
}
