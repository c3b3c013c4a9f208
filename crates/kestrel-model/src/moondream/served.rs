//! A Moondream 2 checkpoint as Kestrel serves it: [`load_dir`] turns a
//! Hugging Face directory (`config.json` with `model_type: "moondream1"`,
//! `model.safetensors`, `tokenizer.json`) into a [`LoadedModel`] whose
//! weights are the Phi text decoder and whose [`VisionModel`] holds the
//! encoder, projector, optional region model and prompt templates; and
//! [`image_token_ids`] names an image's prompt rows by its content.

use std::path::Path;

use tokenizers::Tokenizer;

use super::checkpoint::{load_checkpoint, RegionWeights, VisionWeights};
use super::config::{MoondreamConfig, PromptTokens};
use crate::vision::PreparedImage;
use crate::{LoadedModel, ModelError};

/// What a Moondream model has beyond its text decoder.
#[derive(Debug, Clone)]
pub struct VisionModel {
    /// The whole configuration (its `tokens` are `prompts`).
    pub config: MoondreamConfig,
    /// The encoder and projector.
    pub weights: VisionWeights,
    /// The region model, if the checkpoint has one (`point` / `detect`).
    pub region: Option<RegionWeights>,
    /// The prompt templates of the checkpoint's vocabulary.
    pub prompts: PromptTokens,
}

/// Ids past the vocabulary stand for image rows from here on (`vocab_size
/// + [0, 2^30)`): never looked up, only compared.
const IMAGE_ID_SPAN: u64 = 1 << 30;

/// The `rows` prompt ids standing for an image's rows: ids past the
/// vocabulary (`vocab_size..vocab_size + 2^30`) derived from its content
/// hash, so the prefix cache (keyed by ids) keys an image prefix by its
/// content: the same image gives the same ids, another image (with
/// overwhelming likelihood) others from the first row on.
pub fn image_token_ids(image: &PreparedImage, vocab_size: usize, rows: usize) -> Vec<u32> {
    let words: Vec<u64> = image
        .hash
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("eight bytes")))
        .collect();
    (0..rows)
        .map(|i| {
            let x = splitmix64(words[i % 4] ^ splitmix64(i as u64));
            (vocab_size as u64 + x % IMAGE_ID_SPAN) as u32
        })
        .collect()
}

/// SplitMix64's output function: a bijective mix of 64 bits.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The prompt templates `tokenizer` spells (docs/moondream.md, "Prompts
/// and token ids"): the GPT-2 vocabulary's when id 50256 is
/// `<|endoftext|>` (the 2025-01-09 / 04-14 revisions and the 0.5B model;
/// the 0.5B json, text width 1024, has no long caption), else the
/// 2025-06-21 "Starmie" vocabulary's.
pub fn prompt_tokens_for(tokenizer: &Tokenizer, config: &MoondreamConfig) -> PromptTokens {
    if tokenizer.id_to_token(50256).as_deref() == Some("<|endoftext|>") {
        let small = MoondreamConfig::moondream2_0_5b().text.dim;
        PromptTokens::gpt2(config.text.dim != small)
    } else {
        PromptTokens::starmie()
    }
}

/// Whether `dir` is a Moondream checkpoint (`config.json`'s `model_type`
/// is `moondream1`).
pub(crate) fn is_moondream_dir(config: &serde_json::Value) -> bool {
    config.get("model_type").and_then(serde_json::Value::as_str) == Some("moondream1")
}

/// Loads a Moondream 2 Hugging Face directory: the Phi text weights as
/// [`LoadedModel::weights`], the vision side as [`LoadedModel::vision`],
/// BOS and EOS from the templates' vocabulary. It ships no chat template
/// (its skills are `query` and `caption`); raw prompts start with BOS.
pub(crate) fn load_dir(dir: &Path) -> Result<LoadedModel, ModelError> {
    let mut config = MoondreamConfig::from_file(&dir.join("config.json"))?;
    let tokenizer = crate::tokenizer::tokenizer_from_file(&dir.join("tokenizer.json"))?;
    let prompts = prompt_tokens_for(&tokenizer, &config);
    config.tokens = prompts.clone();
    let md = load_checkpoint(dir, config.clone())?;
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(LoadedModel {
        weights: md.text,
        tokenizer,
        chat_template: None,
        bos_token_id: Some(prompts.bos_id),
        eos_token_ids: vec![prompts.eos_id],
        add_bos_token: true,
        name,
        vision: Some(VisionModel {
            config,
            weights: md.vision,
            region: md.region,
            prompts,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vision::{CropGeometry, RgbImage};

    #[test]
    fn image_ids_are_past_the_vocabulary_and_follow_the_content() {
        let img = |seed: u8| {
            let px = (0..20 * 10 * 3).map(|i| (i as u8) ^ seed).collect();
            PreparedImage::new(
                &RgbImage::from_raw(20, 10, px).unwrap(),
                &CropGeometry::MOONDREAM,
            )
        };
        let (a, b) = (img(1), img(2));
        let ids = image_token_ids(&a, 51200, 729);
        assert_eq!(ids.len(), 729);
        assert!(ids.iter().all(|&t| t >= 51200));
        assert_eq!(ids, image_token_ids(&img(1), 51200, 729));
        let other = image_token_ids(&b, 51200, 729);
        assert!(ids.iter().zip(&other).all(|(x, y)| x != y));
        // Rows differ within one image too.
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert!(distinct.len() > 700);
    }

    /// A BPE tokenizer of `n` tokens, `<|endoftext|>` at `eot`.
    fn tokenizer(n: usize, eot: usize) -> Tokenizer {
        let vocab: serde_json::Map<String, serde_json::Value> = (0..n)
            .map(|i| match i == eot {
                true => ("<|endoftext|>".to_string(), i.into()),
                false => (format!("t{i}"), i.into()),
            })
            .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": []}
        });
        json.to_string().parse().unwrap()
    }

    #[test]
    fn the_tokenizer_decides_the_templates() {
        let gpt2 = tokenizer(50257, 50256);
        let (md2, md05) = (
            MoondreamConfig::moondream2(),
            MoondreamConfig::moondream2_0_5b(),
        );
        assert_eq!(prompt_tokens_for(&gpt2, &md2), PromptTokens::gpt2(true));
        assert_eq!(prompt_tokens_for(&gpt2, &md05), PromptTokens::gpt2(false));
        let starmie = tokenizer(51200, 0);
        assert_eq!(prompt_tokens_for(&starmie, &md2), PromptTokens::starmie());
    }
}
