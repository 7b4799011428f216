"""OpenTelemetry tracing (tokenmill/tracing.py): real workers and routers export their spans over OTLP/HTTP to a
receiver in this test, which decodes them with opentelemetry-proto.

A request sent with a known W3C ``traceparent`` through the router gives a ``router_request`` span, child of the
client's span, and the worker's ``llm_request`` span, child of the router's, both in the client's trace, with the
GenAI attributes equal to what the response says (usage, id, model, sampling parameters). The same for a stream;
under PD disaggregation the prefill worker's span is a child of the router's too. A client that leaves mid-stream
ends both spans with status error. ``--collect-detailed-traces all`` adds its attributes and events on that worker
only, and a server or router without the flag never imports the SDK.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import httpx2 as httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

from tests.server_fixtures import REPO, LocalHTTPServer, ServerProcess
from tests.test_router import RouterProcess, stop_all
from tests.tiny_models import make_tiny_model
from tokenmill.cli.main import build_parser
from tokenmill.cli.router import cmd_router
from tokenmill.cli.serve import cmd_serve
from tokenmill.tracing import detailed_trace_modules, otlp_traces_endpoint, trace_headers

ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "128", "--block-size", "16",
        "--disable-log-requests"]
CHAT = [{"role": "user", "content": "Describe a quiet harbour town at dawn."}]
DETAILED = ("gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode",
            "gen_ai.latency.time_in_model_inference", "gen_ai.latency.time_in_model_execute",
            "tokenmill.engine.num_steps")
STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: ``POST /v1/traces`` bodies decoded as ExportTraceServiceRequest
    into ``spans`` (dicts: name, service, trace_id, span_id, parent_id as hex, attributes, status, events)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(self.path, request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = LocalHTTPServer(Handler)
        self.url = self.server.url

    def add(self, path: str, request: ExportTraceServiceRequest) -> None:
        assert path == "/v1/traces", path
        with self.lock:
            for resource_spans in request.resource_spans:
                service = {a.key: _value(a.value) for a in resource_spans.resource.attributes}["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "name": span.name, "service": service, "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(), "parent_id": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "status": span.status.code, "events": [e.name for e in span.events],
                            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano})

    def wait(self, trace_id: str, count: int, timeout: float = 30.0) -> list[dict]:
        """The spans of ``trace_id`` once ``count`` of them arrived (then a short wait for strays)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                found = [s for s in self.spans if s["trace_id"] == trace_id]
            if len(found) >= count:
                time.sleep(0.3)  # a span more than expected would show up now
                with self.lock:
                    return [s for s in self.spans if s["trace_id"] == trace_id]
            assert time.monotonic() < deadline, (count, found)
            time.sleep(0.05)

    def close(self) -> None:
        self.server.close()


