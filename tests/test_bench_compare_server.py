"""`bench compare --peer llama-server`: tokenmill's own server and llama.cpp's native server on one workload.

Flag parsing and the llama-server command are checked without any process. One short comparison on
the embedded SmolLM2 GGUF (tokenmill's server over real HTTP) names a peer whose binary is absent and
why; where this CPU's llama-server build exists (scripts/build_llama_server.sh) the same run checks
that both servers did the same work. CI never builds llama.cpp: there the real-run test is skipped,
naming the build script.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from tokenmill.bench.datasets import SampledRequest
from tokenmill.bench.llama_server import (
    BUILD_SCRIPT,
    CONTEXT_PAD,
    ServerPeer,
    default_binary_path,
    llama_server_command,
    parse_peer,
    peer_args_for_this_cpu,
    skip_reason,
    slot_context,
)
from tokenmill.bench.metrics import RequestResult, calculate_metrics
from tokenmill.bench.server_compare import (
    ServedRun,
    consistency_notes,
    format_server_table,
    server_ratios,
    warmup_request,
)
from tokenmill.cli.main import build_parser, main


def parse(*argv: str):
    return build_parser().parse_args(["bench", "compare", *argv])


def test_peer_flags_parse_and_are_checked(tmp_path, monkeypatch, capsys):
    assert parse_peer("llama-server") == ServerPeer("llama-server", None)
    assert parse_peer("llama-server=/opt/ls") == ServerPeer("llama-server", Path("/opt/ls"))
    with pytest.raises(ValueError, match="peer: unknown server peer 'vllm'"):
        parse_peer("vllm=/x")
    with pytest.raises(ValueError, match="names no path"):
        parse_peer("llama-server=")

    args = parse("--peer", "llama-server", "--peer", "llama-server=/b/ls", "--max-concurrency", "4",
                 "--peer-args=-ub 128 --no-warmup", "--num-threads", "2")
    assert args.server_peers == ["llama-server", "llama-server=/b/ls"] and args.peers is None
    from tokenmill.cli.bench import server_compare_config

    config = server_compare_config(args, num_requests=10)
    assert (config.threads, config.max_concurrency, config.parallel) == (2, 4, 4)
    assert config.peer_args == ("-ub", "128", "--no-warmup")
    assert server_compare_config(parse("--peer", "llama-server"), num_requests=200).parallel == 128  # --max-num-seqs
    assert server_compare_config(parse("--peer", "llama-server", "--peer-parallel", "3"), 10).parallel == 3

    # two modes that do not mix, and server-only flags without a server peer: exit 2 naming the flag
    assert main(["bench", "compare", "--peers", "transformers", "--peer", "llama-server"]) == 2
    assert "--peers (in-process" in capsys.readouterr().err
    assert main(["bench", "compare", "--max-concurrency", "2"]) == 2
    assert "max_concurrency: only with --peer" in capsys.readouterr().err
    assert main(["bench", "compare", "--peer", "ollama"]) == 2
    assert "unknown server peer 'ollama'" in capsys.readouterr().err

    # the cached build is per CPU under TOKENMILL_CACHE_DIR; absent, the skip names the build script
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    cached = default_binary_path()
    assert cached.parent.parent.parent == tmp_path / "llama.cpp" and cached.name == "llama-server"
    gguf = tmp_path / "m.gguf"
    assert BUILD_SCRIPT in skip_reason(ServerPeer("llama-server"), gguf)
    assert skip_reason(ServerPeer("llama-server", tmp_path / "nope"), gguf) == f"no llama-server binary at {tmp_path / 'nope'}"
    fake = tmp_path / "ls"
    fake.write_text("#!/bin/sh\n")
    assert "not executable" in skip_reason(ServerPeer("llama-server", fake), gguf)
    fake.chmod(0o755)
    assert "needs a .gguf" in skip_reason(ServerPeer("llama-server", fake), tmp_path / "hf_dir")
    assert skip_reason(ServerPeer("llama-server", fake), gguf) is None


def test_llama_server_command_sizes_slots_for_the_longest_request():
    assert [slot_context(n) for n in (1, 256, 257, 192 + 128)] == [256, 256, 512, 512]
    command = llama_server_command(Path("/b/llama-server"), Path("/m.gguf"), threads=2, parallel=32,
                                   slot_tokens=slot_context(64 + 128), port=8123, extra_args=("-ub", "256"))
    assert command == ["/b/llama-server", "-m", "/m.gguf", "-t", "2", "-tb", "2", "-np", "32", "-c",
                       str(32 * CONTEXT_PAD), "--host", "127.0.0.1", "--port", "8123", "-ub", "256"]
    with pytest.raises(ValueError, match="parallel must be >= 1"):
        llama_server_command(Path("/b"), Path("/m"), 2, 0, 256, 1)
    request = SampledRequest("", list(range(100, 140)), 8)
    warm = warmup_request([request])
    assert warm.prompt_token_ids == list(range(115, 99, -1))  # shares no prefix with the workload
    assert warm.expected_output_len == 4


def test_amx_cpus_get_no_repack_unless_the_user_chose():
    # ggml's AMX matmul crashed llama-server on the project's AMX VMs; elsewhere nothing is added.
    amx, plain = frozenset({"avx512f", "amx_tile"}), frozenset({"avx512f", "avx2"})
    assert peer_args_for_this_cpu((), amx) == ("--no-repack",)
    assert peer_args_for_this_cpu(("-ub", "256"), amx) == ("-ub", "256", "--no-repack")
    assert peer_args_for_this_cpu(("--repack",), amx) == ("--repack",)
    assert peer_args_for_this_cpu(("-nr",), amx) == ("-nr",)
    assert peer_args_for_this_cpu(("-ub", "256"), plain) == ("-ub", "256")


def test_binaries_built_without_amx_repack_as_llama_cpp_defaults(tmp_path):
    amx = frozenset({"avx512f", "amx_tile"})
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("")
    assert peer_args_for_this_cpu((), amx, binary) == ("--no-repack",)  # provenance unknown: guarded
    (tmp_path / "build-info.txt").write_text("amx=none-on-this-cpu\n")
    assert peer_args_for_this_cpu((), amx, binary) == ("--no-repack",)  # built where there was no AMX
    (tmp_path / "build-info.txt").write_text("amx=off\n")
    assert peer_args_for_this_cpu((), amx, binary) == ()  # the script's AMX-free build: llama.cpp's defaults
    assert peer_args_for_this_cpu(("-nr",), amx, binary) == ("-nr",)


def test_ratios_and_notes_come_from_the_measured_runs_only():
    def served(engine: str, outputs: list[int], wall: float, ok: bool = True, prompt: int = 10) -> ServedRun:
        results = [RequestResult(ok, prompt_len=prompt, output_len=n if ok else 0, ttft=0.1 if ok else None,
                                 e2el=0.1 + 0.01 * (n - 1) if ok else None, error="" if ok else "HTTP 500")
                   for n in outputs]
        return ServedRun(engine, calculate_metrics(results, wall), asked_output_tokens=8, load_s=1.0, note=engine,
                         errors="" if ok else "  2 x HTTP 500")

    tm, peer = served("tokenmill", [4, 4], 1.0), served("llama-server", [4, 4], 2.0)
    ratios = server_ratios([tm, peer])
    assert ratios["output_tok_s tokenmill/llama-server"] == pytest.approx(2.0)
    assert ratios["total_tok_s tokenmill/llama-server"] == pytest.approx(2.0)
    assert ratios["decode_tok_s tokenmill/llama-server"] == pytest.approx(1.0)  # same 10 ms per token
    assert tm.decode_throughput == pytest.approx(100.0) and consistency_notes([tm, peer]) == []
    failed = served("llama-server", [4, 4], 2.0, ok=False)
    assert server_ratios([tm, failed]) == {}  # nothing measured, no ratio
    short, other_prompt = served("llama-server", [4, 3], 2.0), served("llama-server", [4, 4], 2.0, prompt=11)
    notes = consistency_notes([tm, failed, short, other_prompt])
    assert notes == ["llama-server: 2 of 2 requests failed:\n  2 x HTTP 500",
                     "llama-server: generated 7 tokens, 8 asked",
                     "llama-server: 22 input tokens against tokenmill's 20"]
    table = format_server_table([tm, peer], {"llama-server=/x": "no llama-server binary at /x"}, notes)
    assert "skipped llama-server=/x: no llama-server binary at /x" in table and "note: llama-server: generated" in table


@pytest.fixture(scope="module")
def comparison(tmp_path_factory) -> tuple[dict, str, Path]:
    """One ``bench compare`` run on the embedded GGUF, 2 random requests of 16 + 8 tokens, two at a time,
    against an absent binary and this CPU's cached build (present or not): (result JSON, stdout, absent path)."""
    tmp = tmp_path_factory.mktemp("compare_server")
    absent = tmp / "no-such-binary"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "compare", "--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory", "0.05",
                     "--num-threads", "2", "--dataset", "random", "--random-input-len", "16", "--random-output-len",
                     "8", "--num-prompts", "2", "--seed", "5", "--max-concurrency", "2", "--peer",
                     f"llama-server={absent}", "--peer", "llama-server", "--disable-tqdm", "--result-file",
                     str(tmp / "compare.json")])
    assert code == 0, out.getvalue()
    return json.loads((tmp / "compare.json").read_text()), out.getvalue(), absent


