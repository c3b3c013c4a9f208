//! [`ModelContext`]: the read-only, per-model state every caller shares
//! (tokenizer, chat template, special ids, the skills' token trie), plus the
//! [`Runtime`] contract and the info/health types.
//!
//! Immutable after construction and cheap to clone (`Arc`s), so tokenizing,
//! template rendering and grammar compilation run on the caller's thread
//! and never stall the engine loop.

use std::sync::Arc;

pub use kestrel_cpu::PositionLogprobs;
use kestrel_pipeline::{Cause, Executor, PipelineMode, SamplingParams};
use kestrel_skills::{SkillContext, SkillContextConfig};
use tokenizers::Tokenizer;

use crate::error::EngineError;
use crate::request::{ChatMessage, Prompt};
use crate::validate::Field;

pub use kestrel_kv::KvStats;

/// What the engine needs from a runtime beyond the pipeline's [`Executor`]
/// (whose [`Executor::capabilities`] say what requests it can serve: logit
/// bias, drafts, ...; the engine validates requests against them).
pub trait Runtime: Executor<Params = SamplingParams> + Send + 'static {
    fn kv_stats(&self) -> KvStats;

    /// The log-probability of each of `tokens[1..]` given the tokens before
    /// it, with the `top` most likely tokens at each position. Called on
    /// the engine thread before the request is submitted; it must not touch
    /// the KV of admitted sequences. A runtime that implements it says so in
    /// its [`Capabilities::prompt_logprobs`](kestrel_pipeline::Capabilities::prompt_logprobs),
    /// and the engine refuses `prompt_logprobs` on one that does not.
    fn score_prompt(&self, tokens: &[u32], top: usize) -> Result<Vec<PositionLogprobs>, Cause> {
        let _ = (tokens, top);
        Err(Cause::message("this runtime does not score prompts"))
    }

    /// Host cores this runtime keeps busy computing (a CPU runtime's matmul
    /// threads; 0 for a GPU). The engine fills masks in parallel only on
    /// cores left over.
    fn host_compute_threads(&self) -> usize {
        0
    }

    /// A vision runtime's image counters (none for a text-only one).
    fn image_stats(&self) -> ImageStats {
        ImageStats::default()
    }
}

/// What a runtime's image rows have cost: encoder runs, and images served
/// from its encoded-image cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImageStats {
    pub encodes: u64,
    pub cache_hits: u64,
}

/// The pipeline's simulated device, for tests and demos of the engine.
impl Runtime for kestrel_pipeline::testing::SimExecutor {
    fn kv_stats(&self) -> KvStats {
        let total = self.config().num_pages;
        let used = self.used_pages();
        KvStats {
            total_pages: total,
            used_pages: used,
            free_pages: total - used,
            ..KvStats::default()
        }
    }
}

/// A runtime with an observer around its waits is still that runtime.
impl<E: Runtime, O: kestrel_pipeline::WaitObserver + Send + 'static> Runtime
    for kestrel_pipeline::Observed<E, O>
{
    fn kv_stats(&self) -> KvStats {
        self.inner.kv_stats()
    }

    fn score_prompt(&self, tokens: &[u32], top: usize) -> Result<Vec<PositionLogprobs>, Cause> {
        self.inner.score_prompt(tokens, top)
    }

    fn host_compute_threads(&self) -> usize {
        self.inner.host_compute_threads()
    }

    fn image_stats(&self) -> ImageStats {
        self.inner.image_stats()
    }
}

/// Inputs to [`ModelContext::new`].
pub struct ModelContextConfig {
    pub name: String,
    pub architecture: String,
    pub tokenizer: Arc<Tokenizer>,
    /// Rows of the model's logits (at least the tokenizer's vocabulary).
    pub vocab_size: usize,
    /// The model's context length.
    pub context_length: usize,
    /// Non-empty; the first is the primary EOS.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// Prepend BOS to raw text prompts.
    pub add_bos_token: bool,
    /// `None`: chat prompts are rejected.
    pub chat_template: Option<kestrel_model::ChatTemplate>,
}

impl std::fmt::Debug for ModelContextConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelContextConfig")
            .field("name", &self.name)
            .field("architecture", &self.architecture)
            .field("vocab_size", &self.vocab_size)
            .field("context_length", &self.context_length)
            .field("eos_token_ids", &self.eos_token_ids)
            .finish_non_exhaustive()
    }
}

