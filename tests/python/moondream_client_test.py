#!/usr/bin/env python3
"""Proves Kestrel serves the official `moondream` Python client.

Runs `md.vl(endpoint="http://ADDRESS/v1")` (moondream 2.6.1, installed
`--no-deps`: its HTTP client needs only Pillow) against a server on a
Moondream checkpoint: `query` and `caption` (short, normal, long), unary
and `stream=True` (the chunks concatenate to the unary answer: greedy
settings), `point` and `detect` (normalized points and boxes inside the
image, at most `settings.max_objects`, a smaller limit giving a prefix of
the larger's objects, the same objects when asked again),
the same question as an OpenAI chat with an `image_url` part (the
`openai` package; the same answer, from the same image bytes), and the
400s naming their field: not an image, a remote URL, an empty question,
an unknown caption length, an empty object, `max_objects` 0 or past 256,
an image in an OpenAI chat with a remote URL; an API key is ignored and an
unknown `model` is a 404.

    pip install -r tests/python/requirements.txt
    pip install --no-deps -r tests/python/requirements-no-deps.txt
    python3 scripts/reference/moondream_synth.py /tmp/md --served --seed 17
    kestrel serve --model /tmp/md --http-addr 127.0.0.1:8000 &
    python3 tests/python/moondream_client_test.py 127.0.0.1:8000

Prints "ok: ..." and exits 0 on success; exits 1 with a message on failure.
"""

import json
import urllib.error
import urllib.request

from client_harness import check, main

GREEDY = {"temperature": 0, "max_tokens": 12}


