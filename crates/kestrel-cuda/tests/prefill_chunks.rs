//! Several query rows per sequence with a cached prefix, through the
//! `Executor` calls the pipeline makes: chunked prefill (`PrefillStart::
//! Resume`, a step whose chunk ends no prompt samples nothing), the
//! re-admission of a preempted sequence (`Executor::preempt`, then a
//! prefill over its prompt and generated tokens whose penalties count the
//! generated ones, KV grown lazily with `grow`), and decode steps that
//! verify drafts (`Drafts`: each row's input token and drafts in one
//! forward, sampled in order, the accepted returned per row).
//!
//! On the host device in every CI run (`HostRuntime`, the tiled
//! `prefill_attention` and `count_tokens` through their references), and
//! on the CPU runtime as the harness's own check. A GPU run of the same is
//! `#[ignore]`d without one.

use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig};
use kestrel_cuda::{CudaRuntime, CudaRuntimeConfig, HostRuntime, StepConfig};
use kestrel_model::{synthetic_weights, DType, ModelConfig, ModelWeights};
use kestrel_pipeline::{
    Drafts, Executor, PrefillInput, PrefillStart, RequestId, SamplingParams, TokenId,
};

/// Each sequence's sampled tokens and their log-probabilities.
type Sampled = Vec<(Vec<TokenId>, Vec<f32>)>;

/// Greedy, with penalties: a re-admission whose counts missed its
/// generated tokens would pick other tokens.
fn params() -> SamplingParams {
    SamplingParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        logprobs: true,
        ..SamplingParams::greedy()
    }
}

fn prompts(vocab: u32) -> Vec<Vec<TokenId>> {
    vec![
        (1..20).map(|t| t * 7 % vocab).collect(),
        (1..5).map(|t| t * 13 % vocab).collect(),
        (1..40).map(|t| t * 3 % vocab).collect(),
    ]
}

/// One prefill of `seqs` (id, prompt, generated tokens at its end), in
/// steps of `chunk` prompt tokens each, as the pipeline drives it: the
/// first step admits, later ones resume where the last chunk ended; each
/// sequence's token is pushed to `out` from the step its chunk ends its
/// prompt. Alternates slots from `*slot`, blocking on each step.
fn prefill<E: Executor<Params = SamplingParams>>(
    e: &mut E,
    slot: &mut usize,
    seqs: &[(RequestId, &[TokenId], usize)],
    chunk: usize,
    out: &mut Sampled,
) where
    E::Error: std::fmt::Debug,
{
    let params = params();
    let mut next: Vec<Option<PrefillStart>> = vec![Some(PrefillStart::Admit); seqs.len()];
    while next.iter().any(Option::is_some) {
        let live: Vec<usize> = (0..seqs.len()).filter(|&i| next[i].is_some()).collect();
        let inputs: Vec<PrefillInput<'_, SamplingParams>> = live
            .iter()
            .map(|&i| PrefillInput {
                id: seqs[i].0,
                prompt: seqs[i].1,
                generated: seqs[i].2,
                generated_values: &[],
                params: &params,
                max_len: seqs[i].1.len() + 64,
                start: next[i].expect("live"),
                max_tokens: chunk,
                embeds: None,
            })
            .collect();
        e.launch_prefill(*slot, &inputs).unwrap();
        // Where each chunk started and whether it ends its prompt.
        let mut sampled = Vec::new();
        for (input, &i) in inputs.iter().zip(&live) {
            let start = match input.start {
                PrefillStart::Resume(s) => s,
                PrefillStart::Admit | PrefillStart::Fork { .. } => e.cached_prompt_tokens(input.id),
            };
            let end = input.chunk_end(start);
            if end == input.prompt.len() {
                sampled.push(i);
                next[i] = None;
            } else {
                next[i] = Some(PrefillStart::Resume(end));
            }
        }
        e.finalize_sampling(*slot, None).unwrap();
        let o = e.wait_step(*slot).unwrap();
        assert_eq!(o.tokens.len(), sampled.len(), "one token per prompt ended");
        let lps = o.logprobs.expect("logprobs");
        for (k, &i) in sampled.iter().enumerate() {
            let r = seqs[i].0 as usize - 1;
            out[r].0.push(o.tokens[k]);
            out[r].1.push(lps[k]);
        }
        *slot = 1 - *slot;
    }
}

