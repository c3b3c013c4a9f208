//! Legacy completions: prompt lists with logprobs and streaming, token-id
//! prompts answered as their text is, and `echo` (unary, streamed, and
//! with the prompt's logprobs first).

use crate::common::http::{post, SseStream};
use crate::common::openai::{complete, completion_body, ids, model_id, stream_content, tokenize};
use crate::common::shared_server;
use serde_json::{json, Value};

#[tokio::test]
async fn completions_prompt_list_logprobs_and_stream() {
    let addr = shared_server().http_addr;
    let body = json!({
        "model": model_id(),
        "prompt": ["The capital of France is", "Water boils at"],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
    });
    let r = post(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut texts = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let lp = &c["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        assert!(!tokens.is_empty() && tokens.len() <= 6);
        assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), tokens.len());
        assert!(lp["top_logprobs"][0].as_object().unwrap().len() <= 2);
        assert_eq!(lp["text_offset"][0], 0);
        texts.push(c["text"].as_str().unwrap().to_string());
    }

    let mut sbody = body;
    sbody["stream"] = json!(true);
    let chunks = SseStream::open(addr, "/v1/completions", &sbody)
        .await
        .collect()
        .await;
    let (text, finish, usage) = stream_content(&chunks);
    assert_eq!(text, texts);
    assert!(finish.iter().all(Option::is_some));
    assert!(usage.is_none(), "no usage chunk unless asked");
}

#[tokio::test]
async fn token_id_prompts_answer_as_their_text_does() {
    let addr = shared_server().http_addr;
    let (a, b) = ("The capital of France is", "Once upon a time");
    let (ta, tb) = (
        ids(&tokenize(json!({"prompt": a})).await),
        ids(&tokenize(json!({"prompt": b})).await),
    );
    let text = complete(&completion_body(json!([a, b]), 8)).await;
    let one = complete(&completion_body(json!(ta), 8)).await;
    assert_eq!(one["choices"][0]["text"], text["choices"][0]["text"]);
    assert_eq!(one["usage"]["prompt_tokens"], ta.len());
    let both = complete(&completion_body(json!([ta, tb]), 8)).await;
    assert_eq!(both["choices"], text["choices"]);
    assert_eq!(both["usage"], text["usage"]);

    let vocab = shared_server().engine.model_info().vocab_size;
    let r = post(
        addr,
        "/v1/completions",
        &completion_body(json!([1, vocab, 2]), 4),
    )
    .await;
    let v = r.json();
    assert_eq!(r.status, 400, "{v}");
    assert_eq!(v["error"]["param"], "prompt");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("token 1"),
        "{v}"
    );
}

#[tokio::test]
async fn echo_puts_the_prompt_first_unary_and_streamed() {
    let addr = shared_server().http_addr;
    let prompt = "Roses are red, violets are";
    let plain = complete(&completion_body(json!(prompt), 6)).await;
    let generated = plain["choices"][0]["text"].as_str().unwrap();
    assert!(!generated.is_empty());
    let mut body = completion_body(json!(prompt), 6);
    body["echo"] = json!(true);
    let v = complete(&body).await;
    assert_eq!(v["choices"][0]["text"], format!("{prompt}{generated}"));
    assert_eq!(v["usage"], plain["usage"]);

    // Token ids echo as their text.
    let tokens = ids(&tokenize(json!({"prompt": prompt, "add_special_tokens": false})).await);
    body["prompt"] = json!(tokens);
    let v = complete(&body).await;
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(prompt),
        "{v}"
    );

    // Streamed: the echo is each choice's first chunk.
    let mut sbody = completion_body(json!([prompt, "Twinkle twinkle"]), 6);
    sbody["echo"] = json!(true);
    sbody["n"] = json!(2);
    let unary = complete(&sbody).await;
    sbody["stream"] = json!(true);
    let s = SseStream::open(addr, "/v1/completions", &sbody).await;
    assert_eq!(s.status, 200);
    let chunks = s.collect().await;
    let firsts: Vec<&Value> = (0..4)
        .map(|i| {
            chunks
                .iter()
                .flat_map(|c| c["choices"].as_array().unwrap())
                .find(|ch| ch["index"] == i)
                .unwrap()
        })
        .collect();
    for (i, first) in firsts.iter().enumerate() {
        let p = if i < 2 { prompt } else { "Twinkle twinkle" };
        assert_eq!(first["text"], p, "choice {i}'s first chunk is its prompt");
        assert!(first["finish_reason"].is_null());
    }
    let (text, finish, _) = stream_content(&chunks);
    let expect: Vec<String> = unary["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, expect);
    assert!(finish.iter().all(Option::is_some));
}

