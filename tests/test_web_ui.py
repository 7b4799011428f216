"""The web page at / in a real headless Chromium against a real `tokenmill serve` (tiny random Llama, --api-key,
RAM and disk KV tiers, n-gram speculation), plus the JSON the page reads and the Grafana dashboards' metric names.

Browser: Debian's system `chromium` driven by Playwright (`executable_path=`, no browser download); the test
is skipped, saying why, when either is missing. It enters the API key, sends a chat and sees the streamed answer
equal the server's own greedy answer, sees cached prompt tokens on the second turn, stops a long answer (the
server counts an abort and frees its blocks), reloads (the conversation comes back from localStorage) and
watches the status view update after a request. Screenshots are written to the test's tmp directory.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.server_fixtures import REPO, ServerProcess
from tests.tiny_models import make_tiny_model

API_KEY = "web-ui-test-key"
ABORTED = "tokenmill:request_success_total{finished_reason=abort}"
GRAFANA_DIR = REPO / "examples" / "grafana"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def adapter_path(tiny_path, tmp_path_factory) -> str:
    """A rank-4 LoRA adapter for the tiny model, served as model "sql"."""
    from tests.test_lora import save_adapter

    return save_adapter(tiny_path, tmp_path_factory.mktemp("sql"), seed=7, r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def server(tiny_path, adapter_path, tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv_disk")
    args = ["--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "16", "--num-threads", "1",
            "--kv-offload-memory", "0.01", "--kv-offload-disk-path", str(disk), "--kv-offload-disk-size", "0.05",
            "--kv-offload-disk-drive-size", "1",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',  # for its dashboard
            "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={adapter_path}"]  # for the picker
    proc = ServerProcess(tiny_path, args, tmp_path_factory.mktemp("logs") / "server.log", api_key=API_KEY)
    proc.wait_healthy()
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


# ---- what the page reads ----------------------------------------------------------------------------
def test_page_and_static_files_are_public_the_api_is_not(server):
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text):
        assert httpx.get(f"{server.url}{name}", timeout=10).status_code == 200, name
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/debug/status", timeout=10).status_code == 401


def test_debug_status_metrics_track_the_prometheus_counters(server, tiny_path):
    client = server.client()
    client.completions.create(model=tiny_path, prompt="Counting tokens for the status view", max_tokens=5,
                              temperature=0, extra_body={"ignore_eos": True})
    status = server.get_json("/debug/status?check_integrity=false")
    scraped = server.metrics()
    metrics = status["metrics"]
    assert status["kv_cache"]["integrity"] == "skipped"
    assert server.get_json("/debug/status")["kv_cache"]["integrity"] == "ok"
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "time_to_first_token_seconds_count",
                 "e2e_request_latency_seconds_sum"):
        assert metrics[name] == scraped[f"tokenmill:{name}"], name
    length = scraped["tokenmill:request_success_total{finished_reason=length}"]
    assert metrics["request_success_total"]["length"] == length
    assert metrics["kv_offload_hits_total"] == {"disk": scraped["tokenmill:kv_offload_hits_total{tier=disk}"],
                                                "ram": scraped["tokenmill:kv_offload_hits_total{tier=ram}"]}
    assert metrics["generation_tokens_total"] >= 5
    assert 0 < status["started"] <= status["time"] <= time.time() + 1
    assert status["kv_cache"]["kv_offload"]["ram"]["capacity_blocks"] > 0


# ---- Grafana dashboards -----------------------------------------------------------------------------
PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "by", "without", "on", "ignoring", "group_left",
    "group_right", "avg", "max", "min", "count", "clamp_min", "clamp_max", "topk", "bottomk", "or", "and",
    "unless", "offset", "le", "vector", "scalar", "abs", "delta", "deriv", "avg_over_time", "max_over_time",
    "min_over_time", "time", "label_replace", "sort", "sort_desc", "bool", "quantile", "stddev",
}


def dashboard_exprs(path: Path) -> list[str]:
    """Every PromQL ``expr`` of a dashboard's panels (rows' nested panels included)."""
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(path.read_text()))
    return exprs


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers (``:`` allowed) that are not functions, keywords,
    label names inside ``{...}`` / ``by (...)``, strings, durations or Grafana ``$variables``."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # range durations, $__rate_interval
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])\s*(\()?", expr):
        word, call = match.group(1), match.group(2)
        if call or word in PROMQL_WORDS or re.fullmatch(r"\d+\w*", word):
            continue
        names.add(word)
    return names


def family_name(sample_name: str, histograms: set[str]) -> str:
    """The metric family a queried series belongs to: ``X_bucket``/``X_sum``/``X_count`` of a histogram X, else
    the name itself."""
    for suffix in ("_bucket", "_sum", "_count"):
        if sample_name.endswith(suffix) and sample_name[: -len(suffix)] in histograms:
            return sample_name[: -len(suffix)]
    return sample_name


def test_promql_name_extraction():
    got = promql_metric_names(
        'histogram_quantile(0.99, sum by (le, model_name) (rate(tokenmill:time_to_first_token_seconds_bucket'
        '{model_name=~"$model_name"}[$__rate_interval]))) / ignoring(x) clamp_min(tokenmill:a_total, 1e-9)'
        ' + on(model_name) group_left tokenmill:b offset 5m')
    assert got == {"tokenmill:time_to_first_token_seconds_bucket", "tokenmill:a_total", "tokenmill:b"}
    assert family_name("tokenmill:x_seconds_bucket", {"tokenmill:x_seconds"}) == "tokenmill:x_seconds"
    assert family_name("tokenmill:y_count", set()) == "tokenmill:y_count"  # not a histogram: kept whole


def test_every_dashboard_metric_exists_in_metrics(server, tiny_path):
    server.client().completions.create(model=tiny_path, prompt="Fill the counters", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics", headers=server.headers(), timeout=10).text
    exported = set(re.findall(r"^([A-Za-z_:][\w:]*)(?:\{|\s)", text, re.M))  # every sample name
    histograms = set(re.findall(r"^# TYPE (\S+) histogram$", text, re.M))
    dashboards = sorted(GRAFANA_DIR.glob("*.json"))
    assert {p.name for p in dashboards} >= {"tokenmill_overview.json", "tokenmill_kv_cache.json",
                                            "tokenmill_spec_decode.json"}
    for path in dashboards:
        exprs = dashboard_exprs(path)
        assert len(exprs) >= 6, f"{path.name}: {len(exprs)} queries"
        for expr in exprs:
            names = promql_metric_names(expr)
            assert names, f"{path.name}: no metric in {expr!r}"
            for name in names:
                family = family_name(name, histograms)  # X for X_bucket / X_sum / X_count of a histogram X
                assert family in histograms or family == name, name
                assert name in exported, f"{path.name}: {name} (from {expr!r}) is not in /metrics"


# ---- the page in a real browser ---------------------------------------------------------------------
def system_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    executable = system_chromium()
    if executable is None:
        pytest.skip("no system Chromium: apt-get install chromium (the .ci/run script does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements.lock)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield browser
        browser.close()


def aborted(server: ServerProcess) -> float:
    return server.metrics().get(ABORTED, 0.0)


def test_chat_stream_stop_reload_and_status_in_chromium(server, tiny_path, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server.url}/")
    page.wait_for_function("document.getElementById('server-state').textContent === 'API key needed'")
    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    page.wait_for_function("document.getElementById('server-state').textContent === 'serving'")
    page.wait_for_selector("#model option", state="attached")
    assert page.locator("#model option").all_text_contents() == [tiny_path, f"sql (adapter of {tiny_path})"]

    # a greedy chat: the streamed text is the server's own greedy answer
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "10")
    page.fill("#system-prompt", "You are terse.")
    question = "Name three colours of the rainbow, please."
    page.fill("#chat-input", question)
    page.click("#send")
    done = ".msg.assistant:not(.streaming) .stats:has-text('finish')"
    page.wait_for_selector(done, timeout=30_000)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": question}]
    want = server.client().chat.completions.create(model=tiny_path, messages=messages, max_tokens=10, temperature=0)
    first = page.locator(".msg.assistant").nth(0)
    assert first.locator(".content").text_content() == want.choices[0].message.content
    stats = first.locator(".stats").text_content()
    pattern = r"TTFT \d+ ms · [\d.]+ tok/s · 10 tokens · prompt \d+ · cached \d+ · finish: length"
    assert re.search(pattern, stats), stats
    assert f"prompt {want.usage.prompt_tokens}" in stats
    page.screenshot(path=str(tmp_path / "chat.png"))

    # the same chat with the adapter picked: the adapter's own greedy answer
    page.select_option("#model", "sql")
    page.click("#new-chat")
    page.fill("#chat-input", question)
    page.click("#send")
    page.wait_for_selector(done, timeout=30_000)
    want_sql = server.client().chat.completions.create(model="sql", messages=messages, max_tokens=10, temperature=0)
    assert page.locator(".msg.assistant .content").text_content() == want_sql.choices[0].message.content
    assert page.locator(".msg.assistant .stats").text_content().endswith("· sql")
    page.select_option("#model", tiny_path)
    page.click("#new-chat")
    page.fill("#chat-input", question)
    page.click("#send")
    page.wait_for_selector(done, timeout=30_000)

    # the second turn re-sends the first: its prompt's leading blocks come from the prefix cache
    page.fill("#chat-input", "And two more?")
    page.click("#send")
    page.wait_for_selector(".msg.assistant:nth-of-type(4):not(.streaming) .stats:has-text('finish')", timeout=30_000)
    cached = int(re.search(r"cached (\d+)", page.locator(".msg.assistant").nth(1).locator(".stats").text_content())[1])
    assert cached >= 16 and cached % 16 == 0

    # stop a long answer: the fetch is aborted, the server aborts the request and frees its blocks
    before = aborted(server)
    page.click("#new-chat")
    page.fill("#max-tokens", "400")
    page.fill("#chat-input", "Tell me a very long story.")
    page.click("#send")
    page.wait_for_function("document.querySelector('.msg.assistant.streaming .content')?.textContent.length > 0")
    assert page.locator("#stop").is_visible()
    page.click("#stop")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stats:has-text('finish: stopped')", timeout=10_000)
    partial = page.locator(".msg.assistant .content").text_content()
    deadline = time.monotonic() + 10
    while aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted(server) == before + 1
    kv = server.wait_idle()
    assert kv["num_running"] == 0 and kv["num_free_blocks"] == kv["num_blocks"]
    assert partial

    # the conversation survives a reload (localStorage)
    page.reload()
    page.wait_for_selector(".msg.assistant", state="attached")
    assert page.locator(".msg.user .content").all_text_contents() == ["Tell me a very long story."]
    assert page.locator(".msg.assistant .content").text_content() == partial

    # the status view updates after a request
    page.click("#tab-status")
    page.wait_for_function("document.getElementById('st-requests').textContent !== '–'")
    requests_before = int(page.locator("#st-requests").text_content())
    server.client().completions.create(model=tiny_path, prompt="One more request", max_tokens=4, temperature=0)
    page.wait_for_function(f"Number(document.getElementById('st-requests').textContent) === {requests_before + 1}",
                           timeout=15_000)
    page.wait_for_selector("#chart-throughput polyline[data-series='gen']", state="attached")
    assert "abort 1" in page.locator("#st-requests-sub").text_content()
    assert page.locator("#config-table td", has_text="config.cache.block_size").count() == 1
    assert page.locator("#st-ram").text_content().endswith("%")
    page.screenshot(path=str(tmp_path / "status.png"))
    assert errors == []
    print(f"screenshots: {tmp_path / 'chat.png'} {tmp_path / 'status.png'}")
