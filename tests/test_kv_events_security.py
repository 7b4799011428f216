"""Who can read the KV events (issue 41): a publisher binds loopback by default and refuses a wider bind
without CURVE keys; with keys, an anonymous SUB, a DEALER on the replay socket and a subscriber whose key
is not on the allow-list get nothing while the router's keyed subscriber gets every batch (and a real
``tokenmill router --policy kv_aware`` still routes on them); cache salts and adapter names leave the
engine only as keyed tags. Hostile clients are plain pyzmq sockets on 127.0.0.1."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import stat
import time

import httpx2 as httpx
import pytest
import zmq
import zmq.auth

from tests.server_fixtures import ServerProcess
from tests.tiny_models import make_tiny_model
from tokenmill.config import ConfigError, KVEventsConfig
from tokenmill.kv_events import BlockStored, KVEventCollector, decode_batch
from tokenmill.kv_events.events import END_OF_REPLAY, encode_seq, key_tag
from tokenmill.kv_events.publisher import ZmqEventPublisher
from tokenmill.kv_events.transport import ClientKeys, TransportKeyError
from tokenmill.router.kv_index import KVIndex, kv_event_endpoints
from tokenmill.security import load_cluster_secret

SALT = "tenant-7-secret-salt"
ADAPTER = "acme-private-adapter"
LISTEN_S = 1.0  # how long a refused socket is given to receive something it must not


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout}s")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict:
    """A publisher certificate, the router's (allowed) and a stranger's (not allowed)."""
    root = tmp_path_factory.mktemp("curve")
    allowed, private = root / "allowed", root / "private"
    allowed.mkdir()
    private.mkdir(mode=0o700)
    paths = {}
    for name in ("server", "router", "stranger"):
        public, secret = zmq.auth.create_certificates(private, name)
        os.chmod(secret, 0o600)
        paths[name] = (public, secret)
    (allowed / "router.key").write_bytes(open(paths["router"][0], "rb").read())
    return {"allowed_dir": str(allowed), **{name: p for name, p in paths.items()}}


def curve_config(certs: dict, **kwargs) -> KVEventsConfig:
    return KVEventsConfig(True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                          curve_secret_key_file=str(certs["server"][1]), curve_client_keys_dir=certs["allowed_dir"],
                          **kwargs)


def stored(salt: str = SALT) -> BlockStored:
    return BlockStored((11, 12), None, tuple(range(8)), 4, "pool", 3, ADAPTER, (salt, f"lora:3:{ADAPTER}"))


def lan_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


# ---- where the sockets listen ---------------------------------------------------------------------------
def test_default_bind_is_loopback_and_a_wider_bind_needs_keys_or_an_explicit_opt_out(tmp_path):
    assert KVEventsConfig().endpoint == "tcp://127.0.0.1:5557"
    for field, value in [("endpoint", "tcp://*:5557"), ("endpoint", "tcp://0.0.0.0:5557"),
                         ("endpoint", "tcp://eth0:5557"), ("replay_endpoint", "tcp://[::]:5558"),
                         ("endpoint", "ipc://@abstract-kv-events")]:
        with pytest.raises(ConfigError, match=f"{field} .* listens beyond loopback without CURVE keys") as info:
            KVEventsConfig(True, **{field: value})
        assert "allow_insecure_bind" in str(info.value)
    assert KVEventsConfig(True, endpoint="tcp://*:5557", allow_insecure_bind=True).endpoint == "tcp://*:5557"
    for local in ["tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557", "ipc:///run/x/kv"]:
        assert KVEventsConfig(True, endpoint=local).endpoint == local
    with pytest.raises(ConfigError, match="go together"):
        KVEventsConfig(True, curve_secret_key_file="server.key_secret")

    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"),
                                  KVEventCollector(4))
    try:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:") and publisher.replay_endpoint.startswith("tcp://127.0.0.1:")
        address = lan_address()
        if address is not None:  # the port is not open on the machine's other addresses
            for endpoint in (publisher.endpoint, publisher.replay_endpoint):
                with pytest.raises(OSError):
                    socket.create_connection((address, int(endpoint.rsplit(":", 1)[1])), timeout=2).close()
    finally:
        publisher.close()


def test_an_ipc_socket_file_is_0600_in_a_0700_directory(tmp_path):
    endpoint = f"ipc://{tmp_path}/run/kv/events"
    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint=endpoint), KVEventCollector(4))
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "run" / "kv" / "events").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "run" / "kv").st_mode) == 0o700
    finally:
        publisher.close()


# ---- CURVE --------------------------------------------------------------------------------------------
def anonymous_sub(ctx: zmq.Context, endpoint: str, keys: ClientKeys | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.apply(sock)
    sock.connect(endpoint)
    return sock


def replay_answers(ctx: zmq.Context, endpoint: str, keys: ClientKeys | None = None) -> list[list[bytes]]:
    """Ask the replay socket for everything from batch 0, as a DEALER; the messages it got back."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.apply(dealer)
    dealer.connect(endpoint)
    dealer.send(encode_seq(0))
    answers = []
    while dealer.poll(int(LISTEN_S * 1000)):
        answers.append(dealer.recv_multipart())
        if answers[-1][0] == END_OF_REPLAY:
            break
    dealer.close()
    return answers