/// Every prompt prefilled in chunks of `chunk`, then decoded blocking until
/// each has `steps + 1` tokens; with `preempt_after: Some(k)` sequence 1 is
/// preempted once it has k tokens and re-admitted over its prompt and
/// those tokens.
fn run<E: Executor<Params = SamplingParams>>(
    e: &mut E,
    ps: &[Vec<TokenId>],
    chunk: usize,
    steps: usize,
    preempt_after: Option<usize>,
) -> Sampled
where
    E::Error: std::fmt::Debug,
{
    let ids: Vec<RequestId> = (1..=ps.len() as RequestId).collect();
    let mut out: Sampled = vec![(Vec::new(), Vec::new()); ps.len()];
    let mut slot = 0;
    let all: Vec<(RequestId, &[TokenId], usize)> =
        ids.iter().zip(ps).map(|(&id, p)| (id, &p[..], 0)).collect();
    prefill(e, &mut slot, &all, chunk, &mut out);
    let mut preempted = false;
    loop {
        let live: Vec<usize> = (0..ps.len()).filter(|&i| out[i].0.len() <= steps).collect();
        if live.is_empty() {
            break;
        }
        let rows: Vec<RequestId> = live.iter().map(|&i| ids[i]).collect();
        for &i in &live {
            // The step writes the last sampled token's position.
            assert!(e.grow(ids[i], ps[i].len() + out[i].0.len()), "KV for {i}");
        }
        e.launch_decode(slot, &rows, Drafts::NONE).unwrap();
        e.finalize_sampling(slot, None).unwrap();
        let o = e.wait_step(slot).unwrap();
        let lps = o.logprobs.expect("logprobs");
        for (k, &i) in live.iter().enumerate() {
            out[i].0.push(o.tokens[k]);
            out[i].1.push(lps[k]);
        }
        slot = 1 - slot;
        let k = out[0].0.len();
        if !preempted && preempt_after == Some(k) && k <= steps {
            preempted = true;
            let mut tokens = ps[0].clone();
            tokens.extend(&out[0].0);
            e.preempt(ids[0], &tokens);
            prefill(e, &mut slot, &[(ids[0], &tokens, k)], chunk, &mut out);
        }
    }
    assert!(preempt_after.is_none() || preempted, "the preemption ran");
    for id in ids {
        e.release(id);
    }
    assert_eq!(e.num_allocated(), 0, "a KV row left behind");
    out
}

/// Every prompt prefilled whole, then decoded blocking with drafts until
/// each has `steps + 1` tokens: each step, member `i` proposes the next
/// (up to) 3 tokens of `want[i]` (what it decodes without drafts), the
/// second of them replaced by a wrong token on every third step of member
/// 1 (a rejection mid-row). Returns the tokens, logprobs and the drafts
/// accepted in all.
fn run_drafted<E: Executor<Params = SamplingParams>>(
    e: &mut E,
    ps: &[Vec<TokenId>],
    steps: usize,
    want: &Sampled,
) -> (Sampled, usize)
where
    E::Error: std::fmt::Debug,
{
    let vocab = e.vocab_size() as u32;
    let ids: Vec<RequestId> = (1..=ps.len() as RequestId).collect();
    let mut out: Sampled = vec![(Vec::new(), Vec::new()); ps.len()];
    let mut slot = 0;
    let all: Vec<(RequestId, &[TokenId], usize)> =
        ids.iter().zip(ps).map(|(&id, p)| (id, &p[..], 0)).collect();
    prefill(e, &mut slot, &all, usize::MAX, &mut out);
    let (mut accepted, mut step) = (0, 0);
    loop {
        let live: Vec<usize> = (0..ps.len()).filter(|&i| out[i].0.len() <= steps).collect();
        if live.is_empty() {
            break;
        }
        let (mut indptr, mut tokens) = (vec![0u32], Vec::new());
        for &i in &live {
            let have = out[i].0.len();
            let mut d: Vec<TokenId> = want[i].0.iter().skip(have).take(3).copied().collect();
            if i == 1 && step % 3 == 0 && d.len() > 1 {
                d[1] = (d[1] + 1) % vocab;
            }
            // The input token's position and the drafts'.
            let len = ps[i].len() + have + d.len();
            assert!(e.grow(ids[i], len), "KV for {i}");
            tokens.extend(d);
            indptr.push(tokens.len() as u32);
        }
        let rows: Vec<RequestId> = live.iter().map(|&i| ids[i]).collect();
        let drafts = Drafts {
            indptr: &indptr,
            tokens: &tokens,
        };
        e.launch_decode(slot, &rows, drafts).unwrap();
        e.finalize_sampling(slot, None).unwrap();
        let o = e.wait_step(slot).unwrap();
        let lps = o.logprobs.expect("logprobs");
        assert_eq!(o.num_rows(), live.len());
        for (k, &i) in live.iter().enumerate() {
            let r = o.row_range(k);
            accepted += r.len() - 1;
            out[i].0.extend_from_slice(&o.tokens[r.clone()]);
            out[i].1.extend_from_slice(&lps[r]);
        }
        slot = 1 - slot;
        step += 1;
    }
    for id in ids {
        e.release(id);
    }
    assert_eq!(e.num_allocated(), 0, "a KV row left behind");
    for o in &mut out {
        o.0.truncate(steps + 1);
        o.1.truncate(steps + 1);
    }
    (out, accepted)
}

