//! The engine guarantees on the second real model, Gemma 3 270M Q4_K_M
//! (`gemma3-270m`, fetched and hash-checked like the default model): a
//! request batched with others equals the request alone, blocking equals
//! pipelined decoding, and constrained output follows its constraint.

mod common;

use common::{rt, stream_all};

use std::time::Duration;

use kestrel_engine::{
    Constraint, Engine, EngineConfig, FinishReason, GenerateRequest, ModelSource, PipelineMode,
    PrefillPolicy, SamplingOptions,
};

fn engine(mode: PipelineMode) -> Engine {
    Engine::start(
        EngineConfig {
            model: ModelSource::Path("gemma3-270m".into()),
            threads: 2,
            mode,
            prefill_policy: PrefillPolicy::RideAlong,
            max_batch_size: 8,
            kv_pages: 256,
            max_seq_len: Some(512),
            ..EngineConfig::default()
        },
        |_| {},
    )
    .expect("the Gemma 3 engine starts")
}

fn requests() -> Vec<GenerateRequest> {
    let mut reqs = vec![
        GenerateRequest::text("The capital of France is", 12),
        GenerateRequest::text("Once upon a time", 12),
        GenerateRequest {
            sampling: SamplingOptions {
                temperature: Some(0.8),
                seed: Some(42),
                ..SamplingOptions::default()
            },
            ..GenerateRequest::text("My favourite animal is", 12)
        },
        GenerateRequest {
            sampling: SamplingOptions {
                repetition_penalty: Some(1.2),
                ..SamplingOptions::default()
            },
            ..GenerateRequest::text("one two three four", 12)
        },
        GenerateRequest {
            constraint: Some(Constraint::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
                "additionalProperties": false
            }))),
            ..GenerateRequest::text("A city as JSON:", 32)
        },
    ];
    for (i, r) in reqs.iter_mut().enumerate() {
        r.request_id = Some(format!("gemma-{i}"));
    }
    reqs
}

#[test]
fn gemma3_batched_alone_blocking_and_pipelined_agree() {
    let reqs = requests();
    let mut runs = Vec::new();
    for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
        let engine = engine(mode);
        rt().block_on(async {
            let batched = stream_all(&engine, &reqs).await;
            // The first request alone must equal itself in the batch.
            let alone = engine.generate(reqs[0].clone()).await.expect("alone");
            assert_eq!(
                alone.token_ids, batched[0].token_ids,
                "{mode:?}: batched != alone"
            );
            let json = &batched[4];
            assert_eq!(json.finish_reason, FinishReason::Stop, "{json:?}");
            let v: serde_json::Value = serde_json::from_str(&json.text).expect("valid JSON");
            assert!(v["city"].is_string(), "{v}");
            runs.push(batched);
            engine.shutdown(Duration::from_secs(1)).await;
        });
    }
    for (i, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        assert_eq!(
            a.token_ids, b.token_ids,
            "request {i}: blocking != pipelined"
        );
        assert_eq!(a.text, b.text, "request {i}");
    }
}
