//! [`OutputBuffer`]: a request's committed output and its streaming cursor.
//!
//! Invariant: `streamed <= safe_len <= text.len()`, and text before
//! `safe_len` never changes again. Streaming hands out `text[streamed..safe_len]`,
//! so the concatenated deltas are always a prefix of the final text, and equal
//! to it once the buffer is sealed (sealing releases everything held back).

use kestrel_pipeline::TokenId;
use serde::{Deserialize, Serialize};

use crate::detok::Utf8Decoder;
use crate::stop::StopStrings;

/// Log-probabilities of one committed token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: TokenId,
    /// `None` when the sampler did not compute it for this step.
    pub logprob: Option<f32>,
    /// The top alternatives `(token, logprob)`, best first.
    pub top: Vec<(TokenId, f32)>,
}

/// What was newly committed and is safe to send to a streaming client.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamDelta {
    /// New text: complete characters only, never part of a possible stop string.
    pub text: String,
    /// Tokens committed since the last delta (including a final EOS or stop token).
    pub token_ids: Vec<TokenId>,
    /// Their log-probabilities, when requested.
    pub logprobs: Vec<TokenLogprob>,
}

#[derive(Debug, Default)]
pub(crate) struct OutputBuffer {
    pub text: String,
    safe_len: usize,
    streamed: usize,
    pub tokens: Vec<TokenId>,
    tokens_streamed: usize,
    pub logprobs: Vec<TokenLogprob>,
    logprobs_streamed: usize,
    decoder: Utf8Decoder,
    stops: StopStrings,
    sealed: bool,
}

impl OutputBuffer {
    pub fn new(stops: StopStrings) -> Self {
        Self {
            stops,
            ..Self::default()
        }
    }

    pub fn record_token(&mut self, token: TokenId, logprob: Option<TokenLogprob>) {
        self.tokens.push(token);
        if let Some(lp) = logprob {
            self.logprobs.push(lp);
        }
    }

    /// Appends a token's bytes to the text. Returns true when a stop string
    /// matched (only looked for when `match_stops`; a match ending in text
    /// appended without it never counts): the text is then cut before it
    /// and the buffer sealed.
    pub fn push_text(&mut self, bytes: &[u8], match_stops: bool) -> bool {
        debug_assert!(!self.sealed, "text pushed after the output was sealed");
        let old_len = self.text.len();
        self.decoder.push(bytes, &mut self.text);
        if self.text.len() == old_len {
            return false;
        }
        let found = match_stops
            .then(|| self.stops.find(&self.text, old_len))
            .flatten();
        if let Some(at) = found {
            debug_assert!(
                at >= self.safe_len,
                "stop string inside already-streamable text"
            );
            self.text.truncate(at);
            self.safe_len = at;
            self.sealed = true;
            return true;
        }
        let held = self.stops.holdback(&self.text);
        self.safe_len = self.safe_len.max(self.text.len() - held);
        false
    }

    /// The output is final: flush an incomplete character and release held text.
    pub fn seal(&mut self) {
        if !self.sealed {
            self.decoder.finish(&mut self.text);
            self.safe_len = self.text.len();
            self.sealed = true;
        }
    }

    pub fn take_delta(&mut self) -> Option<StreamDelta> {
        let text = &self.text[self.streamed..self.safe_len];
        if text.is_empty()
            && self.tokens_streamed == self.tokens.len()
            && self.logprobs_streamed == self.logprobs.len()
        {
            return None;
        }
        let delta = StreamDelta {
            text: text.to_owned(),
            token_ids: self.tokens[self.tokens_streamed..].to_vec(),
            logprobs: self.logprobs[self.logprobs_streamed..].to_vec(),
        };
        self.streamed = self.safe_len;
        self.tokens_streamed = self.tokens.len();
        self.logprobs_streamed = self.logprobs.len();
        Some(delta)
    }
}
