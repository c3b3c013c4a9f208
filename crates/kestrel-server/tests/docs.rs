//! `docs/deploy.md`'s shell blocks run as written: each ```` ```sh ````
//! block goes through `bash -eu` with `kestrel` on `PATH` being the real
//! binary with `--help` appended (so every argument the page writes is
//! parsed by clap, and nothing is served) and stubs for the other programs
//! it names (`smg`). A misspelled flag, a bad value or a line continuation
//! broken by a comment fails the test; so does a block that stops calling
//! `kestrel`.

use std::path::Path;
use std::process::Command;

/// The bodies of the page's ```` ```sh ```` blocks.
fn sh_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```sh") => current = Some(String::new()),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some(body), _) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(current.is_none(), "an unclosed ```sh block");
    blocks
}

fn write_script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Runs one block; `Err` says why it failed. Returns the `kestrel` calls.
fn run_block(block: &str, dir: &Path) -> Result<Vec<String>, String> {
    let calls = dir.join("calls");
    let failed = dir.join("failed");
    let _ = std::fs::remove_file(&calls);
    let _ = std::fs::remove_file(&failed);
    let out = Command::new("bash")
        .args(["-eu", "-c", &format!("{block}\nwait\n")])
        .env(
            "PATH",
            format!("{}:{}", dir.display(), std::env::var("PATH").unwrap()),
        )
        .env("KESTREL_BIN", env!("CARGO_BIN_EXE_kestrel"))
        .env("DOCS_DIR", dir)
        .output()
        .expect("bash runs");
    // Background calls (`... &`) report through the file, not the status.
    if let Ok(why) = std::fs::read_to_string(&failed) {
        return Err(why);
    }
    if !out.status.success() {
        return Err(format!(
            "bash exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(std::fs::read_to_string(&calls)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect())
}

fn stub_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kestrel-docs-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_script(
        &dir.join("kestrel"),
        r#"echo "$*" >> "$DOCS_DIR/calls"
if ! "$KESTREL_BIN" "$@" --help > /dev/null 2> "$DOCS_DIR/err.$$"; then
  { echo "kestrel $*:"; cat "$DOCS_DIR/err.$$"; } >> "$DOCS_DIR/failed"
  exit 1
fi"#,
    );
    write_script(&dir.join("smg"), "exit 0");
    dir
}

#[test]
fn deploy_md_shell_blocks_run_as_written() {
    let page = include_str!("../../../docs/deploy.md");
    let blocks = sh_blocks(page);
    assert!(blocks.len() >= 2, "deploy.md has its sh blocks");
    let dir = stub_dir("deploy");
    for block in &blocks {
        let calls = run_block(block, &dir).unwrap_or_else(|why| panic!("{block}\n-> {why}"));
        let written = block.matches("kestrel serve").count();
        assert!(
            calls.iter().filter(|c| c.starts_with("serve ")).count() >= written,
            "{block}\n-> only {calls:?} ran"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The check itself fails on what it is for: a comment after a line
/// continuation (the page's old form), and a misspelled flag.
#[test]
fn a_broken_block_fails_the_check() {
    let dir = stub_dir("broken");
    let broken = [
        "kestrel serve --model smollm2-135m \\\n  --http-addr 0.0.0.0:8000 \\   # the API\n  --drain-timeout 25\n",
        "kestrel serve --http-adr 0.0.0.0:8000\n",
        "for i in 0 1; do\n  kestrel serve --drain-timeout soon &\ndone\n",
    ];
    for block in broken {
        assert!(run_block(block, &dir).is_err(), "{block} passed");
    }
    assert_eq!(
        run_block("kestrel serve --drain-timeout 25\n", &dir).unwrap(),
        ["serve --drain-timeout 25"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
