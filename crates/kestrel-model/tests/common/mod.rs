//! Helpers the reference tests share: finding a Python with numpy and gguf.

use std::process::Command;

/// The Python to run (`$KESTREL_PYTHON`, default `python3`), or `None`
/// (skip, saying so) when it cannot import numpy and gguf; a hard failure
/// instead when `KESTREL_REQUIRE_PYTHON` is set (CI).
pub fn python(test: &str) -> Option<String> {
    let python = std::env::var("KESTREL_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import numpy, gguf"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    assert!(
        std::env::var_os("KESTREL_REQUIRE_PYTHON").is_none(),
        "KESTREL_REQUIRE_PYTHON is set but {python} cannot import numpy and gguf \
         (pip install -r scripts/reference/requirements.txt)"
    );
    eprintln!(
        "SKIPPED {test}: {python} cannot import numpy and gguf \
         (pip install -r scripts/reference/requirements.txt, or set KESTREL_PYTHON)"
    );
    None
}
