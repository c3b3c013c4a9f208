//! Runs the Python client scripts against a real server on `127.0.0.1:0`,
//! proving both APIs are usable from another language:
//! `tests/python/kestrel_client_test.py` (a grpcio client generated from the
//! proto) and `tests/python/openai_client_test.py` (the official `openai`
//! package against the HTTP API). Uses `$KESTREL_PYTHON` (default
//! `python3`); a test skips, saying so, when that interpreter lacks its
//! packages (`pip install -r tests/python/requirements.txt`), except in CI
//! (`KESTREL_REQUIRE_PYTHON`), where it fails.

mod common;

use std::path::PathBuf;
use std::process::Command;

/// The interpreter, if it can import `modules`; otherwise a skip (or, with
/// `KESTREL_REQUIRE_PYTHON`, a failure).
fn python_with(test: &str, modules: &str) -> Option<String> {
    let python = std::env::var("KESTREL_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_deps = Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if has_deps {
        return Some(python);
    }
    // CI installs the clients' requirements and insists on the run.
    assert!(
        std::env::var_os("KESTREL_REQUIRE_PYTHON").is_none(),
        "KESTREL_REQUIRE_PYTHON is set but {python} cannot import {modules}"
    );
    eprintln!(
        "SKIPPED {test}: {python} cannot import {modules} \
         (pip install -r tests/python/requirements.txt, or set KESTREL_PYTHON)"
    );
    None
}

/// Runs `script` with `arg` and checks it reports success.
fn run_script(python: &str, script: &str, arg: String) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/python")
        .join(script);
    let out = Command::new(python)
        .arg(&script)
        .arg(arg)
        .output()
        .expect("run the python client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python client failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.starts_with("ok:"), "{stdout}");
}

#[test]
fn python_client() {
    let Some(python) = python_with("python_client", "grpc, grpc_tools") else {
        return;
    };
    let server = common::shared_server();
    run_script(&python, "kestrel_client_test.py", server.addr.to_string());
}

#[test]
fn python_openai_client() {
    let Some(python) = python_with("python_openai_client", "openai") else {
        return;
    };
    let server = common::shared_server();
    run_script(
        &python,
        "openai_client_test.py",
        server.http_addr.to_string(),
    );
}