def picture():
    """A 640x480 RGB test picture (several crops' worth: a 2x3 tiling)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:480, 0:640]
    rgb = np.stack([(x * 255 // 639), (y * 255 // 479), ((x + y) % 256)], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def bad_request(call, param: str):
    """`call()` must fail with HTTP 400 whose JSON error names `param`."""
    try:
        call()
    except urllib.error.HTTPError as e:
        check(e.code == 400, f"expected 400 naming {param}, got {e.code}")
        body = json.loads(e.read().decode())
        check(body["error"]["param"] == param, f"expected param {param}: {body}")
        return body["error"]["message"]
    raise AssertionError(f"expected a 400 naming {param}, the call succeeded")


def run(address: str, timeout: float) -> str:
    import moondream as md
    import openai
    from moondream.types import Base64EncodedImage

    check(md.__version__ == "2.6.1", f"moondream {md.__version__}, pinned 2.6.1")
    vl = md.vl(endpoint=f"http://{address}/v1")
    image = picture()
    question = "What is in this picture?"

    answer = vl.query(image, question, settings=GREEDY)["answer"]
    check(isinstance(answer, str), f"query answer: {answer!r}")
    streamed = "".join(vl.query(image, question, stream=True, settings=GREEDY)["answer"])
    check(streamed == answer, f"streamed {streamed!r} != unary {answer!r}")
    # The default settings (temperature 0.2, top_p 0.9) sample: any string.
    check(isinstance(vl.query(image, "Describe it.")["answer"], str), "default settings")

    captions = {}
    for length in ("short", "normal", "long"):
        cap = vl.caption(image, length=length, settings=GREEDY)["caption"]
        check(isinstance(cap, str), f"{length} caption: {cap!r}")
        parts = list(vl.caption(image, length=length, stream=True, settings=GREEDY)["caption"])
        check("".join(parts) == cap, f"streamed {length} caption {parts!r} != {cap!r}")
        captions[length] = cap

    # point and detect: the client's own shapes, greedy.
    spatial = {}
    for skill, key in (("point", "points"), ("detect", "objects")):
        call = getattr(vl, skill)
        three = call(image, "cat", settings={"temperature": 0, "max_objects": 3})[key]
        check(isinstance(three, list) and len(three) <= 3, f"{skill}: {three!r}")
        fields = ("x", "y") if skill == "point" else ("x_min", "y_min", "x_max", "y_max")
        for o in three:
            check(set(o) == set(fields), f"{skill} object keys: {o!r}")
            check(all(0.0 <= o[f] <= 1.0 for f in fields), f"{skill} outside the image: {o!r}")
            if skill == "detect":
                check(o["x_min"] <= o["x_max"] and o["y_min"] <= o["y_max"], f"box {o!r}")
        one = call(image, "cat", settings={"temperature": 0, "max_objects": 1})[key]
        check(one == three[:1], f"{skill}: max_objects 1 gave {one!r}, 3 gave {three!r}")
        again = call(image, "cat", settings={"temperature": 0, "max_objects": 3})[key]
        check(again == three, f"{skill} again: {again!r} != {three!r}")
        # The default settings (max_objects 50, sampled) answer too.
        check(isinstance(call(image, "cat")[key], list), f"{skill} with default settings")
        spatial[skill] = three
    check(spatial["point"], "the synthetic checkpoint (seed 17) finds points to compare")
    check(len(spatial["detect"]) >= 1, f"detect found nothing: {spatial}")

    # The same question as an OpenAI chat, with the very bytes the
    # moondream client sent (its own JPEG encoding of the picture).
    data_url = vl.encode_image(image).image_url
    client = openai.OpenAI(
        base_url=f"http://{address}/v1", api_key="unused", timeout=timeout, max_retries=0
    )
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": question},
            {"type": "image_url", "image_url": {"url": data_url}},
        ]}],
        temperature=0,
        max_tokens=GREEDY["max_tokens"],
    )
    content = chat.choices[0].message.content or ""
    check(content == answer, f"chat answer {content!r} != moondream query {answer!r}")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url}},
                {"type": "text", "text": question},
            ]}],
            temperature=0,
            max_tokens=GREEDY["max_tokens"],
            stream=True,
        )
        if c.choices
    )
    check(streamed == answer, f"streamed chat {streamed!r} != {answer!r}")

    # Refusals, each a 400 naming its field, through the client itself.
    not_image = Base64EncodedImage(image_url="data:image/png;base64,bm90IGFuIGltYWdl")
    msg = bad_request(lambda: vl.query(not_image, question), "image_url")
    check("image" in msg, msg)
    truncated = Base64EncodedImage(image_url=data_url[: len(data_url) // 2])
    bad_request(lambda: vl.caption(truncated), "image_url")
    remote = Base64EncodedImage(image_url="https://example.com/cat.jpg")
    msg = bad_request(lambda: vl.query(remote, question), "image_url")
    check("fetches nothing" in msg, msg)
    bad_request(lambda: vl.query(image, ""), "question")
    bad_request(lambda: vl.caption(image, length="medium"), "length")
    for skill in ("point", "detect"):
        call = getattr(vl, skill)
        msg = bad_request(lambda: call(image, ""), "object")
        check("must not be empty" in msg, msg)
        for n in (0, 257):
            msg = bad_request(lambda: call(image, "cat", settings={"max_objects": n}),
                              "settings.max_objects")
            check("[1, 256]" in msg, msg)
        bad_request(lambda: call(not_image, "cat"), "image_url")
    bad_request(lambda: vl.query(image, question, settings={"temperature": -1}),
                "settings.temperature")
    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": question},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
            ]}],
        )
        raise AssertionError("a remote image URL was accepted")
    except openai.BadRequestError as e:
        param = e.body.get("param") if isinstance(e.body, dict) else None
        check(param == "messages[0].content[1].image_url", f"param {param}: {e}")

    # An API key (X-Moondream-Auth) is not read; `model` must be the
    # served id when the client names one.
    keyed = md.vl(endpoint=f"http://{address}/v1", api_key="any-key", model=model)
    check(keyed.query(image, question, settings=GREEDY)["answer"] == answer, "keyed client")
    other = md.vl(endpoint=f"http://{address}/v1", model="moondream3-preview")
    try:
        other.caption(image)
        raise AssertionError("an unknown model was accepted")
    except urllib.error.HTTPError as e:
        check(e.code == 404, f"unknown model: {e.code}")

    # Still serving after the refusals.
    again = vl.query(image, question, settings=GREEDY)["answer"]
    check(again == answer, f"after the refusals {again!r} != {answer!r}")
    return (
        f"query {answer!r}, captions {json.dumps(captions)}, "
        f"points {json.dumps(spatial['point'])}, boxes {json.dumps(spatial['detect'])}, "
        "streams equal, OpenAI image chat equal, 400s named"
    )


if __name__ == "__main__":
    raise SystemExit(main(run, __doc__))