def test_absent_binary_is_skipped_with_a_note_and_tokenmill_still_runs(comparison):
    record, out, absent = comparison
    assert f"skipped llama-server={absent}: no llama-server binary at {absent}" in out
    assert record["skipped"][f"llama-server={absent}"] == f"no llama-server binary at {absent}"
    if not default_binary_path().is_file():  # this CPU's build is absent too: its note names the build script
        assert BUILD_SCRIPT in record["skipped"]["llama-server"] and record["ratios"] == {}
        assert "tokenmill/llama-server" not in out  # no ratio without the peer: nothing made up
    run = record["runs"][0]
    assert run["engine"] == "tokenmill" and (run["completed"], run["failed"]) == (2, 0)
    assert run["total_input_tokens"] == 32  # the workload's token ids, sent as they are
    assert run["total_output_tokens"] == run["asked_output_tokens"] == 16  # ignore_eos: exact targets
    assert run["decode_throughput"] > 0 and run["load_s"] > 0
    assert record["notes"] == [] and (record["max_concurrency"], record["parallel"], record["threads"]) == (2, 2, 2)


def test_short_real_run_against_llama_server(comparison):
    binary = default_binary_path()
    if not binary.is_file():
        pytest.skip(f"no llama-server binary at {binary}; build it with `bash {BUILD_SCRIPT}` (CI does not)")
    record, out, _ = comparison
    assert "llama-server" not in record["skipped"], record["skipped"]
    assert [r["engine"] for r in record["runs"]] == ["tokenmill", "llama-server"]
    for run in record["runs"]:  # the same work on both engines, counted by each server itself
        assert (run["completed"], run["failed"], run["total_input_tokens"], run["total_output_tokens"]) == (2, 0, 32, 16)
        assert run["decode_throughput"] > 0
    command = record["commands"]["llama-server"]
    assert command[:2] == [str(binary), "-m"] and command[2].endswith(".gguf")
    assert command[3:11] == ["-t", "2", "-tb", "2", "-np", "2", "-c", "512"]  # 2 slots of 256 tokens
    assert set(record["ratios"]) == {f"{kind}_tok_s tokenmill/llama-server" for kind in ("output", "total", "decode")}
    assert "output_tok_s tokenmill/llama-server" in out
