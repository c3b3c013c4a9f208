//! Engine metrics: lock-free counters, gauges and fixed-bucket histograms,
//! rendered as Prometheus text exposition (format 0.0.4) by hand.
//!
//! Written by the engine thread (gauges after every loop iteration, request
//! histograms from the streaming skill), read by any thread. Every update is
//! one or two relaxed atomic ops; rendering allocates one `String`. The same
//! values are also rendered under vLLM's names ([`Metrics::render`]'s
//! `vllm:` block) because routers (SMG, the Gateway API Inference
//! Extension's endpoint picker) read those; `docs/deploy.md` has the map.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::request::FinishReason;

/// Latency buckets in seconds (1 ms .. 60 s).
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Step-scale buckets in seconds (10 us .. 1 s).
const STEP_BUCKETS: &[f64] = &[
    0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    1.0,
];

/// A cumulative histogram with fixed bucket bounds.
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (non-cumulative) counts; the last is `+Inf`.
    counts: Vec<AtomicU64>,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: std::time::Duration) {
        let secs = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_nanos
            .fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        self.render_labeled(out, name, help, "");
    }

    /// `labels` is empty or `k="v",...` (already escaped), put before `le`.
    fn render_labeled(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let (sep, set) = if labels.is_empty() {
            ("", String::new())
        } else {
            (",", format!("{{{labels}}}"))
        };
        let mut cum = 0u64;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += self.counts[i].load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cum}");
        }
        cum += self.counts[self.bounds.len()].load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cum}");
        let sum = self.sum_nanos.load(Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{set} {sum}\n{name}_count{set} {cum}");
    }
}

