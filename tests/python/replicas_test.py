#!/usr/bin/env python3
"""Kestrel replicas behind SMG (the Shepherd Model Gateway), on loopback.

Starts three `kestrel serve` replicas on free 127.0.0.1 ports and the real
`smg` router in front of them, and drives 90 chat requests in 6
shared-prefix groups through the router with the official `openai` client
(every sixth one streamed):

1. round_robin on fresh replicas, then cache_aware on fresh replicas, the
   same 90 requests in the same order: every request succeeds, and the
   replicas' summed prefix-cache hit rate (`vllm:prefix_cache_hits_total` /
   `vllm:prefix_cache_queries_total`, read from their /metrics) is higher
   with cache_aware;
2. the same traffic again on the cache_aware replicas while one replica is
   SIGKILLed and another drained with SIGTERM: every request ends in success
   (retryable errors -- connection failures, 5xx, 429, a stream cut short
   by a killed replica -- are retried by the client, at most RETRIES
   times), none times out, the drained replica
   exits 0 within its drain timeout, and the surviving replica's KV pages
   in use return to zero.

Every process it starts is stopped before it exits (and lives in the
caller's process group, so the Rust test can kill them all on a timeout).

    kestrel_replicas_test.py KESTREL_BIN WORK_DIR

Prints "ok: {json}" (hit rates, retries, timings) and exits 0 on success;
exits 1 with the failure and the processes' log tails otherwise.
"""

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

MODEL = "kestrel-test"
GROUPS = 6
PER_GROUP = 15
MAX_TOKENS = 4
CONCURRENCY = 4
RETRIES = 10
REQUEST_TIMEOUT = 60.0
DRAIN_TIMEOUT = 20
# Replicas small enough for three (and the router) on two cores.
REPLICA_ARGS = [
    "--threads", "1",
    "--max-batch", "4",
    "--kv-pages", "512",
    "--max-seq-len", "1024",
    "--drain-timeout", str(DRAIN_TIMEOUT),
]  # fmt: skip

TOPICS = [
    "lighthouse keepers on a stormy northern coast",
    "a bakery that opens at four in the morning",
    "the migration of arctic terns across the globe",
    "repairing an old mechanical wristwatch",
    "a chess club in a small mountain village",
    "growing tomatoes on a city balcony",
]


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0):
    """(status, body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


class Proc:
    """A child process with its log file; stopped (killed if need be) by `stop`.

    Its ports are picked free (`free_port`) and bound by the child a moment
    later, so another process on a busy machine can take one in between: a
    child that exits saying its address is in use is started again on fresh
    ports (`spawn` picks them), a few times, instead of failing the test.
    """

    START_TRIES = 3

    def __init__(self, name: str, work: str):
        self.name = name
        self.log_path = os.path.join(work, f"{name}.log")
        self.retries = 0
        self.start()

    def argv(self) -> list:
        """The command line, on freshly picked ports."""
        raise NotImplementedError

    def start(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv(), stdout=self.log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        if self.proc.poll() is not None and self.retries < self.START_TRIES:
            self.log.close()
            if "Address already in use" in self.tail():
                self.retries += 1
                self.start()
                return True
        return self.proc.poll() is None

    def stop(self):
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self.log.close()

    def tail(self, n: int = 15) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


class Replica(Proc):
    def __init__(self, name: str, kestrel: str, work: str):
        self.kestrel = kestrel
        super().__init__(name, work)

    def argv(self) -> list:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        return [
            self.kestrel, "serve",
            "--addr", f"127.0.0.1:{free_port()}",
            "--http-addr", f"127.0.0.1:{self.port}",
            "--no-metrics",
            "--served-model-name", MODEL,
        ] + REPLICA_ARGS  # fmt: skip

    def wait_ready(self, deadline: float):
        while time.monotonic() < deadline:
            check(self.alive(), f"{self.name} exited while starting:\n{self.tail()}")
            if http_get(self.url + "/health", 1.0)[0] == 200:
                return
            time.sleep(0.2)
        raise AssertionError(f"{self.name} not ready in time:\n{self.tail()}")

    def metrics(self) -> dict:
        """Metric name -> value summed over its label sets (no histograms)."""
        status, body = http_get(self.url + "/metrics")
        check(status == 200, f"{self.name} /metrics answered {status}")
        out = {}
        for line in body.splitlines():
            if not line or line.startswith("#"):
                continue
            head, value = line.rsplit(" ", 1)
            name = head.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out


class Router(Proc):
    def __init__(self, smg: str, policy: str, replicas: list, work: str):
        self.smg, self.policy, self.replicas = smg, policy, replicas
        super().__init__(f"smg-{policy}", work)

    def argv(self) -> list:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        return [
            self.smg, "launch",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--worker-urls", *[r.url for r in self.replicas],
            "--policy", self.policy,
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()),
            "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1",
            "--health-success-threshold", "1",
            "--log-level", "info",
        ]  # fmt: skip

    def wait_ready(self, deadline: float, workers: int):
        while time.monotonic() < deadline:
            check(self.alive(), f"smg exited while starting:\n{self.tail()}")
            status, body = http_get(self.url + "/workers", 1.0)
            if status == 200:
                listed = json.loads(body)
                healthy = [w for w in listed.get("workers", []) if w.get("is_healthy")]
                if len(healthy) == workers:
                    return
            time.sleep(0.3)
        raise AssertionError(f"smg did not register {workers} workers in time:\n{self.tail()}")


def traffic() -> list:
    """90 (group, messages, stream) requests in a fixed shuffled order, so
    round_robin's rotation does not line up with the groups."""
    reqs = []
    for g, topic in enumerate(TOPICS):
        system = (
            f"You are a careful assistant who answers questions about {topic}. "
            f"Keep every answer short, concrete and friendly, and never repeat "
            f"the question. Group {g} context: the reader already knows the "
            f"basics of {topic} and wants one precise new fact each time."
        )
        for i in range(PER_GROUP):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: tell me fact number {i * 7 + g}."},
            ]
            reqs.append((g, messages))
    random.Random(20).shuffle(reqs)
    return [(g, m, k % 6 == 5) for k, (g, m) in enumerate(reqs)]


