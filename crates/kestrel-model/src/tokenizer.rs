//! Tokenizers: loaded from an HF `tokenizer.json`, or rebuilt from GGUF
//! metadata (`tokenizer.ggml.*`) as a byte-level BPE with the pre-tokenizer
//! llama.cpp uses for `tokenizer.ggml.pre`. Control tokens (type 3) become
//! special added tokens, so `<|im_start|>` in text encodes to its own id;
//! user-defined tokens (type 4) become plain added tokens.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::{GgufFile, ModelError};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Loads an HF `tokenizer.json`.
pub fn tokenizer_from_file(path: &Path) -> Result<Tokenizer, ModelError> {
    Tokenizer::from_file(path).map_err(|source| ModelError::Tokenizer { source })
}

/// The pre-tokenizer llama.cpp applies for a `tokenizer.ggml.pre` value.
fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex).into();
    let split = |re: &str| -> Result<PreTokenizerWrapper, ModelError> {
        let pattern = SplitPattern::Regex(re.to_string());
        let split = Split::new(pattern, SplitDelimiterBehavior::Isolated, false)
            .map_err(|source| ModelError::Tokenizer { source })?;
        Ok(split.into())
    };
    Ok(match pre {
        // GPT-2's regex, built into ByteLevel.
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        // Single digits first, then the GPT-2 regex (StarCoder family, SmolLM).
        "smollm" | "starcoder" | "refact" | "codeshell" => {
            Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into()
        }
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "falcon3" | "pixtral" => {
            Sequence::new(vec![split(LLAMA3_REGEX)?, byte_level(false)]).into()
        }
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => {
            Sequence::new(vec![split(QWEN2_REGEX)?, byte_level(false)]).into()
        }
        other => {
            return Err(ModelError::UnsupportedTokenizer {
                reason: format!(
                    "tokenizer.ggml.pre = `{other}` (supported: default, gpt2, smollm, starcoder, refact, codeshell, llama3/llama-bpe, qwen2)"
                ),
            })
        }
    })
}

/// Rebuilds the tokenizer from GGUF metadata (`tokenizer.ggml.model = gpt2`).
pub fn tokenizer_from_gguf(gguf: &GgufFile) -> Result<Tokenizer, ModelError> {
    let model = gguf.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(ModelError::UnsupportedTokenizer {
            reason: format!(
                "tokenizer.ggml.model = `{model}`; only byte-level BPE (`gpt2`) GGUF vocabularies are supported (use an HF directory with tokenizer.json for SentencePiece models)"
            ),
        });
    }
    let tokens = gguf.get_string_array("tokenizer.ggml.tokens")?;
    let merges = gguf.get_string_array("tokenizer.ggml.merges")?;
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| ModelError::UnsupportedTokenizer {
                    reason: format!("merge `{m}` has no space separator"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|source| ModelError::Tokenizer { source })?;

    let pre = match gguf.get("tokenizer.ggml.pre").and_then(|v| v.as_str()) {
        Some(p) => p,
        None => {
            tracing::warn!("GGUF has no tokenizer.ggml.pre; using the GPT-2 pre-tokenizer");
            "default"
        }
    };
    let mut tk = Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(pre_tokenizer_for(pre)?));
    tk.with_decoder(Some(ByteLevelDecoder::default()));

    if let Some(types) = gguf
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
    {
        let mut special = Vec::new();
        let mut added = Vec::new();
        for (i, t) in types.iter().enumerate() {
            let Some(tok) = tokens.get(i) else { break };
            match t.as_i64() {
                Some(TOKEN_TYPE_CONTROL) => special.push(AddedToken::from(tok.to_string(), true)),
                Some(TOKEN_TYPE_USER_DEFINED) => {
                    added.push(AddedToken::from(tok.to_string(), false))
                }
                _ => {}
            }
        }
        tk.add_special_tokens(&special);
        tk.add_tokens(&added);
    }
    Ok(tk)
}

/// Encodes `text` without adding BOS/EOS; special tokens written in the text
/// (e.g. `<|im_start|>`) are recognized.
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, ModelError> {
    tokenizer
        .encode(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|source| ModelError::Tokenizer { source })
}

/// Decodes ids back to text, keeping special tokens.
pub fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> Result<String, ModelError> {
    tokenizer
        .decode(ids, false)
        .map_err(|source| ModelError::Tokenizer { source })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gguf::write_gguf;
    use crate::GgufValue;

    fn strings(v: &[&str]) -> GgufValue {
        GgufValue::Array(v.iter().map(|s| GgufValue::String(s.to_string())).collect())
    }

    pub(crate) fn tiny_gguf(pre: &str) -> GgufFile {
        // Byte-level alphabet for "hello world 12" plus a few merges.
        let tokens = [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "h",
            "e",
            "l",
            "o",
            "Ġ",
            "w",
            "r",
            "d",
            "1",
            "2",
            "he",
            "ll",
            "llo",
            "hello",
            "Ġw",
            "or",
            "Ġwor",
            "Ġworld",
            "12",
            "Ċ",
        ];
        let merges = ["h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "1 2"];
        let mut types = vec![GgufValue::I32(1); tokens.len()];
        for t in types.iter_mut().take(3) {
            *t = GgufValue::I32(3);
        }
        let bytes = write_gguf(
            &[
                ("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
                ("tokenizer.ggml.pre", GgufValue::String(pre.into())),
                ("tokenizer.ggml.tokens", strings(&tokens)),
                ("tokenizer.ggml.merges", strings(&merges)),
                ("tokenizer.ggml.token_type", GgufValue::Array(types)),
            ],
            &[],
        );
        GgufFile::parse(bytes.into(), "t.gguf".into()).unwrap()
    }

    #[test]
    fn special_tokens_and_round_trip() {
        let tk = tokenizer_from_gguf(&tiny_gguf("smollm")).unwrap();
        let ids = encode(&tk, "<|im_start|>hello world<|im_end|>").unwrap();
        // "world" has no "ld" merge: Ġwor + l + d.
        assert_eq!(ids, vec![1, 16, 19, 5, 10, 2]);
        assert_eq!(
            decode(&tk, &ids).unwrap(),
            "<|im_start|>hello world<|im_end|>"
        );
    }

    #[test]
    fn digits_split_individually_for_smollm_only() {
        let smol = tokenizer_from_gguf(&tiny_gguf("smollm")).unwrap();
        assert_eq!(encode(&smol, "12").unwrap(), vec![11, 12]);
        let gpt2 = tokenizer_from_gguf(&tiny_gguf("gpt2")).unwrap();
        assert_eq!(encode(&gpt2, "12").unwrap(), vec![21]);
    }

    #[test]
    fn unknown_pre_is_typed_error() {
        assert!(matches!(
            tokenizer_from_gguf(&tiny_gguf("made-up")),
            Err(ModelError::UnsupportedTokenizer { .. })
        ));
    }
}
