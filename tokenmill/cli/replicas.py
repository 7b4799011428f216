"""Data-parallel serving: N engine replicas and the router over them, in one command.

``tokenmill serve MODEL --data-parallel-size N`` lands here. Each replica is a ``tokenmill serve``
server (``run_server``) in its own spawned process on a free port of 127.0.0.1, with the CPU threads
divided between the replicas; with ``--distributed-executor-backend ray`` each replica process is
started by a Ray actor instead, on whichever node Ray places it (``--data-parallel-size-local L``: L
replicas on each of N / L nodes, one Ray placement group), bound as ``--host`` says (loopback: the
replica must run on this machine). Every replica takes a fresh random API key that only the router
holds (its ``--worker-api-key``); clients use ``--api-key`` on the router. Once every replica answers
``/health``, the router runs in this process on ``--port``. SIGINT/SIGTERM stop the router, then every
replica (a replica also gets SIGTERM if this process dies: no orphans). Owns processes only: no
routing and no engine code here.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import os
import secrets
import signal
from typing import Any

from tokenmill.procs import STOP_TIMEOUT_S, die_with_parent, free_port, stop_processes, wait_healthy

logger = logging.getLogger(__name__)

RAY_OBJECT_STORE_BYTES = 100 * 1024**2  # a local Ray instance's object store: small, to fit a laptop
RAY_MISSING = "--distributed-executor-backend ray needs Ray: pip install tokenmill[ray]"
RAY_PLACEMENT_TIMEOUT_S = 300.0  # --data-parallel-size-local: how long to wait for the nodes to join


def replicas_per_node(size: int, local: int | None, backend: str) -> int | None:
    """``--data-parallel-size-local`` checked against ``--data-parallel-size`` ``size``: the replicas on each
    node (None: Ray places them as it likes; with the mp backend every replica is on this node).

    Raises:
        ValueError: naming ``--data-parallel-size-local``: it does not divide ``size``, or it is set below
            ``size`` without the Ray backend.
    """
    if local is None:
        return None
    if size % local:
        raise ValueError(f"--data-parallel-size-local {local} must divide --data-parallel-size {size}")
    if backend != "ray" and local != size:
        raise ValueError(f"--data-parallel-size-local {local} < --data-parallel-size {size} needs "
                         "--distributed-executor-backend ray (mp replicas all run on this node)")
    return local


def split_threads(total: int | None, replicas: int) -> int:
    """CPU threads of each replica: ``total`` (default: every core) divided evenly, at least 1."""
    total = total or os.cpu_count() or 1
    return max(1, total // replicas)


def replica_config(config: Any, port: int, num_threads: int, host: str = "127.0.0.1",
                   api_key: str | None = None) -> Any:
    """``config`` (a ``ServerConfig``) for one replica: its own address, thread count and API key (the
    router's worker key; the clients' ``--api-key`` stays with the router)."""
    return dataclasses.replace(config, host=host, port=port, api_key=api_key,
                               engine_args=dataclasses.replace(config.engine_args, num_threads=num_threads))


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def replica_bind(host: str, node_address: str, on_router_node: bool) -> tuple[str, str]:
    """(address a Ray replica binds, address the router reaches it at) for ``--host`` ``host`` on a node
    whose address is ``node_address``: loopback binds 127.0.0.1 (only on the router's machine:
    ``on_router_node`` is true for every Ray node on the router's address, as nodes started side by side on
    one machine are), a wildcard binds it and is reached at the node's address, any other address is bound
    and reached as given.

    Raises:
        RuntimeError: ``host`` is loopback and the replica is on another machine.
    """
    from tokenmill.security.http import is_loopback

    if is_loopback(host):
        if not on_router_node:
            raise RuntimeError(f"Ray placed a replica on node {node_address}, but --host {host} binds loopback, "
                               "which the router cannot reach there: pass --host 0.0.0.0 (or the nodes' address)")
        return "127.0.0.1", "127.0.0.1"
    if host in WILDCARD_HOSTS:
        return host, node_address
    return host, host


def _replica_main(config: Any, args: argparse.Namespace) -> None:
    """A spawned replica process: logging as the parent has it, then ``run_server`` until SIGTERM."""
    die_with_parent()
    from tokenmill.cli.logging_setup import configure_logging
    from tokenmill.server.api_server import run_server

    configure_logging(args)
    raise SystemExit(run_server(config))


def start_replica(config: Any, args: argparse.Namespace) -> multiprocessing.Process:
    """Spawn one replica process serving ``config``."""
    process = multiprocessing.get_context("spawn").Process(target=_replica_main, args=(config, args),
                                                           name=f"tokenmill-replica-{config.port}")
    process.start()
    return process


class RayReplica:
    """A Ray actor that runs one replica process on its node (``ray.remote`` wraps it lazily)."""

    def __init__(self) -> None:
        self.process: multiprocessing.Process | None = None

    def start(self, config: Any, args: argparse.Namespace, router_address: str) -> str:
        """Start serving on a free port of this node, bound as ``config.host`` (``--host``) says
        (``replica_bind``; ``router_address``: the Ray address of the router's node); returns the
        replica's URL.

        Raises:
            RuntimeError: ``--host`` is loopback and this node is on another machine than the router.
        """
        import ray

        node_address = ray.util.get_node_ip_address()
        bind, reach = replica_bind(config.host, node_address, node_address == router_address)
        config = dataclasses.replace(config, host=bind, port=free_port(bind or "0.0.0.0"))
        self.process = start_replica(config, args)
        return f"http://{f'[{reach}]' if ':' in reach else reach}:{config.port}"

    def exit_code(self) -> int | None:
        return self.process.exitcode if self.process is not None else None

    def stop(self) -> None:
        if self.process is not None:
            stop_processes([self.process])


def _router_config(args: argparse.Namespace, urls: list[str], worker_api_key: str):
    """The router over the replicas: the clients' ``--api-key``, the replicas' key as its worker key, and
    ``serve``'s surface flags; ``/workers`` only on loopback (``serve`` has no admin key: the replicas are
    fixed)."""
    from tokenmill.router.app import RouterConfig
    from tokenmill.router.policies import PolicyConfig
    from tokenmill.security.http import DEFAULT_MAX_REQUEST_BODY_BYTES, is_loopback
    from tokenmill.tracing import otlp_traces_endpoint

    hosts = getattr(args, "allowed_hosts", None)
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    return RouterConfig(worker_urls=tuple(urls), policy=PolicyConfig(name=args.policy), host=args.host,
                        port=args.port, api_key=args.api_key, worker_api_key=worker_api_key,
                        worker_admin=is_loopback(args.host),
                        allowed_hosts=None if hosts is None else tuple(h for group in hosts for h in group),
                        max_request_body_bytes=getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES),
                        metrics_without_auth=getattr(args, "metrics_without_auth", False),
                        otlp_traces_endpoint=endpoint and otlp_traces_endpoint(endpoint))  # replicas trace too


def _stop_on_signal(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM while replicas load: unwind through the cleanup


def run_data_parallel(config: Any, args: argparse.Namespace) -> int:
    """Start ``args.data_parallel_size`` replicas of ``config``, then the router on ``config``'s port;
    returns the exit code once SIGINT/SIGTERM stopped the router and every replica."""
    from tokenmill.router.app import run_router

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per health poll
    size = args.data_parallel_size
    local = replicas_per_node(size, getattr(args, "data_parallel_size_local", None), args.distributed_executor_backend)
    threads = split_threads(config.engine_args.num_threads, size)
    worker_api_key = secrets.token_urlsafe(32)  # the replicas' key: only the router holds it
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop_on_signal)
    if args.distributed_executor_backend == "ray":
        return _run_on_ray(config, args, threads, worker_api_key, local)
    processes: list[multiprocessing.Process] = []
    try:
        configs = [replica_config(config, free_port(), threads, api_key=worker_api_key) for _ in range(size)]
        processes = [start_replica(c, args) for c in configs]
        urls = [f"http://127.0.0.1:{c.port}" for c in configs]
        logger.info("%d replicas of %d threads each: %s", size, threads, " ".join(urls))

        def alive() -> str | None:
            dead = [p for p in processes if not p.is_alive()]
            return f"replica {dead[0].name} exited with {dead[0].exitcode} while loading" if dead else None

        wait_healthy(urls, alive)
        return run_router(_router_config(args, urls, worker_api_key))
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        stop_processes(processes)


def _run_on_ray(config: Any, args: argparse.Namespace, threads: int, worker_api_key: str,
                local: int | None) -> int:
    """Replicas as Ray actors (``--ray-address`` or a small local instance), the router here; ``local``
    replicas on each node (``replicas_per_node``; None: where Ray likes)."""
    try:
        import ray
    except ImportError:
        raise ValueError(RAY_MISSING) from None
    from tokenmill.router.app import run_router

    started_ray = not ray.is_initialized()
    if started_ray:
        if args.ray_address:
            ray.init(address=args.ray_address)
        else:
            # A new one-node instance on this machine (Ray names it by the machine's address, never 127.0.0.1);
            # "local": never the cluster a `ray start --head` on this machine left in /tmp/ray.
            ray.init(address="local", object_store_memory=RAY_OBJECT_STORE_BYTES, include_dashboard=False,
                     num_cpus=max(os.cpu_count() or 1, threads * args.data_parallel_size))
    actor_class = ray.remote(num_cpus=threads)(RayReplica)
    actors = []
    group = None
    try:
        if local is None:
            actors = [actor_class.remote() for _ in range(args.data_parallel_size)]
        else:
            group = _node_placement(args.data_parallel_size // local, threads * local)
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            actors = [actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=i // local)).remote() for i in range(args.data_parallel_size)]
        router_address = ray.util.get_node_ip_address()
        urls = ray.get([a.start.remote(replica_config(config, 0, threads, config.host, worker_api_key), args,
                                       router_address) for a in actors])
        logger.info("%d Ray replicas of %d threads each: %s", len(urls), threads, " ".join(urls))

        def alive() -> str | None:
            codes = ray.get([a.exit_code.remote() for a in actors])
            dead = [(url, code) for url, code in zip(urls, codes) if code is not None]
            return f"replica {dead[0][0]} exited with {dead[0][1]} while loading" if dead else None

        wait_healthy(urls, alive)
        return run_router(_router_config(args, urls, worker_api_key))
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        for stopped in [a.stop.remote() for a in actors]:  # each on its own: a dead one leaves the rest stopping
            try:
                ray.get(stopped, timeout=STOP_TIMEOUT_S + 5)
            except Exception as exc:  # a dead actor (its node is gone): its replica got SIGTERM with it
                logger.warning("stopping a Ray replica: %s", str(exc).splitlines()[0] if str(exc) else repr(exc))
        for actor in actors:
            ray.kill(actor)
        if group is not None:
            ray.util.remove_placement_group(group)
        if started_ray:
            ray.shutdown()


def _node_placement(nodes: int, cpus: int) -> Any:
    """A Ray placement group of ``nodes`` bundles of ``cpus`` CPUs, each on its own node (STRICT_SPREAD),
    once ready: bundle i holds the replicas of node i.

    Raises:
        RuntimeError: the cluster has not had ``nodes`` nodes with ``cpus`` free CPUs each within
            ``RAY_PLACEMENT_TIMEOUT_S`` seconds.
    """
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group([{"CPU": cpus}] * nodes, strategy="STRICT_SPREAD")
    logger.info("waiting for %d Ray nodes with %d free CPUs each (--data-parallel-size-local)", nodes, cpus)
    ready, _ = ray.wait([group.ready()], timeout=RAY_PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"--data-parallel-size-local: the Ray cluster has not had {nodes} nodes with {cpus} "
                           f"free CPUs each within {RAY_PLACEMENT_TIMEOUT_S:.0f} s (ray status shows its nodes)")
    return group
