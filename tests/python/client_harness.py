"""What the HTTP client scripts share: `check`, and a `main` that runs a
script's `run(address, timeout)` against a running server, prints
"ok: <summary>" and exits 0, or prints the failure and exits 1."""

import argparse
import sys


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def main(run, doc: str) -> int:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("address", help="host:port of the HTTP API")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    try:
        summary = run(args.address, args.timeout)
    except Exception as e:  # noqa: BLE001 - report any failure and exit 1
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"ok: {summary}")
    return 0
