#!/usr/bin/env python3
"""Drives Kestrel's chat page (GET /) in a real headless Chromium with Playwright.

Against a running server it: loads the page and sees the served model's name;
sets a system prompt, temperature 0 and a token cap, types a message and sees
the answer stream in (several growing renderings), equal to the API's own
greedy answer for the same messages (so the page sent the system prompt, the
settings and, on a second turn, the history); starts a long answer and stops
it, then reads /metrics until nothing is left running (no running, waiting or
admitted request, no KV page in use) and the engine counted one abort; answers
in JSON-schema mode (the text parses and fits the schema); shows the server's
400 for an invalid schema and a readable error for a schema that is not JSON.
Screenshots go to the artifacts directory.

    python3 -m pip install -r tests/python/requirements.txt   # playwright (pinned)
    apt-get install -y chromium                                # Debian's browser
    kestrel serve --http-addr 127.0.0.1:8000 &
    python3 tests/python/chat_page_test.py 127.0.0.1:8000 --artifacts /tmp/chat-page

The server must serve nothing else meanwhile (the /metrics checks expect an
idle engine). Prints "ok: ..." and exits 0 on success; exits 1 with a message
(and a failure screenshot) otherwise.
"""

import argparse
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

# Headless, no sandbox (CI runs as root), and no network of its own.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# The gauges that must all read 0 once nothing is running.
IDLE_GAUGES = [
    "kestrel_running_sequences",
    "kestrel_queue_depth",
    "kestrel_admitted_sequences",
    "kestrel_kv_pages_used",
]
ABORTED = 'kestrel_requests_finished_total{reason="abort"}'


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def http_json(address, path, body=None, timeout=120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{address}{path}", data=data, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def metrics(address):
    """The Prometheus text of /metrics as {series: value}."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def wait_idle(address, seconds=30.0):
    """Polls /metrics until every idle gauge reads 0; returns the metrics."""
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(address)
        busy = {g: m.get(g) for g in IDLE_GAUGES if m.get(g) != 0}
        if not busy:
            return m
        check(time.monotonic() < deadline, f"still running after {seconds}s: {busy}")
        time.sleep(0.1)


def api_answer(address, model, messages, max_tokens):
    """The API's own greedy answer and its completion token count."""
    r = http_json(
        address,
        "/v1/chat/completions",
        {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
    )
    return r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]


# Records every rendering of the newest answer's text, to see it stream in.
WATCH_ANSWERS = """() => {
  window.__renderings = [];
  new MutationObserver(() => {
    const texts = document.querySelectorAll('.msg.assistant .text');
    if (texts.length) window.__renderings.push(texts[texts.length - 1].textContent);
  }).observe(document.getElementById('log'),
             {subtree: true, childList: true, characterData: true});
}"""


def run(address, artifacts: Path, chromium, timeout):
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=timeout * 1000)
    artifacts.mkdir(parents=True, exist_ok=True)
    model = http_json(address, "/v1/models")["data"][0]["id"]
    wait_idle(address)
    aborted_before = metrics(address).get(ABORTED, 0)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        problems, urls = [], []
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on(
            "console",
            lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
        )
        page.on("request", lambda r: urls.append(r.url))
        try:
            summary = drive(page, expect, address, model, artifacts, aborted_before, timeout)
        except BaseException:
            page.screenshot(path=str(artifacts / "failure.png"), full_page=True)
            raise
        finally:
            browser.close()

    # The page's own 400 (invalid schema) shows as a console error; nothing else may.
    problems = [p for p in problems if "status of 400" not in p]
    check(not problems, f"the page logged errors: {problems}")
    origin = f"http://{address}/"
    foreign = [u for u in urls if not u.startswith(origin)]
    check(not foreign, f"the page fetched other origins: {foreign}")
    m = wait_idle(address)
    check(m.get(ABORTED, 0) == aborted_before + 1, f"one abort expected: {m.get(ABORTED)}")
    return summary


def send(page, expect, text):
    """Types `text`, sends it with Enter, returns the new answer's locator."""
    count = page.locator(".msg.assistant").count()
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_label("Message", exact=True).press("Enter")
    answer = page.locator(".msg.assistant").nth(count)
    expect(answer).to_be_attached()
    return answer


