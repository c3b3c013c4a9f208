//! Runs the Python client scripts against a real server on `127.0.0.1:0`,
//! proving both APIs are usable from another language and from the clients
//! people use: `tests/python/kestrel_client_test.py` (a grpcio client
//! generated from the proto), `openai_client_test.py` (the official `openai`
//! package), `langchain_client_test.py` (LangChain's `ChatOpenAI`),
//! `litellm_client_test.py` (LiteLLM's `completion`), and
//! `chat_page_test.py` (the chat page at `GET /` in headless Chromium driven
//! by Playwright; screenshots in `target/tmp/browser-artifacts/`). Uses
//! `$KESTREL_PYTHON` (default `python3`) and, for the page, Debian's
//! `/usr/bin/chromium` (or `$KESTREL_CHROMIUM`); a test skips, saying so,
//! when those lack its packages (`pip install -r
//! tests/python/requirements.txt`, `apt-get install chromium`), except in CI
//! (`KESTREL_REQUIRE_PYTHON`), where it fails.

mod common;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The interpreter, if it can import `modules`; otherwise a skip (or, with
/// `KESTREL_REQUIRE_PYTHON`, a failure).
fn python_with(test: &str, modules: &str) -> Option<String> {
    reference_python::python_with(test, modules, "tests/python/requirements.txt")
}

/// Runs `script` with `args` and checks it reports success.
fn run_script(python: &str, script: &str, args: &[&str]) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/python")
        .join(script);
    let out = Command::new(python)
        .arg(&script)
        .args(args)
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

/// Runs an HTTP client script (which needs `modules`) against the shared
/// server's OpenAI API.
fn http_client(test: &str, modules: &str, script: &str) {
    let Some(python) = python_with(test, modules) else {
        return;
    };
    let server = common::shared_server();
    run_script(&python, script, &[&server.http_addr.to_string()]);
}

#[test]
fn python_client() {
    let Some(python) = python_with("python_client", "grpc, grpc_tools") else {
        return;
    };
    let server = common::shared_server();
    run_script(
        &python,
        "kestrel_client_test.py",
        &[&server.addr.to_string()],
    );
}

#[test]
fn python_openai_client() {
    http_client("python_openai_client", "openai", "openai_client_test.py");
}

#[test]
fn python_langchain_client() {
    http_client(
        "python_langchain_client",
        "langchain_openai",
        "langchain_client_test.py",
    );
}

#[test]
fn python_litellm_client() {
    http_client("python_litellm_client", "litellm", "litellm_client_test.py");
}

/// Debian's Chromium (or `$KESTREL_CHROMIUM`), if present; otherwise a skip
/// (or, with `KESTREL_REQUIRE_PYTHON`, a failure).
fn chromium(test: &str) -> Option<String> {
    let path = std::env::var("KESTREL_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if Path::new(&path).is_file() {
        return Some(path);
    }
    assert!(
        std::env::var_os("KESTREL_REQUIRE_PYTHON").is_none(),
        "KESTREL_REQUIRE_PYTHON is set but there is no browser at {path}"
    );
    eprintln!(
        "SKIPPED {test}: no browser at {path} (apt-get install chromium, or set KESTREL_CHROMIUM)"
    );
    None
}

#[test]
fn chat_page_in_a_browser() {
    let Some(python) = python_with("chat_page_in_a_browser", "playwright") else {
        return;
    };
    let Some(chromium) = chromium("chat_page_in_a_browser") else {
        return;
    };
    // Its own engine: the script checks /metrics for an idle engine.
    let server = common::start_server(kestrel_engine::EngineConfig::default());
    let artifacts = Path::new(env!("CARGO_TARGET_TMPDIR")).join("browser-artifacts");
    run_script(
        &python,
        "chat_page_test.py",
        &[
            &server.http_addr.to_string(),
            "--artifacts",
            artifacts.to_str().expect("a UTF-8 target dir"),
            "--chromium",
            &chromium,
        ],
    );
    eprintln!("chat page screenshots in {}", artifacts.display());
}
