"""The README as a user runs it: every block marked runnable succeeds within its time budget and
prints the output the README shows, so the README cannot drift from the code.

Markers (HTML comments on the line before a fenced block; see the README's Contributing part):
``<!-- runnable -->`` runs a ``bash`` or ``python`` block from the repository root;
``<!-- runnable: server -->`` is a server command started in the background, on a free port that
replaces ``8000`` everywhere, when the runnable blocks begin;
``<!-- output -->`` before a ``text`` block: lines the previous runnable block must print, in order
(a line ``...`` stands for any lines).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.server_fixtures import REPO, free_port

README = REPO / "README.md"
BLOCK_BUDGET_S = 300.0  # per runnable block; the blocks are sized for seconds of work on 2 cores
SERVER_START_BUDGET_S = 300.0
MARKER = re.compile(r"^<!--\s*(runnable(?::\s*server)?|output)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
NEEDS_SERVER = re.compile(r"127\.0\.0\.1:8000\b")


@dataclass(frozen=True)
class Block:
    """One marked fenced block of the README."""

    line: int  # 1-based line of the opening fence
    marker: str  # "runnable", "runnable: server" or "output"
    language: str
    code: str


@dataclass(frozen=True)
class Runnable:
    """A runnable block and the output the README shows for it (None: not shown)."""

    block: Block
    expected_output: str | None

    @property
    def needs_server(self) -> bool:
        """True when the block talks to the server on port 8000."""
        return bool(NEEDS_SERVER.search(self.block.code))


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced block that directly follows a marker comment (blank lines between are allowed).

    Raises:
        ValueError: a marker not followed by a fenced block, or a fence left open.
    """
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = MARKER.match(lines[i].strip())
        i += 1
        if not match:
            continue
        marker = re.sub(r"\s*:\s*", ": ", match.group(1))
        while i < len(lines) and not lines[i].strip():
            i += 1
        fence = FENCE.match(lines[i]) if i < len(lines) else None
        if fence is None:
            raise ValueError(f"README line {i + 1}: a <!-- {marker} --> marker must be followed by a fenced block")
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"README line {start + 1}: fenced block never closed")
        i += 1
        blocks.append(Block(start + 1, marker, fence.group(1), "\n".join(body) + "\n"))
    return blocks


def runnable_blocks(blocks: list[Block]) -> tuple[list[Runnable], Block | None]:
    """Pair each runnable block with the output block after it; returns (runnables, server block).

    Raises:
        ValueError: an output block with no runnable block before it, or more than one server block.
    """
    runnables: list[Runnable] = []
    server: Block | None = None
    for block in blocks:
        if block.marker == "output":
            if not runnables or runnables[-1].expected_output is not None:
                raise ValueError(f"README line {block.line}: <!-- output --> must follow a runnable block")
            runnables[-1] = Runnable(runnables[-1].block, block.code)
        elif block.marker == "runnable: server":
            if server is not None:
                raise ValueError(f"README line {block.line}: only one <!-- runnable: server --> block")
            server = block
        else:
            if block.language not in ("bash", "python"):
                raise ValueError(
                    f"README line {block.line}: runnable blocks are bash or python, got {block.language!r}")
            runnables.append(Runnable(block, None))
    return runnables, server


def with_port(code: str, port: int) -> str:
    """``code`` with the README's port 8000 (in ``127.0.0.1:8000`` and ``--port 8000``) replaced by ``port``."""
    return re.sub(r"(?<=127\.0\.0\.1:)8000\b|(?<=--port )8000\b", str(port), code)


def output_pattern(expected: str) -> re.Pattern:
    """A regex for README-shown output: its lines verbatim and in order, each ``...`` line matching any lines."""
    parts = [re.escape(part) for part in re.split(r"^\.\.\.\n", expected, flags=re.MULTILINE)]
    return re.compile("(?:.*\n)*?".join(parts))


def command(block: Block) -> list[str]:
    """The argv that runs ``block``: bash with -e -u -o pipefail, or this test's Python."""
    if block.language == "python":
        return [sys.executable, "-c", block.code]
    return ["bash", "-euo", "pipefail", "-c", block.code]


def readme_env() -> dict[str, str]:
    """This process's environment without the settings tests use to shorten the engine's timers."""
    return {k: v for k, v in os.environ.items() if k != "TOKENMILL_STATS_INTERVAL_S"}


RUNNABLES, SERVER_BLOCK = runnable_blocks(fenced_blocks(README.read_text()))


