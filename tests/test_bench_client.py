"""The bench client end to end against a real local HTTP server that streams scripted SSE replies.

An ``aiohttp.web`` app on 127.0.0.1 (random port) answers ``/v1/completions`` and
``/v1/chat/completions`` from a list of scripts consumed in call order, and records every JSON
body and header it received. On a fake clock (``time.perf_counter`` of the client and the load
generator), the server moves the clock by each chunk's scripted gap before writing it and waits
until the client has read the clock for it, so TTFT, ITL, E2EL, TPOT and the run's duration are
exact and hand-computable over real sockets. Also: the request body (vLLM sampling flags, usage,
prompt or messages), HTTP errors with the server's message, connection refused, timeouts,
error events mid-stream, SSE events split or merged across reads, token counts from the tokenizer
when the server sends no usage, multi-turn histories, a failed turn stopping its conversation,
and the concurrency cap.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from tests.server_fixtures import free_port
from tokenmill.bench import serve_bench, serve_client
from tokenmill.bench.datasets import SampledRequest
from tokenmill.bench.serve_bench import NOT_SENT, LoadConfig, run_serve_benchmark
from tokenmill.bench.serve_client import ClientConfig, discover_model, make_client, send_request
from tokenmill.bench.workload import Conversation


class Clock:
    """A perf_counter that only moves when the scripted server says so; counts its reads."""

    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0

    def perf_counter(self) -> float:
        self.reads += 1
        return self.now


class WordTokenizer:
    """One token per whitespace-separated word; no chat template."""

    vocab_size = 100
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)


def chunk(text: str | None, chat: bool, usage: tuple[int, int] | None = None, finish: str | None = None) -> dict:
    """One OpenAI stream chunk as a server sends it (``text`` None: the usage-only chunk, no choices)."""
    if text is None:
        choices = []
    elif chat:
        choices = [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text, "finish_reason": finish}]
    u = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)} if usage else None
    return {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
            "model": "m", "choices": choices, "usage": u}


@dataclass
class Reject:
    """A scripted non-streamed reply: ``status`` with ``body`` (a dict is sent as JSON)."""

    status: int
    body: dict | str


class ScriptServer:
    """The scripted OpenAI-compatible server.

    Each script is a ``Reject`` or a list of (gap seconds, payload) streamed as SSE and ended with
    ``data: [DONE]``. A dict payload is sent as one ``data:`` event: with a clock, the clock first moves
    by the gap and the server then waits for the client to read it; bytes are written as they are
    (no clock wait). ``hold_s`` is a real sleep before every payload; ``delay_s`` one before the headers.
    """

    def __init__(self, scripts: list, clock: Clock | None = None, hold_s: float = 0.0, delay_s: float = 0.0,
                 models: list[str] | Reject | None = None) -> None:
        self.scripts, self.clock, self.hold_s, self.delay_s = list(scripts), clock, hold_s, delay_s
        self.models = ["m"] if models is None else models
        self.calls: list[dict] = []
        self.paths: list[str] = []
        self.auth: list[str | None] = []
        self.peers: list[Any] = []
        self.in_flight = self.max_in_flight = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.list_models)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def list_models(self, request: web.Request) -> web.Response:
        self.auth.append(request.headers.get("Authorization"))
        if isinstance(self.models, Reject):
            return web.json_response(self.models.body, status=self.models.status)
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.calls.append(await request.json())
        self.paths.append(request.path)
        self.auth.append(request.headers.get("Authorization"))
        self.peers.append(request.transport.get_extra_info("peername"))
        script = self.scripts.pop(0)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if isinstance(script, Reject):
            if isinstance(script.body, dict):
                return web.json_response(script.body, status=script.status)
            return web.Response(text=script.body, status=script.status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await response.prepare(request)
            for gap, payload in script:
                if self.hold_s:
                    await asyncio.sleep(self.hold_s)
                if isinstance(payload, bytes):
                    await response.write(payload)
                    continue
                seen = self.clock.reads if self.clock else 0
                if self.clock:
                    self.clock.now += gap
                await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                if self.clock:
                    await self._until_read(seen)
            await response.write(b"data: [DONE]\n\n")
            await asyncio.sleep(0.005)  # the stream ends a little after [DONE]: the client must read on to reuse it
        except ConnectionResetError:  # the client left (a timeout test)
            return response
        finally:
            self.in_flight -= 1
        await response.write_eof()
        return response

    async def _until_read(self, seen: int) -> None:
        """Wait (at most 5 s) until the client has read the clock since ``seen``, i.e. has taken the chunk."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while self.clock.reads <= seen and loop.time() < deadline:
            await asyncio.sleep(0.0005)


