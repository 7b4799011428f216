"""Who may read the KV event sockets: CURVE certificates (encryption plus an allow-list of subscriber
keys, checked by a ZAP authenticator) for sockets reachable across hosts, and 0600 socket files in a
0700 directory for ``ipc://`` endpoints. Shared by the engine's publisher and the router's subscriber.

Certificates are the files ``zmq.auth.create_certificates(dir, name)`` writes: ``name.key`` (public)
and ``name.key_secret`` (public and secret; keep it 0600). Never imports torch.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth


class TransportKeyError(ValueError):
    """A CURVE certificate that cannot be used (missing, malformed, open to other users), or a
    libzmq built without CURVE."""


def require_curve(what: str) -> None:
    """Raises TransportKeyError when this libzmq has no CURVE support (``what`` names the setting)."""
    if not zmq.has("curve"):
        raise TransportKeyError(f"{what}: this libzmq ({zmq.zmq_version()}) is built without CURVE; "
                                "use an ipc:// endpoint on one host")


def load_secret_certificate(path: str | os.PathLike, what: str) -> tuple[bytes, bytes]:
    """(public key, secret key), Z85, from a secret certificate file.

    Raises:
        TransportKeyError: CURVE unavailable, the file missing, open to group/others, or without a secret key.
    """
    require_curve(what)
    try:
        mode = os.stat(path).st_mode
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise TransportKeyError(f"{what}: cannot read the CURVE certificate {path}: {exc}") from None
    if not secret:
        raise TransportKeyError(f"{what}: {path} holds no secret key (pass the .key_secret file)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TransportKeyError(f"{what}: the CURVE secret certificate {path} is open to other users "
                                f"(mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}")
    return public, secret


def load_public_key(path: str | os.PathLike, what: str) -> bytes:
    """The public key (Z85) of a certificate file (public or secret).

    Raises:
        TransportKeyError: CURVE unavailable, the file missing or without a public key.
    """
    require_curve(what)
    try:
        return zmq.auth.load_certificate(path)[0]
    except (OSError, ValueError) as exc:
        raise TransportKeyError(f"{what}: cannot read the CURVE certificate {path}: {exc}") from None


@dataclass(frozen=True)
class ClientKeys:
    """A subscriber's CURVE identity: its key pair and the publisher's public key (all Z85)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes

    @classmethod
    def from_files(cls, secret_certificate: str | os.PathLike, server_certificate: str | os.PathLike,
                   what: str = "KV events") -> "ClientKeys":
        """From the subscriber's secret certificate and the publisher's (public) certificate.

        Raises:
            TransportKeyError: as ``load_secret_certificate`` / ``load_public_key``.
        """
        public, secret = load_secret_certificate(secret_certificate, what)
        return cls(public, secret, load_public_key(server_certificate, what))

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the publisher (before ``connect``)."""
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.curve_serverkey = self.server_key


def apply_server_keys(sock: zmq.Socket, public: bytes, secret: bytes) -> None:
    """Make ``sock`` a CURVE server (before ``bind``): every peer must complete the handshake and pass
    the context's ZAP authenticator."""
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def check_client_keys_dir(path: str | os.PathLike, what: str) -> None:
    """Raises TransportKeyError unless ``path`` is a directory holding at least one public certificate."""
    directory = Path(path)
    if not directory.is_dir() or not any(directory.glob("*.key")):
        raise TransportKeyError(f"{what}: {path} is not a directory of subscribers' public certificates (*.key)")


def prepare_ipc(endpoint: str) -> None:
    """Before binding ``ipc://PATH``: create PATH's directory with mode 0700 if it is missing, so nobody
    else can reach the socket file between bind and ``restrict_ipc``."""
    if not endpoint.startswith("ipc://") or endpoint == "ipc://*":
        return
    Path(endpoint[len("ipc://"):]).parent.mkdir(mode=0o700, parents=True, exist_ok=True)


def restrict_ipc(bound_endpoint: str) -> None:
    """After binding: the socket file of an ``ipc://`` endpoint becomes 0600 (connecting needs write access)."""
    if bound_endpoint.startswith("ipc://") and not bound_endpoint.startswith("ipc://@"):  # @: abstract namespace
        os.chmod(bound_endpoint[len("ipc://"):], 0o600)
