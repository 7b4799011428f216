"""``kv_transfer_params`` at the HTTP API: taken only when signed with the cluster secret (the PD router signs
them; a client cannot steer this worker's KV transfer), and the router's signed early release of a lease
(``POST /kv_transfer/release``). See ``tokenmill/kv_transfer/params_auth.py``."""
from __future__ import annotations

from fastapi import APIRouter, Request

from tokenmill.kv_transfer.params_auth import RELEASE_PATH
from tokenmill.security import AuthError
from tokenmill.server.errors import APIError


def accept_kv_transfer_params(state, params: dict | None) -> dict | None:
    """A request's ``kv_transfer_params`` without their signature (None stays None).

    Raises:
        APIError: 400 when this server has no ``--kv-transfer-config``; 403 when the parameters are not signed
            with the cluster secret, stale or replayed (nothing is connected to, no lease is taken).
    """
    if params is None:
        return None
    connector = state.llm().engine.kv_connector
    if connector is None:
        raise APIError("kv_transfer_params needs a server started with --kv-transfer-config",
                       param="kv_transfer_params")
    try:
        return connector.verify_params(params)
    except AuthError as exc:
        raise APIError(f"kv_transfer_params are refused: {exc} (only the PD router, holding the cluster secret, "
                       f"may send them)", 403, "permission_error", param="kv_transfer_params") from None


def kv_transfer_router(state) -> APIRouter:
    """``POST /kv_transfer/release``: the PD router frees a prefill worker's lease that no decode worker will
    pull (its decode step failed, or its client left), instead of letting it pin blocks for ``lease_ttl_s``.

    Body: ``{"lease_id": str, "nonce": str, "auth": {...}}`` signed with the cluster secret for the purpose
    ``kv_lease_release`` (``tokenmill.security.sign_params``); each signature is taken once. Answers
    ``{"released": bool}`` (False: unknown, already pulled or being sent); 403 naming ``auth`` when the
    signature does not check out, 400 when this server has no ``--kv-transfer-config``. Like every route it
    also needs the server's ``--api-key`` when one is set.
    """
    router = APIRouter()

    @router.post(RELEASE_PATH)
    async def release_lease(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as exc:
            raise APIError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object")
        connector = state.llm().engine.kv_connector
        if connector is None:
            raise APIError(f"{RELEASE_PATH} needs a server started with --kv-transfer-config", param="lease_id")
        try:
            return {"released": connector.release_lease(body)}
        except AuthError as exc:
            raise APIError(f"release refused: {exc} (only the PD router, holding the cluster secret, may release "
                           f"a lease)", 403, "permission_error", param="auth") from None

    return router
