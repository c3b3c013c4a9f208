//! Which ISAs a kernel test ran and which it skipped, for the tests (unit
//! and integration) that compare every ISA's kernels with the scalar
//! definition: each prints its line, and [`REQUIRE_ENV`] (a comma list of
//! [`NAMES`], e.g. `avx2,avx512`) turns a skip of one listed into a failure,
//! so a CI machine that should run the AVX-512 kernels cannot pass by
//! skipping them. Costs nothing unless a test calls it.

use super::Isa;

/// The environment variable listing ISAs (and kernel features) whose tests
/// must not be skipped: `KESTREL_REQUIRE_ISA=avx2,avx512`.
pub const REQUIRE_ENV: &str = "KESTREL_REQUIRE_ISA";

/// The names [`REQUIRE_ENV`] takes: the [`Isa`] ladder as [`Isa::ENV`]
/// spells it, and the features some kernels need beyond it (AVX-512 VNNI,
/// GFNI).
pub const NAMES: [&str; 7] = [
    "scalar",
    "avx2",
    "avxvnni",
    "avx512",
    "amx",
    "avx512vnni",
    "gfni",
];

/// `isa` as [`Isa::ENV`] and [`REQUIRE_ENV`] spell it.
pub fn isa_name(isa: Isa) -> &'static str {
    match isa {
        Isa::Scalar => "scalar",
        Isa::Avx2 => "avx2",
        Isa::AvxVnni => "avxvnni",
        Isa::Avx512 => "avx512",
        Isa::Amx => "amx",
    }
}

/// The names [`REQUIRE_ENV`] lists (empty when unset).
///
/// # Panics
/// If it lists a name not in [`NAMES`] (a typo would otherwise require
/// nothing).
pub fn required() -> Vec<String> {
    let Ok(list) = std::env::var(REQUIRE_ENV) else {
        return Vec::new();
    };
    let names: Vec<String> = list
        .split(',')
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .collect();
    for n in &names {
        assert!(
            NAMES.contains(&n.as_str()),
            "{REQUIRE_ENV}={list:?} names {n:?}, not one of {NAMES:?}"
        );
    }
    names
}

/// Prints which of `paths` (a name from [`NAMES`] and whether this CPU runs
/// it) `test` ran and which it skipped.
///
/// # Panics
/// If a skipped one is listed in [`REQUIRE_ENV`].
pub fn report(test: &str, paths: &[(&str, bool)]) {
    check(test, paths, &required());
}

/// [`report`] against the `required` names.
fn check(test: &str, paths: &[(&str, bool)], required: &[String]) {
    let ran: Vec<&str> = paths.iter().filter(|p| p.1).map(|p| p.0).collect();
    let skipped: Vec<&str> = paths.iter().filter(|p| !p.1).map(|p| p.0).collect();
    eprintln!("{test}: ran {ran:?}; skipped {skipped:?} (this CPU lacks them)");
    let missing: Vec<&str> = skipped
        .into_iter()
        .filter(|s| required.iter().any(|r| r == s))
        .collect();
    assert!(
        missing.is_empty(),
        "{test}: {REQUIRE_ENV} requires {missing:?}, which this CPU lacks"
    );
}

/// Of `wanted`, the ISAs this CPU supports, after [`report`]ing which ran
/// and which were skipped.
///
/// # Panics
/// As [`report`].
pub fn tested_isas(test: &str, wanted: &[Isa]) -> Vec<Isa> {
    let paths: Vec<(&str, bool)> = wanted
        .iter()
        .map(|&i| (isa_name(i), i.is_supported()))
        .collect();
    report(test, &paths);
    wanted
        .iter()
        .copied()
        .filter(|i| i.is_supported())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_isa_has_a_name_the_env_parsers_take() {
        for isa in [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512, Isa::Amx] {
            let name = isa_name(isa);
            assert!(NAMES.contains(&name));
            // The forcing variable reads the same spelling back (on a CPU
            // that may lack `isa`, refused but not as an unknown name).
            assert!(!matches!(
                Isa::resolve(name, Isa::Amx),
                Err(super::super::IsaRequestError::Unknown { .. })
            ));
        }
    }

    #[test]
    fn a_skip_fails_only_where_required() {
        let paths = [("scalar", true), ("avx2", true), ("amx", false)];
        check("coverage", &paths, &[]);
        check("coverage", &paths, &["avx2".into(), "gfni".into()]);
        let required = ["avx2".to_string(), "amx".to_string()];
        let refused = std::panic::catch_unwind(|| check("coverage", &paths, &required));
        assert!(refused.is_err(), "a required ISA was skipped silently");
    }
}
