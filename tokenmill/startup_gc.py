"""Python's cyclic garbage collector held off while the process starts.

Importing torch, FastAPI and the engine creates some 400k objects, and building a model allocates
thousands more; every 700 allocations the collector runs, and the full collections among those scan all
that is alive so far. On the project's slowest box (first-generation EPYC) that cost 0.35 s of the 4 s of
imports of ``tokenmill serve`` and 0.5 s of the 1.4 s of loading a cached Llama-3.2-1B Q4_K_M (two full
collections of 250 ms each, met inside whichever ``torch.empty`` happened to trigger them). Nothing built
while starting is garbage worth collecting early: the engine collects once, then freezes what is alive
(:class:`tokenmill.engine.llm_engine.LLMEngine`), so later collections scan only what steps allocate.

The CLI pauses the collector first thing for a command that builds an engine (``serve``, ``generate``,
``chat``) and the engine resumes it once loaded, or failed; an engine built from Python pauses it for its
own load only. The collector is only ever turned back on by whoever turned it off here: a program that
disabled it itself keeps it disabled.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_paused_for_startup = False


def pause_for_startup() -> None:
    """Turn the collector off until :func:`resume_after_startup` (no-op where it is already off)."""
    global _paused_for_startup
    with _lock:
        if gc.isenabled():
            gc.disable()
            _paused_for_startup = True


def resume_after_startup() -> None:
    """Turn the collector back on if :func:`pause_for_startup` turned it off; idempotent."""
    global _paused_for_startup
    with _lock:
        if _paused_for_startup:
            _paused_for_startup = False
            gc.enable()


@contextlib.contextmanager
def collector_off_while_loading() -> Iterator[None]:
    """The collector off inside the block (if it was on), and after it on again, together with a
    start-up pause: an engine's load ends the process's start-up, whether it succeeded or raised."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        resume_after_startup()
