"""`bench offline` / `bench compare` on a tiny random Llama, and the workload builders behind every bench command.

Offline runs generate exactly each target (ignore_eos), keep TTFT <= E2EL from the engine's own
timestamps, grow multi-turn histories by each answer and record over-long requests as failed;
compare runs tokenmill and the transformers peer on the same tokens and skips absent peers with a reason.
"""
from __future__ import annotations

import importlib.util
import json

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill import LLM
from tokenmill.bench.compare import compare_engines, format_compare_table
from tokenmill.bench.datasets import SampledRequest, sample_random
from tokenmill.bench.offline import run_offline
from tokenmill.bench.synthetic import sample_shared_prefix
from tokenmill.bench.workload import Conversation, DatasetConfig, build_workload, load_tokenizer
from tokenmill.cli.main import main


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("offline_llama")))


@pytest.fixture(scope="module")
def llm(tiny_path) -> LLM:
    return LLM(model=tiny_path, dtype="float32", num_kv_blocks=256, num_threads=1)


def test_offline_run_generates_targets_and_times_requests(llm):
    tokenizer = llm.get_tokenizer()
    requests = sample_random(tokenizer, 6, 20, 10, 0.5, seed=1)
    too_long = SampledRequest("", requests[0].prompt_token_ids, 600)  # over max_model_len 512
    run = run_offline(llm, [Conversation((r,)) for r in [*requests, too_long]], use_tqdm=False)
    ok, bad = run.results[:6], run.results[6]
    assert [r.output_len for r in ok] == [r.expected_output_len for r in requests]
    assert [r.prompt_len for r in ok] == [r.prompt_len for r in requests]
    assert all(0 < r.ttft <= r.e2el for r in ok)
    assert not bad.success and "max_model_len" in bad.error
    m = run.metrics
    assert (m.completed, m.failed) == (6, 1)
    assert m.total_output_tokens == sum(r.expected_output_len for r in requests)
    assert m.output_throughput == pytest.approx(m.total_output_tokens / run.duration_s)
    assert m.itl.count == 0 and m.tpot.count == 6


def test_offline_multi_turn_appends_answers(llm):
    conv = Conversation((SampledRequest("Hello!", [], 4), SampledRequest("Tell me more.", [], 3)))
    run = run_offline(llm, [conv, conv], use_tqdm=False)
    t1, t2 = run.results[:2]
    assert (t1.output_len, t2.output_len) == (4, 3)
    tokenizer = llm.get_tokenizer()
    assert t2.prompt_len >= t1.prompt_len + t1.output_len + len(tokenizer.encode("Tell me more.", add_special_tokens=False))


def test_cli_offline_writes_consistent_json(tiny_path, tmp_path, capsys):
    out_file = tmp_path / "offline.json"
    code = main(["bench", "offline", tiny_path, "--dtype", "float32", "--num-kv-blocks", "128", "--num-threads", "1",
                 "--dataset", "random", "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "5",
                 "--disable-tqdm", "--result-file", str(out_file)])
    assert code == 0
    assert "Offline Benchmark Result" in capsys.readouterr().out
    record = json.loads(out_file.read_text())
    assert record["completed"] == 5 and record["output_lens"] == [8] * 5
    assert record["total_output_tokens"] == 40


def test_compare_runs_peers_on_the_same_work_and_skips_absent_ones(tiny_path):
    tokenizer = load_tokenizer(tiny_path)
    requests = sample_random(tokenizer, 4, 16, 6, 0.0, seed=2)
    runs, skipped, notes = compare_engines(
        lambda: LLM(model=tiny_path, dtype="float32", num_kv_blocks=128, num_threads=1),
        tiny_path, requests, ["transformers", "llama_cpp", "vllm"], peer_batch_size=2, num_threads=1)
    names = [r.engine for r in runs]
    assert names[0] == "tokenmill" and "transformers" in names
    for run in runs:
        assert (run.num_requests, run.input_tokens, run.output_tokens) == (4, 64, 24)
        assert run.raw_output_tokens == 24 and run.wall_s > 0
    assert "unknown peer" in skipped["vllm"]
    if importlib.util.find_spec("llama_cpp") is None:
        assert skipped["llama_cpp"] == "llama_cpp is not installed"
    table = format_compare_table(runs, skipped, notes)
    assert "output_tok_s tokenmill/transformers" in table and "skipped vllm" in table
    assert notes == []


def test_workload_builders(tiny_path):
    tokenizer = load_tokenizer(tiny_path)
    shared = sample_shared_prefix(tokenizer, num_prompts=9, num_groups=3, prefix_len=40, suffix_len=5, output_len=7,
                                  seed=0)
    prefixes = {r.prompt.split("\n")[0] for r in shared}
    assert len(shared) == 9 and len(prefixes) == 3 and all(r.expected_output_len == 7 for r in shared)
    assert all(r.prompt_token_ids == tokenizer.encode(r.prompt) for r in shared)
    with pytest.raises(ValueError, match="num_groups"):
        sample_shared_prefix(tokenizer, 2, 3, 4, 4, 4, 0)

    convs = build_workload(DatasetConfig("multi-turn", num_prompts=3, multi_turn_num_turns=2,
                                         multi_turn_max_output_len=16, multi_turn_max_total_len=400), tokenizer)
    assert len(convs) == 3 and all(len(c.turns) == 2 and c.is_multi_turn for c in convs)
    assert all(sum(t.prompt_len + t.expected_output_len for t in c.turns) <= 400 for c in convs)
    assert all(t.expected_output_len <= 16 for c in convs for t in c.turns)
    sharegpt = build_workload(DatasetConfig("sharegpt", num_prompts=4, sharegpt_output_len=5), tokenizer)
    assert [len(c.turns) for c in sharegpt] == [1] * 4 and all(c.turns[0].expected_output_len == 5 for c in sharegpt)
    with pytest.raises(ValueError, match="dataset_name"):
        DatasetConfig("nope")
    with pytest.raises(ValueError, match="not a local path"):
        load_tokenizer("/no/such/tokenizer")
