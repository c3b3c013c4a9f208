//! Tokenizer fixtures for tests and benches (no files, no network).
//!
//! [`small_tokenizer`] is a real byte-level BPE `tokenizers::Tokenizer`: the
//! 256 byte tokens (id == byte value), a few merges (including one that makes
//! `é` a single token, while other multi-byte chars stay split across byte
//! tokens), and ChatML special tokens. [`synthetic_tokenizer`] pads that
//! alphabet with generated pieces up to a requested vocabulary size, for
//! benchmarking masks at a realistic vocabulary size.

use std::sync::Arc;

use kestrel_pipeline::TokenId;
use serde_json::{json, Map, Value};
use tokenizers::Tokenizer;

use crate::context::{SkillContext, SkillContextConfig};

/// Merges of the small fixture, in priority order, as GPT-2 byte-level pieces.
const MERGES: &[(&str, &str)] = &[
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
    ("{", "\""),
    ("\"", ":"),
    ("Ã", "©"), // "é" (C3 A9) as one token
    ("E", "N"),
    ("EN", "D"),
];

/// Number of merge tokens in [`small_tokenizer`] (ids `256..256 + N_MERGES`).
pub const N_MERGES: u32 = MERGES.len() as u32;
/// `<|endoftext|>` in [`small_tokenizer`].
pub const ENDOFTEXT: TokenId = 256 + N_MERGES;
/// `<|im_start|>` in [`small_tokenizer`].
pub const IM_START: TokenId = ENDOFTEXT + 1;
/// `<|im_end|>` in [`small_tokenizer`]: the fixture's end-of-sequence token.
pub const IM_END: TokenId = ENDOFTEXT + 2;

fn bytes_to_unicode() -> Vec<char> {
    let mut out = vec!['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let c = b as char;
        let self_mapped =
            matches!(c, '!'..='~' | '\u{00A1}'..='\u{00AC}' | '\u{00AE}'..='\u{00FF}');
        out[b as usize] = if self_mapped {
            c
        } else {
            let c = char::from_u32(next).unwrap_or('\0');
            next += 1;
            c
        };
    }
    out
}

fn tokenizer_json(extra_pieces: &[String], limit: usize) -> Value {
    let alphabet = bytes_to_unicode();
    let mut vocab = Map::new();
    for (b, c) in alphabet.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let mut next = 256u32;
    let mut merges = Vec::new();
    for (a, b) in MERGES {
        vocab.insert(format!("{a}{b}"), json!(next));
        merges.push(json!(format!("{a} {b}")));
        next += 1;
    }
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut added = Vec::new();
    for s in specials {
        vocab.insert(s.to_string(), json!(next));
        added.push(json!({
            "id": next, "content": s, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
        next += 1;
    }
    for piece in extra_pieces {
        if next as usize >= limit {
            break;
        }
        if !vocab.contains_key(piece) {
            vocab.insert(piece.clone(), json!(next));
            next += 1;
        }
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges
        }
    })
}

/// The small byte-level BPE fixture described in the module docs.
pub fn small_tokenizer() -> Tokenizer {
    let json = tokenizer_json(&[], 0).to_string();
    json.parse().expect("fixture tokenizer json is valid")
}

/// A byte-level vocabulary of exactly `vocab_size` tokens: the small fixture
/// plus generated pieces (letter runs with and without the `Ġ` space marker,
/// digit runs, JSON punctuation runs). The extra pieces have no merges, so the
/// tokenizer encodes with bytes; the trie, which is what mask computation
/// walks, has the full size.
pub fn synthetic_tokenizer(vocab_size: usize) -> Tokenizer {
    let base = 256 + MERGES.len() + 3;
    // Generate a margin: pieces already in the vocabulary are skipped.
    let want = vocab_size.saturating_sub(base) + 4096;
    let letters: Vec<char> = ('a'..='z').chain('A'..='Z').collect();
    let mut pieces = Vec::with_capacity(want);
    let punct = [
        "\"", ":", ",", "{", "}", "[", "]", " ", "Ġ", "Ċ", "\\", "_", "-", ".",
    ];
    'outer: for len in 1..=4usize {
        for prefix in ["Ġ", "", "\"", "_"] {
            for n in 0..letters.len().pow(len as u32) {
                if pieces.len() >= want {
                    break 'outer;
                }
                // `n` written in base 52 over the letter alphabet, `len` digits.
                let word: String = (0..len)
                    .map(|k| letters[(n / letters.len().pow(k as u32)) % letters.len()])
                    .collect();
                pieces.push(format!("{prefix}{word}"));
            }
        }
        for n in 0..10usize.pow(len as u32) {
            if pieces.len() >= want {
                break 'outer;
            }
            pieces.push(format!("{n:0len$}"));
        }
        for a in punct {
            for b in punct {
                if pieces.len() >= want {
                    break 'outer;
                }
                pieces.push(format!("{a}{b}{}", "Ġ".repeat(len - 1)));
            }
        }
    }
    let json = tokenizer_json(&pieces, vocab_size).to_string();
    let tok: Tokenizer = json.parse().expect("synthetic tokenizer json is valid");
    assert_eq!(
        tok.get_vocab_size(true),
        vocab_size,
        "synthetic vocabulary size"
    );
    tok
}

/// A context over [`small_tokenizer`] with `<|im_end|>` as end of sequence.
pub fn small_context() -> Arc<SkillContext> {
    SkillContext::new(SkillContextConfig {
        tokenizer: Arc::new(small_tokenizer()),
        eos_token_ids: vec![IM_END],
        vocab_size: None,
        chat_template: Some(Arc::new(crate::context::ChatMlTemplate::default())),
    })
    .expect("fixture context builds")
}