/// What the engine's validation needs of a vision model to build a
/// request's prompt: its templates, the crop geometry (with the engine's
/// crop limit), the decoding limits, the rows an image becomes, where
/// its bidirectional prefix ends and, when it points and detects, its
/// spatial ids.
#[derive(Debug, Clone)]
pub struct VisionContext {
    pub prompts: kestrel_model::moondream::PromptTokens,
    pub geometry: kestrel_model::vision::CropGeometry,
    pub limits: kestrel_model::vision::DecodeLimits,
    /// Prompt rows per image (729).
    pub image_rows: usize,
    /// BOS + the image's rows (730): attended both ways.
    pub bidirectional_end: usize,
    /// The coord, size and EOS ids of a model with a region module (whose
    /// runtime decodes coordinates and sizes); `None`: no `point` or
    /// `detect` (no region module, or a vocabulary without those ids).
    pub spatial: Option<kestrel_skills::SpatialIds>,
}

impl VisionContext {
    /// The vision context of `model` under the engine's image settings.
    pub fn new(model: &kestrel_model::VisionModel, images: &crate::ImageSettings) -> Self {
        let v = &model.config.vision;
        let mut geometry = v.crop_geometry();
        if let Some(max) = images.max_crops {
            geometry.max_crops = max;
        }
        Self {
            prompts: model.prompts.clone(),
            geometry,
            limits: kestrel_model::vision::DecodeLimits {
                max_pixels: images.max_pixels,
            },
            image_rows: v.patches(),
            bidirectional_end: model.config.text.prefix_attn,
            spatial: spatial_ids(model),
        }
    }
}

/// A vision model's spatial ids, when it has a region module and its
/// vocabulary has coord and size ids.
fn spatial_ids(model: &kestrel_model::VisionModel) -> Option<kestrel_skills::SpatialIds> {
    model.region.as_ref()?;
    let p = &model.prompts;
    Some(kestrel_skills::SpatialIds {
        coord: p.coord_id?,
        size: p.size_id?,
        eos: p.eos_id,
    })
}

struct Inner {
    name: String,
    architecture: String,
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    context_length: usize,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
    add_bos_token: bool,
    chat_template: Option<kestrel_model::ChatTemplate>,
    skills: Arc<SkillContext>,
    /// A vision model's prompt facts (`None`: text only).
    vision: Option<VisionContext>,
}

/// Shared read-only model state. Clone is an `Arc` bump.
#[derive(Clone)]
pub struct ModelContext {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ModelContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelContext")
            .field("name", &self.inner.name)
            .field("vocab_size", &self.inner.vocab_size)
            .field("context_length", &self.inner.context_length)
            .finish_non_exhaustive()
    }
}

impl ModelContext {
    /// Builds the skills' token trie and grammar compiler (expensive: once per model).
    pub fn new(config: ModelContextConfig) -> Result<Self, EngineError> {
        let skills = SkillContext::new(SkillContextConfig {
            tokenizer: Arc::clone(&config.tokenizer),
            eos_token_ids: config.eos_token_ids.clone(),
            vocab_size: Some(config.vocab_size),
            chat_template: None,
        })
        .map_err(EngineError::SkillSetup)?;
        Ok(Self {
            inner: Arc::new(Inner {
                name: config.name,
                architecture: config.architecture,
                tokenizer: config.tokenizer,
                vocab_size: config.vocab_size,
                context_length: config.context_length,
                eos_token_ids: config.eos_token_ids,
                bos_token_id: config.bos_token_id,
                add_bos_token: config.add_bos_token,
                chat_template: config.chat_template,
                skills,
                vision: None,
            }),
        })
    }

    /// A loaded model's context; a vision model's images are taken with
    /// the default [`crate::ImageSettings`].
    pub fn from_loaded(model: &kestrel_model::LoadedModel) -> Result<Self, EngineError> {
        Self::from_loaded_with(model, &crate::ImageSettings::default())
    }

    /// A loaded model's context, a vision model's images taken with
    /// `images` (its limits and crops).
    pub fn from_loaded_with(
        model: &kestrel_model::LoadedModel,
        images: &crate::ImageSettings,
    ) -> Result<Self, EngineError> {
        let mut ctx = Self::text_of(model)?;
        if let Some(v) = &model.vision {
            let inner = Arc::get_mut(&mut ctx.inner).expect("a context just built is not shared");
            inner.vision = Some(VisionContext::new(v, images));
        }
        Ok(ctx)
    }