def test_with_curve_only_the_listed_subscriber_reads_events_and_replays(certs):
    router_keys = ClientKeys.from_files(certs["router"][1], certs["server"][0])
    stranger_keys = ClientKeys.from_files(certs["stranger"][1], certs["server"][0])
    publisher = ZmqEventPublisher(curve_config(certs), KVEventCollector(4))
    index, ctx = KVIndex(curve=router_keys), zmq.Context()
    try:
        assert publisher.status()["curve"] is True
        publisher.collector.block_stored([1, 2], None, list(range(8)), (SALT,))  # before anyone listens: replayed
        publisher.publish_pending()
        wait_until(lambda: publisher.next_seq == 1)
        plain = anonymous_sub(ctx, publisher.endpoint)
        stranger = anonymous_sub(ctx, publisher.endpoint, stranger_keys)
        index.add_worker("w", publisher.endpoint, publisher.replay_endpoint)
        wait_until(lambda: index.worker_blocks("w") == {1, 2}, what="the keyed subscriber's replay on join")

        def live() -> bool:
            publisher.collector.all_cleared("probe")
            publisher.publish_pending()
            time.sleep(0.05)
            return index.last_seq("w") == publisher.num_batches - 1

        wait_until(live, what="the keyed subscriber's live stream")
        for i in range(5):
            publisher.collector.block_stored([100 + i], None, [i] * 4, (SALT,))
            publisher.publish_pending()
        wait_until(lambda: index.last_seq("w") == publisher.num_batches - 1, what="the keyed subscriber's batches")
        assert {100, 104} <= index.worker_blocks("w") and index.stats()["w"]["lost_batches"] == 0
        # The same stream was offered to an anonymous SUB and to a CURVE client whose key is not listed.
        assert not plain.poll(int(LISTEN_S * 1000)) and not stranger.poll(0)
        # The replay socket: nothing for an anonymous DEALER or the stranger, the history for the router's key.
        assert replay_answers(ctx, publisher.replay_endpoint) == []
        assert replay_answers(ctx, publisher.replay_endpoint, stranger_keys) == []
        answers = replay_answers(ctx, publisher.replay_endpoint, router_keys)
        assert answers[-1][0] == END_OF_REPLAY and len(answers) == publisher.next_seq + 1
        plain.close()
        stranger.close()
    finally:
        index.close()
        publisher.close()
        ctx.term()


def test_unusable_curve_certificates_are_refused_naming_the_setting(certs, tmp_path):
    loose = tmp_path / "loose.key_secret"
    loose.write_bytes(open(certs["server"][1], "rb").read())
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match="open to other users"):
        ZmqEventPublisher(dataclasses.replace(curve_config(certs), curve_secret_key_file=str(loose)),
                          KVEventCollector(4))
    empty = tmp_path / "no-keys"
    empty.mkdir()
    with pytest.raises(ConfigError, match="public certificates"):
        ZmqEventPublisher(dataclasses.replace(curve_config(certs), curve_client_keys_dir=str(empty)),
                          KVEventCollector(4))
    with pytest.raises(TransportKeyError, match="holds no secret key"):
        ClientKeys.from_files(certs["router"][0], certs["server"][0])  # the public half given as the secret


