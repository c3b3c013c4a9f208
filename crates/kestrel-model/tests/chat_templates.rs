//! The chat templates of the new families, as their models publish them
//! (`tests/chat_templates/`: Gemma 3's from google/gemma-3-*-it, Qwen3's from
//! Qwen/Qwen3-*), rendered by Kestrel's minijinja environment and compared
//! with what Python's jinja2 renders in `transformers`' configuration
//! (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`); the
//! expected strings were produced that way. They use what SmolLM2's template
//! does not: `is string` / `is iterable` tests, `| trim`, `messages[1:]` and
//! `messages[::-1]`, `namespace()` mutated in a loop, `str.split/lstrip/
//! rstrip/strip/startswith`, `is defined`, and role checks that raise.

use kestrel_model::{ChatMessage, ChatTemplate, ModelError};

const GEMMA3: &str = include_str!("../../../tests/chat_templates/gemma3.jinja");
const QWEN3: &str = include_str!("../../../tests/chat_templates/qwen3.jinja");

fn system_user() -> Vec<ChatMessage> {
    vec![
        ChatMessage::system("Be brief."),
        ChatMessage::user("  What is 2+2? "),
    ]
}

fn multi_turn() -> Vec<ChatMessage> {
    vec![
        ChatMessage::user("Hi"),
        ChatMessage::assistant("<think>\nhmm\n</think>\n\nHello!"),
        ChatMessage::user("Bye"),
    ]
}

#[test]
fn gemma3_template() {
    let t = ChatTemplate::new(GEMMA3, "<bos>", "<eos>").unwrap();
    assert_eq!(
        t.render(&system_user(), true).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(
        t.render(&multi_turn(), true).unwrap(),
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n<think>\nhmm\n</think>\n\nHello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    // Roles must alternate starting with the user: the template raises.
    match t.render(&[ChatMessage::assistant("x")], false) {
        Err(ModelError::ChatTemplate { source }) => {
            assert!(source.to_string().contains("must alternate"), "{source}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn qwen3_template() {
    let t = ChatTemplate::new(QWEN3, "", "<|im_end|>").unwrap();
    assert_eq!(
        t.render(&system_user(), true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  What is 2+2? <|im_end|>\n<|im_start|>assistant\n"
    );
    // Reasoning of turns before the last user query is dropped.
    assert_eq!(
        t.render(&multi_turn(), true).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
}
