"""The cyclic collector held off while an engine loads (tokenmill/startup_gc.py), and given back as found."""
from __future__ import annotations

import gc

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill import LLM
from tokenmill.cli.main import main
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine_args import EngineArgs
from tokenmill.startup_gc import pause_for_startup, resume_after_startup


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("startup_gc")))


@pytest.fixture(autouse=True)
def collector_restored():
    was = gc.isenabled()
    yield
    resume_after_startup()
    (gc.enable if was else gc.disable)()


def _collections_during(build) -> list[int]:
    """The generations of the collections that ran while ``build()`` ran."""
    seen: list[int] = []

    def callback(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(callback)
    try:
        build()
    finally:
        gc.callbacks.remove(callback)
    return seen


def test_a_load_runs_no_automatic_collection_and_leaves_the_collector_on(tiny):
    gc.enable()
    config = EngineArgs(model=tiny, dtype="float32", kv_cache_memory=0.05).create_engine_config()
    seen = _collections_during(lambda: LLMEngine(config))
    # The engine's own full collections (one before freezing; one more for an earlier engine's frozen objects),
    # and young ones only in the few allocations around the load: with the collector on, the load of this
    # tiny model alone ran some 80 (one every 700 allocations).
    assert 1 <= seen.count(2) <= 2
    assert len(seen) - seen.count(2) <= 4, seen
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off(tiny):
    gc.disable()
    LLM(model=tiny, dtype="float32", kv_cache_memory=0.05)
    assert not gc.isenabled()


def test_a_startup_pause_ends_when_the_load_fails():
    gc.enable()
    pause_for_startup()
    assert not gc.isenabled()
    with pytest.raises(ValueError):
        LLM(model="/nonexistent/model/dir", dtype="float32")
    assert gc.isenabled()


def test_the_cli_gives_the_collector_back_for_every_outcome(capsys):
    gc.enable()
    with pytest.raises(SystemExit):
        main(["plan", "--help"])  # a command that builds no engine
    assert gc.isenabled()
    assert main(["generate", "hi", "--model", "/nonexistent/model/dir"]) == 2  # an engine command that fails
    assert gc.isenabled()
    assert "error:" in capsys.readouterr().err
