//! NVRTC compilation of the embedded kernels, with a PTX cache keyed by hash.
//!
//! The key is a SHA-256 over the NVRTC version, the target architecture, the
//! options and the full source text, so a changed kernel, flag or compiler
//! can never reuse stale PTX. The cache is a directory of `<key>.ptx` files
//! (default `<kestrel cache>/ptx`), written atomically (temp file + rename);
//! an unreadable or unwritable cache only costs a recompile. Compiling all
//! kernels takes NVRTC about a second per architecture; a hit costs a read.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::kernels::{KernelSource, SOURCES};
use crate::libs;
use crate::CudaError;

/// `KESTREL_CUDA_INCLUDE`: an optional `-I` directory for NVRTC (the kernels
/// need no header, but a build that adds one can point here).
pub const ENV_CUDA_INCLUDE: &str = "KESTREL_CUDA_INCLUDE";

/// A compile target: a virtual architecture, `compute_XY` for PTX.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
}

impl Arch {
    pub const SM80: Arch = Arch { major: 8, minor: 0 };
    pub const SM90: Arch = Arch { major: 9, minor: 0 };

    /// `sm_XY`, as NVIDIA names architectures.
    pub fn name(&self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }

    /// The PTX target (`compute_XY`): PTX is JIT-compiled by the driver, so
    /// it also runs on newer devices.
    pub fn nvrtc_flag(&self) -> String {
        format!("--gpu-architecture=compute_{}{}", self.major, self.minor)
    }
}

/// One compiled kernel file.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    pub source: KernelSource,
    pub ptx: String,
    /// Whether the PTX came from the cache.
    pub cached: bool,
}

/// NVRTC options shared by every kernel. No fast-math: `expf`/`logf`/
/// divisions stay IEEE so results track the CPU runtime.
fn options(arch: Arch) -> Vec<String> {
    let mut o = vec![
        arch.nvrtc_flag(),
        "--std=c++17".to_owned(),
        "--fmad=true".to_owned(),
        "-default-device".to_owned(),
    ];
    if let Some(inc) = std::env::var_os(ENV_CUDA_INCLUDE) {
        o.push(format!("--include-path={}", Path::new(&inc).display()));
    }
    o
}

/// The NVRTC version (`major`, `minor`); requires [`libs::nvrtc_available`].
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    libs::nvrtc_available()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (checked above); nvrtcVersion writes two ints
    // through valid pointers to locals and has no other preconditions.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Compile {
            kernel: "nvrtcVersion",
            arch: String::new(),
            log: format!("{r:?}"),
        });
    }
    Ok((major, minor))
}

/// The cache key of `source` for `arch` under NVRTC `version`.
pub fn cache_key(source: &str, arch: Arch, opts: &[String], version: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(format!("nvrtc {}.{}\n", version.0, version.1));
    h.update(arch.name());
    for o in opts {
        h.update(b"\0");
        h.update(o.as_bytes());
    }
    h.update(b"\0\0");
    h.update(source.as_bytes());
    h.finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>()
}

/// Default cache directory: `<kestrel cache dir>/ptx`, or none if the
/// cache dir cannot be determined (then nothing is cached).
pub fn default_cache_dir() -> Option<PathBuf> {
    kestrel_model::fetch::cache_dir()
        .ok()
        .map(|d| d.join("ptx"))
}

/// Compile one kernel file to PTX for `arch` (no cache).
pub fn compile_ptx(k: &KernelSource, arch: Arch) -> Result<String, CudaError> {
    libs::nvrtc_available()?;
    let opts = cudarc::nvrtc::CompileOptions {
        options: options(arch),
        name: Some(k.file.to_owned()),
        ..Default::default()
    };
    match cudarc::nvrtc::compile_ptx_with_opts(k.full_source(), opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(e) => Err(CudaError::Compile {
            kernel: k.file,
            arch: arch.name(),
            log: match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    log.to_string_lossy().into_owned()
                }
                other => format!("{other:?}"),
            },
        }),
    }
}

fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        std::process::id()
    ));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// Compile every kernel for `arch`, reading and filling `cache` when given.
pub fn compile_all(arch: Arch, cache: Option<&Path>) -> Result<Vec<CompiledKernel>, CudaError> {
    let version = nvrtc_version()?;
    let opts = options(arch);
    let mut out = Vec::with_capacity(SOURCES.len());
    for k in SOURCES {
        let full = k.full_source();
        let key = cache_key(&full, arch, &opts, version);
        let path = cache.map(|d| d.join(format!("{key}.ptx")));
        if let Some(p) = &path {
            if let Ok(ptx) = std::fs::read_to_string(p) {
                out.push(CompiledKernel {
                    source: *k,
                    ptx,
                    cached: true,
                });
                continue;
            }
        }
        let ptx = compile_ptx(k, arch)?;
        if let Some(p) = &path {
            if let Err(e) = write_atomic(p, &ptx) {
                tracing::warn!(path = %p.display(), error = %e, "could not cache PTX");
            }
        }
        out.push(CompiledKernel {
            source: *k,
            ptx,
            cached: false,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_changes_with_every_input() {
        let o = vec!["a".to_owned()];
        let base = cache_key("src", Arch::SM80, &o, (13, 0));
        assert_eq!(base.len(), 64);
        assert_eq!(base, cache_key("src", Arch::SM80, &o, (13, 0)));
        assert_ne!(base, cache_key("src2", Arch::SM80, &o, (13, 0)));
        assert_ne!(base, cache_key("src", Arch::SM90, &o, (13, 0)));
        assert_ne!(
            base,
            cache_key("src", Arch::SM80, &["b".to_owned()], (13, 0))
        );
        assert_ne!(base, cache_key("src", Arch::SM80, &o, (13, 1)));
    }

    #[test]
    fn arch_names() {
        assert_eq!(Arch::SM90.name(), "sm_90");
        assert_eq!(Arch::SM80.nvrtc_flag(), "--gpu-architecture=compute_80");
    }
}
