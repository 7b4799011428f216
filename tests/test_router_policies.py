"""The router's policies and approximate prefix tree, without processes or a network: exact choices,
thresholds, the bounded-load cap, session affinity, and the tree against a brute-force reference."""
from __future__ import annotations

import importlib.util
import random

import pytest

from tokenmill.router.policies import (
    CacheAware, LeastLoad, PolicyConfig, PowerOfTwo, RoundRobin, SessionAffinity, bounded_load_ok, make_policy,
    session_key,
)
from tokenmill.router.policy import Decision, RouteRequest, WorkerView
from tokenmill.router.prefix_tree import PrefixTree, common_prefix_len


def req(text: str = "hello", max_tokens: int = 16, session_id: str | None = None, rid: str = "r") -> RouteRequest:
    return RouteRequest(request_id=rid, text=text, prompt_token_ids=None, num_prompt_tokens=len(text) // 4,
                        max_tokens=max_tokens, session_id=session_id)


def view(worker_id: str, tokens: int = 0, running: int = 0) -> WorkerView:
    return WorkerView(worker_id=worker_id, url=f"http://{worker_id}", healthy=True, outstanding_tokens=tokens,
                      running_requests=running)


def dispatch(policy, request: RouteRequest, workers: list[WorkerView]) -> Decision:
    decision = policy.select(request, workers)
    policy.on_dispatched(request, decision)
    return decision


# ---- prefix tree ----------------------------------------------------------------------------------
def reference_match(held: dict[str, set[str]], text: str) -> dict[str, int]:
    """Brute force: per tenant, the longest common prefix of ``text`` with any string it inserted."""
    out = {}
    for tenant, texts in held.items():
        best = max((common_prefix_len(t, text, 0) for t in texts), default=0)
        if best:
            out[tenant] = best
    return out


def test_common_prefix_len_equals_a_character_loop():
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 12)))
        b = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 12)))
        pos = rng.randrange(0, len(b) + 1)
        n = 0
        while n < len(a) and pos + n < len(b) and a[n] == b[pos + n]:
            n += 1
        assert common_prefix_len(a, b, pos) == n


def test_tree_match_equals_brute_force_over_random_inserts():
    rng = random.Random(1)
    tree, held = PrefixTree(), {}
    for step in range(400):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 20)))
        tenant = rng.choice(["w0", "w1", "w2"])
        tree.insert(text, tenant)
        held.setdefault(tenant, set()).add(text)
        probe = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 25)))
        assert tree.match(probe) == reference_match(held, probe), (step, probe)
        if step % 50 == 0:
            tree.check_integrity()
    tree.check_integrity()


def test_tree_sizes_count_distinct_characters_per_tenant():
    tree = PrefixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "a")  # shares "hello " (6 chars): 11 + 5
    tree.insert("hello", "b")
    assert tree.size("a") == 16 and tree.size("b") == 5 and tree.size("c") == 0
    assert tree.match("hello th") == {"a": 8, "b": 5}
    assert tree.match("xyz") == {}
    tree.check_integrity()


def test_evict_drops_least_recently_used_leaves_first():
    tree = PrefixTree()
    tree.insert("system prompt A: question 1", "w")  # leaf "1" at time 1
    tree.insert("system prompt B: question 2", "w")  # leaf "B: question 2" at time 2
    tree.insert("system prompt A: question 3", "w")  # leaf "3" at time 3; refreshes "system prompt ", "A: question "
    total = tree.size("w")
    assert tree.evict("w", total - 1) == 1  # the oldest leaf, "1", is enough
    assert tree.match("system prompt A: question 1")["w"] == len("system prompt A: question ")
    assert tree.evict("w", total - 2) == len("B: question 2")  # next oldest leaf
    assert tree.match("system prompt B: question 2")["w"] == len("system prompt ")
    assert tree.match("system prompt A: question 3")["w"] == len("system prompt A: question 3")
    tree.check_integrity()


def test_evict_only_touches_the_tenant_over_budget():
    tree = PrefixTree()
    for i in range(20):
        tree.insert(f"prefix {i:02d} " * 3, "big")
    tree.insert("prefix 00 small", "small")
    tree.evict_all(max_chars=40)
    assert tree.size("big") <= 40 and tree.size("small") == len("prefix 00 small")
    assert tree.match("prefix 00 small")["small"] == len("prefix 00 small")
    tree.check_integrity()


def test_remove_tenant_keeps_the_others():
    tree = PrefixTree()
    tree.insert("shared prefix one", "a")
    tree.insert("shared prefix two", "b")
    tree.remove_tenant("a")
    assert tree.match("shared prefix one") == {"b": len("shared prefix ")}
    assert tree.tenants() == ["b"]
    tree.check_integrity()


# ---- simple policies ------------------------------------------------------------------------------
def test_round_robin_cycles_in_order():
    workers = [view("a"), view("b"), view("c")]
    policy = RoundRobin()
    assert [policy.select(req(), workers).worker_id for _ in range(5)] == ["a", "b", "c", "a", "b"]


