"""Saved sessions under attack (issue 41): one client filling the disk by saving the same tokens under
new ids, a session bigger than the per-session limit, a session file changed or planted on disk (refused
on restore when a session secret is configured), and ids that try to leave the save directory. One real
``tokenmill serve`` with a small quota; httpx as the client."""
from __future__ import annotations

import os
import secrets
import shutil

import httpx2 as httpx
import pytest

from tests.server_fixtures import ServerProcess
from tests.tiny_models import make_tiny_model
from tokenmill.kv_transfer.session import KV_FILE, MAC_FILE, directory_bytes, read_session, write_session

BLOCK_SIZE = 16
MAX_SESSION_BYTES = 150_000  # a 160-token session of the tiny model is ~85 kB, a 496-token one ~260 kB
MAX_TOTAL_BYTES = 400_000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sessions_security")
    model = str(make_tiny_model("llama", root / "tiny"))
    secret_file = root / "session.key"
    secret_file.write_text(secrets.token_hex(32))
    os.chmod(secret_file, 0o600)
    save_dir = root / "saved"
    server = ServerProcess(model, ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "96",
                                   "--block-size", str(BLOCK_SIZE), "--disable-log-requests",
                                   "--session-save-path", str(save_dir),
                                   "--session-max-bytes", str(MAX_SESSION_BYTES),
                                   "--session-max-total-bytes", str(MAX_TOTAL_BYTES),
                                   "--session-secret-file", str(secret_file)], root / "server.log")
    try:
        server.wait_healthy()
        yield server, save_dir, root
    finally:
        server.stop()


def tokens(n: int, start: int = 300) -> list[int]:
    return list(range(start, start + n))


def save(server: ServerProcess, session_id: str, token_ids: list[int]) -> httpx.Response:
    return server.post(f"/v1/sessions/{session_id}/save", {"token_ids": token_ids})


def delete(server: ServerProcess, session_id: str) -> int:
    """``DELETE /v1/sessions/{id}`` (declaring JSON, as every state-changing request must); its status."""
    return httpx.delete(f"{server.url}/v1/sessions/{session_id}", timeout=30,
                        headers={"content-type": "application/json"}).status_code


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


def test_a_session_over_the_per_session_limit_is_refused_and_nothing_is_written(setup):
    server, save_dir, _ = setup
    response = save(server, "big", tokens(496))
    assert response.status_code == 413, response.text
    assert error_of(response)["param"] == "token_ids" and "--session-max-bytes" in error_of(response)["message"]
    assert directory_bytes(save_dir) == 0 and not any(save_dir.iterdir())
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # still serving
    assert save(server, "small", tokens(160)).status_code == 200
    assert delete(server, "small") == 200


def test_saving_the_same_tokens_under_new_ids_stops_at_the_directory_quota(setup):
    server, save_dir, _ = setup
    statuses = []
    for i in range(20):  # the attack: the same tokens, a new id each time
        response = save(server, f"copy-{i}", tokens(160))
        statuses.append(response.status_code)
        if response.status_code != 200:
            assert response.status_code == 507, response.text
            assert error_of(response)["param"] == "session_id"
            assert "--session-max-total-bytes" in error_of(response)["message"]
        assert directory_bytes(save_dir) <= MAX_TOTAL_BYTES
    accepted = statuses.count(200)
    assert 1 <= accepted < 20 and statuses == [200] * accepted + [507] * (20 - accepted)
    # Replacing a session under its own id frees its old bytes first; deleting one makes room for another.
    assert save(server, "copy-0", tokens(160)).status_code == 200
    assert delete(server, "copy-0") == 200
    assert save(server, "after-delete", tokens(160)).status_code == 200
    for session_id in [f"copy-{i}" for i in range(1, accepted)] + ["after-delete"]:
        assert delete(server, session_id) == 200
    assert directory_bytes(save_dir) == 0


def test_a_changed_or_planted_session_is_refused_on_restore(setup):
    server, save_dir, root = setup
    assert save(server, "genuine", tokens(64, start=900)).status_code == 200
    assert (save_dir / "genuine" / MAC_FILE).is_file()
    assert server.post("/v1/sessions/genuine/restore", {}).status_code == 200
    # Planted under another id: a copy of a genuine session (its MAC binds the id).
    shutil.copytree(save_dir / "genuine", save_dir / "copied")
    # Planted by someone without the secret: a session file written with no MAC at all.
    meta, blocks, state = read_session(save_dir, "genuine")
    write_session(save_dir, "unsigned", meta, blocks, state)
    # Changed: one byte of the KV data flipped.
    shutil.copytree(save_dir / "genuine", save_dir / "tampered")
    kv = bytearray((save_dir / "genuine" / KV_FILE).read_bytes())
    kv[-1] ^= 0x01
    (save_dir / "genuine" / KV_FILE).write_bytes(bytes(kv))
    for session_id in ("genuine", "copied", "unsigned"):
        response = server.post(f"/v1/sessions/{session_id}/restore", {})
        assert response.status_code == 400, response.text
        assert error_of(response)["param"] == "session_id" and "integrity" in error_of(response)["message"]
    # A changed session.json is refused the same way.
    meta_file = save_dir / "tampered" / "session.json"
    meta_file.write_text(meta_file.read_text().replace('"session_id": "genuine"', '"session_id": "tampered"'))
    assert server.post("/v1/sessions/tampered/restore", {}).status_code == 400
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    for session_id in ("genuine", "copied", "unsigned", "tampered"):
        assert delete(server, session_id) == 200


@pytest.mark.parametrize("session_id", ["..", ".hidden", "..%2F..%2Fescape", "%2e%2e", "a%2Fb", "x" * 129,
                                        "caf%C3%A9", "-flag"])
def test_ids_that_would_leave_the_directory_are_refused(setup, session_id):
    server, save_dir, root = setup
    before = sorted(p.name for p in root.iterdir())
    response = httpx.post(f"{server.url}/v1/sessions/{session_id}/save", json={"token_ids": tokens(32)}, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    assert sorted(p.name for p in root.iterdir()) == before
    assert not save_dir.exists() or not any(save_dir.iterdir())
    restore = httpx.post(f"{server.url}/v1/sessions/{session_id}/restore", json={}, timeout=30)
    assert 400 <= restore.status_code < 500