    /// The text side of a loaded model.
    fn text_of(model: &kestrel_model::LoadedModel) -> Result<Self, EngineError> {
        let cfg = &model.weights.config;
        Self::new(ModelContextConfig {
            name: model.name.clone(),
            architecture: cfg.architecture.name().to_string(),
            tokenizer: Arc::new(model.tokenizer.clone()),
            vocab_size: cfg.vocab_size.max(model.tokenizer.get_vocab_size(true)),
            context_length: cfg.max_position_embeddings,
            eos_token_ids: model.eos_token_ids.clone(),
            bos_token_id: model.bos_token_id,
            add_bos_token: model.add_bos_token,
            chat_template: model.chat_template.clone(),
        })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// A vision model's prompt facts; `None` for a text-only model, which
    /// refuses images.
    pub fn vision(&self) -> Option<&VisionContext> {
        self.inner.vision.as_ref()
    }

    pub fn architecture(&self) -> &str {
        &self.inner.architecture
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    pub fn context_length(&self) -> usize {
        self.inner.context_length
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos_token_ids
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.inner.tokenizer
    }

    /// The chat template chat prompts are rendered with (`None`: chat
    /// prompts are rejected).
    pub fn chat_template(&self) -> Option<&kestrel_model::ChatTemplate> {
        self.inner.chat_template.as_ref()
    }

    /// The most bytes one token stands for: a prompt of `n` bytes is at
    /// least `n / max_token_bytes` tokens.
    pub fn max_token_bytes(&self) -> usize {
        self.inner.skills.max_token_bytes()
    }

    pub(crate) fn skills(&self) -> &Arc<SkillContext> {
        &self.inner.skills
    }

    /// Text of one token for logprob reports (lossy; empty for control tokens).
    pub(crate) fn token_text(&self, token: u32) -> String {
        if self.inner.skills.is_special(token) {
            return String::new();
        }
        String::from_utf8_lossy(self.inner.skills.token_bytes(token)).into_owned()
    }

    /// Tokenizes `text`; with `add_special_tokens`, BOS is prepended when the
    /// model wants one (and the tokenizer's post-processor runs).
    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EngineError> {
        let enc = self
            .inner
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|source| EngineError::Tokenizer {
                field: Field::Text,
                source,
            })?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens {
            if let (true, Some(bos)) = (self.inner.add_bos_token, self.inner.bos_token_id) {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    pub fn detokenize(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, EngineError> {
        self.inner
            .tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|source| EngineError::Tokenizer {
                field: Field::TokenId(0),
                source,
            })
    }

    /// Renders a conversation with the model's chat template, the
    /// assistant's generation prompt appended when asked (as a request's
    /// prompt always has it).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        let template = self
            .inner
            .chat_template
            .as_ref()
            .ok_or(EngineError::NoChatTemplate)?;
        // The template's reason (minijinja's) stays the typed `source`; the
        // wire formats print the whole chain.
        template
            .render_with_tools(messages, tools, add_generation_prompt)
            .map_err(|source| EngineError::ChatTemplate {
                field: Field::Messages,
                source,
            })
    }

    /// Renders (chat) and tokenizes a prompt; token ids are checked against
    /// the vocabulary and taken as they are.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        match prompt {
            Prompt::Text(text) => self.tokenize(text, true),
            // The template writes BOS itself when the model wants it.
            Prompt::Chat { messages, tools } => {
                self.tokenize(&self.render_chat(messages, tools, true)?, false)
            }
            Prompt::Tokens(ids) => {
                let vocab = self.vocab_size();
                match ids.iter().position(|&id| id as usize >= vocab) {
                    None => Ok(ids.clone()),
                    Some(i) => Err(EngineError::invalid(
                        Field::Prompt,
                        format!("token {i} must be in [0, {vocab}), got {}", ids[i]),
                    )),
                }
            }
            // An image's prompt is the model's own (BOS, image rows,
            // template), not text to tokenize.
            Prompt::Vision { .. } => Err(crate::validate::no_vision(self)),
        }
    }
}

/// Model and engine facts for `ModelInfo` RPCs; KV fields are live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub name: String,
    pub architecture: String,
    pub vocab_size: usize,
    /// Context length the engine serves (the configured `max_seq_len` or the model's).
    pub context_length: usize,
    pub eos_token_ids: Vec<u32>,
    pub backend: String,
    pub mode: PipelineMode,
    pub max_batch_size: usize,
    pub kv_pages_total: usize,
    pub kv_pages_used: usize,
    pub kv_pages_free: usize,
    /// Requests holding KV now (zombies included), from the last loop iteration.
    pub num_admitted: usize,
    pub num_running: usize,
    pub num_waiting: usize,
}

/// Serving state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Serving,
    NotServing(String),
}
