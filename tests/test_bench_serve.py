"""`tokenmill bench serve` against a real `tokenmill serve` process (tiny random Llama) over real HTTP.

The saved JSON must agree with itself, with the workload (ignore_eos: every request generates
exactly its target) and with the server's own token counter; multi-turn chat histories grow by
each answer; a dead port, an unknown model and over-long requests give failed-request counts
and exit code 0, never a crash; a concurrency sweep writes its table, JSON and plot.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.server_fixtures import ServerProcess, free_port
from tests.tiny_models import make_tiny_model
from tokenmill.bench.datasets import SampledRequest, sample_random
from tokenmill.bench.serve_bench import LoadConfig, chat_prompt_len, run_serve_benchmark
from tokenmill.bench.serve_client import ClientConfig, make_client
from tokenmill.bench.workload import Conversation, load_tokenizer
from tokenmill.cli.main import main

SERVER_ARGS = ["--dtype", "float32", "--max-num-seqs", "4", "--kv-cache-memory", "0.01", "--num-threads", "1"]
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    proc = ServerProcess(tiny_path, SERVER_ARGS, tmp_path_factory.mktemp("logs") / "server.log").wait_healthy()
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def bench(url: str, tokenizer: str, *args: str) -> int:
    return main(["bench", "serve", "--base-url", url, "--tokenizer", tokenizer, "--disable-tqdm", *args])


def generated_tokens(server: ServerProcess) -> float:
    return server.metrics()["tokenmill:generation_tokens_total"]


def test_saved_json_is_consistent_with_workload_and_server(server, tiny_path, tmp_path, capsys):
    result_file = tmp_path / "run.json"
    random_args = ["--dataset", "random", "--random-input-len", "24", "--random-output-len", "12",
                   "--random-range-ratio", "0.5", "--num-prompts", "10", "--seed", "3"]
    before = generated_tokens(server)
    code = bench(server.url, tiny_path, *random_args, "--max-concurrency", "3", "--ignore-eos",
                 "--result-file", str(result_file), "--plot")
    assert code == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    record = json.loads(result_file.read_text())

    tokenizer = load_tokenizer(tiny_path)
    workload = sample_random(tokenizer, 10, 24, 12, 0.5, 3)
    assert (record["completed"], record["failed"], record["num_requests"]) == (10, 0, 10)
    assert record["model_id"] == tiny_path and record["token_counts_from"] == "server"
    assert record["output_lens"] == [r.expected_output_len for r in workload]  # ignore_eos: exact targets
    assert record["input_lens"] == [len(tokenizer.encode(r.prompt)) for r in workload]  # server tokenized the text
    assert record["total_output_tokens"] == sum(record["output_lens"])
    assert record["total_input_tokens"] == sum(record["input_lens"])
    assert generated_tokens(server) - before == record["total_output_tokens"]
    assert record["request_throughput"] == pytest.approx(10 / record["duration"])
    assert record["output_throughput"] == pytest.approx(record["total_output_tokens"] / record["duration"])
    for ttft, itls, e2el, n, tpot in zip(record["ttfts"], record["itls"], record["e2els"], record["output_lens"],
                                         record["tpots"]):
        assert 0 < ttft <= e2el and 1 <= len(itls) <= n - 1
        assert ttft + sum(itls) <= e2el + 1e-9
        assert tpot == pytest.approx((e2el - ttft) / (n - 1))
    assert record["errors"] == [""] * 10
    assert result_file.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_chat_turns_carry_the_history(server, tiny_path):
    tokenizer = load_tokenizer(tiny_path)
    convs = [Conversation((SampledRequest("Name a colour.", [], 5), SampledRequest("And another one?", [], 4)))
             for _ in range(3)]
    config = ClientConfig(base_url=server.url, model=tiny_path, endpoint="chat", ignore_eos=True)

    async def go():
        client = make_client(config)
        try:
            return await run_serve_benchmark(client, config, LoadConfig(max_concurrency=2, disable_tqdm=True),
                                             convs, tokenizer)
        finally:
            await client.close()

    run = asyncio.run(go())
    assert (run.metrics.completed, run.metrics.failed) == (6, 0)
    first = chat_prompt_len(tokenizer, [{"role": "user", "content": "Name a colour."}])
    for i in range(3):
        t1, t2 = run.results[2 * i], run.results[2 * i + 1]
        assert (t1.output_len, t2.output_len) == (5, 4)
        assert t1.prompt_len == first  # the server rendered the same chat template
        # turn 2's prompt holds turn 1, its answer and the new question
        assert t2.prompt_len >= t1.prompt_len + t1.output_len + len(tokenizer.encode("And another one?",
                                                                                    add_special_tokens=False))


def test_failures_are_counted_not_raised(server, tiny_path, tmp_path):
    args = ["--dataset", "random", "--random-input-len", "8", "--random-output-len", "4", "--num-prompts", "4"]
    dead = tmp_path / "dead.json"
    assert bench(f"http://127.0.0.1:{free_port()}", tiny_path, *args, "--result-file", str(dead)) == 0
    record = json.loads(dead.read_text())
    assert (record["completed"], record["failed"], record["total_output_tokens"]) == (0, 4, 0)
    assert all(e.startswith("ClientConnectorError") for e in record["errors"])
    assert record["ttfts"] == [None] * 4 and record["mean_ttft_ms"] is None

    wrong = tmp_path / "wrong.json"
    assert bench(server.url, tiny_path, *args, "--model", "no-such-model", "--result-file", str(wrong)) == 0
    record = json.loads(wrong.read_text())
    assert (record["completed"], record["failed"]) == (0, 4)
    assert all("404" in e and "no-such-model" in e for e in record["errors"])

    # Requests whose prompt + max_tokens exceed max_model_len are rejected (HTTP 400); the rest succeed.
    ok = [SampledRequest("Once upon a time", [], 3)] * 3
    too_long = [SampledRequest("Once upon a time", [], MAX_MODEL_LEN + 10)] * 2
    workload = [Conversation((r,)) for r in (ok[0], too_long[0], ok[1], too_long[1], ok[2])]
    config = ClientConfig(base_url=server.url, model=tiny_path, ignore_eos=True)

    async def go():
        client = make_client(config)
        try:
            return await run_serve_benchmark(client, config, LoadConfig(disable_tqdm=True), workload,
                                             load_tokenizer(tiny_path))
        finally:
            await client.close()

    run = asyncio.run(go())
    assert [r.success for r in run.results] == [True, False, True, False, True]
    assert (run.metrics.completed, run.metrics.failed, run.metrics.total_output_tokens) == (3, 2, 9)
    assert all("400" in r.error and "max_model_len" in r.error for r in run.results if not r.success)


def test_concurrency_sweep_writes_table_json_and_plot(server, tiny_path, tmp_path, capsys):
    result_file = tmp_path / "sweep.json"
    code = bench(server.url, tiny_path, "--dataset", "shared-prefix", "--shared-prefix-num-groups", "2",
                 "--shared-prefix-len", "48", "--shared-prefix-suffix-len", "8", "--shared-prefix-output-len", "6",
                 "--num-prompts", "6", "--ignore-eos", "--concurrency", "1,3", "--result-file", str(result_file))
    assert code == 0
    out = capsys.readouterr().out
    assert "Throughput vs latency" in out
    record = json.loads(result_file.read_text())
    assert [row["concurrency"] for row in record["sweep"]] == [1, 3]
    assert [row["completed"] for row in record["sweep"]] == [6, 6]
    assert [run["max_concurrency"] for run in record["runs"]] == [1, 3]
    assert all(sum(run["output_lens"]) == 36 for run in record["runs"])
    table = out[out.index("Throughput vs latency"):].splitlines()
    assert table[2].split()[0] == "1" and table[3].split()[0] == "3"
    assert result_file.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_vllm_spellings_result_dir_filename_host_port_backend(server, tiny_path, tmp_path, capsys):
    """vLLM's ``bench serve`` spellings: ``--result-dir D --result-filename F`` writes ``D/F`` (D created),
    ``--host``/``--port`` stand for ``--base-url``, ``--backend openai-chat`` for ``--endpoint chat`` and
    ``--served-model-name`` for ``--model``; ``--result-file`` with ``--result-dir`` is refused naming the flag."""
    result_dir = tmp_path / "results" / "nested"
    args = ["--dataset", "random", "--random-input-len", "8", "--random-output-len", "3", "--num-prompts", "2",
            "--ignore-eos", "--result-dir", str(result_dir), "--result-filename", "chat.json"]
    code = main(["bench", "serve", "--host", "127.0.0.1", "--port", str(server.port), "--tokenizer", tiny_path,
                 "--disable-tqdm", "--backend", "openai-chat", "--served-model-name", tiny_path,
                 "--temperature", "1", "--top-p", "0.9", "--top-k", "5", "--min-p", "0.01", *args])
    assert code == 0
    record = json.loads((result_dir / "chat.json").read_text())
    assert (record["completed"], record["failed"]) == (2, 0)
    assert record["endpoint"] == "chat" and record["model_id"] == tiny_path
    assert (record["temperature"], record["top_p"], record["top_k"], record["min_p"]) == (1, 0.9, 5, 0.01)
    assert str(result_dir / "chat.json") in capsys.readouterr().out
    assert bench(server.url, tiny_path, *args, "--result-file", str(tmp_path / "x.json")) == 2
    assert "result_file" in capsys.readouterr().err
