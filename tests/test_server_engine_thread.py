"""AsyncEngine (the server's engine-owner thread) in-process on a tiny model: atomic adds, a crash
in ``step()`` failing live requests and marking the engine unhealthy, load failures; and the
``serve`` process exiting with 1 when its model cannot be loaded.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.server_fixtures import REPO, free_port
from tests.tiny_models import make_tiny_model
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.async_engine import AsyncEngine, EngineDeadError, EngineRequest

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama")))


async def started(kwargs: dict, **options) -> AsyncEngine:
    engine = AsyncEngine(EngineArgs(**kwargs), **options)
    engine.start(asyncio.get_running_loop())
    await asyncio.to_thread(engine.wait_loaded, 120)
    return engine


def tiny_kwargs(path: str) -> dict:
    return dict(model=path, dtype="float32", num_kv_blocks=NUM_BLOCKS, num_threads=1)


def request(request_id: str, num_tokens: int, max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(request_id, list(range(100, 100 + num_tokens)), SamplingParams(temperature=0.0,
                                                                                        max_tokens=max_tokens))


def test_add_is_all_or_nothing(tiny_path):
    async def run():
        engine = await started(tiny_kwargs(tiny_path))
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add([request("ok", 8), request("too-long", 600)])
        state = await engine.call(lambda e: (e.has_unfinished_requests(), e.kv_cache_manager.block_pool.num_free_blocks))
        assert state == (False, NUM_BLOCKS)
        stream = await engine.add([request("a", 8), request("b", 5)])
        finals = {o.request_id: o async for o in stream if o.finished}
        assert sorted(finals) == ["a", "b"] and all(len(o.outputs[0].token_ids) == 4 for o in finals.values())
        await asyncio.to_thread(engine.shutdown)
        assert not engine.is_healthy

    asyncio.run(run())


def test_step_crash_fails_live_requests_and_marks_unhealthy(tiny_path):
    async def run():
        engine = await started(tiny_kwargs(tiny_path))
        assert engine.is_healthy

        def broken_step():
            raise RuntimeError("boom")

        engine.llm.engine.step = broken_step  # the engine thread is idle, blocked on its queue
        stream = await engine.add([request("x", 8)])
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in stream:
                pass
        await asyncio.to_thread(engine._thread.join, 10)
        assert not engine.is_healthy and not engine.is_loading
        with pytest.raises(EngineDeadError):
            await engine.add([request("y", 8)])
        engine.abort(["x"])  # a no-op now, not an error

    asyncio.run(run())


def test_load_failure_is_reported(tmp_path):
    failures = []

    async def run():
        engine = await started(dict(model=str(tmp_path / "missing")), on_load_failure=failures.append)
        assert not engine.is_loading and not engine.is_healthy
        with pytest.raises(EngineDeadError, match="not running"):
            await engine.add([request("x", 8)])

    asyncio.run(run())
    assert len(failures) == 1 and isinstance(failures[0], ValueError)


def test_serve_exits_with_2_and_one_line_when_the_model_path_is_wrong(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "serve", str(tmp_path / "missing"),
                           "--port", str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # a bad argument, as for `generate`: one `error:` line, no traceback
    assert "error: " in proc.stderr and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
