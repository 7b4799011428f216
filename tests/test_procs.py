"""tokenmill.procs: /health polling against a local HTTP server, a dead child, a deadline."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tokenmill.procs import free_port, wait_healthy


class _Health(BaseHTTPRequestHandler):
    answers: list[int] = []  # status codes to answer in turn; 200 once they run out

    def do_GET(self) -> None:
        self.send_response(self.answers.pop(0) if self.answers else 200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def health_server():
    server = HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_wait_healthy_returns_once_health_answers_200_after_503s(health_server):
    _Health.answers = [503, 503]
    asked = []
    wait_healthy([health_server], lambda: asked.append(1), timeout_s=30)
    assert _Health.answers == [] and len(asked) == 3  # one alive() check before each of the three polls


def test_wait_healthy_raises_what_alive_says_when_a_child_is_gone():
    with pytest.raises(RuntimeError, match="^child exited with 3$"):
        wait_healthy([f"http://127.0.0.1:{free_port()}"], lambda: "child exited with 3", timeout_s=30)


def test_wait_healthy_times_out_when_nothing_listens():
    with pytest.raises(TimeoutError, match="not healthy after 0 s"):
        wait_healthy([f"http://127.0.0.1:{free_port()}"], lambda: None, timeout_s=0.3)
