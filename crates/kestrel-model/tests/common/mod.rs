//! Helpers the reference tests share: finding a Python with numpy and gguf.

#[path = "../../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

/// The Python to run (`$KESTREL_PYTHON`, default `python3`), or `None`
/// (skip, saying so) when it cannot import numpy and gguf; a hard failure
/// instead when `KESTREL_REQUIRE_PYTHON` is set (CI).
pub fn python(test: &str) -> Option<String> {
    reference_python::python_with(test, "numpy, gguf", "scripts/reference/requirements.txt")
}
