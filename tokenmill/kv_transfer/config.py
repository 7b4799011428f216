"""``--kv-transfer-config``: vLLM's field names for prefill/decode disaggregation (docs/pd_disaggregation.md)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from tokenmill.config import ConfigError, _config_from_value

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("TokenmillConnector", "TCPConnector", "SharedMemoryConnector")
EXTRA_KEYS = ("lease_ttl_s", "transfer_timeout_s")


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
            30) and ``transfer_timeout_s`` (longest wait for one pull, default 30); a failed or late
            pull falls back to computing the prompt locally.

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
        for key in EXTRA_KEYS:
            value = extra.get(key, 30.0)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise ConfigError(f"`{name}` kv_connector_extra_config.{key} must be a number > 0, got {value!r}")

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
    return _config_from_value(KVTransferConfig, value, "kv_transfer_config", '{"kv_role": "kv_producer"}')