/// A gauge holding an `f64` or integer value.
#[derive(Debug, Default)]
pub(crate) struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: u64) {
        self.0.store(v, Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

const REASONS: [FinishReason; 5] = [
    FinishReason::Stop,
    FinishReason::Length,
    FinishReason::Eos,
    FinishReason::Abort,
    FinishReason::Error,
];

fn reason_index(r: FinishReason) -> usize {
    match r {
        FinishReason::Stop => 0,
        FinishReason::Length => 1,
        FinishReason::Eos => 2,
        FinishReason::Abort => 3,
        FinishReason::Error => 4,
    }
}

/// Everything the engine reports. Shared by the handle and the engine thread.
#[derive(Debug)]
pub(crate) struct Metrics {
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    /// Wall time of one `run_once` that made progress.
    pub step_period: Histogram,
    /// Device idle between consecutive forwards while busy: from the
    /// runtime's own timestamps when it reports them (the CPU runtime does),
    /// else approximated by host time between two busy `run_once` calls.
    pub device_gap: Histogram,
    pub tokens_generated: AtomicU64,
    pub prompt_tokens: AtomicU64,
    finished: [AtomicU64; 5],
    /// Requests cut by `max_tokens` while repeating one n-gram
    /// (`kestrel_skills::looping_tail`): greedy loops an operator should see.
    pub length_loops: AtomicU64,
    pub rejected: AtomicU64,
    /// Nanoseconds the engine thread spent blocked waiting for commands.
    pub idle_nanos: AtomicU64,
    pub waiting: Gauge,
    pub running: Gauge,
    pub admitted: Gauge,
    pub kv_total: Gauge,
    pub kv_used: Gauge,
    pub kv_free: Gauge,
    pub kv_cached: Gauge,
    pub prefix_hit_tokens: Gauge,
    pub fork_shared_tokens: Gauge,
    pub kv_prompt_tokens: Gauge,
    /// The loop's step counters (`PipelineStats`), copied each iteration.
    pub prefill_steps: Gauge,
    pub decode_steps: Gauge,
    pub preemptions: Gauge,
    /// Draft tokens verified, and accepted (speculative decoding).
    pub draft_tokens: Gauge,
    pub accepted_drafts: Gauge,
    /// Preempted sequences waiting to be prefilled again.
    pub preempted: Gauge,
    /// Images run through the vision encoder, and image rows served from
    /// the runtime's encoded-image cache instead (a vision model's).
    pub image_encodes: Gauge,
    pub image_cache_hits: Gauge,
    pub healthy: Gauge,
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            ttft: Histogram::new(LATENCY_BUCKETS),
            inter_token: Histogram::new(LATENCY_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
            queue_time: Histogram::new(LATENCY_BUCKETS),
            step_period: Histogram::new(STEP_BUCKETS),
            device_gap: Histogram::new(STEP_BUCKETS),
            tokens_generated: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            finished: Default::default(),
            length_loops: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            idle_nanos: AtomicU64::new(0),
            waiting: Gauge::default(),
            running: Gauge::default(),
            admitted: Gauge::default(),
            kv_total: Gauge::default(),
            kv_used: Gauge::default(),
            kv_free: Gauge::default(),
            kv_cached: Gauge::default(),
            prefix_hit_tokens: Gauge::default(),
            fork_shared_tokens: Gauge::default(),
            kv_prompt_tokens: Gauge::default(),
            prefill_steps: Gauge::default(),
            decode_steps: Gauge::default(),
            preemptions: Gauge::default(),
            draft_tokens: Gauge::default(),
            accepted_drafts: Gauge::default(),
            preempted: Gauge::default(),
            image_encodes: Gauge::default(),
            image_cache_hits: Gauge::default(),
            healthy: Gauge(AtomicU64::new(1)),
        }
    }

    pub fn request_finished(&self, r: FinishReason) {
        self.finished[reason_index(r)].fetch_add(1, Relaxed);
    }

    pub fn finished_count(&self, r: FinishReason) -> u64 {
        self.finished[reason_index(r)].load(Relaxed)
    }

    /// Prometheus text exposition: Kestrel's own series, then the
    /// router-readable `vllm:` ones labelled with `model_name`.
    pub fn render(&self, model_name: &str) -> String {
        let mut out = String::with_capacity(8 * 1024);
        self.ttft.render(
            &mut out,
            "kestrel_time_to_first_token_seconds",
            "Submission to first committed token.",
        );
        self.inter_token.render(
            &mut out,
            "kestrel_inter_token_latency_seconds",
            "Time between consecutive committed tokens of a request.",
        );
        self.e2e.render(
            &mut out,
            "kestrel_request_duration_seconds",
            "Submission to finish (end-to-end latency).",
        );
        self.queue_time.render(
            &mut out,
            "kestrel_request_queue_seconds",
            "Submission to admission (prefill launch).",
        );
        self.step_period.render(
            &mut out,
            "kestrel_step_period_seconds",
            "Wall time of one engine-loop iteration that made progress.",
        );
        self.device_gap.render(
            &mut out,
            "kestrel_device_idle_between_steps_seconds",
            "Device idle between consecutive forwards while busy (runtime timestamps, or host-side approximation).",
        );
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        counter(
            &mut out,
            "kestrel_generated_tokens_total",
            "Tokens committed to requests.",
            self.tokens_generated.load(Relaxed),
        );
        counter(
            &mut out,
            "kestrel_prompt_tokens_total",
            "Prompt tokens of accepted requests.",
            self.prompt_tokens.load(Relaxed),
        );
        counter(
            &mut out,
            "kestrel_prefill_steps_total",
            "Prefill steps launched (a prompt prefilled in chunks counts one per chunk).",
            self.prefill_steps.get(),
        );
        counter(
            &mut out,
            "kestrel_fork_shared_prompt_tokens_total",
            "Prompt tokens a sample of an n > 1 request shared from its first sample's KV pages instead of computing.",
            self.fork_shared_tokens.get(),
        );
        counter(
            &mut out,
            "kestrel_decode_steps_total",
            "Decode steps launched.",
            self.decode_steps.get(),
        );
        counter(
            &mut out,
            "kestrel_preemptions_total",
            "Sequences preempted because KV pages ran out (each is prefilled again later).",
            self.preemptions.get(),
        );
        counter(
            &mut out,
            "kestrel_image_encodes_total",
            "Images run through the vision encoder and projector.",
            self.image_encodes.get(),
        );
        counter(
            &mut out,
            "kestrel_image_cache_hits_total",
            "Images whose encoded rows came from the encoded-image cache instead of the encoder.",
            self.image_cache_hits.get(),
        );
        counter(
            &mut out,
            "kestrel_spec_draft_tokens_total",
            "Draft tokens verified by speculative decoding.",
            self.draft_tokens.get(),
        );
        counter(
            &mut out,
            "kestrel_spec_accepted_tokens_total",
            "Draft tokens accepted (each saved a decode step).",
            self.accepted_drafts.get(),
        );
        counter(
            &mut out,
            "kestrel_requests_rejected_total",
            "Requests refused at submission.",
            self.rejected.load(Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP kestrel_requests_finished_total Requests finished, by reason.\n# TYPE kestrel_requests_finished_total counter"
        );
        for r in REASONS {
            let _ = writeln!(
                out,
                "kestrel_requests_finished_total{{reason=\"{}\"}} {}",
                r.as_str(),
                self.finished_count(r)
            );
        }
        counter(
            &mut out,
            "kestrel_requests_length_loop_total",
            "Requests finished by max_tokens while repeating one n-gram (at least 4 times, 16 tokens, n <= 16): greedy loops.",
            self.length_loops.load(Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP kestrel_engine_idle_seconds_total Time the engine thread waited for work.\n# TYPE kestrel_engine_idle_seconds_total counter\nkestrel_engine_idle_seconds_total {}",
            self.idle_nanos.load(Relaxed) as f64 / 1e9
        );
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge(
            &mut out,
            "kestrel_queue_depth",
            "Requests waiting for admission.",
            self.waiting.get() as f64,
        );
        gauge(
            &mut out,
            "kestrel_running_sequences",
            "Admitted, unfinished sequences.",
            self.running.get() as f64,
        );
        gauge(
            &mut out,
            "kestrel_preempted_sequences",
            "Sequences preempted for KV pages, waiting to be prefilled again.",
            self.preempted.get() as f64,
        );
        gauge(
            &mut out,
            "kestrel_admitted_sequences",
            "Sequences holding KV (zombies included).",
            self.admitted.get() as f64,
        );
        gauge(
            &mut out,
            "kestrel_kv_pages_total",
            "KV cache pages.",
            self.kv_total.get() as f64,
        );
        gauge(
            &mut out,
            "kestrel_kv_pages_used",
            "KV cache pages in use.",
            self.kv_used.get() as f64,
        );
        gauge(
            &mut out,
            "kestrel_kv_pages_free",
            "KV cache pages free.",
            self.kv_free.get() as f64,
        );
        gauge(
            &mut out,
            "kestrel_kv_pages_cached",
            "KV pages held only by the prefix cache.",
            self.kv_cached.get() as f64,
        );
        gauge(
            &mut out,
            "kestrel_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens.",
            self.prefix_hit_rate(),
        );
        gauge(
            &mut out,
            "kestrel_healthy",
            "1 while serving.",
            self.healthy.get() as f64,
        );
        self.render_vllm(&mut out, model_name);
        out
    }

    /// The subset of vLLM's (V1) metric names and label sets that routers
    /// read, from the same atomics as Kestrel's own series. One engine per
    /// process, so `engine="0"`, as vLLM labels a single-engine server.
    /// `vllm:gpu_cache_usage_perc` is vLLM's older name for
    /// `vllm:kv_cache_usage_perc`, still the one SMG 1.13 reads.
    fn render_vllm(&self, out: &mut String, model_name: &str) {
        let labels = format!("model_name=\"{}\",engine=\"0\"", escape_label(model_name));
        let sample = |out: &mut String, name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {v}"
            );
        };
        sample(
            out,
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            self.running.get() as f64,
        );
        sample(
            out,
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            self.waiting.get() as f64,
        );
        let usage = self.kv_usage();
        sample(
            out,
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            usage,
        );
        sample(
            out,
            "vllm:gpu_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage (older name of vllm:kv_cache_usage_perc).",
            usage,
        );
        sample(
            out,
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.kv_prompt_tokens.get() as f64,
        );
        sample(
            out,
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.prefix_hit_tokens.get() as f64,
        );
        sample(
            out,
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemption from the engine.",
            self.preemptions.get() as f64,
        );
        sample(
            out,
            "vllm:spec_decode_num_draft_tokens_total",
            "counter",
            "Number of draft tokens.",
            self.draft_tokens.get() as f64,
        );
        sample(
            out,
            "vllm:spec_decode_num_accepted_tokens_total",
            "counter",
            "Number of accepted tokens.",
            self.accepted_drafts.get() as f64,
        );
        self.ttft.render_labeled(
            out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &labels,
        );
        self.e2e.render_labeled(
            out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &labels,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
        );
        // vLLM's finish reasons: an end-of-sequence token is a "stop" there.
        let finished = |r| self.finished_count(r);
        for (reason, n) in [
            (
                "stop",
                finished(FinishReason::Stop) + finished(FinishReason::Eos),
            ),
            ("length", finished(FinishReason::Length)),
            ("abort", finished(FinishReason::Abort)),
        ] {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {n}"
            );
        }
    }

    /// Pages referenced by a sequence / pages in the pool (0 before the
    /// first report).
    pub fn kv_usage(&self) -> f64 {
        let total = self.kv_total.get();
        if total == 0 {
            0.0
        } else {
            self.kv_used.get() as f64 / total as f64
        }
    }

    pub fn prefix_hit_rate(&self) -> f64 {
        let prompt = self.kv_prompt_tokens.get();
        if prompt == 0 {
            0.0
        } else {
            self.prefix_hit_tokens.get() as f64 / prompt as f64
        }
    }
}

