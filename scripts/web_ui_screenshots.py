"""Take the README's screenshots of the web page (docs/images/web_ui_chat.png, web_ui_status.png).

Starts `tokenmill serve` with the embedded SmolLM2-135M-Instruct on a free port, drives the page in the system
Chromium through Playwright (no browser download), sends a few chats and some background traffic so the
status charts have a minute of history, and saves the two views. Usage: .venv/bin/python scripts/web_ui_screenshots.py
"""
from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from playwright.sync_api import sync_playwright  # noqa: E402

from tests.server_fixtures import ServerProcess  # noqa: E402

OUT = REPO / "docs" / "images"


def traffic(server: ServerProcess, model: str, stop: threading.Event) -> None:
    """Background requests so that the throughput and latency charts move."""
    client = server.client()
    prompts = ["Write a haiku about the sea.", "List three uses of copper.", "What is a prime number?"]
    i = 0
    while not stop.is_set():
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[i % 3]}],
                                       max_tokens=48, temperature=0.7)
        i += 1


def main() -> int:
    chromium = shutil.which("chromium")
    if chromium is None:
        print("no chromium: apt-get install chromium", file=sys.stderr)
        return 1
    logs = Path("/tmp/tokenmill_screenshots_server.log")
    server = ServerProcess(None, ["--kv-offload-memory", "0.5", "--num-kv-blocks", "512"], logs).wait_healthy()
    try:
        model = server.client().models.list().data[0].id
        stop = threading.Event()
        workers = [threading.Thread(target=traffic, args=(server, model, stop)) for _ in range(3)]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
            page.goto(f"{server.url}/")
            page.wait_for_selector("#model option", state="attached")
            page.fill("#system-prompt", "You are a helpful assistant.")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "96")
            for question in ("What is the capital of France?", "And what is it famous for?"):
                page.fill("#chat-input", question)
                page.click("#send")
                page.wait_for_selector("#send:not([disabled])", timeout=120_000)
            OUT.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(OUT / "web_ui_chat.png"))
            page.click("#tab-status")
            for worker in workers:
                worker.start()
            time.sleep(60)
            page.screenshot(path=str(OUT / "web_ui_status.png"), full_page=False)
            stop.set()
            browser.close()
        for worker in workers:
            worker.join()
    finally:
        server.stop()
    print(f"wrote {OUT / 'web_ui_chat.png'} and {OUT / 'web_ui_status.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
