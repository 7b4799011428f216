"""Agent sessions keep their KV between turns (``session_kv_ttl``): a session request's cached blocks outlive plain
LRU for the TTL (plain blocks are evicted first, even newer ones), go first once the TTL passed, are evicted to the
lower tier when the pool needs them anyway, come back as prefix hits on the next turn; /debug/kv_cache and
/metrics show the sessions; the server takes the session from ``X-Session-Id`` or ``user``."""
from __future__ import annotations

import httpx2 as httpx
import pytest

from tests.scheduler_helpers import make_request
from tests.server_fixtures import ServerProcess
from tokenmill.config import CacheConfig, ConfigError
from tokenmill.kv_cache import KVCacheManager

BLOCK = 4


class Clock:
    """A clock the test moves (the manager's ``clock`` argument), in seconds."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Evictions:
    """A pool listener recording evicted hashes (what the lower tiers' planner is told)."""

    def __init__(self) -> None:
        self.hashes: list[int] = []

    def block_evicted(self, block_id: int, block_hash: int) -> None:
        self.hashes.append(block_hash)

    def prefix_cache_reset(self) -> None:
        pass


def run_and_free(kv: KVCacheManager, request) -> None:
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    kv.free(request)


def session_request(request_id: str, prompt: list[int], session: str | None):
    request = make_request(request_id, prompt)
    request.session_id = session
    return request


def test_session_blocks_outlive_newer_plain_blocks_then_expire_first():
    clock = Clock()
    kv = KVCacheManager(12, BLOCK, session_ttl=30.0, clock=clock)
    listener = Evictions()
    kv.block_pool.listeners = (listener,)
    agent = list(range(100, 117))  # 4 full blocks + 1 token
    run_and_free(kv, session_request("turn1", agent, "s1"))
    assert kv.block_pool.num_session_blocks == 4 and dict(kv.block_pool.session_blocks) == {"s1": 4}
    plain = list(range(500, 517))
    run_and_free(kv, session_request("plain", plain, None))  # freed after the session's blocks: newer
    filler = make_request("filler", list(range(900, 928)))  # 7 blocks: only 12 - 4 kept are plain
    hits, _ = kv.get_computed_blocks(filler)
    assert kv.allocate_slots(filler, filler.num_tokens, hits) is not None
    assert kv.block_pool.num_session_blocks == 4, "plain LRU went first, even the newer plain blocks"
    kv.free(filler)
    # the next turn hits the whole kept prefix
    turn2 = session_request("turn2", agent + [7, 7, 7], "s1")
    hits, num_hit = kv.get_computed_blocks(turn2)
    assert num_hit == 16 and kv.block_pool.num_session_blocks == 4  # a lookup takes nothing yet
    assert kv.allocate_slots(turn2, turn2.num_tokens - num_hit, hits) is not None
    assert kv.block_pool.num_session_blocks == 0  # taken back by the session
    turn2.num_computed_tokens = turn2.num_tokens
    kv.free(turn2)
    assert kv.session_snapshot()["sessions"][0]["blocks_kept"] == 5
    assert kv.session_hits == 16 and kv.session_queries == 17 + 20
    # the TTL passes: the kept blocks become the first to go
    clock.now += 31
    listener.hashes.clear()
    other = make_request("other", list(range(2000, 2004)) + [1])  # two new blocks
    hits, _ = kv.get_computed_blocks(other)
    assert kv.allocate_slots(other, other.num_tokens, hits) is not None
    assert kv.block_pool.num_session_blocks == 0
    # the expired session's blocks went first (tail blocks before head blocks), ahead of older plain ones
    assert listener.hashes == [turn2.block_hashes[4], turn2.block_hashes[3]]
    kv.free(other)
    kv.check_integrity(idle=True)


def test_kept_blocks_are_evicted_to_the_lower_tier_when_the_pool_needs_them_anyway():
    clock = Clock()
    kv = KVCacheManager(8, BLOCK, session_ttl=300.0, clock=clock)
    listener = Evictions()
    kv.block_pool.listeners = (listener,)
    agent = session_request("turn1", list(range(100, 121)), "s1")  # 5 full blocks
    run_and_free(kv, agent)
    big = make_request("big", list(range(900, 928)))  # 7 blocks: the 3 plain free ones + 4 of the 5 kept
    hits, _ = kv.get_computed_blocks(big)
    assert kv.allocate_slots(big, big.num_tokens, hits) is not None
    # told, so the tiers' planner copies them down; the chain's tail goes first, its head stays
    assert listener.hashes == agent.block_hashes[4:0:-1]
    assert kv.block_pool.num_session_blocks == 1
    kv.free(big)
    kv.check_integrity(idle=True)


def test_without_a_ttl_or_a_session_nothing_is_kept():
    kv = KVCacheManager(8, BLOCK, session_ttl=0.0)
    run_and_free(kv, session_request("a", list(range(100, 117)), "s1"))
    assert kv.block_pool.num_session_blocks == 0
    kv = KVCacheManager(8, BLOCK, session_ttl=10.0)
    run_and_free(kv, session_request("a", list(range(100, 117)), None))
    assert kv.block_pool.num_session_blocks == 0
    kv.block_pool.reset_prefix_cache()
    kv.check_integrity(idle=True)
    with pytest.raises(ConfigError, match="session_kv_ttl"):
        CacheConfig(session_kv_ttl=5.0, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="session_kv_ttl"):
        CacheConfig(session_kv_ttl=-1.0)


def test_prefix_cache_reset_drops_kept_blocks():
    kv = KVCacheManager(8, BLOCK, session_ttl=60.0)
    run_and_free(kv, session_request("a", list(range(100, 117)), "s1"))
    assert kv.block_pool.num_session_blocks == 4
    assert kv.block_pool.reset_prefix_cache()
    assert kv.block_pool.num_session_blocks == 0 and not kv.block_pool.session_blocks
    kv.check_integrity(idle=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(None, ["--session-kv-ttl", "120", "--max-model-len", "512"],
                         tmp_path_factory.mktemp("logs") / "server.log").wait_healthy()
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def test_server_keeps_a_sessions_blocks_and_reports_them(server):
    system = "You are a careful agent. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "List the files."}]
    session = {**server.headers(), "X-Session-Id": "agent-7"}
    first = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, headers=session,
                       json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert first.status_code == 200, first.text
    snapshot = server.wait_idle()
    sessions = snapshot["sessions"]
    assert sessions["session_kv_ttl"] == 120 and sessions["num_sessions_keeping_blocks"] == 1
    assert sessions["num_session_blocks"] > 0 and sessions["sessions"][0]["session"] != "agent-7"  # a digest
    metrics = server.metrics()
    assert metrics["tokenmill:kv_sessions"] == 1 and metrics["tokenmill:kv_session_blocks"] > 0
    # the next turn, after a tool call
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                 {"role": "tool", "content": "a.txt b.txt"}]
    second = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, headers=session,
                        json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert second.status_code == 200
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    by_user = server.post("/v1/completions", {"prompt": system, "max_tokens": 2, "user": "someone"})  # a 2nd session
    assert by_user.status_code == 200
    after = server.wait_idle()["sessions"]
    assert after["num_sessions_keeping_blocks"] == 2
    assert server.metrics()["tokenmill:session_prefix_cache_hits_total"] >= 64
