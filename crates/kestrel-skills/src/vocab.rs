//! Token bytes and the llguidance token environment, built once per model.
//!
//! Every token id maps to its exact raw bytes (byte-level BPE characters are
//! un-mapped, `<0xNN>` byte-fallback tokens become their byte); special tokens
//! carry toktrie's `0xFF` marker so they never match grammar text. Ids past the
//! tokenizer's vocabulary (padded logits rows) get a special placeholder. Cost:
//! one pass over the vocabulary plus the trie build (tens of ms for 50k tokens).

use std::collections::HashMap;
use std::sync::Arc;

use kestrel_pipeline::TokenId;
use tokenizers::{DecoderWrapper, Tokenizer};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::error::SkillError;

/// How the tokenizer's pieces map to bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceEncoding {
    /// GPT-2 style: each byte is one printable char.
    ByteLevel,
    /// SentencePiece style: `<0xNN>` byte tokens, `space_char` stands for ' '.
    ByteFallback { space_char: char },
}

fn is_self_mapped(c: char) -> bool {
    matches!(c, '!'..='~' | '\u{00A1}'..='\u{00AC}' | '\u{00AE}'..='\u{00FF}')
}

/// The inverse of GPT-2's `bytes_to_unicode`.
fn byte_level_char_map() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut next = 0x100u32;
    for byte in 0..=255u8 {
        let c = byte as char;
        if is_self_mapped(c) {
            map.insert(c, byte);
        } else {
            // 0x100..0x143 are all valid chars.
            if let Some(c) = char::from_u32(next) {
                map.insert(c, byte);
            }
            next += 1;
        }
    }
    map
}

fn detect_encoding(tokenizer: &Tokenizer) -> Result<PieceEncoding, SkillError> {
    fn walk(d: &DecoderWrapper, byte_level: &mut bool, fallback: &mut bool, space: &mut char) {
        match d {
            DecoderWrapper::ByteLevel(_) => *byte_level = true,
            DecoderWrapper::ByteFallback(_) => *fallback = true,
            DecoderWrapper::Replace(r) if r.content == " " => {
                // The pattern is private; its serialized form is {"String": "▁"}.
                if let Ok(v) = serde_json::to_value(r) {
                    if let Some(s) = v["pattern"]["String"].as_str() {
                        let mut chars = s.chars();
                        if let (Some(c), None) = (chars.next(), chars.next()) {
                            *space = c;
                        }
                    }
                }
            }
            DecoderWrapper::Sequence(seq) => {
                for d in seq.get_decoders() {
                    walk(d, byte_level, fallback, space);
                }
            }
            _ => {}
        }
    }
    let (mut byte_level, mut fallback, mut space) = (false, false, ' ');
    if let Some(d) = tokenizer.get_decoder() {
        walk(d, &mut byte_level, &mut fallback, &mut space);
    }
    if byte_level {
        Ok(PieceEncoding::ByteLevel)
    } else if fallback {
        Ok(PieceEncoding::ByteFallback { space_char: space })
    } else {
        Err(SkillError::UnsupportedTokenizer {
            reason: format!(
                "decoder is neither ByteLevel nor ByteFallback: {:?}",
                tokenizer.get_decoder()
            ),
        })
    }
}

