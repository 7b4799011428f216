"""examples/kubernetes: every manifest is valid against the Kubernetes schema, and the files agree with each
other and with tokenmill itself.

The schema check uses ``kubernetes-validate`` (pinned in requirements.lock), whose JSON schemas for each
Kubernetes release ship inside its wheel, so it runs offline; strict mode also refuses unknown fields. The rest
reads the manifests as data: every ``tokenmill`` argument parses with tokenmill's own parser, the probes hit
``/health`` and ``/ready`` on the container port, the grace period covers the drain, the Host allow-lists admit
the Services' names and the pod IP (checked with the server's own matching code), keys come from the Secret by
reference only, and the scrape annotations name the metrics port. The discovery sidecar runs against a real
router. No cluster, no image build, no model: a few seconds.
"""
from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import kubernetes_validate
import pytest
import yaml

from tokenmill.cli.main import build_parser
from tokenmill.procs import free_port
from tokenmill.security.http import allowed_hosts_for, host_matches, host_name

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "kubernetes"
sys.path.insert(0, str(EXAMPLE))
import discover_workers  # noqa: E402  (examples/kubernetes/discover_workers.py, the router's sidecar)

KUBERNETES_VERSIONS = ("1.30", "1.37")  # the oldest release still common in managed clouds, and the newest shipped
SECRET_NAME = "tokenmill-secrets"
POD_IP = "10.244.1.17"  # stands in for $(POD_IP), the downward API's status.podIP
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
KEY_FLAGS = ("--api-key", "--admin-api-key", "--worker-api-key")


