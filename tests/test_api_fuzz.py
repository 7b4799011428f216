"""API fuzzing (issue 44, item 1): Schemathesis against the OpenAPI schemas of a real ``tokenmill serve``
(the embedded model, 127.0.0.1) and of a real ``tokenmill router`` in front of it.

Every operation of each schema is fuzzed: Schemathesis's examples, coverage (boundary and wrong-type
values, missing fields) and fuzzing phases, positive and negative data, up to
``TOKENMILL_FUZZ_MAX_EXAMPLES`` examples per operation and mode (default 8: about a minute per app on
a 2-core machine; benchmarks/fuzz_api.py runs longer). Checks on every answer:

- no 5xx (``not_a_server_error``): hostile input is refused with a 4xx;
- the answer is what the schema documents: status code (the OpenAI error body under ``4XX``/``503``,
  tokenmill/openapi_errors.py), content type, body schema, headers; a 405 carries ``Allow``;
- data that breaks the schema is refused (``negative_data_rejection``).
Afterwards both processes are healthy: ``/health`` 200, a real completion answers, the server's KV pool is
idle with every block free and its integrity check passing, and neither process logged an unhandled error.

What is generated is bounded by the server's own request limits (``--max-model-len 128``,
``--max-tokens-per-request 64``, ``--max-num-seqs-per-request 4`` ...), never by leaving fields out.
State-changing operations are fuzzed too, each made harmless rather than skipped:

- ``POST /sleep`` and ``POST /pause_generation`` (RL endpoints): after each such call the test wakes the
  engine and resumes generation, so the next example meets a serving engine;
- ``POST /v1/sessions/{id}/save`` writes under a temporary --session-save-path;
- the LoRA routes answer "runtime LoRA updating is off" (404) after body validation: the server runs
  without ``--enable-lora`` (loading adapters is tests/test_server_lora.py's);
- the router's ``POST /workers`` may register only the one worker (``--allowed-worker-urls``), so a
  generated URL is refused (403) instead of health-checked; ``DELETE``/drain of a generated id is a 404.

The router forwards the worker's request bodies without parsing them, so its schema declares none for
``/v1/completions`` and ``/v1/chat/completions``; the server's body schemas are grafted onto those two
operations so that generated requests pass through the router to the worker.
"""
from __future__ import annotations

import copy
import re

import httpx2 as httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi import checks as openapi_checks

from tokenmill import envs
from tests.server_fixtures import ServerProcess
from tests.test_router import RouterProcess, stop_all

