//! The prompt's rules (its shape, and its size capped before it is tokenized),
//! stop strings and stop token ids, token ids against the vocabulary, and a
//! constraint's shape before it is compiled.

use super::{bad, Field, Limits, Result};
use super::{
    CHAT_ROLES, MAX_CHAT_MESSAGES, MAX_CHOICES, MAX_PROMPT_BYTES, MAX_STOP_BYTES,
    MAX_STOP_SEQUENCES, MAX_STOP_TOKEN_IDS,
};
use crate::request::{Constraint, Prompt, VisionTask};

pub(super) fn check_prompt_shape(input: &Prompt) -> Result<()> {
    match input {
        Prompt::Text(text) if text.is_empty() => bad(Field::Prompt, "must not be empty"),
        Prompt::Text(_) => Ok(()),
        Prompt::Tokens(ids) if ids.is_empty() => bad(Field::Prompt, "must not be empty"),
        Prompt::Tokens(_) => Ok(()),
        // The question and the model's vision: `vision.rs`.
        Prompt::Vision { .. } => Ok(()),
        Prompt::Chat { messages, .. } => {
            if messages.is_empty() {
                return bad(Field::Messages, "must not be empty");
            }
            if messages.len() > MAX_CHAT_MESSAGES {
                return bad(
                    Field::Messages,
                    format!(
                        "must have at most {MAX_CHAT_MESSAGES} entries, got {}",
                        messages.len()
                    ),
                );
            }
            for (i, m) in messages.iter().enumerate() {
                if !CHAT_ROLES.contains(&m.role.as_str()) {
                    return bad(
                        Field::MessageRole(i),
                        format!("must be one of {}, got {:?}", CHAT_ROLES.join(", "), m.role),
                    );
                }
            }
            Ok(())
        }
    }
}

/// Refuses, before tokenizing, a prompt too large to fit the context
/// whatever it tokenizes to: every token covers at most
/// `max_token_bytes` bytes, so more bytes than `context x max_token_bytes`
/// is more tokens than the context holds. Token ids need no tokenizing:
/// their count is checked against the context with the output budget.
pub(super) fn check_prompt_size(input: &Prompt, limits: &Limits<'_>) -> Result<()> {
    let (field, bytes) = match input {
        Prompt::Text(text) => (Field::Prompt, text.len()),
        Prompt::Tokens(_) => return Ok(()),
        // The image's rows are a fixed count; the question is text.
        Prompt::Vision {
            task: VisionTask::Query { question },
            ..
        } => (Field::Question, question.len()),
        Prompt::Vision { .. } => return Ok(()),
        // Calls and tools are rendered too; their JSON length bounds
        // their share of the prompt.
        Prompt::Chat { messages, tools } => (
            Field::Messages,
            messages
                .iter()
                .map(|m| {
                    m.content.len()
                        + m.tool_calls
                            .iter()
                            .map(|c| c.name.len() + c.arguments.to_string().len())
                            .sum::<usize>()
                })
                .sum::<usize>()
                + tools.iter().map(|t| t.to_string().len()).sum::<usize>(),
        ),
    };
    let fits = limits
        .max_seq_len
        .saturating_mul(limits.model.max_token_bytes().max(1))
        .min(MAX_PROMPT_BYTES);
    if bytes > fits {
        return bad(
            field,
            format!(
                "is {bytes} bytes, more than a context of {} tokens can hold (at most {fits} bytes)",
                limits.max_seq_len
            ),
        );
    }
    Ok(())
}

pub(super) fn stop_sequences(stop: Vec<String>) -> Result<Vec<String>> {
    if stop.len() > MAX_STOP_SEQUENCES {
        return bad(
            Field::Stop,
            format!(
                "must have at most {MAX_STOP_SEQUENCES} entries, got {}",
                stop.len()
            ),
        );
    }
    for (i, s) in stop.iter().enumerate() {
        if s.is_empty() || s.len() > MAX_STOP_BYTES {
            return bad(
                Field::StopEntry(i),
                format!("must be 1 to {MAX_STOP_BYTES} bytes long, got {}", s.len()),
            );
        }
    }
    Ok(stop)
}

pub(super) fn stop_token_ids(ids: Vec<u32>, vocab_size: usize) -> Result<Vec<u32>> {
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return bad(
            Field::StopTokenIds,
            format!(
                "must have at most {MAX_STOP_TOKEN_IDS} entries, got {}",
                ids.len()
            ),
        );
    }
    token_ids_in_vocab(&ids, vocab_size, Field::StopTokenId)?;
    Ok(ids)
}

/// Checks that every id is below the vocabulary size; `field(i)` names the
/// offending entry.
pub(crate) fn token_ids_in_vocab(
    ids: &[u32],
    vocab_size: usize,
    field: impl Fn(usize) -> Field,
) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab_size) {
        None => Ok(()),
        Some(i) => bad(
            field(i),
            format!("must be in [0, {vocab_size}), got {}", ids[i]),
        ),
    }
}

pub(super) fn check_constraint(c: Constraint) -> Result<Constraint> {
    match &c {
        Constraint::JsonSchema(schema) if !(schema.is_object() || schema.is_boolean()) => bad(
            Field::JsonSchema,
            "must be a JSON object or boolean (a JSON Schema)",
        ),
        Constraint::Regex(re) if re.is_empty() => bad(Field::Regex, "must not be empty"),
        Constraint::Grammar(g) if g.trim().is_empty() => bad(Field::Grammar, "must not be empty"),
        Constraint::Choice(list) => {
            if list.is_empty() {
                return bad(Field::Choices, "must not be empty");
            }
            if list.len() > MAX_CHOICES {
                return bad(
                    Field::Choices,
                    format!(
                        "must have at most {MAX_CHOICES} entries, got {}",
                        list.len()
                    ),
                );
            }
            if let Some(i) = list.iter().position(String::is_empty) {
                return bad(Field::Choice(i), "must not be empty");
            }
            Ok(c)
        }
        _ => Ok(c),
    }
}
