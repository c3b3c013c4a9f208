//! Locating the CUDA shared libraries at run time.
//!
//! cudarc opens `libcuda`, `libnvrtc` and `libcublas` by name on first use
//! and panics when they are missing, so every entry point of this crate asks
//! here first and turns absence into a [`CudaError`]. Libraries outside the
//! loader's search path (the PyPI wheels' `nvidia/cu13/lib`) are preloaded by
//! absolute path from `KESTREL_NVRTC_LIB` (a file or a directory) and
//! `KESTREL_CUDA_LIB_DIR`; glibc's `dlopen` then resolves cudarc's by-name
//! lookup to the already-loaded object through its soname. Preloaded
//! handles live for the whole process (the libraries are never unloaded).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::CudaError;

/// `KESTREL_NVRTC_LIB`: `libnvrtc.so.13` itself or the directory holding it.
pub const ENV_NVRTC_LIB: &str = "KESTREL_NVRTC_LIB";
/// `KESTREL_CUDA_LIB_DIR`: a directory with any of libnvrtc / libcublas / libcublasLt.
pub const ENV_CUDA_LIB_DIR: &str = "KESTREL_CUDA_LIB_DIR";

/// File names preloaded from a directory, in dependency order: NVRTC opens
/// its builtins by name, cuBLAS needs cuBLASLt.
const DIR_LIBS: &[&str] = &[
    "libnvrtc-builtins.so.13.0",
    "libnvrtc.so.13",
    "libcublasLt.so.13",
    "libcublas.so.13",
];

static PRELOADED: OnceLock<Mutex<Vec<libloading::Library>>> = OnceLock::new();

fn load(var: &'static str, path: &Path) -> Result<(), CudaError> {
    // SAFETY: these are NVIDIA's CUDA libraries, whose initializers have no
    // preconditions; the handle is kept for the life of the process, so no
    // symbol resolved through it (by cudarc) can outlive the mapping.
    let lib =
        unsafe { libloading::Library::new(path) }.map_err(|source| CudaError::LibraryLoad {
            var,
            path: path.display().to_string(),
            source,
        })?;
    let held = PRELOADED.get_or_init(|| Mutex::new(Vec::new()));
    held.lock().unwrap_or_else(|p| p.into_inner()).push(lib);
    Ok(())
}

fn preload_dir(var: &'static str, dir: &Path) -> Result<usize, CudaError> {
    let mut n = 0;
    for name in DIR_LIBS {
        let p = dir.join(name);
        if p.is_file() {
            load(var, &p)?;
            n += 1;
        }
    }
    Ok(n)
}

/// Preload the libraries named by the environment (once per process; later
/// calls return the first outcome).
pub fn preload_from_env() -> Result<(), CudaError> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    let r = DONE.get_or_init(|| {
        let run = || -> Result<(), CudaError> {
            if let Some(v) = std::env::var_os(ENV_NVRTC_LIB) {
                let p = PathBuf::from(v);
                if p.is_dir() {
                    preload_dir(ENV_NVRTC_LIB, &p)?;
                } else {
                    if let Some(dir) = p.parent() {
                        let builtins = dir.join(DIR_LIBS[0]);
                        if builtins.is_file() {
                            load(ENV_NVRTC_LIB, &builtins)?;
                        }
                    }
                    load(ENV_NVRTC_LIB, &p)?;
                }
            }
            if let Some(v) = std::env::var_os(ENV_CUDA_LIB_DIR) {
                preload_dir(ENV_CUDA_LIB_DIR, Path::new(&v))?;
            }
            Ok(())
        };
        run().map_err(|e| {
            let mut msg = e.to_string();
            if let Some(s) = std::error::Error::source(&e) {
                msg.push_str(&format!(": {s}"));
            }
            msg
        })
    });
    r.clone().map_err(|msg| CudaError::LibraryMissing {
        what: "preloaded",
        searched: msg,
        hint: "KESTREL_NVRTC_LIB / KESTREL_CUDA_LIB_DIR",
    })
}

fn candidates(name: &str) -> String {
    cudarc::get_lib_name_candidates(name).join(", ")
}

/// NVRTC can be called without panicking.
pub fn nvrtc_available() -> Result<(), CudaError> {
    preload_from_env()?;
    // SAFETY: `is_culib_present` only tries `dlopen` on candidate names and
    // closes what it opened; it calls no NVRTC function.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            what: "NVRTC",
            searched: candidates("nvrtc"),
            hint: ENV_NVRTC_LIB,
        })
    }
}

/// The driver (`libcuda`) can be called without panicking.
pub fn driver_available() -> Result<(), CudaError> {
    preload_from_env()?;
    // SAFETY: as in `nvrtc_available`: a dlopen probe, no driver call.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            what: "driver",
            searched: candidates("cuda"),
            hint: "LD_LIBRARY_PATH (install the NVIDIA driver)",
        })
    }
}

/// cuBLAS can be called without panicking.
pub fn cublas_available() -> Result<(), CudaError> {
    preload_from_env()?;
    // SAFETY: as in `nvrtc_available`: a dlopen probe, no cuBLAS call.
    if unsafe {
        cudarc::cublas::sys::is_culib_present() && cudarc::cublaslt::sys::is_culib_present()
    } {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            what: "cuBLAS",
            searched: candidates("cublas"),
            hint: ENV_CUDA_LIB_DIR,
        })
    }
}
