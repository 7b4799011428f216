"""Who may steer KV transfer over HTTP: ``kv_transfer_params`` count only when signed with the cluster secret.

A client of a worker's OpenAI API could otherwise point the worker at a producer of its own (the worker would
pull and index forged K/V, and connect wherever it is told) or pin the producer's blocks with leases nobody
pulls. The PD router signs what it sends (``tokenmill.security.sign_params`` with a fresh ``nonce``); a worker
takes parameters whose MAC and age check out and that it has not seen before (a replay within the age window
is refused). Torch-free; the offline ``LLM`` API is in-process and passes plain parameters.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from tokenmill.security import AuthError, verify_params

PARAMS_MAX_AGE_S = 120.0  # a signature older (or newer, clock skew) than this is stale
MAX_REMEMBERED = 200_000  # signatures remembered against replay (oldest forgotten first)
RELEASE_PURPOSE = "kv_lease_release"  # the MAC label of the PD router's early release of a lease
RELEASE_PATH = "/kv_transfer/release"  # the prefill worker's route for it (tokenmill/server/kv_transfer_params.py)


class SignedParamsVerifier:
    """Checks signed ``kv_transfer_params`` and refuses replays.

    Args:
        secret: the cluster secret.
        max_age_s: how far a signature's time may be from now, in seconds.
    """

    def __init__(self, secret: bytes, max_age_s: float = PARAMS_MAX_AGE_S) -> None:
        self._secret = secret
        self.max_age_s = max_age_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # mac -> monotonic time it was taken
        self._lock = threading.Lock()

    def verify(self, params: dict, purpose: str = "kv_transfer_params") -> dict:
        """The parameters without their ``auth`` field; ``purpose``: the label they were signed for
        (``kv_transfer_params``, or ``kv_lease_release`` for the router's early release of a lease).

        Raises:
            AuthError: unsigned, a wrong MAC, stale, or already used.
        """
        plain = verify_params(self._secret, params, purpose, max_age_s=self.max_age_s)
        mac = params["auth"]["mac"]
        now = time.monotonic()
        with self._lock:
            while self._seen and (len(self._seen) >= MAX_REMEMBERED
                                  or now - next(iter(self._seen.values())) > 2 * self.max_age_s):
                self._seen.popitem(last=False)
            if mac in self._seen:
                raise AuthError("kv_transfer_params were already used (a replay)")
            self._seen[mac] = now
        return plain