class Client:
    """The openai client with the retry loop a production client would have."""

    def __init__(self, base: str):
        import openai

        self.openai = openai
        self.client = openai.OpenAI(
            base_url=base + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0
        )
        self.retries = 0
        self.errors = {}

    def retryable(self, e) -> bool:
        o = self.openai
        if isinstance(e, o.APITimeoutError):
            return False  # a hang: fail the test rather than hide it
        if isinstance(e, (o.APIConnectionError, o.RateLimitError, o.InternalServerError)):
            return True
        if isinstance(e, o.APIStatusError):
            return e.status_code in (502, 503, 504)
        # A stream the router could not finish (its replica was SIGKILLed
        # mid-answer: SMG ends the body early, the client raises a plain
        # APIError "Stream error"): the partial answer is dropped and the
        # request sent again.
        return isinstance(e, o.APIError) and "Stream error" in str(e)

    def chat(self, messages, stream: bool) -> str:
        for attempt in range(RETRIES + 1):
            try:
                if not stream:
                    r = self.client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
                    )
                    check(r.choices[0].finish_reason in ("stop", "length"), f"{r}")
                    return r.choices[0].message.content
                text, finish = [], None
                for chunk in self.client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                ):
                    if chunk.choices:
                        text.append(chunk.choices[0].delta.content or "")
                        finish = chunk.choices[0].finish_reason or finish
                check(finish in ("stop", "length"), f"stream ended with {finish!r}")
                return "".join(text)
            except Exception as e:  # noqa: BLE001 (sorted below)
                kind = type(e).__name__
                self.errors[kind] = self.errors.get(kind, 0) + 1
                if attempt == RETRIES or not self.retryable(e):
                    raise
                self.retries += 1
                time.sleep(min(0.2 * 2**attempt, 2.0))
        raise AssertionError("unreachable")


def drive(router: Router, reqs: list, during=None) -> dict:
    """Sends `reqs` through the router, CONCURRENCY at a time; `during(n)`
    is called with the count of completed requests as they complete."""
    client = Client(router.url)
    done, streamed = 0, 0
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(client.chat, m, s) for _, m, s in reqs]
        for f in concurrent.futures.as_completed(futures):
            text = f.result()  # re-raises a request that did not succeed
            check(text, "an empty answer")
            done += 1
            if during:
                during(done)
    streamed = sum(1 for _, _, s in reqs if s)
    return {
        "ok": done,
        "streamed": streamed,
        "retries": client.retries,
        "errors": client.errors,
        "seconds": round(time.monotonic() - started, 1),
    }


def hit_rate(replicas: list) -> float:
    hits = queries = 0.0
    for r in replicas:
        m = r.metrics()
        hits += m["vllm:prefix_cache_hits_total"]
        queries += m["vllm:prefix_cache_queries_total"]
    check(queries > 0, "no prefix-cache queries recorded")
    return hits / queries


