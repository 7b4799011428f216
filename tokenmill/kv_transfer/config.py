"""``--kv-transfer-config``: vLLM's field names for prefill/decode disaggregation (docs/pd_disaggregation.md)."""
from __future__ import annotations

import ipaddress
import numbers
from dataclasses import dataclass, field

from tokenmill.config_error import ConfigError, config_from_value

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("TokenmillConnector", "TCPConnector", "SharedMemoryConnector")
EXTRA_KEYS = ("lease_ttl_s", "transfer_timeout_s", "secret_file", "allowed_producers", "max_connections",
              "max_leases", "max_lease_blocks", "allowed_consumers")
_SECONDS_KEYS = ("lease_ttl_s", "transfer_timeout_s")
_COUNT_KEYS = ("max_connections", "max_leases", "max_lease_blocks")
DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_MAX_LEASES = 64


def _check_address_list(name: str, key: str, value, hosts: bool) -> None:
    """Check ``kv_connector_extra_config.<key>``: None, or a list of CIDRs and IP addresses (``hosts``: host names too).

    Raises:
        ConfigError naming the key.
    """
    if value is None:
        return
    what = "hosts or CIDRs" if hosts else "CIDRs or IP addresses"
    if not isinstance(value, list) or not all(isinstance(a, str) and a for a in value):
        raise ConfigError(f"`{name}` kv_connector_extra_config.{key} must be a list of {what}, got {value!r}")
    for entry in value:
        if hosts and "/" not in entry:
            continue  # a host name or address, resolved when connecting
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ConfigError(f"`{name}` kv_connector_extra_config.{key}: {entry!r} is not one of {what}") from None


@dataclass(frozen=True)
class KVTransferConfig:
    """How this engine takes part in KV transfer.

    Args:
        kv_connector: ``TokenmillConnector`` (the default: shared memory when the producer is on this
            host, TCP otherwise), ``TCPConnector`` (always TCP) or ``SharedMemoryConnector`` (always
            ``/dev/shm``; both ends on one host).
        kv_role: ``kv_producer`` (prefill worker: leases its finished prompts' blocks),
            ``kv_consumer`` (decode worker: pulls them) or ``kv_both``.
        kv_ip: address the producer's transfer server binds and advertises (consumers connect to it).
        kv_port: its port (0: any free port, advertised in each lease).
        kv_connector_extra_config: ``lease_ttl_s`` (seconds a lease waits for its consumer, default
            30) and ``transfer_timeout_s`` (longest time one whole pull may take, connect to confirm, default
            30; a failed or late pull falls back to computing the prompt locally); ``secret_file`` (a file
            holding the cluster secret, mode 0600; default: ``TOKENMILL_CLUSTER_SECRET`` or the per-user
            default file, ``tokenmill.security``): signed ``kv_transfer_params`` and every producer/consumer
            frame are checked with it; ``allowed_producers`` (hosts or CIDRs a consumer may pull from;
            default: any); ``allowed_consumers`` (CIDRs, or single addresses, a connection to the producer may
            come from; default: any; others are closed on accept); ``max_connections`` (authenticated pulls the
            producer serves at once, default 16; one more is answered "busy"; connections not yet authenticated
            wait in a separate pool of the same size, the oldest closed to admit a new one); ``max_leases`` (leases held at once, default 64) and ``max_lease_blocks`` (KV
            blocks they may pin, default half the pool): a finished prefill over either cap is not leased.

    Raises:
        ConfigError: an unknown connector or role, a bad port or extra key.
    """

    kv_connector: str | None = None
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        name = "kv_transfer_config"
        if self.kv_connector is not None and self.kv_connector not in KV_CONNECTORS:
            raise ConfigError(f"`{name}` kv_connector must be one of {', '.join(KV_CONNECTORS)}, got "
                              f"{self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"`{name}` kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ConfigError(f"`{name}` kv_ip must be a host address, got {self.kv_ip!r}")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, numbers.Integral) \
                or not 0 <= self.kv_port <= 65535:
            raise ConfigError(f"`{name}` kv_port must be an integer in [0, 65535], got {self.kv_port!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict) or set(extra) - set(EXTRA_KEYS):
            raise ConfigError(f"`{name}` kv_connector_extra_config takes only {list(EXTRA_KEYS)}, got {extra!r}")
        for key in _SECONDS_KEYS:
            value = extra.get(key, 30.0)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise ConfigError(f"`{name}` kv_connector_extra_config.{key} must be a number > 0, got {value!r}")
        for key in _COUNT_KEYS:
            value = extra.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not value > 0:
                raise ConfigError(f"`{name}` kv_connector_extra_config.{key} must be an integer > 0, got {value!r}")
        secret_file = extra.get("secret_file")
        if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
            raise ConfigError(f"`{name}` kv_connector_extra_config.secret_file must be a file path, got "
                              f"{secret_file!r}")
        _check_address_list(name, "allowed_producers", extra.get("allowed_producers"), hosts=True)
        _check_address_list(name, "allowed_consumers", extra.get("allowed_consumers"), hosts=False)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def lease_ttl_s(self) -> float:
        return float(self.kv_connector_extra_config.get("lease_ttl_s", 30.0))

    @property
    def transfer_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("transfer_timeout_s", 30.0))

    @property
    def secret_file(self) -> str | None:
        """The cluster secret's file (None: ``tokenmill.security.load_cluster_secret``'s default sources)."""
        return self.kv_connector_extra_config.get("secret_file")

    @property
    def allowed_producers(self) -> tuple[str, ...] | None:
        """Hosts or CIDRs a consumer may pull from (None: any)."""
        allowed = self.kv_connector_extra_config.get("allowed_producers")
        return None if allowed is None else tuple(allowed)

    @property
    def allowed_consumers(self) -> tuple[str, ...] | None:
        """CIDRs a connection to the producer may come from (None: any)."""
        allowed = self.kv_connector_extra_config.get("allowed_consumers")
        return None if allowed is None else tuple(allowed)

    @property
    def max_connections(self) -> int:
        return int(self.kv_connector_extra_config.get("max_connections", DEFAULT_MAX_CONNECTIONS))

    @property
    def max_leases(self) -> int:
        return int(self.kv_connector_extra_config.get("max_leases", DEFAULT_MAX_LEASES))

    @property
    def max_lease_blocks(self) -> int | None:
        """Blocks leases may pin at once (None: half the KV pool)."""
        value = self.kv_connector_extra_config.get("max_lease_blocks")
        return None if value is None else int(value)

    @property
    def transport(self) -> str:
        """``auto``, ``tcp`` or ``shm``."""
        return {"TCPConnector": "tcp", "SharedMemoryConnector": "shm"}.get(self.kv_connector or "", "auto")


def kv_transfer_config(value) -> KVTransferConfig | None:
    """A ``KVTransferConfig`` from an instance, a dict or its JSON text; None stays None (off).

    Raises:
        ConfigError naming ``kv_transfer_config``.
    """
    if value is None:
        return None
    return config_from_value(KVTransferConfig, value, "kv_transfer_config", '{"kv_role": "kv_producer"}')
