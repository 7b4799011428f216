"""The bench client's timing and load logic against a scripted fake OpenAI client on a fake clock.

Each fake stream advances the clock by scripted gaps before each chunk, so TTFT, ITL, E2EL,
TPOT and the run's duration are exact and hand-computable. Also: token counts fall back to
the tokenizer when the server sends no usage, multi-turn histories carry the answers, a
failed turn stops its conversation, and the concurrency cap holds.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tokenmill.bench import serve_bench, serve_client
from tokenmill.bench.datasets import SampledRequest
from tokenmill.bench.serve_bench import NOT_SENT, LoadConfig, run_serve_benchmark
from tokenmill.bench.serve_client import ClientConfig, send_request
from tokenmill.bench.workload import Conversation


class Clock:
    """A perf_counter that only moves when a fake stream says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class WordTokenizer:
    """One token per whitespace-separated word; no chat template."""

    vocab_size = 100
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)


def chunk(text: str | None, chat: bool, usage: tuple[int, int] | None = None, finish: str | None = None):
    if text is None:  # usage-only chunk
        choices = []
    elif chat:
        choices = [SimpleNamespace(delta=SimpleNamespace(content=text), finish_reason=finish)]
    else:
        choices = [SimpleNamespace(text=text, finish_reason=finish)]
    u = SimpleNamespace(prompt_tokens=usage[0], completion_tokens=usage[1]) if usage else None
    return SimpleNamespace(choices=choices, usage=u)


class FakeClient:
    """``client.completions.create`` / ``client.chat.completions.create`` returning scripted streams.

    ``scripts`` is consumed in call order; each is a list of (gap seconds, chunk) or an exception.
    """

    def __init__(self, clock: Clock, scripts: list, real_sleep: bool = False) -> None:
        self.clock, self.scripts, self.real_sleep = clock, list(scripts), real_sleep
        self.calls: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.completions = SimpleNamespace(create=self._create)
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **kwargs):
        self.calls.append(kwargs)
        script = self.scripts.pop(0)
        if isinstance(script, Exception):
            raise script
        return self._stream(script)

    async def _stream(self, script):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for gap, item in script:
                if self.real_sleep:
                    await asyncio.sleep(0.001)
                self.clock.now += gap
                yield item
        finally:
            self.in_flight -= 1


@pytest.fixture()
def clock(monkeypatch) -> Clock:
    c = Clock()
    fake_time = SimpleNamespace(perf_counter=c.perf_counter)
    monkeypatch.setattr(serve_client, "time", fake_time)
    monkeypatch.setattr(serve_bench, "time", fake_time)
    return c


def test_send_request_times_content_chunks(clock):
    # sent at 100.0; role-only chunk at +0.02 (no content), content at +0.10, +0.15, +0.25, +0.30; usage at +0.32
    script = [(0.02, chunk("", chat=True)), (0.08, chunk("a", chat=True)), (0.05, chunk(" b", chat=True)),
              (0.10, chunk(" c", chat=True)), (0.05, chunk(" d", chat=True)), (0.02, chunk(None, True, usage=(7, 4)))]
    client = FakeClient(clock, [script])
    config = ClientConfig(model="m", endpoint="chat", ignore_eos=True)
    reply = asyncio.run(send_request(client, config, [{"role": "user", "content": "hi"}], 4, run_start=99.5))
    r = reply.result
    assert r.success and r.error == ""
    assert r.start_time == pytest.approx(0.5)
    assert r.ttft == pytest.approx(0.10)
    assert r.itls == pytest.approx([0.05, 0.10, 0.05])
    assert r.e2el == pytest.approx(0.32)
    assert reply.text == "a b c d" and (reply.usage_prompt_tokens, reply.usage_completion_tokens) == (7, 4)
    call = client.calls[0]
    assert call["stream"] is True and call["stream_options"] == {"include_usage": True}
    assert call["max_tokens"] == 4 and call["extra_body"] == {"ignore_eos": True} and call["model"] == "m"
    assert "top_p" not in call  # unset sampling fields are the server's to choose


def test_send_request_carries_vllm_sampling_flags(clock):
    """``bench serve --top-p/--top-k/--min-p``: top_p as the OpenAI field, top_k and min_p as extra fields."""
    client = FakeClient(clock, [[(0.01, chunk("a", False)), (0.01, chunk(None, False, usage=(3, 1)))]])
    config = ClientConfig(model="m", temperature=0.8, top_p=0.9, top_k=5, min_p=0.05)
    asyncio.run(send_request(client, config, "hi", 1, run_start=0.0))
    call = client.calls[0]
    assert (call["temperature"], call["top_p"], call["extra_body"]) == (0.8, 0.9, {"top_k": 5, "min_p": 0.05})