def against(server: ScriptServer, work) -> Any:
    """Start ``server``, run ``await work(base_url)`` in the same event loop, stop the server."""

    async def main():
        url = await server.start()
        try:
            return await work(url)
        finally:
            await server.stop()

    return asyncio.run(main())


def one_request(server: ScriptServer, config: ClientConfig, prompt, max_tokens: int, run_start: float):
    """``send_request`` once through a fresh client pointed at ``server``."""

    async def work(url: str):
        async with make_client(config) as client:
            return await send_request(client, _at(config, url), prompt, max_tokens, run_start)

    return against(server, work)


def _at(config: ClientConfig, url: str) -> ClientConfig:
    return replace(config, base_url=url)


def run_bench(server: ScriptServer, config: ClientConfig, load: LoadConfig, workload: list[Conversation]):
    """``run_serve_benchmark`` through a real client against ``server``."""

    async def work(url: str):
        client = make_client(_at(config, url))
        try:
            return await run_serve_benchmark(client, _at(config, url), load, workload, WordTokenizer())
        finally:
            await client.close()

    return against(server, work)


@pytest.fixture()
def clock(monkeypatch) -> Clock:
    c = Clock()
    fake_time = SimpleNamespace(perf_counter=c.perf_counter)
    monkeypatch.setattr(serve_client, "time", fake_time)
    monkeypatch.setattr(serve_bench, "time", fake_time)
    return c


def test_send_request_times_content_chunks(clock, monkeypatch):
    # sent at 100.0; role-only chunk at +0.02 (no content), content at +0.10, +0.15, +0.25, +0.30; usage at +0.32
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    script = [(0.02, chunk("", chat=True)), (0.08, chunk("a", chat=True)), (0.05, chunk(" b", chat=True)),
              (0.10, chunk(" c", chat=True)), (0.05, chunk(" d", chat=True)), (0.02, chunk(None, True, usage=(7, 4)))]
    server = ScriptServer([script], clock)
    config = ClientConfig(model="m", endpoint="chat", ignore_eos=True)
    reply = one_request(server, config, [{"role": "user", "content": "hi"}], 4, run_start=99.5)
    r = reply.result
    assert r.success and r.error == ""
    assert r.start_time == pytest.approx(0.5)
    assert r.ttft == pytest.approx(0.10)
    assert r.itls == pytest.approx([0.05, 0.10, 0.05])
    assert r.e2el == pytest.approx(0.32)
    assert reply.text == "a b c d" and (reply.usage_prompt_tokens, reply.usage_completion_tokens) == (7, 4)
    assert reply.chunks == 6 and reply.finish_reason is None
    assert server.paths == ["/v1/chat/completions"] and server.auth == ["Bearer EMPTY"]
    assert server.calls[0] == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                               "ignore_eos": True}  # unset sampling fields (top_p...) are the server's to choose


