"""API fuzzing, longer than CI: tests/test_api_fuzz.py (Schemathesis against a real ``tokenmill serve`` on the
embedded model and a real ``tokenmill router`` in front of it, 127.0.0.1) with more examples per operation.

It runs that test file under pytest with ``TOKENMILL_FUZZ_MAX_EXAMPLES`` set, then reads the two processes'
access logs and prints, per app, the requests sent by method, route and status, the 5xx count (must be 0),
and the wall time. Exit status: pytest's (nonzero when any check failed: a 5xx, a schema violation, an
unhealthy process afterwards)::

    .venv/bin/python benchmarks/fuzz_api.py                      # 100 examples per operation and mode
    .venv/bin/python benchmarks/fuzz_api.py --max-examples 500   # longer
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ACCESS = re.compile(r'uvicorn\.access: \S+ - "(\w+) ([^ ?]*)\S* HTTP/[\d.]+" (\d{3})')
ID_SEGMENT = re.compile(r"/(sessions|workers|models)/[^/]+")


def access_counts(log: Path) -> collections.Counter:
    """(method, route with ids folded to ``{id}``, status) -> requests, from a uvicorn access log."""
    counts: collections.Counter = collections.Counter()
    for match in ACCESS.finditer(log.read_text(errors="replace")):
        method, path, status = match.groups()
        counts[method, ID_SEGMENT.sub(r"/\1/{id}", path), int(status)] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=100,
                        help="examples per operation and generation mode (CI: 8)")
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[], help="more pytest arguments")
    args = parser.parse_args()
    env = {**os.environ, "TOKENMILL_FUZZ_MAX_EXAMPLES": str(args.max_examples)}
    with tempfile.TemporaryDirectory(prefix="tokenmill-fuzz-") as basetemp:
        started = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", basetemp,
                                "tests/test_api_fuzz.py", *args.pytest_args], cwd=REPO, env=env)
        elapsed = time.perf_counter() - started
        logs = sorted(Path(basetemp).glob("fuzz_logs[0-9]*/*.log"))
        print(f"\nfuzz_api: {args.max_examples} examples per operation and mode, {elapsed:.0f} s, pytest exit {code}")
        for log in logs:
            counts = access_counts(log)
            total = sum(counts.values())
            errors = sum(n for (_, _, status), n in counts.items() if status >= 500)
            print(f"\n{log.stem}: {total} requests, {errors} with a 5xx status (during loading, /health and "
                  "generation answer 503 by design)")
            by_status = collections.Counter()
            for (_, _, status), n in counts.items():
                by_status[status] += n
            print("  by status: " + ", ".join(f"{s}: {n}" for s, n in sorted(by_status.items())))
            for (method, route, status), n in sorted(counts.items()):
                if status != 405:  # the unsupported-method probes, one per route and method
                    print(f"  {n:6d}  {method:6s} {route:40s} {status}")
    return code


if __name__ == "__main__":
    sys.exit(main())