def start_replicas(kestrel: str, work: str, tag: str, procs: list) -> list:
    replicas = [Replica(f"kestrel-{tag}{i}", kestrel, work) for i in range(3)]
    procs.extend(replicas)
    deadline = time.monotonic() + 180
    for r in replicas:
        r.wait_ready(deadline)
    return replicas


def start_router(smg: str, policy: str, replicas: list, work: str, procs: list) -> Router:
    router = Router(smg, policy, replicas, work)
    procs.append(router)
    router.wait_ready(time.monotonic() + 60, len(replicas))
    return router


def drain_all(replicas: list):
    """SIGTERM each replica and check it exits 0 (an idle drain)."""
    for r in replicas:
        r.proc.send_signal(signal.SIGTERM)
    for r in replicas:
        code = r.proc.wait(timeout=DRAIN_TIMEOUT + 10)
        check(code == 0, f"{r.name} exited {code} after SIGTERM:\n{r.tail()}")


def run(kestrel: str, smg: str, work: str, procs: list) -> dict:
    reqs = traffic()
    check(len(reqs) == GROUPS * PER_GROUP, "90 requests")
    report = {"requests_per_phase": len(reqs)}
    started = time.monotonic()

    # 1. The same traffic under round_robin and under cache_aware, each on
    # fresh replicas (empty prefix caches).
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        replicas = start_replicas(kestrel, work, policy[:2], procs)
        router = start_router(smg, policy, replicas, work, procs)
        report[policy] = drive(router, reqs)
        rates[policy] = hit_rate(replicas)
        report[policy]["prefix_cache_hit_rate"] = round(rates[policy], 4)
        if policy == "round_robin":
            router.stop()
            drain_all(replicas)
    check(
        rates["cache_aware"] > rates["round_robin"],
        f"cache_aware hit rate {rates['cache_aware']:.3f} is not above "
        f"round_robin's {rates['round_robin']:.3f}",
    )

    # Text completions pass through the router too (SMG adds `echo: false`
    # to every one).
    c = Client(router.url).client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    check(c.choices[0].text, f"an empty completion through the router: {c}")
    report["completion_through_router"] = c.choices[0].text

    # 2. Failures on the cache_aware replicas: SIGKILL one after 20
    # requests, drain another with SIGTERM after 40.
    killed, drained, survivor = replicas
    events = {}

    def during(n: int):
        if n == 20 and "kill" not in events:
            killed.proc.send_signal(signal.SIGKILL)
            events["kill"] = n
        if n == 40 and "term" not in events:
            drained.proc.send_signal(signal.SIGTERM)
            # Not ready as soon as the signal is handled (or already gone,
            # when nothing was in flight).
            sent = time.monotonic()
            status = 200
            while status == 200 and time.monotonic() - sent < 2.0:
                status = http_get(drained.url + "/health", 2.0)[0]
            events["health_after_term"] = status
            events["health_flip_ms"] = round((time.monotonic() - sent) * 1000)
            events["term"] = n

    report["failover"] = drive(router, reqs, during)
    check(events.get("kill") and events.get("term"), f"failures not injected: {events}")
    check(
        events["health_after_term"] in (503, 0),
        f"drained replica answered /health {events['health_after_term']}",
    )
    report["failover"]["drained_health"] = events["health_after_term"]
    report["failover"]["drained_health_flip_ms"] = events["health_flip_ms"]
    code = drained.proc.wait(timeout=DRAIN_TIMEOUT + 10)
    check(code == 0, f"the drained replica exited {code}:\n{drained.tail()}")
    check(killed.proc.wait(timeout=5) == -signal.SIGKILL, "the killed replica")

    # The survivor's KV pages come back once its requests are done.
    deadline = time.monotonic() + 10
    while True:
        m = survivor.metrics()
        if m["kestrel_kv_pages_used"] == 0 and m["vllm:num_requests_running"] == 0:
            break
        check(time.monotonic() < deadline, f"KV pages still in use: {m['kestrel_kv_pages_used']}")
        time.sleep(0.2)
    report["failover"]["survivor_kv_pages_used"] = 0
    router.stop()
    drain_all([survivor])
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("kestrel", help="the kestrel binary")
    parser.add_argument("work", help="a directory for the processes' logs")
    args = parser.parse_args()
    smg = shutil.which("smg") or os.path.join(os.path.dirname(sys.executable), "smg")
    procs = []
    try:
        report = run(args.kestrel, smg, args.work, procs)
    except Exception as e:  # noqa: BLE001 (reported with the logs)
        print(f"FAILED: {type(e).__name__}: {e}")
        for p in procs:
            print(f"--- {p.name} (log {p.log_path}) ---\n{p.tail()}")
        return 1
    finally:
        for p in procs:
            p.stop()
    print("ok: " + json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