fn weights() -> ModelWeights {
    synthetic_weights(&ModelConfig::tiny(), DType::F32, 7)
}

fn cuda_config() -> CudaRuntimeConfig {
    CudaRuntimeConfig {
        step: step_config(),
        ..CudaRuntimeConfig::default()
    }
}

/// The KV and step shape of both runtimes here.
fn step_config() -> StepConfig {
    StepConfig {
        max_rows: 8,
        num_pages: 256,
        max_seq_len: 512,
        ..StepConfig::default()
    }
}

/// Chunked prefill equals whole-prompt prefill exactly (each row's
/// arithmetic does not depend on which step computes it), and a preempted,
/// re-admitted sequence continues with the tokens it would have sampled,
/// and so does a run verifying drafts; log-probabilities agree to `tol` (0
/// on the CPU and the host device, whose prefill and decode compute a
/// position alike; on a GPU re-prefilled and drafted positions take the
/// tiled kernel instead of the decode one, which sums in another order).
fn chunks_and_readmission_match<E: Executor<Params = SamplingParams>>(e: &mut E, tol: f32)
where
    E::Error: std::fmt::Debug,
{
    let ps = prompts(ModelConfig::tiny().vocab_size as u32);
    let whole = run(e, &ps, usize::MAX, 24, None);
    assert!(whole.iter().all(|(t, _)| t.len() == 25));
    for chunk in [5, 16] {
        assert_eq!(run(e, &ps, chunk, 24, None), whole, "chunks of {chunk}");
    }
    // Speculation changes no output: the drafts are the tokens decoding
    // picks (most accepted), or one is wrong (the row keeps the tokens up
    // to it and the one sampled in its place).
    let (drafted, accepted) = run_drafted(e, &ps, 24, &whole);
    assert!(accepted >= 24, "{accepted} drafts accepted");
    for (i, ((gt, gl), (wt, wl))) in drafted.iter().zip(&whole).enumerate() {
        assert_eq!(gt, wt, "drafted: sequence {i}");
        for (j, (a, b)) in gl.iter().zip(wl).enumerate() {
            assert!(
                (a - b).abs() <= tol,
                "drafted: sequence {i} token {j}: {a} vs {b}"
            );
        }
    }
    for (chunk, after) in [(usize::MAX, 10), (7, 3)] {
        let got = run(e, &ps, chunk, 24, Some(after));
        let what = match chunk {
            usize::MAX => format!("whole prompts, preempted after {after} tokens"),
            c => format!("chunks of {c}, preempted after {after} tokens"),
        };
        for (i, ((gt, gl), (wt, wl))) in got.iter().zip(&whole).enumerate() {
            assert_eq!(gt, wt, "{what}: sequence {i}");
            for (j, (a, b)) in gl.iter().zip(wl).enumerate() {
                assert!(
                    (a - b).abs() <= tol,
                    "{what}: sequence {i} token {j}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn cpu_runtime_chunks_and_readmits_exactly() {
    let mut cpu = CpuRuntime::new(
        weights(),
        CpuRuntimeConfig {
            step: step_config(),
            ..CpuRuntimeConfig::default()
        },
    )
    .unwrap();
    chunks_and_readmission_match(&mut cpu, 0.0);
}

#[test]
fn host_device_chunks_and_readmits_like_whole_prompts() {
    let mut host = HostRuntime::new(weights(), cuda_config()).unwrap();
    chunks_and_readmission_match(&mut host, 0.0);
}

#[test]
#[ignore = "needs a GPU: cargo test -p kestrel-cuda -- --include-ignored"]
fn gpu_chunks_and_readmits_like_whole_prompts() {
    let mut gpu = CudaRuntime::new(weights(), cuda_config()).unwrap();
    chunks_and_readmission_match(&mut gpu, 1e-3);
}
