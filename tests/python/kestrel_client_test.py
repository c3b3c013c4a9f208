#!/usr/bin/env python3
"""Proves proto/kestrel/v1/kestrel.proto is usable from another language.

Generates Python stubs from the proto with grpcio-tools into a temporary
directory, then calls Generate, StreamGenerate and ModelInfo against a running
Kestrel server and checks the answers are sane.

    python3 -m pip install -r tests/python/requirements.txt
    kestrel serve --addr 127.0.0.1:50051 &
    python3 tests/python/kestrel_client_test.py 127.0.0.1:50051

Exits 0 on success, 1 with a message on failure.
"""

import argparse
import importlib
import pathlib
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "proto"
PROTO = PROTO_ROOT / "kestrel" / "v1" / "kestrel.proto"


def generate_stubs(out_dir: pathlib.Path):
    """Compiles the proto into out_dir and imports the generated modules."""
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    sys.path.insert(0, str(out_dir))
    pb2 = importlib.import_module("kestrel.v1.kestrel_pb2")
    pb2_grpc = importlib.import_module("kestrel.v1.kestrel_pb2_grpc")
    return pb2, pb2_grpc


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def run(address: str, timeout: float) -> None:
    import grpc

    with tempfile.TemporaryDirectory(prefix="kestrel-stubs-") as tmp:
        pb2, pb2_grpc = generate_stubs(pathlib.Path(tmp))
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=timeout)
            stub = pb2_grpc.KestrelStub(channel)

            info = stub.ModelInfo(pb2.ModelInfoRequest(), timeout=timeout)
            check(info.vocab_size > 0, f"vocab_size: {info}")
            check(info.max_new_tokens == info.context_length - 1, f"limits: {info}")

            request = pb2.GenerateRequest(
                prompt="The capital of France is",
                max_new_tokens=8,
                temperature=0.0,
            )
            unary = stub.Generate(request, timeout=timeout)
            check(len(unary.token_ids) >= 1, f"no tokens: {unary}")
            check(len(unary.token_ids) <= 8, f"too many tokens: {unary}")
            check(unary.usage.prompt_tokens > 0, f"usage: {unary.usage}")
            check(
                unary.finish_reason
                in (pb2.FINISH_REASON_LENGTH, pb2.FINISH_REASON_EOS),
                f"finish_reason: {unary.finish_reason}",
            )

            text, tokens, done = "", [], None
            for message in stub.StreamGenerate(request, timeout=timeout):
                kind = message.WhichOneof("event")
                check(done is None, "a message after done")
                if kind == "delta":
                    text += message.delta.text
                    tokens.extend(message.delta.token_ids)
                elif kind == "done":
                    done = message.done
            check(done is not None, "no done message")
            check(text == done.text, f"deltas {text!r} != done {done.text!r}")
            check(list(done.token_ids) == tokens, "token ids differ")
            check(done.text == unary.text, f"greedy stream {done.text!r} != unary {unary.text!r}")

            chat = pb2.GenerateRequest(
                chat=pb2.ChatMessages(
                    messages=[pb2.ChatMessage(role="user", content="Pick a colour.")]
                ),
                max_new_tokens=8,
                choice=pb2.ChoiceList(choices=["red", "green", "blue"]),
            )
            picked = stub.Generate(chat, timeout=timeout)
            check(picked.text in ("red", "green", "blue"), f"choice: {picked.text!r}")

            try:
                stub.Generate(
                    pb2.GenerateRequest(prompt="x", temperature=-1.0), timeout=timeout
                )
                raise AssertionError("temperature=-1 was accepted")
            except grpc.RpcError as e:
                check(e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"code: {e.code()}")
                check("temperature" in e.details(), f"details: {e.details()}")

    print(f"ok: {unary.text!r} / {done.text!r} / {picked.text!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of a Kestrel gRPC server")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    try:
        run(args.address, args.timeout)
    except Exception as e:  # noqa: BLE001 - report any failure as a test failure
        print(f"FAIL: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