def manifests() -> list[tuple[str, dict]]:
    """(file name, document) for every document of every examples/kubernetes/*.yaml."""
    docs = []
    for path in sorted(EXAMPLE.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


DOCS = manifests()


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def deployment(component: str) -> dict:
    (found,) = [d for d in of_kind("Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return found


def service(component: str) -> dict:
    (found,) = [s for s in of_kind("Service") if s["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return found


def container(deploy: dict, name: str) -> dict:
    (found,) = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def expanded_args(ctr: dict) -> list[str]:
    """The container's args with each ``$(VAR)`` replaced as the kubelet would, from the container's own env.

    Every reference must name an env var of the container: the kubelet leaves an unknown ``$(NAME)`` as it is,
    which would make a literal "$(NAME)" the API key.
    """
    env = {}
    for var in ctr.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", var
            env[var["name"]] = POD_IP
        else:
            env[var["name"]] = f"secret-from-{var['valueFrom']['secretKeyRef']['key']}"
    out = []
    for arg in ctr["args"]:
        for ref in VAR_REF.findall(arg):
            assert ref in env, f"{ctr['name']}: $({ref}) names no env var of the container"
        out.append(VAR_REF.sub(lambda m: env[m.group(1)], arg))
    return out


def tokenmill_args(ctr: dict):
    """The container's arguments parsed by ``tokenmill``'s own parser (the image's ENTRYPOINT is ``tokenmill``)."""
    assert "command" not in ctr, "tokenmill containers run the image's ENTRYPOINT"
    return build_parser().parse_args(expanded_args(ctr))


def flat(names) -> list[str]:
    """``--allowed-hosts`` as parsed: serve flattens its groups, router keeps one list per occurrence."""
    return [n for item in names for n in (item if isinstance(item, list) else [item])]


def container_port(ctr: dict, port: int | str) -> int:
    """A probe's or Service's port (a number or a port name) as the container's port number."""
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in ctr["ports"] if p["name"] == port]
    return found


WORKER, ROUTER = deployment("worker"), deployment("router")
WORKER_CTR, ROUTER_CTR = container(WORKER, "tokenmill"), container(ROUTER, "router")
SIDECAR = container(ROUTER, "discover-workers")


# --- the schema ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schema(version):
    assert {doc["kind"] for _, doc in DOCS} == {"Namespace", "Deployment", "Service"}
    for name, doc in DOCS:
        try:  # SchemaNotFoundError (an unknown kind or apiVersion) fails too
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']} at {path}: {exc.message}")


def test_the_validator_rejects_a_misspelled_field():
    """The schema check above could fail: strict validation refuses a typo in a probe."""
    broken = next(yaml.safe_load_all((EXAMPLE / "worker.yaml").read_text().replace("path: /ready", "pth: /ready")))
    with pytest.raises(kubernetes_validate.ValidationError, match="pth"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


# --- tokenmill's flags ----------------------------------------------------------------------------------------

def test_every_tokenmill_flag_in_the_manifests_parses_with_tokenmills_parser():
    worker = tokenmill_args(WORKER_CTR)
    assert (worker.command, worker.host, worker.port) == ("serve", "0.0.0.0", 8000)
    router = tokenmill_args(ROUTER_CTR)
    assert (router.command, router.host, router.port) == ("router", "0.0.0.0", 30000)
    assert router.worker_urls == []  # the sidecar owns the worker table
    assert router.admin_api_key, "a router beyond loopback refuses to start without --admin-api-key"
    sidecar = discover_workers.build_parser().parse_args(expanded_args(SIDECAR))
    assert sidecar.service == f"{service('worker')['metadata']['name']}.tokenmill.svc.cluster.local"
    assert sidecar.port == worker.port
    assert sidecar.router == f"http://127.0.0.1:{router.port}"  # same pod: loopback, always an allowed Host
    (key_ref,) = [v for v in SIDECAR["env"] if v["name"] == sidecar.admin_key_env]
    assert key_ref["valueFrom"]["secretKeyRef"]["key"] == "admin-api-key"


def test_probes_hit_health_and_ready_on_the_servers_port():
    port = tokenmill_args(WORKER_CTR).port
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health"), ("startupProbe", "/health")):
        get = WORKER_CTR[probe]["httpGet"]
        assert (get["path"], container_port(WORKER_CTR, get["port"])) == (path, port), probe
    router = ROUTER_CTR["readinessProbe"]["httpGet"]
    assert (router["path"], container_port(ROUTER_CTR, router["port"])) == ("/health", tokenmill_args(ROUTER_CTR).port)


def test_grace_period_covers_prestop_and_the_drain():
    tree = ast.parse((ROOT / "tokenmill" / "server" / "api_server.py").read_text())  # not imported: torch
    (response_grace_s,) = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                           and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["RESPONSE_GRACE_S"]]
    command = WORKER_CTR["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    budget = float(command[1]) + tokenmill_args(WORKER_CTR).shutdown_timeout + response_grace_s
    assert WORKER["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > budget


# --- Host allow-lists -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("component", ["worker", "router"])
def test_host_allow_list_admits_the_service_names_and_the_pod_ip(component):
    ctr = WORKER_CTR if component == "worker" else ROUTER_CTR
    args = tokenmill_args(ctr)
    allowed = allowed_hosts_for(args.host, flat(args.allowed_hosts))
    svc = service(component)
    name, ns = svc["metadata"]["name"], svc["metadata"]["namespace"]
    for host in (f"{POD_IP}:{args.port}", name, f"{name}.{ns}", f"{name}.{ns}.svc",
                 f"{name}.{ns}.svc.cluster.local:{args.port}", f"127.0.0.1:{args.port}"):
        assert host_matches(host_name(host), allowed), (host, allowed)
    assert not host_matches(host_name("attacker.example"), allowed)
    assert not host_matches(host_name("10.244.9.9"), allowed)  # another pod's IP: the list is not a wildcard


# --- secrets --------------------------------------------------------------------------------------------------

def test_keys_come_from_the_secret_by_reference_only():
    assert not of_kind("Secret"), "no key is written into a manifest"
    readme_keys = set(re.findall(r"--from-literal=([a-z-]+)=", (EXAMPLE / "README.md").read_text()))
    used = set()
    for deploy in (WORKER, ROUTER):
        for ctr in deploy["spec"]["template"]["spec"]["containers"]:
            secret_vars = set()
            for var in ctr.get("env", []):
                assert "value" not in var or not re.search("KEY|SECRET", var["name"]), var
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == SECRET_NAME
                    used.add(ref["key"])
                    secret_vars.add(var["name"])
            args = ctr.get("args", [])
            for flag, value in zip(args, args[1:]):
                if flag in KEY_FLAGS:
                    assert VAR_REF.fullmatch(value) and VAR_REF.fullmatch(value).group(1) in secret_vars, (flag, value)
    assert used == readme_keys  # the README's `kubectl create secret` makes exactly the keys the pods read
    assert {"worker-api-key", "client-api-key", "admin-api-key", "cluster-secret"} == used


# --- Services, annotations, image -----------------------------------------------------------------------------

@pytest.mark.parametrize("component", ["worker", "router"])
def test_service_selects_the_pods_and_targets_the_servers_port(component):
    deploy, ctr = (WORKER, WORKER_CTR) if component == "worker" else (ROUTER, ROUTER_CTR)
    svc = service(component)
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    assert container_port(ctr, port["targetPort"]) == tokenmill_args(ctr).port
    assert {d["metadata"]["namespace"] for d in (deploy, svc)} == {of_kind("Namespace")[0]["metadata"]["name"]}


def test_worker_service_is_headless_and_lists_pods_that_are_not_ready():
    spec = service("worker")["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("component", ["worker", "router"])
def test_prometheus_annotations_name_the_metrics_port_and_path(component):
    deploy, ctr = (WORKER, WORKER_CTR) if component == "worker" else (ROUTER, ROUTER_CTR)
    notes = deploy["spec"]["template"]["metadata"]["annotations"]
    args = tokenmill_args(ctr)
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": str(args.port),
                     "prometheus.io/path": "/metrics"}
    assert args.metrics_without_auth  # an annotation-driven scrape sends no bearer token


def test_dockerfile_matches_the_manifests():
    text = (EXAMPLE / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["tokenmill"\]$', text, re.M)  # the tokenmill containers give args only
    assert re.search(r"^USER 10001$", text, re.M)
    for deploy in (WORKER, ROUTER):
        assert deploy["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
    copies = [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("COPY ")]
    assert ["examples/kubernetes/discover_workers.py", SIDECAR["command"][1]] in copies
    # BuildKit's Dockerfile-specific ignore file must let every COPY source into the build context.
    allowed = [line[1:] for line in (EXAMPLE / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for *sources, _ in copies:
        for source in sources:
            assert source in allowed, f"{source} is ignored by Dockerfile.dockerignore"
    readme = (EXAMPLE / "README.md").read_text()
    for path in sorted(EXAMPLE.glob("*.yaml")):
        assert f"kubectl apply -f examples/kubernetes/{path.name}" in readme


# --- the discovery sidecar against a real router ---------------------------------------------------------------

@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """A real ``tokenmill router`` on loopback with an admin key and no workers; yields (url, admin key)."""
    port, key = free_port(), "admin-key-for-the-discovery-test"
    log = tmp_path_factory.mktemp("router") / "router.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", "router", "--port", str(port),
                                 "--admin-api-key", key], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            httpx.get(f"{url}/health", timeout=1)  # 503 with no healthy worker: up all the same
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the router did not start"
            time.sleep(0.1)
    yield url, key
    proc.terminate()
    proc.wait(timeout=30)


def test_discovery_registers_new_pods_and_unregisters_gone_ones(router):
    url, key = router
    admin = discover_workers.RouterAdmin(url, key)
    pod_a = discover_workers.worker_url("127.0.0.1", free_port())
    pod_b = discover_workers.worker_url("::1", 8000)
    assert pod_b == "http://[::1]:8000"
    assert discover_workers.reconcile(admin, {pod_a, pod_b}) == (sorted([pod_a, pod_b]), [])
    assert set(admin.workers()) == {pod_a, pod_b}  # the router writes the URLs as the sidecar does
    assert discover_workers.reconcile(admin, {pod_a, pod_b}) == ([], [])  # a steady state changes nothing
    assert discover_workers.reconcile(admin, {pod_a}) == ([], [pod_b])
    listed = httpx.get(f"{url}/workers", headers={"Authorization": f"Bearer {key}"}).json()["workers"]
    assert [w["url"] for w in listed] == [pod_a]
    with pytest.raises(RuntimeError, match="401"):
        discover_workers.RouterAdmin(url, "wrong-key").workers()
    assert discover_workers.reconcile(admin, set()) == ([], [pod_a])


def test_discovery_main_resolves_the_service_name_and_registers_its_addresses(router, monkeypatch):
    url, key = router
    port = free_port()
    monkeypatch.setenv("ADMIN_API_KEY", key)
    assert discover_workers.resolve("localhost", port) >= {"127.0.0.1"}
    assert discover_workers.main(["--service", "localhost", "--port", str(port), "--router", url, "--once"]) == 0
    admin = discover_workers.RouterAdmin(url, key)
    expected = {discover_workers.worker_url(a, port) for a in discover_workers.resolve("localhost", port)}
    assert set(admin.workers()) == expected
    monkeypatch.setenv("ADMIN_API_KEY", "wrong-key")
    assert discover_workers.main(["--service", "localhost", "--port", str(port), "--router", url, "--once"]) == 1
    discover_workers.reconcile(admin, set())
