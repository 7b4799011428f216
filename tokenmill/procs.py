"""Child server processes shared by ``serve --data-parallel-size`` (router) and ``bench compare`` (bench).

Owns the generic parts of running a server as a child process: a free port, dying with the parent,
polling ``/health`` until it answers, and stopping. Knows nothing of what the child serves; imports
neither torch nor router or bench code, so the router process stays torch-free.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import time
from typing import Callable

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # a child's graceful shutdown, then SIGKILL
PR_SET_PDEATHSIG = 1
HEALTH_POLL_S = 0.2  # pause between two rounds of /health polls
HEALTH_TIMEOUT_S = 2.0  # one /health request


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now on ``host``."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """Linux: ask for SIGTERM when the process that started us dies (a killed parent leaves no child).

    Call it in the child (a ``preexec_fn``, or first thing in a spawned process's target); elsewhere
    than Linux it does nothing.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def wait_healthy(urls: list[str], alive: Callable[[], str | None], timeout_s: float | None = None,
                 name: str | None = "replica") -> None:
    """Poll each server's ``/health`` in turn until all answer 200, every ``HEALTH_POLL_S`` seconds.

    ``alive`` is asked before each poll: it returns why a server is gone, or None while all run. With
    ``name`` each server that comes up is logged at INFO as ``"<name> <url> is up"`` (None: not logged).

    Raises:
        RuntimeError: ``alive`` said a server is gone (the message is what it returned).
        TimeoutError: not all healthy within ``timeout_s`` seconds (None: wait for ever).
    """
    import httpx2 as httpx

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{pending[0]} not healthy after {timeout_s:.0f} s")
        why = alive()
        if why is not None:
            raise RuntimeError(why)
        try:
            if httpx.get(f"{pending[0]}/health", timeout=HEALTH_TIMEOUT_S, trust_env=False).status_code == 200:
                url = pending.pop(0)
                if name is not None:
                    logger.info("%s %s is up", name, url)
                continue
        except httpx.TransportError:
            pass
        time.sleep(HEALTH_POLL_S)


def stop_processes(processes: list[multiprocessing.Process], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every live process, wait up to ``timeout`` seconds for all, then SIGKILL the rest."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
