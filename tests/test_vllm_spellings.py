"""vLLM's flag spellings on ``tokenmill serve`` and ``tokenmill bench serve`` parse to the same settings as ours
(no model, no server: argparse and the result-path rule only). The bench run that writes ``D/F`` is in
test_bench_serve.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.cli.bench import serve_endpoint, serve_result_file
from tokenmill.cli.main import build_parser, engine_kwargs


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("flag, field, value", [
    ("--enable-prefix-caching", "enable_prefix_caching", True),
    ("--no-enable-prefix-caching", "enable_prefix_caching", False),
    ("--enable-chunked-prefill", "enable_chunked_prefill", True),
    ("--no-enable-chunked-prefill", "enable_chunked_prefill", False),
])
def test_serve_boolean_engine_flags_have_both_forms(flag, field, value):
    assert engine_kwargs(parse("serve", flag))[field] is value
    assert engine_kwargs(parse("serve"))[field] is True  # the default


@pytest.mark.parametrize("argv, enabled", [
    ((), True), (("--enable-log-requests",), True), (("--no-enable-log-requests",), False),
    (("--disable-log-requests",), False),
])
def test_serve_log_requests_spellings(argv, enabled):
    assert parse("serve", *argv).enable_log_requests is enabled


def test_serve_cors_flags_take_vllms_json_lists_and_plain_names():
    vllm = parse("serve", "--allowed-origins", '["https://a.example", "https://b.example"]',
                 "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization"]',
                 "--allow-credentials")
    ours = parse("serve", "--allowed-origins", "https://a.example", "--allowed-origins", "https://b.example",
                 "--allowed-methods", "GET,POST", "--allowed-headers", "authorization", "--allow-credentials")
    for args in (vllm, ours):
        assert args.allowed_origins == ["https://a.example", "https://b.example"]
        assert (args.allowed_methods, args.allowed_headers) == (["GET", "POST"], ["authorization"])
        assert args.allow_credentials
    default = parse("serve")
    assert default.allowed_origins == [] and default.allowed_hosts is None and not default.allow_credentials


def test_bench_serve_result_path_spellings(tmp_path):
    args = parse("bench", "serve", "--result-dir", str(tmp_path), "--result-filename", "r.json")
    assert serve_result_file(args) == tmp_path / "r.json"
    only_dir = serve_result_file(parse("bench", "serve", "--dataset", "random", "--result-dir", str(tmp_path),
                                       "--max-concurrency", "4"))
    assert only_dir.parent == tmp_path and only_dir.name.startswith("tokenmill-bench-random-completions-c4-")
    sweep = serve_result_file(parse("bench", "serve", "--backend", "openai-chat", "--result-dir", str(tmp_path),
                                    "--concurrency", "1,2"))
    assert sweep.name.startswith("tokenmill-bench-sharegpt-chat-cinf-sweep-")
    assert serve_result_file(parse("bench", "serve", "--result-filename", "f.json")) == Path("f.json")
    assert serve_result_file(parse("bench", "serve", "--result-file", "a/b.json")) == Path("a/b.json")
    assert serve_result_file(parse("bench", "serve")) is None
    with pytest.raises(ValueError, match="result_file"):
        serve_result_file(parse("bench", "serve", "--result-file", "a.json", "--result-dir", str(tmp_path)))


@pytest.mark.parametrize("argv, endpoint", [
    (("--endpoint", "/v1/chat/completions"), "chat"), (("--endpoint", "/v1/completions"), "completions"),
    (("--backend", "vllm"), "completions"), (("--backend", "openai-chat", "--endpoint", "completions"), "chat"),
])
def test_bench_serve_endpoint_spellings(argv, endpoint):
    assert serve_endpoint(parse("bench", "serve", *argv)) == endpoint
    assert parse("bench", "serve", "--served-model-name", "m").model == "m"


def test_kv_cache_memory_bytes_is_kv_cache_memory_in_bytes():
    assert engine_kwargs(parse("serve", "--kv-cache-memory-bytes", str(3 * 2**29)))["kv_cache_memory"] == 1.5
    assert engine_kwargs(parse("serve", "--kv-cache-memory", "0.25"))["kv_cache_memory"] == 0.25


def test_scheduling_policy_flag_is_vllms():
    assert engine_kwargs(parse("serve", "--scheduling-policy", "priority"))["scheduling_policy"] == "priority"
    assert engine_kwargs(parse("serve"))["scheduling_policy"] == "fcfs"
    with pytest.raises(SystemExit):
        parse("serve", "--scheduling-policy", "lifo")
