//! Runs `tests/python/kestrel_client_test.py` (a grpcio client generated
//! from the proto) against a real server on `127.0.0.1:0`, proving the proto
//! is usable from another language. Uses `$KESTREL_PYTHON` (default
//! `python3`); skips, saying so, when it lacks `grpcio`/`grpcio-tools`
//! (`pip install -r tests/python/requirements.txt`).

mod common;

use std::path::PathBuf;
use std::process::Command;

#[test]
fn python_client() {
    let python = std::env::var("KESTREL_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_deps = Command::new(&python)
        .args(["-c", "import grpc, grpc_tools"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_deps {
        // CI installs the client's requirements and insists on the run.
        assert!(
            std::env::var_os("KESTREL_REQUIRE_PYTHON").is_none(),
            "KESTREL_REQUIRE_PYTHON is set but {python} cannot import grpc and grpc_tools"
        );
        eprintln!(
            "SKIPPED python_client: {python} cannot import grpc and grpc_tools \
             (pip install -r tests/python/requirements.txt, or set KESTREL_PYTHON)"
        );
        return;
    }
    let server = common::start_server(kestrel_engine::EngineConfig::default());
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/kestrel_client_test.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(server.addr.to_string())
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
