"""Which addresses reach only this machine. Standard library only (config, router and HTTP guards share it)."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether a host or bind address (``127.0.0.1``, ``::1``, ``[::1]``, ``localhost``) reaches only this machine;
    ``*``, ``0.0.0.0``, interface names and other addresses do not."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