def client_context() -> tuple[str, str, dict]:
    """A fresh client span: (trace id, span id, the headers carrying it)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "vendor=opaque"}


@contextmanager
def env(**values: str):
    """``os.environ`` with ``values`` while the body runs (the child processes started in it inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(receiver, tiny model path, prefill worker, decode worker (``--collect-detailed-traces all``), a router over
    the decode worker, a PD router over both); every one traced to the receiver, spans exported every 0.1 s."""
    logs = tmp_path_factory.mktemp("tracing")
    receiver = Receiver()
    endpoint = f"{receiver.url}/v1/traces"
    procs: list[ServerProcess] = []
    try:
        tiny = str(make_tiny_model("llama", logs / "tiny"))
        with env(OTEL_BSP_SCHEDULE_DELAY="100"):
            p = ServerProcess(tiny, [*ARGS, "--kv-transfer-config", json.dumps({"kv_role": "kv_producer"}),
                                     "--otlp-traces-endpoint", endpoint], logs / "p.log")
            procs.append(p)
            d = ServerProcess(tiny, [*ARGS, "--kv-transfer-config", json.dumps(
                {"kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_timeout_s": 5.0}}),
                "--otlp-traces-endpoint", endpoint, "--collect-detailed-traces", "all"], logs / "d.log")
            procs.append(d)
            router = RouterProcess([d.url], ["--otlp-traces-endpoint", receiver.url], logs / "router.log")
            procs.append(router)
            pd_router = RouterProcess([], ["--pd-disaggregation", "--prefill", p.url, "--decode", d.url,
                                           "--otlp-traces-endpoint", endpoint], logs / "pd_router.log")
            procs.append(pd_router)
        for server in (p, d):
            server.wait_healthy()
        for r in (router, pd_router):
            r.wait_up()
        router.wait_workers_healthy()
        yield receiver, tiny, p, d, router, pd_router
    finally:
        stop_all(procs)
        receiver.close()


def check_llm_request(span: dict, response: dict, max_tokens: int) -> None:
    """The worker span's GenAI attributes match the response the client got."""
    a = span["attributes"]
    usage = response["usage"]
    assert span["name"] == "llm_request" and span["service"] == "tokenmill"
    assert a["gen_ai.request.id"] == response["id"]
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == response["model"]
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.usage.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert a["gen_ai.request.max_tokens"] == max_tokens
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.top_p"] == 0.9 and a["gen_ai.request.n"] == 1
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert span["end"] - span["start"] == pytest.approx(a["gen_ai.latency.e2e"] * 1e9, abs=1e6)
    assert span["status"] != STATUS_ERROR


def check_detailed(span: dict) -> None:
    """``--collect-detailed-traces all``: model-phase latencies, engine steps, events."""
    a = span["attributes"]
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(
        a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"], abs=1e-6)
    assert a["tokenmill.engine.num_steps"] >= 1 and 0 < a["gen_ai.latency.time_in_model_execute"] <= \
        a["gen_ai.latency.e2e"]
    assert span["events"] == ["scheduled", "first_token"]


def router_and_worker(spans: list[dict], parent_id: str, nested: bool = True) -> tuple[dict, list[dict]]:
    """The one ``router_request`` span (child of ``parent_id``) and the ``llm_request`` spans under it (``nested``:
    within its time; a worker's abort after a client left ends after the router's span)."""
    routed = [s for s in spans if s["name"] == "router_request"]
    assert len(routed) == 1, spans
    router = routed[0]
    assert router["service"] == "tokenmill-router" and router["parent_id"] == parent_id
    workers = [s for s in spans if s["name"] == "llm_request"]
    assert len(spans) == 1 + len(workers), spans
    assert all(w["parent_id"] == router["span_id"] for w in workers), spans
    assert all(router["start"] <= w["start"] and (w["end"] <= router["end"] or not nested) for w in workers), spans
    return router, workers


def test_spans_chain_client_router_worker_with_the_responses_numbers(cluster):
    receiver, tiny, _, d, router, _ = cluster
    trace_id, span_id, headers = client_context()
    response = router.client().completions.create(model=tiny, prompt="The harbour at dawn", max_tokens=12,
                                                  temperature=0, top_p=0.9, extra_body={"ignore_eos": True},
                                                  extra_headers=headers).model_dump()
    assert response["usage"]["completion_tokens"] == 12
    router_span, (worker_span,) = router_and_worker(receiver.wait(trace_id, 2), span_id)
    check_llm_request(worker_span, response, 12)
    check_detailed(worker_span)  # the decode worker runs with --collect-detailed-traces all
    assert router_span["attributes"]["http.response.status_code"] == 200
    assert router_span["attributes"]["url.path"] == "/v1/completions"
    assert router_span["attributes"]["tokenmill.router.worker_id"] == "worker-0"
    assert router_span["status"] != STATUS_ERROR


def test_a_stream_gets_the_same_chain_ended_after_its_last_chunk(cluster):
    receiver, tiny, _, _, router, _ = cluster
    trace_id, span_id, headers = client_context()
    chunks = list(router.client().chat.completions.create(
        model=tiny, messages=CHAT, max_tokens=10, temperature=0, top_p=0.9, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, extra_headers=headers))
    last = chunks[-1].model_dump()
    streamed = {"id": last["id"], "model": last["model"], "usage": last["usage"]}
    _, (worker_span,) = router_and_worker(receiver.wait(trace_id, 2), span_id)
    check_llm_request(worker_span, streamed, 10)


def test_pd_prefill_and_decode_spans_are_both_children_of_the_router_span(cluster):
    receiver, tiny, p, d, _, pd_router = cluster
    trace_id, span_id, headers = client_context()
    response = pd_router.client().chat.completions.create(model=tiny, messages=CHAT, max_tokens=8, temperature=0,
                                                          top_p=0.9, extra_body={"ignore_eos": True},
                                                          extra_headers=headers).model_dump()
    _, workers = router_and_worker(receiver.wait(trace_id, 3), span_id)
    assert len(workers) == 2
    prefill = next(w for w in workers if w["attributes"]["gen_ai.request.max_tokens"] == 1)
    decode = next(w for w in workers if w is not prefill)
    check_llm_request(decode, response, 8)
    check_detailed(decode)
    assert prefill["attributes"]["gen_ai.usage.prompt_tokens"] == response["usage"]["prompt_tokens"]
    assert not set(DETAILED) & set(prefill["attributes"]) and prefill["events"] == []  # no detail flag there
    assert prefill["end"] <= decode["end"]


def test_a_client_leaving_mid_stream_ends_both_spans_with_status_error(cluster):
    receiver, tiny, _, d, router, _ = cluster
    trace_id, span_id, headers = client_context()
    body = {"model": tiny, "prompt": "Tell me a long story", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        chunks = response.iter_raw()  # kept: a dropped iterator closes the response
        assert next(chunks).startswith(b"data: ")
    router_span, (worker_span,) = router_and_worker(receiver.wait(trace_id, 2), span_id, nested=False)
    assert router_span["status"] == worker_span["status"] == STATUS_ERROR
    assert worker_span["attributes"]["gen_ai.usage.completion_tokens"] < 480
    assert worker_span["attributes"]["gen_ai.response.finish_reasons"] == ["abort"]
    d.wait_idle()


def test_a_request_without_traceparent_starts_a_trace_at_the_router(cluster):
    receiver, tiny, _, _, router, _ = cluster
    marker = secrets.token_hex(4)
    router.post("/v1/completions", {"model": tiny, "prompt": f"no context {marker}", "max_tokens": 2})
    deadline = time.monotonic() + 30
    while not (roots := [s for s in receiver.spans if s["name"] == "router_request" and not s["parent_id"]]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    spans = receiver.wait(roots[-1]["trace_id"], 2)
    assert {s["name"] for s in spans} == {"router_request", "llm_request"}


def test_flags_are_checked_and_untraced_processes_never_import_the_sdk():
    assert otlp_traces_endpoint("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert otlp_traces_endpoint("https://otel.example:443/custom") == "https://otel.example:443/custom"
    for bad in ("localhost:4317", "grpc://collector:4317", "collector"):
        with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
            otlp_traces_endpoint(bad)
    assert detailed_trace_modules(["all"]) == ("model", "worker")
    assert detailed_trace_modules(["worker", "model"]) == ("model", "worker")
    with pytest.raises(ValueError, match="--collect-detailed-traces"):
        detailed_trace_modules(["gpu"])
    assert trace_headers({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "x" * 600}) == {
        "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}  # an over-long tracestate is dropped
    assert trace_headers({"tracestate": "a=b"}) is None
    parser = build_parser()  # the commands refuse bad flags before anything loads
    with pytest.raises(ValueError, match="--collect-detailed-traces needs --otlp-traces-endpoint"):
        cmd_serve(parser.parse_args(["serve", "--collect-detailed-traces", "all"]))
    with pytest.raises(ValueError, match="--otlp-traces-endpoint must be"):
        cmd_serve(parser.parse_args(["serve", "--otlp-traces-endpoint", "localhost:4317"]))
    with pytest.raises(ValueError, match="--otlp-traces-endpoint must be"):
        cmd_router(parser.parse_args(["router", "--otlp-traces-endpoint", "grpc://collector:4317"]))
    code = ("import sys; import tokenmill.server.api_server, tokenmill.router.app, tokenmill.cli.main; "
            "assert 'opentelemetry.sdk' not in sys.modules, 'SDK imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
