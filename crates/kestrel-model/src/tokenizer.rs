//! Tokenizers: loaded from an HF `tokenizer.json`, or rebuilt from GGUF
//! metadata (`tokenizer.ggml.*`): `gpt2` as a byte-level BPE with the
//! pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`; `llama`
//! (SentencePiece BPE: Gemma, Llama 2) as a BPE whose merges are every split
//! of a vocabulary piece ranked by the piece's score, which merges exactly
//! what llama.cpp's score-driven SPM tokenizer merges. Control tokens (type 3)
//! become special added tokens, so `<|im_start|>` in text encodes to its own
//! id; user-defined tokens (type 4) become plain added tokens.

use std::path::Path;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::{GgufFile, ModelError};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// SentencePiece's visible space.
const SPM_SPACE: &str = "\u{2581}";

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

/// Rebuilds the tokenizer from GGUF metadata (`tokenizer.ggml.model` =
/// `gpt2` or `llama`).
pub fn tokenizer_from_gguf(gguf: &GgufFile) -> Result<Tokenizer, ModelError> {
    let model = gguf.get_str("tokenizer.ggml.model")?;
    match model {
        "gpt2" => {}
        "llama" => return spm_from_gguf(gguf),
        _ => {
            return Err(ModelError::UnsupportedTokenizer {
                reason: format!(
                    "tokenizer.ggml.model = `{model}` (supported: gpt2 = byte-level BPE, llama = SentencePiece BPE; or use an HF directory with tokenizer.json)"
                ),
            })
        }
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
    add_typed_tokens(gguf, &tokens, &mut tk, true);
    Ok(tk)
}

/// Control tokens (type 3) as special added tokens, user-defined ones
/// (type 4) as plain added tokens, matched against the normalized text when
/// `normalized`, else the raw text (SentencePiece: llama.cpp splits them out
/// before it escapes spaces, and Gemma has user-defined runs of spaces).
fn add_typed_tokens(gguf: &GgufFile, tokens: &[&str], tk: &mut Tokenizer, normalized: bool) {
    let Some(types) = gguf
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
    else {
        return;
    };
    let mut special = Vec::new();
    let mut added = Vec::new();
    for (i, t) in types.iter().enumerate() {
        let Some(tok) = tokens.get(i) else { break };
        match t.as_i64() {
            Some(TOKEN_TYPE_CONTROL) => special.push(AddedToken::from(tok.to_string(), true)),
            Some(TOKEN_TYPE_USER_DEFINED) => {
                added.push(AddedToken::from(tok.to_string(), false).normalized(normalized))
            }
            _ => {}
        }
    }
    tk.add_special_tokens(&special);
    tk.add_tokens(&added);
}

/// A SentencePiece-BPE vocabulary (`tokenizer.ggml.model = llama`) as an HF
/// BPE: spaces become `▁` (plus a leading one with `add_space_prefix`), no
/// pre-splitting, merges = every `(a, b)` with `a`, `b` and `a + b` in the
/// vocabulary and `a + b` a normal token, ranked by `a + b`'s score (highest
/// first), and `<0xXX>` byte fallback. llama.cpp's SPM tokenizer merges the
/// adjacent pair whose concatenation has the highest score until none is in
/// the vocabulary: the same merges in the same order.
fn spm_from_gguf(gguf: &GgufFile) -> Result<Tokenizer, ModelError> {
    let tokens = gguf.get_string_array("tokenizer.ggml.tokens")?;
    let scores = gguf.get_array("tokenizer.ggml.scores")?;
    let types = gguf.get_array("tokenizer.ggml.token_type")?;
    if scores.len() != tokens.len() || types.len() != tokens.len() {
        return Err(ModelError::UnsupportedTokenizer {
            reason: format!(
                "{} tokens but {} scores and {} types",
                tokens.len(),
                scores.len(),
                types.len()
            ),
        });
    }
    let mut vocab = Vocab::default();
    for (i, t) in tokens.iter().enumerate() {
        // The first id of a duplicated piece wins, as in llama.cpp.
        vocab.entry(t.to_string()).or_insert(i as u32);
    }
    let mut normal: Vec<(f32, usize)> = (0..tokens.len())
        .filter(|&i| types[i].as_i64() == Some(TOKEN_TYPE_NORMAL))
        .map(|i| (scores[i].as_f32().unwrap_or(f32::NEG_INFINITY), i))
        .collect();
    // Highest score first; ties by id (stable, deterministic).
    normal.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut merges = Vec::new();
    for &(_, i) in &normal {
        let t = tokens[i];
        for (at, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(at);
            if vocab.contains_key(a) && vocab.contains_key(b) {
                merges.push((a.to_string(), b.to_string()));
            }
        }
    }
    let unk = gguf
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(|v| v.as_u64())
        .and_then(|i| tokens.get(i as usize))
        .map(|t| t.to_string());
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder
        .build()
        .map_err(|source| ModelError::Tokenizer { source })?;
    let space_prefix = gguf
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(|v| v.as_bool())
        .unwrap_or(true);
    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|source| ModelError::Tokenizer { source })
    };
    let mut normalizers = Vec::new();
    if space_prefix {
        normalizers.push(Prepend::new(SPM_SPACE.into()).into());
    }
    normalizers.push(replace(" ", SPM_SPACE)?.into());
    let mut decoders = vec![
        replace(SPM_SPACE, " ")?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    let mut tk = Tokenizer::new(bpe);
    tk.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    tk.with_decoder(Some(DecoderSequence::new(decoders)));
    add_typed_tokens(gguf, &tokens, &mut tk, false);
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
