//! The README's first command, run as written on the real binary with the
//! default configuration (default model, the command line's default
//! numerics, this machine's best ISA; only the listeners moved to free
//! ports): `kestrel serve --first-request "What is the capital of France?"`
//! asks its own gRPC API and prints the answer, which must be right and must
//! not loop. The same question as a chat turn with the command line's default
//! sampling (`kestrel generate --chat`, the in-process path `kestrel chat`
//! takes) is held to the same words.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

const QUESTION: &str = "What is the capital of France?";

/// Whether `text` repeats one word n-gram (1 to 8 words) at least three
/// times in a row: the "la Femme, la Femme, la Femme" of a greedy loop.
fn loops(text: &str) -> bool {
    let words: Vec<&str> = text.split_whitespace().collect();
    (1..=8).any(|n| {
        words.windows(3 * n).any(|w| {
            let (a, rest) = w.split_at(n);
            let (b, c) = rest.split_at(n);
            a == b && b == c
        })
    })
}

#[test]
fn loops_are_seen_and_answers_are_not_mistaken_for_them() {
    assert!(loops("L'Étoile, la Femme, la Femme, la Femme, la"));
    assert!(loops("a a a"));
    assert!(!loops("The capital of France is Paris."));
    assert!(!loops("la Femme, la Femme, et la Cité"));
}

#[test]
fn the_readme_first_command_answers_right() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--no-http",
            "--no-metrics",
        ])
        .args(["--first-request", QUESTION])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kestrel serve");
    let mut stdout = child.stdout.take().expect("stdout");
    let answer = std::thread::spawn(move || {
        let mut text = String::new();
        stdout.read_to_string(&mut text).expect("read stdout");
        text
    });
    // The stats line on stderr comes after the whole answer is printed;
    // stderr is read to its end (the drain logs to it too).
    let stderr = BufReader::new(child.stderr.take().expect("stderr"));
    let (tx, rx) = std::sync::mpsc::channel();
    let log = std::thread::spawn(move || {
        let mut log = String::new();
        for line in stderr.lines() {
            let line = line.expect("read stderr");
            if line.starts_with('[') && line.contains("generated tokens") {
                let _ = tx.send(());
            }
            log.push_str(&line);
            log.push('\n');
        }
        log
    });
    // Ends when the answer is printed, or the server exits without one.
    let _ = rx.recv();
    // SIGTERM: the server drains and exits 0, closing stdout.
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = child.wait().expect("wait");
    let answer = answer.join().expect("stdout reader");
    let log = log.join().expect("stderr reader");
    assert!(status.success(), "{status}\n{log}\n{answer}");
    assert!(answer.contains("Paris"), "answer: {answer:?}\n{log}");
    assert!(!loops(&answer), "answer loops: {answer:?}");
}

#[test]
fn a_chat_turn_with_the_cli_defaults_answers_right() {
    let out = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["generate", "--chat", "--max-new-tokens", "32", QUESTION])
        .output()
        .expect("run kestrel generate");
    let answer = String::from_utf8_lossy(&out.stdout);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{log}", out.status);
    assert!(answer.contains("Paris"), "answer: {answer:?}\n{log}");
    assert!(!loops(&answer), "answer loops: {answer:?}");
}
