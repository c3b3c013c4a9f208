//! `KESTREL_ISA` as a process sees it. The variable is read once per
//! process, so each case runs this test binary again as a child with the
//! variable set; the child (`probe`) reports what `Isa::try_detect` and
//! `CpuModel::new` made of it on one line, and the parent checks the line.

use std::process::Command;

use kestrel_cpu::kernels::coverage::{isa_name, tested_isas};
use kestrel_cpu::synth::{config, random_model};
use kestrel_cpu::{CpuModel, CpuModelOptions, Isa};
use kestrel_model::{DType, RopeStyle};

/// Set in the child only; the probe does nothing without it.
const PROBE: &str = "KESTREL_ISA_TEST_PROBE";

#[test]
fn probe() {
    if std::env::var_os(PROBE).is_none() {
        return;
    }
    let cfg = config(64, 64, 128, 1, 2, 1, RopeStyle::Interleaved);
    let weights = random_model(&cfg, DType::Q4_1, DType::Q8_0, 1);
    let model = CpuModel::new(weights, CpuModelOptions::default());
    println!(
        "PROBE detect={:?} try_detect={:?} model={:?}",
        Isa::detect(),
        Isa::try_detect().map_err(|e| e.to_string()),
        model.map(|m| m.isa()).map_err(|e| e.to_string()),
    );
}

/// The probe's line with `KESTREL_ISA` set to `value`.
fn run_probe(value: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "probe", "--nocapture", "--test-threads=1"])
        .env(PROBE, "1")
        .env(Isa::ENV, value)
        .output()
        .unwrap();
    assert!(out.status.success(), "child failed: {out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    // libtest prints `test probe ... ` on the same line first.
    stdout
        .lines()
        .find_map(|l| l.find("PROBE ").map(|i| l[i..].to_owned()))
        .unwrap_or_else(|| panic!("no probe line in {stdout}"))
}

#[test]
fn forced_scalar_is_used_everywhere() {
    assert_eq!(
        run_probe("scalar"),
        "PROBE detect=Scalar try_detect=Ok(Scalar) model=Ok(Scalar)"
    );
}

#[test]
fn forced_avx2_and_avx_vnni_are_used_where_the_cpu_has_them() {
    for isa in tested_isas("forced ISAs", &[Isa::Avx2, Isa::AvxVnni]) {
        let value = isa_name(isa);
        assert_eq!(
            run_probe(value),
            format!("PROBE detect={isa:?} try_detect=Ok({isa:?}) model=Ok({isa:?})")
        );
    }
}

#[test]
fn an_isa_the_cpu_lacks_is_refused_by_the_model_and_warned_about_elsewhere() {
    // AVX-VNNI is not on the ladder's line (an AVX-512 CPU may lack it):
    // it can be the best, but is not the one asked for here.
    let ladder = [Isa::Amx, Isa::Avx512, Isa::AvxVnni, Isa::Avx2, Isa::Scalar];
    let lacking = ladder
        .into_iter()
        .rev()
        .find(|&i| i != Isa::AvxVnni && !i.is_supported());
    let Some(lacking) = lacking else {
        eprintln!("skipped: this CPU supports every ISA");
        return;
    };
    let best = format!(
        "{:?}",
        ladder.into_iter().find(|i| i.is_supported()).unwrap()
    );
    let value = format!("{lacking:?}").to_lowercase();
    let line = run_probe(&value);
    let want_err =
        format!("KESTREL_ISA asks for {lacking:?}, but this CPU supports at most {best}");
    assert_eq!(
        line,
        format!("PROBE detect={best} try_detect=Err({want_err:?}) model=Err({want_err:?})")
    );
}

#[test]
fn an_unknown_name_is_refused() {
    let line = run_probe("sse9");
    assert!(
        line.contains(
            r#"model=Err("KESTREL_ISA=\"sse9\" names no ISA (scalar, avx2, avxvnni, avx512, amx)")"#
        ),
        "{line}"
    );
}
