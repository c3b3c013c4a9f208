#!/usr/bin/env python3
"""Proves Kestrel's HTTP API works with the official `openai` Python client.

Calls a running server through `openai.OpenAI(base_url=...)`: the model
list, a chat completion, a streamed chat completion (deltas concatenate to
the unary answer), a json_schema response format, a required tool call
whose arguments parse and validate, a text completion (and the same
prompt as token ids from `/tokenize`, echoed), and an invalid
request that must raise `openai.BadRequestError` naming its parameter.

    python3 -m pip install -r tests/python/requirements.txt
    kestrel serve --http-addr 127.0.0.1:8000 &
    python3 tests/python/openai_client_test.py 127.0.0.1:8000

Prints "ok: ..." and exits 0 on success; exits 1 with a message on failure.
"""

import json
import sys

from client_harness import check, main


def run(address: str, timeout: float) -> str:
    import openai

    client = openai.OpenAI(
        base_url=f"http://{address}/v1", api_key="unused", timeout=timeout, max_retries=0
    )
    models = client.models.list().data
    check(len(models) == 1, f"one model expected, got {models}")
    model = models[0].id

    messages = [{"role": "user", "content": "Name three colours."}]
    unary = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0
    )
    answer = unary.choices[0].message.content
    check(answer, f"empty answer: {unary}")
    check(unary.choices[0].finish_reason in ("stop", "length"), unary)
    check(unary.usage.completion_tokens >= 1, unary.usage)

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    check("".join(pieces) == answer, f"stream {''.join(pieces)!r} != unary {answer!r}")
    check(finish == unary.choices[0].finish_reason, finish)
    check(usage is not None and usage.completion_tokens == unary.usage.completion_tokens, usage)

    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 16}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    structured = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Pick a colour, as JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "colour", "schema": schema, "strict": True},
        },
    )
    value = json.loads(structured.choices[0].message.content)
    check(set(value) == {"colour"} and isinstance(value["colour"], str), value)

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    called = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=40,
        temperature=0,
        tools=tools,
        tool_choice="required",
        # One call, then the end: with parallel calls allowed, a small model
        # may go on calling until max_tokens cuts it ("length").
        parallel_tool_calls=False,
    )
    choice = called.choices[0]
    check(choice.finish_reason == "tool_calls", choice)
    call = choice.message.tool_calls[0]
    check(call.function.name == "get_weather", call)
    args = json.loads(call.function.arguments)
    check(set(args) == {"city"} and isinstance(args["city"], str), args)

    text = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    check(text.choices[0].text, text)

    # vLLM's /tokenize (at the server's root), then the same prompt as
    # token ids, echoed: the text is the prompt followed by the same answer.
    import httpx

    tokens = httpx.post(
        f"http://{address}/tokenize",
        json={"prompt": "The capital of France is"},
        timeout=timeout,
    ).json()["tokens"]
    echoed = client.completions.create(
        model=model, prompt=tokens, max_tokens=5, temperature=0, echo=True
    )
    check(
        echoed.choices[0].text.endswith("The capital of France is" + text.choices[0].text),
        (echoed, text),
    )

    try:
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=4, temperature=5000
        )
        raise AssertionError("temperature=5000 was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, e)
        check(e.body.get("param") == "temperature", e.body)
    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=4)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        check(e.body.get("code") == "model_not_found", e.body)

    return f"model {model}, answer {answer!r}, tool call {call.function.arguments}"


if __name__ == "__main__":
    sys.exit(main(run, __doc__))