/// A Prometheus label value: backslash, double quote and newline escaped.
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::new();
        m.ttft.observe(Duration::from_millis(3));
        m.ttft.observe(Duration::from_millis(30));
        m.ttft.observe(Duration::from_secs(100));
        m.request_finished(FinishReason::Eos);
        let text = m.render("m");
        assert!(
            text.contains("kestrel_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"),
            "{text}"
        );
        assert!(text.contains("kestrel_time_to_first_token_seconds_bucket{le=\"0.05\"} 2"));
        assert!(text.contains("kestrel_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("kestrel_time_to_first_token_seconds_count 3"));
        assert!(text.contains("kestrel_requests_finished_total{reason=\"eos\"} 1"));
        assert!(text.contains("# TYPE kestrel_kv_pages_used gauge"));
    }

    /// docs/deploy.md's table names every `kestrel_*` series `/metrics`
    /// renders, so an operator finds each one there.
    #[test]
    fn every_series_is_documented() {
        let text = Metrics::new().render("m");
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/deploy.md"),
        )
        .expect("docs/deploy.md");
        let mut missing = Vec::new();
        for line in text.lines() {
            let Some(name) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let name = name.split(' ').next().unwrap_or_default();
            if name.starts_with("kestrel_") && !doc.contains(&format!("`{name}")) {
                missing.push(name.to_string());
            }
        }
        assert!(missing.is_empty(), "not in docs/deploy.md: {missing:?}");
    }

    #[test]
    fn vllm_names_carry_the_same_values() {
        let m = Metrics::new();
        m.running.set(3);
        m.waiting.set(2);
        m.kv_total.set(8);
        m.kv_used.set(2);
        m.kv_prompt_tokens.set(100);
        m.prefix_hit_tokens.set(40);
        m.preemptions.set(5);
        m.ttft.observe(Duration::from_millis(3));
        m.request_finished(FinishReason::Eos);
        m.request_finished(FinishReason::Stop);
        m.request_finished(FinishReason::Length);
        let text = m.render("a \"b\"");
        let l = r#"{model_name="a \"b\"",engine="0"}"#;
        for line in [
            format!("vllm:num_requests_running{l} 3"),
            format!("vllm:num_requests_waiting{l} 2"),
            format!("vllm:kv_cache_usage_perc{l} 0.25"),
            format!("vllm:gpu_cache_usage_perc{l} 0.25"),
            format!("vllm:prefix_cache_queries_total{l} 100"),
            format!("vllm:prefix_cache_hits_total{l} 40"),
            format!("vllm:num_preemptions_total{l} 5"),
            r#"vllm:time_to_first_token_seconds_bucket{model_name="a \"b\"",engine="0",le="0.005"} 1"#.to_string(),
            format!("vllm:time_to_first_token_seconds_count{l} 1"),
            format!("vllm:e2e_request_latency_seconds_count{l} 0"),
            r#"vllm:request_success_total{model_name="a \"b\"",engine="0",finished_reason="stop"} 2"#.to_string(),
            r#"vllm:request_success_total{model_name="a \"b\"",engine="0",finished_reason="length"} 1"#.to_string(),
        ] {
            assert!(text.lines().any(|x| x == line), "missing {line}\n{text}");
        }
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter"));
    }

    #[test]
    fn hit_rate_is_zero_without_prompts() {
        let m = Metrics::new();
        assert_eq!(m.prefix_hit_rate(), 0.0);
        m.kv_prompt_tokens.set(10);
        m.prefix_hit_tokens.set(4);
        assert!((m.prefix_hit_rate() - 0.4).abs() < 1e-9);
    }
}