def test_send_request_carries_vllm_sampling_flags(clock, monkeypatch):
    """``bench serve --top-p/--top-k/--min-p``: top_p as the OpenAI field, top_k and min_p as extra fields;
    completions send the prompt as text or token ids; the bearer key is the config's, else $OPENAI_API_KEY."""
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    script = [(0.01, chunk("a", False)), (0.01, chunk(None, False, usage=(3, 1)))]
    server = ScriptServer([script, script], clock)
    config = ClientConfig(model="m", temperature=0.8, top_p=0.9, top_k=5, min_p=0.05)

    async def work(url: str):
        async with make_client(_at(config, url + "/v1/")) as client:
            first = await send_request(client, _at(config, url + "/v1/"), "hi", 1, run_start=0.0)
        async with make_client(ClientConfig(base_url=url, api_key="k")) as client:
            second = await send_request(client, ClientConfig(base_url=url, api_key="k"), [5, 6, 7], 2, 0.0)
        return first, second

    first, second = against(server, work)
    assert first.result.success and second.result.success and first.text == "a"
    call = server.calls[0]
    assert (call["temperature"], call["top_p"], call["top_k"], call["min_p"]) == (0.8, 0.9, 5, 0.05)
    assert call["prompt"] == "hi" and "ignore_eos" not in call
    assert server.calls[1]["prompt"] == [5, 6, 7] and server.calls[1]["model"] is None
    assert not {"top_p", "top_k", "min_p", "ignore_eos"} & set(server.calls[1])
    assert server.paths == ["/v1/completions"] * 2 and server.auth == ["Bearer from-env", "Bearer k"]


def test_ttft_of_a_reply_without_text_is_its_finish_chunk(clock):
    # EOS as the first token: a role-only chunk at +0.02, the finish chunk (no text) at +0.30, usage at +0.31.
    script = [(0.02, chunk("", chat=True)), (0.28, chunk("", chat=True, finish="stop")),
              (0.01, chunk(None, True, usage=(9, 1)))]
    reply = one_request(ScriptServer([script], clock), ClientConfig(endpoint="chat"),
                        [{"role": "user", "content": "hi"}], 8, run_start=100.0)
    assert reply.result.success and reply.finish_reason == "stop" and reply.text == ""
    assert reply.result.ttft == pytest.approx(0.30) and reply.result.e2el == pytest.approx(0.31)
    assert reply.result.itls == []


def test_connection_refused_is_a_failed_result():
    config = ClientConfig(base_url=f"http://127.0.0.1:{free_port()}")

    async def go():
        async with make_client(config) as client:
            return await send_request(client, config, "hi", 4, run_start=0.0)

    reply = asyncio.run(go())
    assert not reply.result.success and reply.result.error.startswith("ClientConnectorError")
    assert reply.result.ttft is None and reply.result.e2el is None and reply.text == ""


