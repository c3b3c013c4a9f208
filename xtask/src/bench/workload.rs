//! What the bench runs: the engine configurations it alternates, the
//! workloads (stream count x constraint mix) and the fixed prompt set.
//!
//! Every request is greedy and ignores EOS (text) so its length is set by
//! `max_new_tokens`, which cycles over a fixed range: the generated length L
//! is controlled and equal across configurations. JSON-constrained requests
//! may end earlier, when their JSON is complete: those are the zombie source.

use std::sync::Arc;

use anyhow::Context as _;
use kestrel_model::{ChatMessage, LoadedModel};
use kestrel_pipeline::{PipelineMode, PrefillPolicy, TokenId};
use kestrel_skills::{Skill, SkillContext, SkillOptions, SkillSpec};
use serde::Serialize;

/// One engine configuration: pipeline depth and prefill policy.
///
/// Blocking has no ride-along variant: at depth 1 no slot is free while a
/// step is in flight, so both policies run the same loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum EngineConfig {
    Blocking,
    PipelinedDrain,
    PipelinedRideAlong,
}

impl EngineConfig {
    pub const ALL: [EngineConfig; 3] = [
        EngineConfig::Blocking,
        EngineConfig::PipelinedDrain,
        EngineConfig::PipelinedRideAlong,
    ];

    pub fn mode(self) -> PipelineMode {
        match self {
            EngineConfig::Blocking => PipelineMode::Blocking,
            _ => PipelineMode::Pipelined,
        }
    }

    pub fn prefill_policy(self) -> PrefillPolicy {
        match self {
            EngineConfig::PipelinedRideAlong => PrefillPolicy::RideAlong,
            _ => PrefillPolicy::Drain,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            EngineConfig::Blocking => "blocking (depth 1)",
            EngineConfig::PipelinedDrain => "pipelined, drain-before-prefill",
            EngineConfig::PipelinedRideAlong => "pipelined, prefill rides along",
        }
    }

    pub fn short(self) -> &'static str {
        match self {
            EngineConfig::Blocking => "blocking",
            EngineConfig::PipelinedDrain => "pipe/drain",
            EngineConfig::PipelinedRideAlong => "pipe/ride",
        }
    }
}

/// The constraint mix of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Mix {
    /// Unconstrained text only.
    Text,
    /// A share of the requests is JSON-schema constrained.
    Json,
}

/// N concurrent streams, each running `requests_per_stream` requests back to
/// back (closed loop: a stream submits its next request when one finishes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Workload {
    pub streams: usize,
    pub requests_per_stream: usize,
    pub mix: Mix,
}

impl Workload {
    pub fn requests(&self) -> usize {
        self.streams * self.requests_per_stream
    }

    pub fn label(&self) -> String {
        let s = if self.streams == 1 { "" } else { "s" };
        match self.mix {
            Mix::Text => format!("{} stream{s}, text", self.streams),
            Mix::Json => format!("{} stream{s}, +JSON", self.streams),
        }
    }
}

/// Output length range and JSON share, shared by every workload of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LengthPlan {
    pub min_tokens: u32,
    pub max_tokens: u32,
    /// Fraction of requests (in the `Json` mix) that are JSON-constrained.
    pub json_share: f64,
}

impl LengthPlan {
    /// `max_new_tokens` of request `i`: a fixed stride through the range, so
    /// streams desynchronize and prefills land during other streams' decode.
    pub fn tokens_for(&self, i: usize) -> u32 {
        let span = self.max_tokens - self.min_tokens + 1;
        self.min_tokens + ((i as u32).wrapping_mul(7) % span)
    }

    /// Whether request `i` of a `Json` workload is constrained: evenly spread.
    pub fn is_json(&self, i: usize) -> bool {
        let before = (i as f64 * self.json_share).floor();
        let after = ((i + 1) as f64 * self.json_share).floor();
        after > before
    }
}

const TEXT_PROMPTS: [&str; 8] = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Describe a walk through a busy market in the early morning.",
    "What are the main differences between rivers and canals?",
    "Give some advice to someone learning to cook for the first time.",
    "Tell me about the history of bicycles.",
    "Write a letter from a cat to its owner about breakfast.",
    "Why is the sky blue? Explain it step by step.",
];

const JSON_PROMPT: &str = "Invent a fictional city. Reply in JSON with its name, \
population, a few landmarks and a short description.";

fn city_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "population": {"type": "integer"},
            "landmarks": {
                "type": "array",
                "items": {"type": "string", "maxLength": 24},
                "minItems": 2,
                "maxItems": 4
            },
            "description": {"type": "string", "maxLength": 160}
        },
        "required": ["name", "population", "landmarks", "description"],
        "additionalProperties": false
    })
}

/// Tokenized prompts and the skill context: everything needed to build a
/// request, prepared once.
pub struct PromptSet {
    text: Vec<Vec<TokenId>>,
    json: Vec<TokenId>,
    schema: serde_json::Value,
    ctx: Arc<SkillContext>,
}

impl std::fmt::Debug for PromptSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptSet")
            .field("text", &self.text.len())
            .finish_non_exhaustive()
    }
}

/// One request before submission.
pub struct PreparedRequest {
    pub prompt: Vec<TokenId>,
    pub max_new_tokens: u32,
    pub skill: Skill,
}

impl PromptSet {
    pub fn new(model: &LoadedModel, ctx: Arc<SkillContext>) -> anyhow::Result<Self> {
        let encode = |text: &str| -> anyhow::Result<Vec<TokenId>> {
            let rendered = model
                .chat_template
                .as_ref()
                .context("the model has no chat template")?
                .render(&[ChatMessage::user(text)], true)
                .context("rendering the chat template")?;
            Ok(model.encode_prompt(&rendered)?)
        };
        Ok(Self {
            text: TEXT_PROMPTS
                .iter()
                .map(|p| encode(p))
                .collect::<anyhow::Result<_>>()?,
            json: encode(JSON_PROMPT)?,
            schema: city_schema(),
            ctx,
        })
    }

    pub fn mean_text_prompt_len(&self) -> f64 {
        self.text.iter().map(Vec::len).sum::<usize>() as f64 / self.text.len() as f64
    }

    /// Request `i` of a workload (same `i`, same request, in every configuration).
    pub fn request(
        &self,
        w: &Workload,
        plan: &LengthPlan,
        i: usize,
    ) -> anyhow::Result<PreparedRequest> {
        let json = w.mix == Mix::Json && plan.is_json(i);
        let (prompt, spec) = if json {
            (
                self.json.clone(),
                SkillSpec::Json {
                    schema: self.schema.clone(),
                },
            )
        } else {
            (
                self.text[i % self.text.len()].clone(),
                SkillSpec::Text {
                    stop: Vec::new(),
                    stop_token_ids: Vec::new(),
                    ignore_eos: true,
                    min_tokens: 0,
                },
            )
        };
        let skill = Skill::new(&self.ctx, &spec, SkillOptions::default())
            .context("building a request's skill")?;
        Ok(PreparedRequest {
            prompt,
            max_new_tokens: plan.tokens_for(i),
            skill,
        })
    }
}
