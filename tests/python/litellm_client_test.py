#!/usr/bin/env python3
"""Proves Kestrel's HTTP API works with LiteLLM's `completion`.

Against a running server, with `api_base` pointed at it and the model named
`openai/<served name>` (LiteLLM's route for any OpenAI-compatible server): a
unary completion (content, usage, finish reason), a streamed one (the deltas
concatenate to the unary answer; the usage chunk's count matches), and an
invalid request that must raise `litellm.BadRequestError`.

LiteLLM fetches its model-cost map from the internet at import unless
`LITELLM_LOCAL_MODEL_COST_MAP=True`; this script sets it.

    python3 -m pip install -r tests/python/requirements.txt
    kestrel serve --http-addr 127.0.0.1:8000 &
    python3 tests/python/litellm_client_test.py 127.0.0.1:8000

Prints "ok: ..." and exits 0 on success; exits 1 with a message on failure.
"""

import json
import os
import sys
import urllib.request

from client_harness import check, main


def run(address: str, timeout: float) -> str:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm

    # Its "Give Feedback" banner on every error goes to stdout.
    litellm.suppress_debug_info = True

    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=timeout) as r:
        served = json.load(r)["data"][0]["id"]
    common = {
        "model": f"openai/{served}",
        "api_base": f"http://{address}/v1",
        "api_key": "unused",
        "timeout": timeout,
        "max_retries": 0,
        "temperature": 0,
        "max_tokens": 12,
    }
    messages = [{"role": "user", "content": "Name three colours."}]

    unary = litellm.completion(messages=messages, **common)
    answer = unary.choices[0].message.content
    check(answer, f"empty answer: {unary}")
    check(unary.choices[0].finish_reason in ("stop", "length"), unary)
    check(unary.usage.completion_tokens >= 1, unary.usage)

    stream = litellm.completion(
        messages=messages, stream=True, stream_options={"include_usage": True}, **common
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    check(len(pieces) > 2, f"not streamed: {pieces}")
    check("".join(pieces) == answer, f"stream {''.join(pieces)!r} != unary {answer!r}")
    check(finish == unary.choices[0].finish_reason, finish)
    check(usage is not None and usage.completion_tokens == unary.usage.completion_tokens, usage)

    try:
        litellm.completion(messages=messages, **{**common, "temperature": 5000})
        raise AssertionError("temperature=5000 was accepted")
    except litellm.BadRequestError as e:
        check("temperature" in str(e), e)

    return f"model openai/{served}, answer {answer!r}, {usage.completion_tokens} tokens"


if __name__ == "__main__":
    sys.exit(main(run, __doc__))