def test_least_load_counts_tokens_not_requests_and_rotates_ties():
    policy = LeastLoad()
    # b runs 3 short requests (60 tokens), a one long one (500): tokens decide
    assert policy.select(req(), [view("a", 500, 1), view("b", 60, 3)]).worker_id == "b"
    idle = [view("a"), view("b")]
    assert {policy.select(req(), idle).worker_id for _ in range(4)} == {"a", "b"}


def test_power_of_two_takes_the_less_loaded_of_its_two_samples():
    policy = PowerOfTwo(seed=0)
    assert all(policy.select(req(), [view("a", 10), view("b", 5)]).worker_id == "b" for _ in range(20))
    workers = [view("a", 0), view("b", 100), view("c", 200)]
    chosen = [policy.select(req(), workers).worker_id for _ in range(300)]
    assert "c" not in chosen  # c loses to whichever worker is sampled with it
    assert {"a", "b"} == set(chosen)  # (b, c) pairs pick b


# ---- cache_aware ----------------------------------------------------------------------------------
def test_cache_aware_goes_to_the_longest_match_above_the_threshold():
    policy = CacheAware(PolicyConfig(cache_threshold=0.5))
    workers = [view("a"), view("b")]
    system = "You are a pirate. Answer in pirate speech. " * 3
    first = dispatch(policy, req(system + "Q1"), workers)
    assert first.reason == "cache_miss"
    second = dispatch(policy, req(system + "Q2"), workers)
    assert second.worker_id == first.worker_id and second.reason == "cache_hit"
    assert second.expected_hit_tokens == round(len(system + "Q2") // 4 * len(system) / len(system + "Q2"))


def test_cache_aware_below_threshold_goes_to_the_smallest_tree():
    policy = CacheAware(PolicyConfig(cache_threshold=0.5))
    workers = [view("a"), view("b")]
    policy.on_dispatched(req("x" * 100), Decision("a", "test"))
    policy.on_dispatched(req("y" * 10), Decision("b", "test"))
    decision = policy.select(req("x" * 10 + "z" * 90), workers)  # 10% match on a
    assert decision.worker_id == "b" and decision.reason == "cache_miss"
    at_threshold = policy.select(req("x" * 50 + "z" * 50), workers)  # ratio exactly 0.5 counts as a hit
    assert at_threshold.worker_id == "a" and at_threshold.reason == "cache_hit"


def test_cache_aware_imbalance_needs_both_thresholds():
    policy = CacheAware(PolicyConfig(balance_abs_threshold=4, balance_rel_threshold=2.0))
    policy.on_dispatched(req("prompt"), Decision("a", "test"))
    # abs exceeded (10 - 5 > 4) but not rel (10 <= 2 * 5): the cache decides
    assert policy.select(req("prompt"), [view("a", 900, 10), view("b", 10, 5)]).reason == "cache_hit"
    # both exceeded (10 - 4 > 4 and 10 > 2 * 4): least outstanding tokens
    decision = policy.select(req("prompt"), [view("a", 900, 10), view("b", 10, 4)])
    assert decision.worker_id == "b" and decision.reason == "imbalance"


def test_cache_aware_forgets_a_removed_worker_and_housekeeping_bounds_trees():
    policy = CacheAware(PolicyConfig(max_tree_size=200))
    sizes = []
    for i in range(30):
        policy.on_dispatched(req(f"{i:02d} " + "text " * 10), Decision("a", "test"))  # 53 new chars each
        sizes.append(policy.tree.size("a"))
    assert max(sizes) <= 400 and max(sizes) > 200  # an insert evicts at once only past twice the bound
    policy.housekeeping()
    assert policy.tree.size("a") <= 200
    assert policy.tree.match("29 " + "text " * 10)["a"] == 53  # the most recent text survives
    policy.on_worker_removed("a")
    assert policy.tree.size("a") == 0


# ---- bounded load and sessions --------------------------------------------------------------------
def test_bounded_load_ok_counts_the_request_in_the_mean():
    idle = [view("a"), view("b")]
    assert bounded_load_ok(idle[0], idle, 100, 0.25)  # idle fleet: 0 <= 1.25 * 50
    workers = [view("a", 150), view("b", 50)]
    # mean with the request: (200 + 100) / 2 = 150; cap 1.25 * 150 = 187.5
    assert bounded_load_ok(workers[0], workers, 100, 0.25)
    assert not bounded_load_ok(view("a", 200), [view("a", 200), view("b", 0)], 100, 0.25)  # 200 > 187.5
    assert bounded_load_ok(view("a", 200), [view("a", 200), view("b", 0)], 100, 1.0)  # cap 300
    assert bounded_load_ok(view("a", 10**6), [view("a", 10**6)], 1, 0.0)  # alone: always


def test_session_sticks_to_its_worker_until_the_load_cap():
    policy = SessionAffinity(RoundRobin(), epsilon=0.25)
    workers = [view("a"), view("b")]
    first = dispatch(policy, req(session_id="s1"), workers)
    again = [dispatch(policy, req(session_id="s1"), workers) for _ in range(3)]
    assert {d.worker_id for d in again} == {first.worker_id} and {d.reason for d in again} == {"session"}
    loaded = [view(w.worker_id, 1000 if w.worker_id == first.worker_id else 0) for w in workers]
    moved = dispatch(policy, req(session_id="s1"), loaded)
    assert moved.worker_id != first.worker_id and moved.reason == "load_cap"
    assert dispatch(policy, req(session_id="s1"), workers).worker_id == moved.worker_id  # follows the move
    gone = [w for w in workers if w.worker_id != moved.worker_id]
    assert dispatch(policy, req(session_id="s1"), gone).reason == "round_robin"  # its worker left


def test_session_map_is_bounded():
    policy = SessionAffinity(RoundRobin(), epsilon=0.25, max_sessions=3)
    for i in range(5):
        dispatch(policy, req(session_id=f"s{i}"), [view("a"), view("b")])
    assert list(policy.sessions) == [session_key(s) for s in ("s2", "s3", "s4")]
    dispatch(policy, req(session_id="x" * 100_000), [view("a"), view("b")])  # kept as a 16-byte digest
    assert all(len(key) == 16 for key in policy.sessions)


def test_session_affinity_reports_cache_aware_hit_estimate():
    policy = make_policy(PolicyConfig(name="cache_aware"))
    workers = [view("a"), view("b")]
    text = "shared system prompt " * 4 + "question"
    first = dispatch(policy, req(text, session_id="s"), workers)
    second = dispatch(policy, req(text, session_id="s"), workers)
    assert second.worker_id == first.worker_id and second.reason == "session"
    assert second.expected_hit_tokens == len(text) // 4


# ---- factory and config ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["round_robin", "least_load", "power_of_two", "cache_aware"])
def test_make_policy_wraps_every_policy_in_session_affinity(name):
    policy = make_policy(PolicyConfig(name=name, seed=0))
    assert isinstance(policy, SessionAffinity) and policy.name == name
    assert policy.select(req(), [view("a")]).worker_id == "a"


@pytest.mark.skipif(importlib.util.find_spec("tokenmill.router.kv_aware") is not None,
                    reason="kv_aware.py exists in this build")
def test_kv_aware_without_its_module_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_aware is not available"):
        make_policy(PolicyConfig(name="kv_aware"))


@pytest.mark.parametrize("field,value", [("name", "random"), ("cache_threshold", 1.5), ("balance_abs_threshold", -1),
                                         ("balance_rel_threshold", 0.5), ("max_tree_size", 0),
                                         ("eviction_interval", 0), ("load_cap_epsilon", -0.1)])
def test_policy_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field if field != "name" else "policy"):
        PolicyConfig(**{field: value})