def drive(page, expect, address, model, artifacts, aborted_before, timeout):
    page.goto(f"http://{address}/")
    expect(page.locator("#model")).to_have_text(model)
    expect(page.get_by_role("button", name="Send")).to_be_enabled()

    # 1. A streamed answer, the same as the API's greedy one.
    system = "You are a concise assistant."
    page.get_by_label("System prompt").fill(system)
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("24")
    page.evaluate(WATCH_ANSWERS)
    question = "Name three colours."
    answer = send(page, expect, question)
    expect(answer).to_have_attribute("data-state", "done")
    text = answer.locator(".text").text_content()
    renderings = page.evaluate("window.__renderings")
    growing = sorted({len(r) for r in renderings if r})
    check(len(growing) >= 3, f"the answer did not stream in: {renderings}")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    expected, tokens = api_answer(address, model, messages, 24)
    check(text == expected, f"page {text!r} != API {expected!r}")
    stats = answer.locator(".stats").text_content()
    check(re.match(rf"{tokens} tokens? · [0-9.]+ tok/s · first token \d+ ms", stats), stats)
    page.screenshot(path=str(artifacts / "01-answer.png"))

    # 2. A second turn carries the history.
    follow_up = "Which one is the warmest?"
    answer = send(page, expect, follow_up)
    expect(answer).to_have_attribute("data-state", "done")
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
    expected, _ = api_answer(address, model, messages, 24)
    check(answer.locator(".text").text_content() == expected, "the second turn lost the history")

    # 3. A long answer (greedy, it runs to the cap), stopped: the engine
    # aborts it and frees its KV.
    page.get_by_role("button", name="New chat").click()
    expect(page.locator(".msg")).to_have_count(0)
    page.get_by_label("Max tokens").fill("2000")
    answer = send(page, expect, "List the numbers from 1 to 500, separated by commas.")
    page.wait_for_function(
        "() => { const t = document.querySelectorAll('.msg.assistant .text');"
        " return t[t.length - 1].textContent.length > 40; }",
        timeout=timeout * 1000,
    )
    running = metrics(address)
    check(running["kestrel_running_sequences"] == 1, "the long answer is not running")
    check(running["kestrel_kv_pages_used"] > 0, "the long answer holds no KV")
    check(running.get(ABORTED, 0) == aborted_before, "an abort before Stop")
    page.get_by_role("button", name="Stop").click()
    expect(answer).to_have_attribute("data-state", "stopped")
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    check(answer.locator(".text").text_content(), "the stopped answer's text is gone")
    page.screenshot(path=str(artifacts / "02-stopped.png"))
    idle = wait_idle(address)
    check(idle.get(ABORTED, 0) == aborted_before + 1, "Stop did not abort the request")

    # 4. JSON-schema mode: the answer fits the schema.
    page.get_by_role("button", name="New chat").click()
    expect(page.locator(".msg")).to_have_count(0)
    page.get_by_label("JSON schema mode").check()
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 16}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    page.get_by_label("JSON schema", exact=True).fill(json.dumps(schema, indent=2))
    page.get_by_label("Max tokens").fill("40")
    answer = send(page, expect, "Pick a colour, as JSON.")
    expect(answer).to_have_attribute("data-state", "done")
    value = json.loads(answer.locator(".text").text_content())
    check(set(value) == {"colour"} and isinstance(value["colour"], str), value)
    page.screenshot(path=str(artifacts / "03-json.png"))

    # 5. Errors: the server's 400 for a bad schema, and a schema that is not JSON.
    page.get_by_label("JSON schema", exact=True).fill('{"type": "strin"}')
    page.get_by_label("Message", exact=True).fill("Again, please.")
    page.get_by_label("Message", exact=True).press("Enter")
    notice = page.get_by_role("alert")
    expect(notice).to_be_visible()
    expect(notice).to_contain_text("parameter: response_format")
    expect(notice).to_contain_text("HTTP 400")
    # The failed turn is taken out and its text given back to edit.
    expect(page.get_by_label("Message", exact=True)).to_have_value("Again, please.")
    expect(page.locator(".msg")).to_have_count(2)
    server_error = notice.text_content()
    page.screenshot(path=str(artifacts / "04-schema-error.png"))
    page.get_by_label("JSON schema", exact=True).fill('{"type": ')
    page.get_by_label("Message", exact=True).press("Enter")
    expect(notice).to_contain_text("The JSON schema is not valid JSON")
    expect(page.locator(".msg")).to_have_count(2)
    expect(page.get_by_label("Message", exact=True)).to_have_value("Again, please.")

    return f"model {model}, answer {text!r}, schema error {server_error!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the HTTP API")
    parser.add_argument("--artifacts", type=Path, required=True, help="screenshot directory")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    try:
        summary = run(args.address, args.artifacts, args.chromium, args.timeout)
    except Exception as e:  # noqa: BLE001 - report any failure and exit 1
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"ok: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
