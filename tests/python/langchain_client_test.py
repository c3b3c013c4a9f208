#!/usr/bin/env python3
"""Proves Kestrel's HTTP API works with LangChain's `ChatOpenAI` (langchain-openai).

Against a running server: `invoke` (content, usage, finish reason), `stream`
with usage (the chunks add up to the unary answer and its token count),
`batch`, `bind_tools` with a forced tool and with `tool_choice="any"` (the
call's arguments parse into the tool's schema), and `with_structured_output`
by `json_schema`, `function_calling` and `json_mode`; then an invalid
request must raise `openai.BadRequestError` naming its parameter.

    python3 -m pip install -r tests/python/requirements.txt
    kestrel serve --http-addr 127.0.0.1:8000 &
    python3 tests/python/langchain_client_test.py 127.0.0.1:8000

Prints "ok: ..." and exits 0 on success; exits 1 with a message on failure.
"""

import sys

from client_harness import check, main


def run(address: str, timeout: float) -> str:
    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """Current weather in a city."""

        city: str = Field(max_length=20)

    class GetTime(BaseModel):
        """Current local time in a city."""

        city: str = Field(max_length=20)

    class Colour(BaseModel):
        """A colour."""

        colour: str = Field(max_length=16)

    model = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused").models.list()
    model = model.data[0].id

    def chat(max_tokens):
        return ChatOpenAI(
            model=model,
            base_url=f"http://{address}/v1",
            api_key="unused",
            temperature=0,
            max_tokens=max_tokens,
            timeout=timeout,
            max_retries=0,
        )

    llm = chat(12)
    question = "Name three colours."
    unary = llm.invoke(question)
    check(isinstance(unary.content, str) and unary.content, unary)
    check(unary.response_metadata["finish_reason"] in ("stop", "length"), unary.response_metadata)
    out_tokens = unary.usage_metadata["output_tokens"]
    check(out_tokens >= 1 and unary.usage_metadata["input_tokens"] >= 1, unary.usage_metadata)

    chunks = list(llm.stream(question, stream_usage=True))
    check(len(chunks) > 2, f"not streamed: {chunks}")
    streamed = chunks[0]
    for c in chunks[1:]:
        streamed = streamed + c
    check(streamed.content == unary.content, f"{streamed.content!r} != {unary.content!r}")
    check(streamed.usage_metadata["output_tokens"] == out_tokens, streamed.usage_metadata)

    batch = llm.batch([question, "Say hello."])
    check(len(batch) == 2 and all(m.content for m in batch), batch)

    tool_llm = chat(60)
    ask = "What is the weather in Paris?"
    forced = tool_llm.bind_tools([GetWeather, GetTime], tool_choice="GetWeather").invoke(ask)
    check(len(forced.tool_calls) >= 1, forced)
    check(forced.tool_calls[0]["name"] == "GetWeather", forced.tool_calls)
    GetWeather(**forced.tool_calls[0]["args"])
    # One call, then the end (parallel calls let a small model go on calling
    # until max_tokens cuts it: finish_reason "length").
    anyone = tool_llm.bind_tools(
        [GetWeather, GetTime], tool_choice="any", parallel_tool_calls=False
    ).invoke(ask)
    check(len(anyone.tool_calls) >= 1, anyone)
    check(anyone.tool_calls[0]["name"] in ("GetWeather", "GetTime"), anyone.tool_calls)
    check(anyone.response_metadata["finish_reason"] == "tool_calls", anyone.response_metadata)

    pick = "Pick a colour."
    by_schema = tool_llm.with_structured_output(Colour, method="json_schema").invoke(pick)
    check(isinstance(by_schema, Colour), by_schema)
    by_function = tool_llm.with_structured_output(Colour, method="function_calling").invoke(pick)
    check(isinstance(by_function, Colour), by_function)
    by_json_mode = tool_llm.with_structured_output(method="json_mode").invoke(
        'Pick a colour. Answer in JSON like {"colour": "red"}.'
    )
    check(isinstance(by_json_mode, dict), by_json_mode)

    try:
        chat(4).bind(temperature=5000).invoke(question)
        raise AssertionError("temperature=5000 was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.body.get("param") == "temperature", e.body)

    return (
        f"model {model}, answer {unary.content!r}, forced {forced.tool_calls[0]['args']}, "
        f"structured {by_schema!r} {by_function!r} {by_json_mode!r}"
    )


if __name__ == "__main__":
    sys.exit(main(run, __doc__))
