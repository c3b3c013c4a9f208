//! Kestrel replicas behind a real router: runs
//! `tests/python/replicas_test.py`, which starts three `kestrel serve`
//! processes (this crate's binary) and the `smg` gateway (PyPI `smg`, in
//! `tests/python/requirements.txt`) on loopback ports and drives 90
//! requests through it with the `openai` client: all succeed, cache_aware
//! routing beats round_robin on prefix-cache hit rate, and a SIGKILLed and
//! a SIGTERM-drained replica cost no request.
//!
//! Uses `$KESTREL_PYTHON` (default `python3`); skips, saying so, when it
//! lacks `openai` or `smg`, except with `KESTREL_REQUIRE_PYTHON` (CI),
//! where it fails. The script and its processes share one process group,
//! which is killed if the run overruns [`LIMIT`].

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Far above the few minutes a run takes on two cores; a run past it is a hang.
const LIMIT: Duration = Duration::from_secs(600);

/// The interpreter, if it has `openai` and the `smg` router next to it.
fn python() -> Option<String> {
    let python = std::env::var("KESTREL_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = "import openai, smg, os, shutil, sys; \
                 assert shutil.which('smg') or os.path.exists(os.path.join(os.path.dirname(sys.executable), 'smg'))";
    let ok = Command::new(&python)
        .args(["-c", probe])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    assert!(
        std::env::var_os("KESTREL_REQUIRE_PYTHON").is_none(),
        "KESTREL_REQUIRE_PYTHON is set but {python} lacks openai or the smg router \
         (pip install -r tests/python/requirements.txt)"
    );
    eprintln!(
        "SKIPPED replicas_behind_smg: {python} lacks openai or smg \
         (pip install -r tests/python/requirements.txt, or set KESTREL_PYTHON)"
    );
    None
}

#[test]
fn replicas_behind_smg() {
    let Some(python) = python() else {
        return;
    };
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/replicas_test.py");
    let work = std::env::temp_dir().join(format!("kestrel-replicas-{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("create the log directory");
    let out_path = work.join("script.out");
    let out = std::fs::File::create(&out_path).expect("create the output file");
    let started = Instant::now();
    let mut child = Command::new(&python)
        .arg(&script)
        .arg(env!("CARGO_BIN_EXE_kestrel"))
        .arg(&work)
        .stdout(out.try_clone().expect("clone the output file"))
        .stderr(out)
        .stdin(Stdio::null())
        // Its own group, so a timeout can stop the script and every
        // replica and router it started at once.
        .process_group(0)
        .spawn()
        .expect("start the replicas script");
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll the script") {
            break Some(status);
        }
        if started.elapsed() > LIMIT {
            let group = format!("-{}", child.id());
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let output = std::fs::read_to_string(&out_path).unwrap_or_default();
    eprintln!("{output}");
    eprintln!("replicas test took {:.0?}", started.elapsed());
    let Some(status) = status else {
        panic!(
            "the replicas script ran past {LIMIT:?} (killed); logs in {}",
            work.display()
        );
    };
    assert!(
        status.success() && output.lines().any(|l| l.starts_with("ok: ")),
        "the replicas script failed ({status}); logs in {}",
        work.display()
    );
    let _ = std::fs::remove_dir_all(&work);
}