MODEL = "SmolLM2-135M-Instruct"
SERVER_ARGS = [
    "--max-model-len", "128", "--num-threads", "1", "--max-num-seqs", "4", "--max-tokens-per-request", "64",
    "--max-num-seqs-per-request", "4", "--max-prompts-per-request", "4", "--max-stop-strings", "4",
    "--max-stop-token-ids", "16", "--max-logit-bias", "16", "--max-tools", "4",
    "--max-structured-output-bytes", "4096", "--structured-outputs-compile-timeout", "2",
    "--enable-rl-endpoints", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--session-max-total-bytes", str(64 * 1024 * 1024)]
CHECKS = [
    not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
    openapi_checks.response_headers_conformance,
    openapi_checks.negative_data_rejection,
    openapi_checks.unsupported_method,
    openapi_checks.allow_header_conformance,
    openapi_checks.missing_required_header,
]
# Every request declares a JSON body, as the apps require of every POST/DELETE (415 otherwise, which
# tests/test_server_surface.py covers): without it a bodiless POST such as /sleep never reached its handler.
JSON_HEADERS = {"Content-Type": "application/json"}
RESTORE = {"/sleep": "/wake_up", "/pause_generation": "/resume_generation"}  # run after each call of the key
UNHANDLED = re.compile(r"unhandled error|Traceback \(most recent call last\)")
FUZZ_SETTINGS = settings(max_examples=envs.fuzz_max_examples(), deadline=None, database=None,
                         suppress_health_check=list(HealthCheck))


def _server_openapi() -> dict:
    """The server app's schema, built in this process (no engine starts) so pytest can collect one test
    per operation; the ``apps`` fixture checks that the real server serves exactly this schema."""
    from tokenmill.server.api_server import build_app
    from tokenmill.server.state import ServerConfig

    return build_app(ServerConfig(served_model_name=MODEL)).openapi()


def _router_openapi(server_openapi: dict) -> dict:
    """The router app's schema with the server's request bodies on the two generation routes."""
    from tokenmill.router.app import RouterConfig, build_app

    schema = copy.deepcopy(build_app(RouterConfig()).openapi())
    for path in ("/v1/completions", "/v1/chat/completions"):
        schema["paths"][path]["post"]["requestBody"] = server_openapi["paths"][path]["post"]["requestBody"]
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, component in server_openapi["components"]["schemas"].items():
        components.setdefault(name, component)
    return schema


SERVER_OPENAPI = _server_openapi()
ROUTER_OPENAPI = _router_openapi(SERVER_OPENAPI)
server_schema = schemathesis.openapi.from_dict(SERVER_OPENAPI)
router_schema = schemathesis.openapi.from_dict(ROUTER_OPENAPI)


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    """(server, router): the embedded model behind a router that may hold only that worker."""
    logs = tmp_path_factory.mktemp("fuzz_logs")
    sessions = tmp_path_factory.mktemp("fuzz_sessions")
    server = ServerProcess(None, [*SERVER_ARGS, "--session-save-path", str(sessions)], logs / "server.log")
    router = RouterProcess([server.url], ["--policy", "round_robin", "--health-check-interval", "0.5",
                                          "--allowed-worker-urls", server.url], logs / "router.log")
    try:
        server.wait_healthy()
        router.wait_up().wait_workers_healthy()
        served = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
        assert served == SERVER_OPENAPI, "the fuzzed schema must be the one the server serves"
        yield server, router
    finally:
        stop_all([router, server])


@server_schema.parametrize()
@FUZZ_SETTINGS
def test_server_api_fuzz(case, apps):
    server, _ = apps
    try:
        case.call_and_validate(base_url=server.url, headers=JSON_HEADERS, checks=CHECKS, timeout=120)
    finally:
        restore = RESTORE.get(case.operation.path)
        if restore is not None:
            response = httpx.post(f"{server.url}{restore}", json={}, timeout=120)
            assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_answers_conform_to_both_schemas(apps, path):
    """A streamed generation answers text/event-stream, which both schemas document beside JSON (the fuzzer
    drew "stream": true on the router once and found it undocumented)."""
    body = ({"prompt": "Hello", "max_tokens": 3, "stream": True} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "stream": True})
    for schema, app in ((server_schema, apps[0]), (router_schema, apps[1])):
        case = schema[path]["POST"].Case(body=dict(body, model=MODEL), media_type="application/json")
        response = case.call_and_validate(base_url=app.url, headers=JSON_HEADERS, checks=CHECKS, timeout=120)
        assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
        assert response.text.rstrip().endswith("data: [DONE]")


@router_schema.parametrize()
@FUZZ_SETTINGS
def test_router_api_fuzz(case, apps):
    _, router = apps
    case.call_and_validate(base_url=router.url, headers=JSON_HEADERS, checks=CHECKS, timeout=120)


def test_server_and_router_still_serve_after_fuzzing(apps):
    """Runs after the fuzz tests (file order): both answer, generate, and leaked nothing."""
    server, router = apps
    for proc in (server, router):
        assert httpx.get(f"{proc.url}/health", timeout=30).status_code == 200
        completion = proc.client().completions.create(model=MODEL, prompt="The capital of France is",
                                                      max_tokens=8, temperature=0)
        assert completion.choices[0].text and completion.usage.completion_tokens > 0
    assert router.workers()[server.url]["state"] == "healthy"
    kv = server.wait_idle()
    assert kv["num_free_blocks"] == kv["num_blocks"] and kv["integrity"] == "ok", kv
    assert not httpx.get(f"{server.url}/is_sleeping", timeout=30).json()["is_sleeping"]
    for proc in (server, router):
        assert not UNHANDLED.search(proc.log()), proc.log()[-3000:]
