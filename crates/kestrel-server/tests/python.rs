//! Runs the Python client scripts against a real server on `127.0.0.1:0`,
//! proving both APIs are usable from another language and from the clients
//! people use: `tests/python/kestrel_client_test.py` (a grpcio client
//! generated from the proto), `openai_client_test.py` (the official `openai`
//! package), `langchain_client_test.py` (LangChain's `ChatOpenAI`),
//! `litellm_client_test.py` (LiteLLM's `completion`),
//! `moondream_client_test.py` (the `moondream` package's `md.vl` client,
//! and an OpenAI chat with an image, against `kestrel serve --model DIR` on
//! a synthetic served Moondream checkpoint), and
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

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

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

/// A `kestrel serve` child, killed when dropped.
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `kestrel serve --model dir` on free loopback ports and returns
/// it with its HTTP address, read from the line it prints once it serves.
fn serve_model(dir: &Path) -> (Served, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .arg("serve")
        .arg("--model")
        .arg(dir)
        .args(["--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(["--no-metrics", "--threads", "2", "--kv-pages", "512"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kestrel serve");
    let stderr = BufReader::new(child.stderr.take().expect("stderr"));
    let served = Served(child);
    const PREFIX: &str = "serving the OpenAI-compatible API on http://";
    let mut seen = Vec::new();
    let mut lines = stderr.lines();
    while let Some(line) = lines.next() {
        let line = line.expect("read kestrel serve's stderr");
        if let Some(rest) = line.strip_prefix(PREFIX) {
            let addr = rest.trim_end_matches("/v1").to_string();
            // Keep draining stderr so the server never blocks writing it.
            std::thread::spawn(move || lines.for_each(drop));
            return (served, addr);
        }
        seen.push(line);
    }
    panic!(
        "kestrel serve --model {} exited before serving:\n{}",
        dir.display(),
        seen.join("\n")
    );
}

/// The official `moondream` client (`md.vl(endpoint=...)`: `query` and
/// `caption`, unary and streamed, `point` and `detect`) and an OpenAI chat
/// with an `image_url` part, against `kestrel serve --model DIR` on a
/// synthetic Moondream checkpoint (`scripts/reference/moondream_synth.py
/// --served --seed 17`: the real tensor names, vocabulary and prompt
/// templates, tiny widths, a region model; seed 17's point and detect find
/// objects).
#[test]
fn python_moondream_client() {
    let Some(python) = python_with("python_moondream_client", "moondream, openai, PIL, numpy")
    else {
        return;
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("moondream-served");
    let _ = std::fs::remove_dir_all(&dir);
    let synth = reference_python::repo().join("scripts/reference/moondream_synth.py");
    let out = Command::new(&python)
        .arg(&synth)
        .arg(&dir)
        .args(["--served", "--seed", "17"])
        .output()
        .expect("run moondream_synth.py");
    assert!(
        out.status.success(),
        "moondream_synth.py --served failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_server, addr) = serve_model(&dir);
    run_script(&python, "moondream_client_test.py", &[&addr]);
}
