"""Renders tests/chat_templates/*.jinja for one tool-calling conversation the
way `transformers`' `apply_chat_template` does (jinja2 sandbox with
trim_blocks, lstrip_blocks, loopcontrols, `raise_exception` and its `tojson`),
printing each result as a JSON string: the expected values of
crates/kestrel-model/tests/chat_templates.rs's tool tests.

Usage: python scripts/reference/tool_templates.py
(`strftime_now` is left undefined, as Kestrel leaves it, so Llama 3.2's
template writes its fixed date.)
"""

import json
import pathlib

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "chat_templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "abc123XYZ",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "22 C", "tool_call_id": "abc123XYZ"},
]

# (fixture, bos_token, eos_token)
FIXTURES = [
    ("qwen2.5.jinja", "", "<|im_end|>"),
    ("qwen3.jinja", "", "<|im_end|>"),
    ("llama3.1.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("llama3.2.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("mistral-v0.3.jinja", "<s>", "</s>"),
]


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def main():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    for name, bos, eos in FIXTURES:
        template = env.from_string((ROOT / name).read_text())
        out = template.render(
            messages=MESSAGES,
            tools=TOOLS,
            add_generation_prompt=True,
            bos_token=bos,
            eos_token=eos,
        )
        print(name, json.dumps(out))


if __name__ == "__main__":
    main()