/// Long enough to fill a KV page (the second request's prefix-cache hit).
const CAPITALS: &str = "The capital of France is Paris. The capital of Germany is Berlin. \
                        The capital of Italy is Rome. The capital of Spain is";

/// `echo` with `logprobs`: the prompt tokens' logprobs come first (the
/// first null), and they line up: a prompt made of a greedy completion's
/// prompt and output scores the output tokens as generation sampled them.
/// The same prompt again (a prefix-cache hit) scores the same, and
/// `max_tokens: 0` scores it without generating.
#[tokio::test]
async fn echo_with_logprobs_scores_the_prompt_first() {
    let engine = &shared_server().engine;
    let prompt = ids(&tokenize(json!({"prompt": CAPITALS})).await);
    let n = 5;
    let mut req = kestrel_engine::GenerateRequest {
        input: kestrel_engine::Prompt::Tokens(prompt.clone()),
        ..kestrel_engine::GenerateRequest::text("", n)
    };
    req.sampling.logprobs = true;
    req.speculate = kestrel_engine::Speculation::Off;
    let gen = engine.generate(req).await.unwrap();
    assert_eq!(gen.token_ids.len(), n as usize);
    let all: Vec<u32> = prompt.iter().chain(&gen.token_ids).copied().collect();

    let mut body = completion_body(json!(all), 1);
    body["echo"] = json!(true);
    body["logprobs"] = json!(2);
    let v = complete(&body).await;
    let again = complete(&body).await;
    let lp = &v["choices"][0]["logprobs"];
    let token_logprobs = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(
        token_logprobs.len(),
        all.len() + 1,
        "prompt tokens + 1 generated"
    );
    assert_eq!(v["usage"]["prompt_tokens"], all.len());
    for key in ["tokens", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), all.len() + 1, "{key}");
    }
    assert!(token_logprobs[0].is_null(), "{lp}");
    assert_eq!(lp["top_logprobs"][0], json!({}));
    for (i, l) in token_logprobs.iter().enumerate().skip(1) {
        let l = l.as_f64().unwrap();
        assert!(l.is_finite() && l <= 0.0, "position {i}: {l}");
        assert!(lp["top_logprobs"][i].as_object().unwrap().len() <= 2);
    }
    let offsets: Vec<u64> = serde_json::from_value(lp["text_offset"].clone()).unwrap();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    let tokens: Vec<String> = serde_json::from_value(lp["tokens"].clone()).unwrap();
    assert_eq!(tokens.concat(), text, "the tokens spell the echoed text");
    for (k, g) in gen.logprobs.iter().enumerate() {
        let scored = token_logprobs[prompt.len() + k].as_f64().unwrap();
        assert!(
            (scored - f64::from(g.logprob)).abs() < 1e-4,
            "generated token {k}: scored {scored}, sampled {}",
            g.logprob
        );
        assert_eq!(tokens[prompt.len() + k], g.text);
    }
    assert_eq!(again["choices"][0]["logprobs"], v["choices"][0]["logprobs"]);
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    // max_tokens 0: the prompt scored and echoed, nothing generated.
    body["max_tokens"] = json!(0);
    let only = complete(&body).await;
    let c = &only["choices"][0];
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(only["usage"]["completion_tokens"], 0);
    assert_eq!(
        c["logprobs"]["token_logprobs"].as_array().unwrap()[..],
        token_logprobs[..all.len()]
    );
    assert_eq!(
        c["text"].as_str().unwrap().len(),
        offsets[all.len()] as usize
    );
    body["max_tokens"] = json!(1);

    // Without echo only the generated token has logprobs.
    body["echo"] = json!(false);
    let plain = complete(&body).await;
    let plain_lps = &plain["choices"][0]["logprobs"]["token_logprobs"];
    assert_eq!(plain_lps.as_array().unwrap().len(), 1);
    assert_eq!(plain_lps[0], token_logprobs[all.len()]);
}