class ReadmeServer:
    """The README's server block, started in the background on a free port (loading overlaps the first
    blocks, which matters on 2 cores); ``port()`` waits until it is healthy."""

    def __init__(self, block: Block, log_path: Path) -> None:
        self.port_number = free_port()
        code = with_port(block.code, self.port_number).strip()
        assert "\n" not in code, "the server block must be one command"
        self.log_path = log_path
        with open(log_path, "w") as log:
            # exec: SIGTERM reaches the server itself, not a shell around it.
            self.proc = subprocess.Popen(["bash", "-c", f"exec {code}"], cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT, env=readme_env())
        self.healthy = False

    def port(self) -> int:
        """The server's port, once /health answers 200 (fails the test if it exits or takes too long)."""
        deadline = time.monotonic() + SERVER_START_BUDGET_S
        while not self.healthy:
            assert self.proc.poll() is None, (
                f"README server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            assert time.monotonic() < deadline, f"README server not healthy after {SERVER_START_BUDGET_S:.0f}s"
            try:
                self.healthy = httpx.get(f"http://127.0.0.1:{self.port_number}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        return self.port_number

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a minute."""
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The README's server block, started at the first runnable block and stopped after the last (None: no
    block needs it)."""
    if not any(r.needs_server for r in RUNNABLES):
        yield None
        return
    assert SERVER_BLOCK is not None, "a block talks to 127.0.0.1:8000 but no block is marked <!-- runnable: server -->"
    server = ReadmeServer(SERVER_BLOCK, tmp_path_factory.mktemp("readme") / "server.log")
    yield server
    server.stop()


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "tokenmill").exists(), reason="the README's commands use .venv/bin")
@pytest.mark.parametrize("runnable", RUNNABLES, ids=[f"line{r.block.line}" for r in RUNNABLES])
def test_readme_block_runs(runnable: Runnable, readme_server: ReadmeServer | None):
    block = runnable.block
    code = with_port(block.code, readme_server.port()) if runnable.needs_server else block.code
    started = time.monotonic()
    try:
        result = subprocess.run(command(Block(block.line, block.marker, block.language, code)), cwd=REPO,
                                capture_output=True, text=True, timeout=BLOCK_BUDGET_S, env=readme_env())
    except subprocess.TimeoutExpired:
        pytest.fail(f"README block at line {block.line} ran past its {BLOCK_BUDGET_S:.0f}s budget:\n{block.code}")
    print(f"README block at line {block.line}: {time.monotonic() - started:.1f}s")
    assert result.returncode == 0, f"README block at line {block.line} failed:\n{block.code}\n{result.stderr[-3000:]}"
    if runnable.expected_output is not None:
        assert output_pattern(runnable.expected_output).search(result.stdout), (
            f"README block at line {block.line} no longer prints what the README shows:\n{result.stdout}")


def test_readme_has_runnable_blocks_of_each_kind():
    # A typo in a marker must not silently turn the doc-test into a test of nothing.
    assert len(RUNNABLES) >= 4
    assert {r.block.language for r in RUNNABLES} == {"bash", "python"}
    assert SERVER_BLOCK is not None and any(r.needs_server for r in RUNNABLES)
    assert any(r.expected_output is not None for r in RUNNABLES)


def test_quick_start_is_two_commands_and_the_scripts_exist():
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]
    assert all((REPO / c.split()[1]).is_file() for c in commands)


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="scripts/test.sh uses .venv")
def test_quick_test_subset_the_readme_names_collects():
    assert "bash scripts/test.sh --quick" in README.read_text()
    result = subprocess.run(["bash", "scripts/test.sh", "--quick", "--collect-only"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert len(collected) >= 50
    assert not any(line.startswith(("tests/test_readme.py", "tests/test_server")) for line in collected)


@pytest.mark.parametrize("text, message", [
    ("<!-- runnable -->\ntext, no block\n", "must be followed by a fenced block"),
    ("<!-- runnable -->\n```bash\necho hi\n", "never closed"),
])
def test_marker_mistakes_are_errors(text, message):
    with pytest.raises(ValueError, match=message):
        fenced_blocks(text)


@pytest.mark.parametrize("stdout, matches", [
    ("### Q\n Paris.\n\nThe answer is:\nend\n", True),
    ("noise\n### Q\n Paris.\nend\n", True),  # "..." may stand for no line at all
    ("### Q\n Lyon.\nend\n", False),
    ("### Q\n Paris.\n", False),  # the line after "..." is missing
])
def test_shown_output_matches_lines_in_order_with_ellipsis(stdout, matches):
    assert bool(output_pattern("### Q\n Paris.\n...\nend\n").search(stdout)) == matches


def test_parser_pairs_output_with_the_runnable_block_before_it():
    text = ("<!-- runnable -->\n```bash\necho hi\n```\n\n<!-- output -->\n```text\nhi\n```\n"
            "```bash\nnot marked\n```\n<!-- runnable: server -->\n```bash\nserve --port 8000\n```\n")
    runnables, server = runnable_blocks(fenced_blocks(text))
    assert [(r.block.code, r.expected_output) for r in runnables] == [("echo hi\n", "hi\n")]
    assert server is not None and with_port(server.code, 1234) == "serve --port 1234\n"
