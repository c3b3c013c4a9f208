//! A Phi checkpoint served end to end: the engine loads the tiny HF `phi`
//! directory `scripts/reference/phi_fixtures.py` writes, takes the
//! fixture's prompt as text, and its greedy tokens equal the f32 NumPy
//! Phi's, alone and batched with the BF16 case's request (both pipeline
//! modes; exact numerics). Skipped, saying so, without the Python side
//! unless `KESTREL_REQUIRE_PYTHON` is set (CI).

mod common;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use std::path::Path;
use std::time::Duration;

use common::{rt, stream_all};
use kestrel_engine::{
    Engine, EngineConfig, GenerateRequest, ModelSource, Numerics, PipelineMode, PrefillPolicy,
};

fn fixture(dir: &Path, name: &str) -> (String, Vec<u32>) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap())
            .unwrap();
    let tokens = v["steps"].as_array().unwrap();
    let tokens = tokens.iter().map(|s| s["token"].as_u64().unwrap() as u32);
    (v["prompt"].as_str().unwrap().into(), tokens.collect())
}

#[test]
fn phi_served_greedy_matches_numpy_reference() {
    let Some(dir) =
        reference_python::fixture_script("phi_fixtures.py", "engine phi", "engine-phi", &[])
    else {
        return;
    };
    for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
        let engine = Engine::start(
            EngineConfig {
                model: ModelSource::Path(dir.join("phi")),
                threads: 2,
                mode,
                prefill_policy: PrefillPolicy::RideAlong,
                numerics: Numerics::Exact,
                kv_pages: 64,
                page_size: 4,
                max_seq_len: Some(128),
                ..EngineConfig::default()
            },
            |_| {},
        )
        .expect("the Phi engine starts");
        let (prompt, want) = fixture(&dir, "phi");
        let n = want.len() as u32;
        rt().block_on(async {
            let alone = engine
                .generate(GenerateRequest::text(prompt.clone(), n))
                .await
                .expect("alone");
            assert_eq!(alone.token_ids, want, "{mode:?}: alone vs NumPy");
            // Batched with another prompt (a prefix of it, so other rows and
            // lengths ride along in the same steps).
            let other = prompt.split(' ').take(5).collect::<Vec<_>>().join(" ");
            let reqs = [
                GenerateRequest::text(other, n),
                GenerateRequest::text(prompt.clone(), n),
            ];
            let batched = stream_all(&engine, &reqs).await;
            assert_eq!(batched[1].token_ids, want, "{mode:?}: batched vs NumPy");
            engine.shutdown(Duration::from_secs(1)).await;
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
}
