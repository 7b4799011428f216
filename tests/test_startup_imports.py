"""What a server's start imports: modules only some requests or flags need stay out of it.

`tokenmill serve` of the embedded GGUF runs as a real process with ``PYTHONPROFILEIMPORTTIME`` set, so its
log lists every module as it is imported, at start or later. jsonschema (checking tool schemas) comes in with
the first request that has tools, and pyzmq only where KV events are published; a plain chat turn imports
neither. Each would add to every start what only some deployments use (about 60 ms for jsonschema on a
first-generation Zen core).
"""
from __future__ import annotations

import re

from tests.server_fixtures import ServerProcess
from tests.tiny_models import smollm2_gguf_path

_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|(\s*)(\S+)\s*$")


def imported_roots(log: str) -> set[str]:
    """The top-level packages of every module an ``-X importtime`` log names."""
    return {m.group(2).split(".")[0] for line in log.splitlines() if (m := _IMPORT_LINE.match(line))}


def test_a_server_imports_jsonschema_and_pyzmq_only_when_a_request_or_flag_needs_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    server = ServerProcess(str(smollm2_gguf_path()), ["--max-model-len", "512"], tmp_path / "serve.log")
    try:
        server.wait_healthy()
        client = server.client()
        chat = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                              messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].finish_reason in ("stop", "length")
        before = imported_roots(server.log())
        assert "fastapi" in before and "torch" in before  # the log does list the start's imports
        assert not {"jsonschema", "zmq"} & before, sorted({"jsonschema", "zmq"} & before)
        tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        with_tools = client.chat.completions.create(model=chat.model, max_tokens=4, tools=[tool], tool_choice="none",
                                                    messages=[{"role": "user", "content": "Weather in Paris?"}])
        assert with_tools.choices
        assert "jsonschema" in imported_roots(server.log())  # the first request with tools brought it in
    finally:
        assert server.stop() == 0, server.log()[-3000:]
