//! The sampling flags `generate` and `chat` share ([`SamplingArgs`]), written
//! into the proto request both paths (in-process and `--server`) send.

use clap::Args;
use kestrel_server::pb;
use kestrel_server::pb::generate_request::{Constraint, Input};

/// Request options, mirroring the proto's GenerateRequest fields.
#[derive(Debug, Args)]
pub(crate) struct SamplingArgs {
    /// Most tokens to generate [default: 256].
    #[arg(long, short = 'n')]
    max_new_tokens: Option<u32>,
    /// 0 = greedy [default: 0].
    #[arg(long, short = 't', allow_negative_numbers = true)]
    temperature: Option<f32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    top_k: Option<u32>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    frequency_penalty: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    presence_penalty: Option<f32>,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop sequence (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence.
    #[arg(long)]
    ignore_eos: bool,
    /// No stop condition (end-of-sequence, a stop sequence) ends the
    /// output before N tokens [default: 0].
    #[arg(long, value_name = "N")]
    min_tokens: Option<u32>,
    /// Speculative decoding for this request: up to K draft tokens per step
    /// by prompt lookup (1 to 16); 0 turns it off [default: the server's].
    #[arg(long, value_name = "K")]
    speculate_ngram: Option<u32>,
    /// Add BIAS to token ID's logit, as `ID=BIAS` (repeatable; BIAS in
    /// [-100, 100], -100 bans the token).
    #[arg(long = "logit-bias", value_name = "ID=BIAS", value_parser = parse_logit_bias, allow_hyphen_values = true)]
    logit_bias: Vec<(u32, f32)>,
    /// Constrain the output to JSON valid against this JSON Schema (text).
    #[arg(long, group = "constraint")]
    json_schema: Option<String>,
    /// Constrain the output to match this regex.
    #[arg(long, group = "constraint")]
    regex: Option<String>,
    /// Constrain the output to one of these strings (repeatable).
    #[arg(long, group = "constraint")]
    choice: Vec<String>,
    /// Constrain the output with a Lark grammar (llguidance dialect).
    #[arg(long, group = "constraint")]
    grammar: Option<String>,
}

impl SamplingArgs {
    pub(crate) fn request(&self, input: Input) -> pb::GenerateRequest {
        let constraint = if let Some(s) = &self.json_schema {
            Some(Constraint::JsonSchema(s.clone()))
        } else if let Some(r) = &self.regex {
            Some(Constraint::Regex(r.clone()))
        } else if let Some(g) = &self.grammar {
            Some(Constraint::Grammar(g.clone()))
        } else if !self.choice.is_empty() {
            Some(Constraint::Choice(pb::ChoiceList {
                choices: self.choice.clone(),
            }))
        } else {
            None
        };
        pb::GenerateRequest {
            input: Some(input),
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens.unwrap_or(0),
            logprobs: false,
            top_logprobs: 0,
            prompt_logprobs: None,
            logit_bias: self.logit_bias.iter().copied().collect(),
            request_id: String::new(),
            constraint,
            speculate_ngram: self.speculate_ngram,
            n: None,
        }
    }
}

/// `ID=BIAS` of `--logit-bias` (the range is the server's to check).
fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=BIAS, got {s:?}"))?;
    let id = id
        .trim()
        .parse()
        .map_err(|e| format!("token id {id:?}: {e}"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|e| format!("bias {bias:?}: {e}"))?;
    Ok((id, bias))
}