/// Raw bytes of every token id in `0..vocab_size`, special tokens marked with
/// [`TokTrie::SPECIAL_TOKEN_MARKER`].
fn token_bytes(
    tokenizer: &Tokenizer,
    encoding: PieceEncoding,
    vocab_size: usize,
) -> Result<Vec<Vec<u8>>, SkillError> {
    let tok_vocab = tokenizer.get_vocab_size(true);
    if vocab_size < tok_vocab {
        return Err(SkillError::VocabTooSmall {
            model: vocab_size,
            tokenizer: tok_vocab,
        });
    }
    let added = tokenizer.get_added_tokens_decoder();
    let char_map = byte_level_char_map();
    let special = |content: &str| {
        let mut b = Vec::with_capacity(content.len() + 1);
        b.push(TokTrie::SPECIAL_TOKEN_MARKER);
        b.extend_from_slice(content.as_bytes());
        b
    };
    let mut out = Vec::with_capacity(vocab_size);
    for id in 0..vocab_size as TokenId {
        if let Some(tok) = added.get(&id) {
            // Added tokens of the form <...> are control tokens even when not
            // flagged special (as llguidance's own HF adapter does).
            let is_control =
                tok.special || (tok.content.starts_with('<') && tok.content.ends_with('>'));
            out.push(if is_control {
                special(&tok.content)
            } else {
                tok.content.clone().into_bytes()
            });
            continue;
        }
        let Some(piece) = tokenizer.id_to_token(id) else {
            // Padding rows past the tokenizer: never text, never grammar.
            out.push(special(&format!("<[{id}]>")));
            continue;
        };
        let bytes = match encoding {
            PieceEncoding::ByteLevel => {
                let mapped: Option<Vec<u8>> =
                    piece.chars().map(|c| char_map.get(&c).copied()).collect();
                match mapped {
                    Some(b) => b,
                    None => {
                        tracing::warn!(
                            id,
                            piece,
                            "token has chars outside the byte-level alphabet"
                        );
                        piece.into_bytes()
                    }
                }
            }
            PieceEncoding::ByteFallback { space_char } => {
                if piece.len() == 6 && piece.starts_with("<0x") && piece.ends_with('>') {
                    match u8::from_str_radix(&piece[3..5], 16) {
                        Ok(b) => vec![b],
                        Err(_) => piece.into_bytes(),
                    }
                } else {
                    piece.replace(space_char, " ").into_bytes()
                }
            }
        };
        out.push(bytes);
    }
    Ok(out)
}

/// llguidance's view of the tokenizer: the trie plus canonical tokenization.
struct KestrelTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
    canonical: bool,
}

impl TokenizerEnv for KestrelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            match self.tokenizer.encode(s, false) {
                Ok(enc) => enc.get_ids().to_vec(),
                // Never panic inside the grammar engine: fall back to the trie.
                Err(_) => self.trie.greedy_tokenize(s.as_bytes()),
            }
        })
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

/// Builds the token environment for `tokenizer` with `vocab_size` logits rows
/// and the given end-of-sequence ids (non-empty, all in range).
pub(crate) fn build_tok_env(
    tokenizer: &Arc<Tokenizer>,
    vocab_size: usize,
    eos: &[TokenId],
) -> Result<TokEnv, SkillError> {
    let encoding = detect_encoding(tokenizer)?;
    let words = token_bytes(tokenizer, encoding, vocab_size)?;
    let first_eos = *eos.first().ok_or(SkillError::NoEosToken)?;
    let info = TokRxInfo::new(vocab_size as u32, first_eos);
    let mut trie = TokTrie::from(&info, &words);
    if eos.len() > 1 {
        trie = trie.with_eos_tokens(eos);
    }
    Ok(Arc::new(KestrelTokEnv {
        trie,
        tokenizer: Arc::clone(tokenizer),
        // Byte-fallback tokenizers may prepend spaces when encoding fragments;
        // let llguidance tokenize greedily from the trie instead of forcing.
        canonical: encoding == PieceEncoding::ByteLevel,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;

    #[test]
    fn byte_level_map_is_a_bijection() {
        let map = byte_level_char_map();
        assert_eq!(map.len(), 256);
        let mut seen = [false; 256];
        for &b in map.values() {
            seen[b as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn fixture_tokens_decode_to_their_bytes() {
        let tok = Arc::new(testing::small_tokenizer());
        let env = build_tok_env(&tok, tok.get_vocab_size(true) + 3, &[testing::IM_END]).unwrap();
        let trie = env.tok_trie();
        // Byte tokens: id == byte value in the fixture.
        for b in 0..=255u8 {
            assert_eq!(trie.token(b as TokenId), &[b]);
        }
        assert!(trie.is_special_token(testing::IM_END));
        assert!(trie.is_special_token(testing::IM_START));
        // Padding rows are special placeholders.
        let pad = tok.get_vocab_size(true) as TokenId;
        assert!(trie.is_special_token(pad));
        // Encoding through the env round-trips.
        let ids = env.tokenize("hello world");
        assert_eq!(trie.decode_str(&ids), "hello world");
    }

    #[test]
    fn vocab_smaller_than_tokenizer_is_rejected() {
        let tok = Arc::new(testing::small_tokenizer());
        let err = build_tok_env(&tok, 10, &[0]).err().unwrap();
        assert!(matches!(err, SkillError::VocabTooSmall { model: 10, .. }));
    }
}
