"""Run a Triton test file again in a fresh interpreter with TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when it is first imported; a test process that imported it earlier (another test
file) cannot switch to the interpreter, so each Triton test file reruns itself in a subprocess instead.
"""
from __future__ import annotations

import os
import subprocess
import sys


def rerun_in_interpreter(test_file: str, timeout: int = 600) -> None:
    """``pytest -q test_file`` in a new Python with TRITON_INTERPRET=1; fails with its output unless it passes."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                            env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
