//! Greedy loops are visible: a request cut by `max_new_tokens` while its
//! output repeats one n-gram counts in `kestrel_requests_length_loop_total`;
//! one cut in ordinary text, or ended by EOS, does not. Real model, greedy.

mod common;

use std::time::Duration;

use common::{counter, rt, start_default};
use kestrel_engine::{EngineConfig, FinishReason, GenerateRequest};

const LOOPS: &str = "kestrel_requests_length_loop_total";

#[test]
fn a_length_cut_loop_is_counted_and_ordinary_text_is_not() {
    let engine = start_default(EngineConfig {
        max_batch_size: 4,
        kv_pages: 64,
        ..Default::default()
    });
    rt().block_on(async {
        assert_eq!(counter(&engine, LOOPS), 0);
        // Ordinary text cut by length: not a loop.
        let r = engine
            .generate(GenerateRequest::text("Once upon a time", 12))
            .await
            .expect("generates");
        assert_eq!(r.finish_reason, FinishReason::Length);
        assert_eq!(counter(&engine, LOOPS), 0, "{:?}", r.text);
        // A list the model continues greedily, one item again and again.
        let looping = GenerateRequest {
            ignore_eos: true,
            ..GenerateRequest::text("0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,", 40)
        };
        let r = engine.generate(looping).await.expect("generates");
        assert_eq!(r.finish_reason, FinishReason::Length);
        assert!(
            kestrel_skills::looping_tail(&r.token_ids).is_some(),
            "{:?}",
            r.text
        );
        assert_eq!(counter(&engine, LOOPS), 1, "{:?}", r.text);
        engine.shutdown(Duration::from_secs(1)).await;
    });
}
