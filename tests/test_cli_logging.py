"""What the interactive commands print besides the answer: no periodic stats lines in `chat` and
`generate` unless `-v` / `--log-level` asks for them (warnings still show), one startup line naming
dtype, device, ISA path and kernels; `serve` keeps logging the stats line.

Real processes on a tiny random Llama, with the stats interval shortened through
TOKENMILL_STATS_INTERVAL_S so every session spans many intervals.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from tests.server_fixtures import REPO, ServerProcess
from tests.tiny_models import make_tiny_model
from tokenmill.cli.logging_setup import log_level
from tokenmill.cli.main import build_parser
from tokenmill.engine.stats_logger import StatsLogger
from tokenmill.envs import stats_interval_s

STATS_LINE = "prompt throughput:"  # the start of StatsLogger's line
SHORT_INTERVAL = {"TOKENMILL_STATS_INTERVAL_S": "0.001"}
ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "0.05", "--num-threads", "1"]
STARTUP_LINE = re.compile(r"^tokenmill: \S+, float32 on cpu, ISA \w+, kernels: .+$", re.MULTILINE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("cli_logging")))


def tokenmill(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m tokenmill.cli.main *args`` with ``env`` added to this process's environment."""
    return subprocess.run([sys.executable, "-m", "tokenmill.cli.main", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, cwd=REPO, env={**os.environ, **(env or {})})


def chat(tiny: str, *flags: str) -> subprocess.CompletedProcess:
    """Two greedy turns of `tokenmill chat` fed through a pipe, with a 1 ms stats interval."""
    return tokenmill("chat", tiny, *ENGINE_ARGS, "--max-tokens", "24", "--temperature", "0", *flags,
                     stdin="Hello there\nTell me more\n\n", env=SHORT_INTERVAL)


def test_chat_over_many_stats_intervals_prints_no_stats_line_unless_verbose(tiny):
    quiet = chat(tiny)
    assert quiet.returncode == 0, quiet.stderr
    assert STATS_LINE not in quiet.stdout and STATS_LINE not in quiet.stderr
    assert " INFO " not in quiet.stderr
    assert quiet.stdout.count("> ") == 3  # the conversation itself is intact
    assert len(STARTUP_LINE.findall(quiet.stderr)) == 1, quiet.stderr
    assert "tokenmill:" not in quiet.stdout
    # The same session with -v: the same steps span several intervals, so the quiet run above did too.
    verbose = chat(tiny, "-v")
    assert verbose.returncode == 0, verbose.stderr
    assert verbose.stderr.count(STATS_LINE) >= 2
    assert verbose.stdout == quiet.stdout  # logs go to stderr, never into the conversation


def test_generate_prints_one_startup_line_and_still_shows_warnings(tiny):
    # 4 blocks of 16 tokens are fewer than the tiny model's 512 positions: the engine warns it lowers max_model_len.
    result = tokenmill("generate", "Once upon a time", "--model", tiny, "--dtype", "float32", "--num-kv-blocks", "4",
                       "--max-tokens", "8", "--temperature", "0", env=SHORT_INTERVAL)
    assert result.returncode == 0, result.stderr
    assert len(STARTUP_LINE.findall(result.stderr)) == 1, result.stderr
    assert "WARNING" in result.stderr and "max_model_len lowered" in result.stderr
    assert STATS_LINE not in result.stderr and " INFO " not in result.stderr
    assert result.stdout.startswith("### Once upon a time\n")


def test_serve_still_logs_the_stats_line(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_STATS_INTERVAL_S", "0.001")  # inherited by the server process
    server = ServerProcess(tiny, ENGINE_ARGS, tmp_path / "server.log").wait_healthy()
    try:
        response = server.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0})
        assert response.status_code == 200, response.text
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert STATS_LINE in server.log()


@pytest.mark.parametrize("argv, level", [
    (["chat"], logging.WARNING),
    (["generate", "hi"], logging.WARNING),
    (["chat", "-v"], logging.INFO),
    (["-v", "generate", "hi"], logging.INFO),
    (["chat", "-vv"], logging.DEBUG),
    (["chat", "--log-level", "error"], logging.ERROR),
    (["--log-level", "INFO", "chat"], logging.INFO),
    (["serve"], logging.INFO),
    (["serve", "--log-level", "WARNING"], logging.WARNING),
    (["bench", "serve", "-v"], logging.INFO),
    (["plan"], logging.INFO),
])
def test_console_level_per_command_and_flag(argv, level):
    args = build_parser().parse_args(argv)
    assert log_level(args.command, args.log_level, args.verbose) == level


def test_unknown_log_level_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--log-level", "LOUD"])
    assert "invalid choice: 'LOUD'" in capsys.readouterr().err


@pytest.mark.parametrize("value, expected", [(None, 10.0), ("", 10.0), ("0.25", 0.25)])
def test_stats_interval_setting(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("TOKENMILL_STATS_INTERVAL_S", raising=False)
    else:
        monkeypatch.setenv("TOKENMILL_STATS_INTERVAL_S", value)
    assert stats_interval_s() == expected
    assert StatsLogger().interval_s == expected
    assert StatsLogger(interval_s=3.0).interval_s == 3.0


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf", "nan"])
def test_bad_stats_interval_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("TOKENMILL_STATS_INTERVAL_S", value)
    with pytest.raises(ValueError, match="TOKENMILL_STATS_INTERVAL_S"):
        stats_interval_s()


def test_only_the_named_subcommand_module_is_imported_and_every_command_still_parses():
    """``main`` registers just the module-defined subcommand argv names (a server's start skips importing the
    others); the full parser still lists them all."""
    from tokenmill.cli.main import build_parser, named_subcommand

    assert named_subcommand(["serve", "model.gguf", "--port", "8000"]) == "serve"
    assert named_subcommand(["-v", "--log-level", "debug", "plan", "--memory", "8"]) == "plan"
    assert named_subcommand(["generate", "serve"]) is None and named_subcommand(["--help"]) is None
    assert named_subcommand(["-h", "serve"]) is None and named_subcommand(["serve", "-h"]) == "serve"
    assert named_subcommand([]) is None
    choices = build_parser("serve")._subparsers._group_actions[0].choices
    assert set(choices) == {"generate", "chat", "serve"}
    assert set(build_parser()._subparsers._group_actions[0].choices) == {
        "generate", "chat", "serve", "bench", "plan", "router"}
    done = subprocess.run([sys.executable, "-c", "import sys; from tokenmill.cli import main as m; "
                           "m.build_parser(m.named_subcommand(['serve'])); "
                           "print(sorted(n for n in sys.modules if n.startswith('tokenmill.cli.')))"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokenmill.cli.plan" not in done.stdout and "tokenmill.cli.bench" not in done.stdout
    assert "tokenmill.cli.serve" in done.stdout