def test_http_error_status_is_a_failed_result_with_the_servers_message(clock):
    body = {"error": {"message": "This model's maximum context length is 512 tokens", "type": "BadRequestError",
                      "param": None, "code": 400}}
    reply = one_request(ScriptServer([Reject(400, body)], clock), ClientConfig(model="m"), "hi", 4, 100.0)
    assert not reply.result.success
    assert reply.result.error == "HTTP 400 Bad Request: This model's maximum context length is 512 tokens"
    assert reply.result.ttft is None and reply.result.e2el is None and reply.chunks == 0

    reply = one_request(ScriptServer([Reject(502, "upstream gone")], clock), ClientConfig(), "hi", 4, 100.0)
    assert reply.result.error == "HTTP 502 Bad Gateway: upstream gone"
    vllm_style = {"object": "error", "message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}
    reply = one_request(ScriptServer([Reject(404, vllm_style)], clock), ClientConfig(), "hi", 4, 100.0)
    assert reply.result.error == "HTTP 404 Not Found: The model `x` does not exist."


def test_stream_errors_abort_and_timeout_are_failed_results(clock):
    # an error event after one content chunk (what tokenmill sends when the engine dies mid-stream)
    script = [(0.1, chunk("a", False)), (0.1, {"error": {"message": "engine died", "code": 503}})]
    reply = one_request(ScriptServer([script], clock), ClientConfig(), "hi", 4, 100.0)
    assert not reply.result.success and reply.result.error == "stream error: engine died"
    assert reply.result.ttft == pytest.approx(0.1) and reply.result.e2el is None and reply.text == "a"

    script = [(0.1, chunk("a", False)), (0.1, chunk("", False, finish="abort"))]
    reply = one_request(ScriptServer([script], clock), ClientConfig(), "hi", 4, 100.0)
    assert not reply.result.success and reply.result.error == "the server aborted the request"

    script = [(0.0, b"data: {not json\n\n")]
    reply = one_request(ScriptServer([script], clock), ClientConfig(), "hi", 4, 100.0)
    assert not reply.result.success and reply.result.error.startswith("JSONDecodeError")

    reply = one_request(ScriptServer([[(0.0, chunk("a", False))]], delay_s=1.0), ClientConfig(timeout_s=0.2),
                        "hi", 4, 100.0)
    assert not reply.result.success and reply.result.error == "TimeoutError: no complete reply within timeout_s=0.2 s"


def test_sse_events_split_and_merged_across_reads():
    """Events cut mid-line and several in one write, CRLF endings, ``data:`` without its space, comments,
    and a last event without its blank line all parse; nothing after ``[DONE]`` counts."""
    first = json.dumps(chunk("a", False)).encode()
    pieces = [b"data: " + first[:10], first[10:] + b"\n", b"\n: keep-alive\n\n",
              b"data:" + json.dumps(chunk("b", False, finish="length")).encode() + b"\r\n\r\n"
              + b"data: " + json.dumps(chunk(None, False, usage=(2, 2))).encode() + b"\n\n"]
    script = [(0.0, p) for p in pieces]
    reply = one_request(ScriptServer([script], hold_s=0.01), ClientConfig(), "hi", 2, 0.0)
    assert reply.result.success and reply.text == "ab" and reply.finish_reason == "length" and reply.chunks == 3
    assert (reply.usage_prompt_tokens, reply.usage_completion_tokens) == (2, 2)
    assert reply.result.ttft is not None and len(reply.result.itls) == 1
    assert 0 < reply.result.ttft <= reply.result.ttft + reply.result.itls[0] <= reply.result.e2el

    after_done = [(0.0, b"data: " + json.dumps(chunk("x", False)).encode() + b"\n\ndata: [DONE]\n\n"
                   + b"data: " + json.dumps(chunk("y", False)).encode())]
    reply = one_request(ScriptServer([after_done]), ClientConfig(), "hi", 2, 0.0)
    assert reply.result.success and reply.text == "x" and reply.chunks == 1


def test_discover_model_and_client_lifecycle(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    outside = make_client(ClientConfig())  # made outside any event loop: its session waits for first use

    async def work(url: str):
        config = ClientConfig(base_url=url, api_key="secret")
        client = make_client(config)
        found = await discover_model(client)
        await client.close()
        await client.close()  # closing twice is harmless
        found_again = await discover_model(client)  # a closed client opens a new session when used again
        await client.close()
        async with make_client(ClientConfig(base_url=url)) as plain:
            plain_found = await discover_model(plain)
        await outside.close()  # never used: nothing to close
        return found, found_again, plain_found

    server = ScriptServer([], models=["first", "second"])
    assert against(server, work) == ("first", "first", "first")
    assert server.auth == ["Bearer secret", "Bearer secret", "Bearer EMPTY"]

    async def fails(url: str):
        async with make_client(ClientConfig(base_url=url)) as client:
            with pytest.raises(expected):
                await discover_model(client)

    expected = ValueError
    against(ScriptServer([], models=[]), fails)
    expected = RuntimeError
    against(ScriptServer([], models=Reject(401, {"error": {"message": "bad key"}})), fails)


def test_run_without_usage_counts_with_tokenizer_and_matches_hand_metrics(clock):
    # Sequential (max_concurrency 1) completions, no usage chunks: lengths come from the tokenizer.
    a = [(0.10, chunk("w1", False)), (0.05, chunk(" w2", False)), (0.10, chunk(" w3", False)),
         (0.05, chunk(" w4", False))]
    b = [(0.20, chunk("v1", False)), (0.10, chunk(" v2", False)), (0.05, chunk("", False))]
    workload = [Conversation((SampledRequest("p q r", [1, 1, 1], 4),)),
                Conversation((SampledRequest("s t", [1, 1], 2),))]
    server = ScriptServer([a, b], clock)
    run = run_bench(server, ClientConfig(model="m"), LoadConfig(max_concurrency=1, disable_tqdm=True), workload)
    assert run.usage_source == "tokenizer"
    assert [(r.prompt_len, r.output_len) for r in run.results] == [(3, 4), (2, 2)]
    assert run.duration_s == pytest.approx(0.30 + 0.35)
    assert run.results[1].start_time == pytest.approx(0.30)
    m = run.metrics
    assert (m.completed, m.failed, m.total_input_tokens, m.total_output_tokens) == (2, 0, 5, 6)
    assert m.ttft.mean_ms == pytest.approx(150.0) and m.ttft.p90_ms == pytest.approx(100 + 0.9 * 100)
    assert m.tpot.median_ms == pytest.approx((200 / 3 + 150) / 2)  # (0.30-0.10)/3 and (0.35-0.20)/1
    assert m.itl.count == 4 and m.itl.mean_ms == pytest.approx(75.0)
    assert m.e2el.median_ms == pytest.approx(325.0)
    assert m.output_throughput == pytest.approx(6 / 0.65)
    # each request on a connection of its own: a kept-alive one the server had closed meanwhile failed the
    # next request sent on it (llama-server closes one after 5 requests or 5 idle seconds)
    assert len(server.peers) == 2 and server.peers[0] != server.peers[1]


def test_multi_turn_appends_answers_and_stops_after_a_failed_turn(clock):
    def answer(text: str, usage: tuple[int, int]):
        return [(0.01, chunk(text, True)), (0.01, chunk(None, True, usage=usage))]

    conv_ok = Conversation((SampledRequest("hello there", [1, 1], 3), SampledRequest("and more", [1, 1], 3)))
    conv_bad = Conversation((SampledRequest("first", [1], 3), SampledRequest("second", [1], 3),
                             SampledRequest("third", [1], 3)))
    scripts = [answer("hi you", (5, 2)), answer("sure", (12, 1)),
               Reject(400, {"error": {"message": "prompt too long", "type": "BadRequestError"}})]
    server = ScriptServer(scripts, clock)
    config = ClientConfig(model="m", endpoint="chat")
    run = run_bench(server, config, LoadConfig(max_concurrency=1, disable_tqdm=True), [conv_ok, conv_bad])
    assert server.calls[1]["messages"] == [
        {"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi you"},
        {"role": "user", "content": "and more"}]
    assert len(server.calls) == 3  # the bad conversation's later turns were never sent
    assert [r.success for r in run.results] == [True, True, False, False, False]
    assert run.results[2].error == "HTTP 400 Bad Request: prompt too long" and run.results[3].error == NOT_SENT
    assert [r.prompt_len for r in run.results[:2]] == [5, 12] and run.usage_source == "server"
    assert (run.metrics.completed, run.metrics.failed) == (2, 3)
    with pytest.raises(ValueError, match="endpoint"):
        asyncio.run(run_serve_benchmark(make_client(ClientConfig()), ClientConfig(), LoadConfig(disable_tqdm=True),
                                        [conv_ok], WordTokenizer()))


def test_max_concurrency_caps_requests_in_flight():
    script = [(0.0, chunk("a", False)), (0.0, chunk(" b", False))]
    workload = [Conversation((SampledRequest("p", [1], 2),)) for _ in range(12)]
    for cap, expected in ((3, 3), (None, 12)):
        server = ScriptServer([script] * 12, hold_s=0.05)
        run = run_bench(server, ClientConfig(), LoadConfig(max_concurrency=cap, disable_tqdm=True), workload)
        assert run.metrics.completed == 12
        assert server.max_in_flight == expected