def test_ttft_of_a_reply_without_text_is_its_finish_chunk(clock):
    # EOS as the first token: a role-only chunk at +0.02, the finish chunk (no text) at +0.30, usage at +0.31.
    script = [(0.02, chunk("", chat=True)), (0.28, chunk("", chat=True, finish="stop")),
              (0.01, chunk(None, True, usage=(9, 1)))]
    reply = asyncio.run(send_request(FakeClient(clock, [script]), ClientConfig(endpoint="chat"),
                                     [{"role": "user", "content": "hi"}], 8, run_start=100.0))
    assert reply.result.success and reply.finish_reason == "stop" and reply.text == ""
    assert reply.result.ttft == pytest.approx(0.30) and reply.result.e2el == pytest.approx(0.31)
    assert reply.result.itls == []


def test_send_request_turns_exceptions_into_failed_results(clock):
    client = FakeClient(clock, [ConnectionRefusedError("nothing listening")])
    reply = asyncio.run(send_request(client, ClientConfig(), "hi", 4, run_start=100.0))
    assert not reply.result.success and reply.result.error == "ConnectionRefusedError: nothing listening"
    assert reply.result.ttft is None and reply.result.e2el is None


def test_run_without_usage_counts_with_tokenizer_and_matches_hand_metrics(clock):
    # Sequential (max_concurrency 1) completions, no usage chunks: lengths come from the tokenizer.
    a = [(0.10, chunk("w1", False)), (0.05, chunk(" w2", False)), (0.10, chunk(" w3", False)), (0.05, chunk(" w4", False))]
    b = [(0.20, chunk("v1", False)), (0.10, chunk(" v2", False)), (0.05, chunk("", False))]
    workload = [Conversation((SampledRequest("p q r", [1, 1, 1], 4),)),
                Conversation((SampledRequest("s t", [1, 1], 2),))]
    client = FakeClient(clock, [a, b])
    run = asyncio.run(run_serve_benchmark(client, ClientConfig(model="m"), LoadConfig(max_concurrency=1, disable_tqdm=True),
                                          workload, WordTokenizer()))
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


def test_multi_turn_appends_answers_and_stops_after_a_failed_turn(clock):
    def answer(text: str, usage: tuple[int, int]):
        return [(0.01, chunk(text, True)), (0.01, chunk(None, True, usage=usage))]

    conv_ok = Conversation((SampledRequest("hello there", [1, 1], 3), SampledRequest("and more", [1, 1], 3)))
    conv_bad = Conversation((SampledRequest("first", [1], 3), SampledRequest("second", [1], 3),
                             SampledRequest("third", [1], 3)))
    scripts = [answer("hi you", (5, 2)), answer("sure", (12, 1)), RuntimeError("HTTP 400")]
    client = FakeClient(clock, scripts)
    config = ClientConfig(model="m", endpoint="chat")
    run = asyncio.run(run_serve_benchmark(client, config, LoadConfig(max_concurrency=1, disable_tqdm=True),
                                          [conv_ok, conv_bad], WordTokenizer()))
    assert client.calls[1]["messages"] == [
        {"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi you"},
        {"role": "user", "content": "and more"}]
    assert len(client.calls) == 3  # the bad conversation's later turns were never sent
    assert [r.success for r in run.results] == [True, True, False, False, False]
    assert run.results[2].error == "RuntimeError: HTTP 400" and run.results[3].error == NOT_SENT
    assert [r.prompt_len for r in run.results[:2]] == [5, 12] and run.usage_source == "server"
    assert (run.metrics.completed, run.metrics.failed) == (2, 3)
    with pytest.raises(ValueError, match="endpoint"):
        asyncio.run(run_serve_benchmark(client, ClientConfig(), LoadConfig(disable_tqdm=True), [conv_ok], WordTokenizer()))


def test_max_concurrency_caps_requests_in_flight(clock):
    script = [(0.01, chunk("a", False)), (0.01, chunk(" b", False))]
    workload = [Conversation((SampledRequest("p", [1], 2),)) for _ in range(12)]
    for cap, expected in ((3, 3), (None, 12)):
        client = FakeClient(clock, [script] * 12, real_sleep=True)
        run = asyncio.run(run_serve_benchmark(client, ClientConfig(), LoadConfig(max_concurrency=cap, disable_tqdm=True),
                                              workload, WordTokenizer()))
        assert run.metrics.completed == 12
        assert client.max_in_flight == expected
