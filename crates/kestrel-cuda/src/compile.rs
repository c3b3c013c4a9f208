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

/// What the device's assembler made of one entry point (`ptxas -v`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryResources {
    pub name: String,
    pub registers: u32,
    /// Local memory per thread (`stack frame`): 0 unless the kernel indexes
    /// a register array dynamically or spills.
    pub stack_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    /// Static shared memory per block.
    pub smem_bytes: u32,
}

/// One kernel file assembled for a real architecture (`sm_XY`).
#[derive(Debug, Clone)]
pub struct Cubin {
    pub image: Vec<u8>,
    /// The assembler's report, one per entry point.
    pub entries: Vec<EntryResources>,
    /// NVRTC's log (ptxas's `-v` report included).
    pub log: String,
}

/// Compile one kernel file to a cubin for `arch` (what the driver would
/// load on that GPU), with ptxas's resource report. CI runs this where no
/// GPU is: the registers, spills and shared memory a device would see at
/// module load are checked here (`tests/nvrtc.rs`).
pub fn compile_cubin(k: &KernelSource, arch: Arch) -> Result<Cubin, CudaError> {
    use cudarc::nvrtc::{result, sys};
    libs::nvrtc_available()?;
    let fail = |log: String| CudaError::Compile {
        kernel: k.file,
        arch: arch.name(),
        log,
    };
    let mut opts = options(arch);
    opts[0] = format!("--gpu-architecture={}", arch.name());
    opts.push("--ptxas-options=-v".to_owned());
    let src = std::ffi::CString::new(k.full_source()).map_err(|e| fail(e.to_string()))?;
    let name = std::ffi::CString::new(k.file).map_err(|e| fail(e.to_string()))?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    // SAFETY: `prog` was created above from `src` and `name`, which outlive
    // it, and is destroyed once, at the end of this block.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog)
            .map(|l| {
                std::ffi::CStr::from_ptr(l.as_ptr())
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        let image = compiled
            .map_err(|e| format!("{e:?}: {log}"))
            .and_then(|()| {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
                let mut image = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
                Ok(image)
            });
        let _ = result::destroy_program(prog);
        image.map(|image| (image, log))
    };
    let (image, log) = out.map_err(fail)?;
    let entries = parse_ptxas_report(&log);
    Ok(Cubin {
        image,
        entries,
        log,
    })
}

/// The per-entry figures of a `ptxas -v` report: for each `Compiling entry
/// function 'NAME'`, its `N bytes stack frame, N bytes spill stores, N bytes
/// spill loads` and `Used N registers, ..., N bytes smem` lines.
pub fn parse_ptxas_report(log: &str) -> Vec<EntryResources> {
    fn before(line: &str, unit: &str) -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    }
    let mut out: Vec<EntryResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_owned();
            out.push(EntryResources {
                name,
                registers: 0,
                stack_bytes: 0,
                spill_store_bytes: 0,
                spill_load_bytes: 0,
                smem_bytes: 0,
            });
            continue;
        }
        let Some(e) = out.last_mut() else { continue };
        if line.contains("stack frame") {
            e.stack_bytes = before(line, " bytes stack frame").unwrap_or(0);
            e.spill_store_bytes = before(line, " bytes spill stores").unwrap_or(0);
            e.spill_load_bytes = before(line, " bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains(" registers") {
            e.registers = before(line, " registers").unwrap_or(0);
            e.smem_bytes = before(line, " bytes smem").unwrap_or(0);
        }
    }
    out
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
    fn the_ptxas_report_is_read_per_entry() {
        let log = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'reset_counts' for 'sm_90'
ptxas info    : Function properties for reset_counts
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
ptxas info    : Compiling entry function 'sample_rows' for 'sm_90'
ptxas info    : Function properties for sample_rows
ptxas         .     24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8704 bytes smem, 488 bytes cmem[0]
";
        let e = parse_ptxas_report(log);
        assert_eq!(
            e,
            [
                EntryResources {
                    name: "reset_counts".into(),
                    registers: 10,
                    stack_bytes: 0,
                    spill_store_bytes: 0,
                    spill_load_bytes: 0,
                    smem_bytes: 0,
                },
                EntryResources {
                    name: "sample_rows".into(),
                    registers: 64,
                    stack_bytes: 24,
                    spill_store_bytes: 20,
                    spill_load_bytes: 16,
                    smem_bytes: 8704,
                },
            ]
        );
    }

    #[test]
    fn arch_names() {
        assert_eq!(Arch::SM90.name(), "sm_90");
        assert_eq!(Arch::SM80.nvrtc_flag(), "--gpu-architecture=compute_80");
    }
}