# ---- no clear salts or adapter names ---------------------------------------------------------------------------
def test_published_events_carry_keyed_tags_not_salts_or_adapter_names():
    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint="tcp://127.0.0.1:*"), KVEventCollector(4))
    ctx = zmq.Context()
    sub = anonymous_sub(ctx, publisher.endpoint)  # a local process allowed to listen: what does it learn?
    try:
        def probe() -> bool:
            publisher.collector.all_cleared("probe")
            publisher.publish_pending()
            return bool(sub.poll(50))

        wait_until(probe, what="subscription")
        while sub.poll(100):
            sub.recv_multipart()
        event = stored()
        publisher.collector.block_stored(list(event.block_hashes), None, list(event.token_ids), event.extra_keys,
                                         event.lora_id, event.lora_name)
        publisher.publish_pending()
        assert sub.poll(5000)
        _, _, payload = sub.recv_multipart()
        assert SALT.encode() not in payload and ADAPTER.encode() not in payload
        (got,) = decode_batch(payload).events
        secret = load_cluster_secret()  # the router holds the same secret: it can match a salt it knows
        assert got.extra_keys == (key_tag(secret, SALT), key_tag(secret, f"lora:3:{ADAPTER}"))
        assert got.lora_name == key_tag(secret, ADAPTER) and got.lora_id == 3
        assert (got.block_hashes, got.token_ids) == (event.block_hashes, event.token_ids)  # what routing matches on
    finally:
        sub.close()
        ctx.term()
        publisher.close()


# ---- a real worker and router with CURVE ------------------------------------------------------------------------
BLOCK_SIZE = 16


def test_router_with_its_key_routes_on_a_curve_workers_events_and_a_listener_learns_nothing(certs, tmp_path):
    from tests.test_router import RouterProcess

    model = str(make_tiny_model("llama", tmp_path / "tiny"))
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
              "curve_secret_key_file": str(certs["server"][1]), "curve_client_keys_dir": certs["allowed_dir"]}
    worker = ServerProcess(model, ["--dtype", "float32", "--num-kv-blocks", "64", "--block-size", str(BLOCK_SIZE),
                                   "--num-threads", "1", "--kv-events-config", json.dumps(config)],
                           tmp_path / "worker.log")
    router = None
    ctx = zmq.Context()
    try:
        worker.wait_healthy()
        status = worker.get_json("/debug/status")["kv_events"]
        assert status["curve"] is True
        endpoint, _ = kv_event_endpoints({"kv_events": status}, worker.url)
        eavesdropper = anonymous_sub(ctx, endpoint)
        router = RouterProcess([worker.url], ["--policy", "kv_aware", "--kv-predicted-ttl", "0",
                                              "--kv-events-curve-secret-key-file", str(certs["router"][1]),
                                              "--kv-events-curve-server-key-file", str(certs["server"][0])],
                               tmp_path / "router.log")
        router.wait_up()
        router.wait_workers_healthy()
        prompt = list(range(1000, 1080))  # 5 full blocks

        def complete(salt: str | None) -> dict:
            body = {"model": model, "prompt": prompt + [7], "max_tokens": 2, "temperature": 0}
            if salt is not None:
                body["cache_salt"] = salt
            response = router.post("/v1/completions", body)
            assert response.status_code == 200, response.text
            return response.json()["usage"]

        def overlap_decisions() -> float:
            text = httpx.get(f"{router.url}/metrics", timeout=10).text
            line = re.search(r'^tokenmill_router:routing_decisions_total\{policy="kv_aware",reason="kv_overlap"\} (\S+)$',
                             text, re.M)
            return float(line.group(1)) if line else 0.0

        for salt in (None, SALT):
            complete(salt)
            before = overlap_decisions()
            # With predictions off, only the worker's (CURVE) events can make the router see an overlap.
            deadline = time.monotonic() + 20
            while True:
                usage = complete(salt)
                if overlap_decisions() > before or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert overlap_decisions() == before + 1, router.log()[-3000:]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK_SIZE
        assert worker.get_json("/debug/status")["kv_events"]["num_batches"] > 0
        assert not eavesdropper.poll(0)  # every batch went past it
        eavesdropper.close()
    finally:
        if router is not None:
            router.stop()
        worker.stop()
        ctx.term()


def test_a_router_does_not_mistake_its_own_loopback_for_a_remote_workers_publisher():
    status = {"kv_events": {"enabled": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557",
                            "replay_endpoint": "tcp://127.0.0.1:5558"}}
    assert kv_event_endpoints(status, "http://127.0.0.1:8000") == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    # The worker at 10.1.2.3 publishes on its own loopback: connecting to ours could reach another publisher.
    assert kv_event_endpoints(status, "http://10.1.2.3:8000") == (None, None)
    ipc = {"kv_events": {"enabled": True, "publisher": "zmq", "endpoint": "ipc:///run/tm/kv", "replay_endpoint": None}}
    assert kv_event_endpoints(ipc, "http://localhost:8000") == ("ipc:///run/tm/kv", None)
    assert kv_event_endpoints(ipc, "http://10.1.2.3:8000") == (None, None)