# ---- what routing reads of a request body (the router's app module; FastAPI, no torch) ------------
def test_route_request_reads_text_budget_and_session():
    from tokenmill.router.app import CHAT_MAX_TOKENS_ESTIMATE, route_request

    chat = route_request("chat", {"messages": [{"role": "system", "content": "Be terse."},
                                               {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                  "max_completion_tokens": 5, "max_tokens": 99, "n": 2, "user": "u"}, None)
    assert chat.text == "Be terse.\nHi" and chat.max_tokens == 10 and chat.session_id == "u"
    assert chat.prompt_token_ids is None and chat.num_prompt_tokens == len("Be terse.\nHi") // 4
    assert route_request("chat", {"messages": [{"role": "user", "content": "x"}]}, "s").max_tokens == \
        CHAT_MAX_TOKENS_ESTIMATE
    assert route_request("chat", {"messages": [{"role": "user", "content": "x"}], "user": "u"}, "hdr").session_id == "hdr"
    ids = route_request("completions", {"prompt": [5, 6, 7]}, None)
    assert ids.prompt_token_ids == (5, 6, 7) and ids.num_prompt_tokens == 3 and ids.text == "5 6 7 "
    assert ids.max_tokens == 16  # OpenAI's completions default
    batch = route_request("completions", {"prompt": ["abcdefgh", "abcd"], "max_tokens": 3, "n": 2}, None)
    assert batch.text == "abcdefgh" and batch.num_prompt_tokens == 3 and batch.max_tokens == 12
    assert batch.prompt_token_ids is None


@pytest.mark.parametrize("kind,body,param", [
    ("completions", {}, "prompt"), ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"), ("completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": "a", "n": 1.5}, "n"), ("chat", {"messages": [{"content": 5}]}, "messages[0].content"),
    ("chat", {"messages": "hi"}, "messages"), ("chat", {"messages": [{}], "stream": 1}, "stream"),
])
def test_route_request_names_the_bad_field(kind, body, param):
    from tokenmill.router.app import RouterError, route_request

    with pytest.raises(RouterError) as info:
        route_request(kind, body, None)
    assert info.value.param == param and info.value.status_code == 400
