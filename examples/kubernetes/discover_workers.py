"""Keep a `tokenmill router`'s worker table equal to the worker pods behind a headless Service.

The router's sidecar in examples/kubernetes/router.yaml runs this. Every ``--interval`` seconds it resolves
``--service`` (a headless Service with ``publishNotReadyAddresses``, so its name resolves to every worker pod's
IP, loading and draining ones included), registers each new pod with the router (``POST /workers``) and
unregisters the pods that are gone (``DELETE /workers/{id}``: their requests in flight finish). Whether a pod
gets requests is the router's call, from its own ``/health`` and ``/ready`` checks, so this loop never reads
readiness. It owns the router's whole worker table: start the router without ``--worker-urls``.

The admin key comes from the environment (``--admin-key-env``, default ``ADMIN_API_KEY``), never argv.
Standard library only, so it runs in any Python image. See examples/kubernetes/README.md.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import socket
import sys
import time
import urllib.error
import urllib.request

logger = logging.getLogger("discover_workers")


def resolve(service: str, port: int) -> set[str] | None:
    """The IP addresses ``service`` resolves to now; an empty set when the name does not exist (no pod), None
    on a lookup error that may pass (then nothing is unregistered on its account)."""
    try:
        infos = socket.getaddrinfo(service, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return set()
        logger.warning("resolving %s failed (%s): keeping the worker table as it is", service, exc)
        return None
    return {str(info[4][0]).split("%", 1)[0] for info in infos}


def worker_url(address: str, port: int) -> str:
    """``http://ADDRESS:PORT`` as the router writes it (IPv6 in brackets)."""
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


class RouterAdmin:
    """The router's ``/workers`` API, with the admin key.

    Args:
        router_url: the router's base URL, e.g. ``http://127.0.0.1:30000`` (same pod: loopback).
        admin_api_key: the router's ``--admin-api-key`` (None: the router has none).
        timeout_s: seconds each call may take (``POST /workers`` waits for the worker's first health check).
    """

    def __init__(self, router_url: str, admin_api_key: str | None, timeout_s: float = 10.0) -> None:
        self.router_url = router_url.rstrip("/")
        self.admin_api_key = admin_api_key
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if self.admin_api_key:
            headers["Authorization"] = f"Bearer {self.admin_api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.router_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def workers(self) -> dict[str, str]:
        """{url: worker id} of every worker the router knows.

        Raises:
            RuntimeError: the router answered anything but 200.
        """
        status, body = self._call("GET", "/workers")
        if status != 200:
            raise RuntimeError(f"GET /workers answered {status}: {body}")
        return {w["url"]: w["id"] for w in body["workers"]}

    def add(self, url: str) -> bool:
        """Register ``url``; True when the router took it (201) or already had it (409)."""
        status, body = self._call("POST", "/workers", {"url": url})
        if status not in (201, 409):
            logger.warning("POST /workers %s answered %d: %s", url, status, body)
        return status in (201, 409)

    def remove(self, worker_id: str) -> bool:
        """Unregister a worker (its requests in flight finish); True when it is gone (200 or 404)."""
        status, body = self._call("DELETE", f"/workers/{worker_id}")
        if status not in (200, 404):
            logger.warning("DELETE /workers/%s answered %d: %s", worker_id, status, body)
        return status in (200, 404)


def reconcile(router: RouterAdmin, want: set[str]) -> tuple[list[str], list[str]]:
    """Make the router's worker URLs equal to ``want``; returns (URLs registered, URLs unregistered)."""
    have = router.workers()
    added = [url for url in sorted(want - have.keys()) if router.add(url)]
    removed = [url for url in sorted(have.keys() - want) if router.remove(have[url])]
    return added, removed


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--service`` (required), ``--port``, ``--router``, ``--admin-key-env``, ``--interval``,
    ``--once``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", required=True,
                        help="the workers' headless Service, e.g. tokenmill-worker.tokenmill.svc.cluster.local")
    parser.add_argument("--port", type=int, default=8000, help="the workers' port (default 8000)")
    parser.add_argument("--router", default="http://127.0.0.1:30000", help="the router's base URL")
    parser.add_argument("--admin-key-env", default="ADMIN_API_KEY",
                        help="environment variable holding the router's --admin-api-key")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between rounds (default 5)")
    parser.add_argument("--once", action="store_true", help="one round, then exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Reconcile every ``--interval`` seconds until killed (``--once``: one round; exit 1 if it failed)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = RouterAdmin(args.router, os.environ.get(args.admin_key_env) or None)
    while True:
        ok = False
        addresses = resolve(args.service, args.port)
        if addresses is not None:
            try:
                added, removed = reconcile(router, {worker_url(a, args.port) for a in addresses})
                ok = True
                if added or removed:
                    logger.info("workers registered: %s; unregistered: %s", added or "none", removed or "none")
            except (OSError, RuntimeError, ValueError, KeyError) as exc:  # router not up yet, or restarting
                logger.warning("reconciling with %s failed: %s", args.router, exc)
        if args.once:
            return 0 if ok else 1
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
