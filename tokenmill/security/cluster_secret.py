"""The cluster secret: the key every party of one deployment holds (router, prefill and decode workers,
KV event consumers) and nobody else.

Where it comes from, first match wins: an explicit value, an explicit file, the environment variable
``TOKENMILL_CLUSTER_SECRET``, then a per-user default file (``$XDG_CONFIG_HOME/tokenmill/cluster.key``,
else ``~/.config/tokenmill/cluster.key``) created on first use with 32 random bytes and mode 0600. The
default lets processes of one user on one host work together with no setup; across hosts, copy one file
to every node (or set the variable) — docs/security.md.
"""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from tokenmill import envs

SECRET_ENV = envs.CLUSTER_SECRET
MIN_SECRET_BYTES = 16


class SecretError(ValueError):
    """A secret that cannot be used: a file readable by other users, too short, unreadable."""


def default_secret_path() -> Path:
    """``$XDG_CONFIG_HOME/tokenmill/cluster.key`` (``~/.config`` when the variable is unset)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tokenmill" / "cluster.key"


def read_secret_file(path: str | os.PathLike) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped).

    Raises:
        SecretError: the file is missing, readable or writable by group/others, or holds under 16 bytes.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise SecretError(f"cannot read the secret file {path}: {e.strerror}") from e
    try:
        mode = os.fstat(fd).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"the secret file {path} is open to other users (mode {stat.S_IMODE(mode):o}); "
                              f"run: chmod 600 {path}")
        data = os.read(fd, 1 << 16).strip()
    finally:
        os.close(fd)
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(f"the secret in {path} is shorter than {MIN_SECRET_BYTES} bytes")
    return data


def _create_default(path: Path) -> bytes:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = secrets.token_hex(32).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic and never overwrites: two processes racing agree on the first file
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return read_secret_file(path)


def load_cluster_secret(value: str | bytes | None = None, file: str | os.PathLike | None = None,
                        create_default: bool = True) -> bytes:
    """The cluster secret as bytes (see the module docstring for the order of sources).

    Args:
        value: the secret itself (a flag or config value); at least 16 bytes.
        file: a file holding it (mode 0600 or stricter).
        create_default: make the per-user default file when no other source gives one.

    Raises:
        SecretError: a source that is given but unusable, or none at all with ``create_default`` off.
    """
    if value is not None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        if len(data.strip()) < MIN_SECRET_BYTES:
            raise SecretError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        return data.strip()
    if file is not None:
        return read_secret_file(file)
    env = envs.cluster_secret()
    if env:
        return load_cluster_secret(value=env)
    path = default_secret_path()
    if path.exists():
        return read_secret_file(path)
    if not create_default:
        raise SecretError(f"no cluster secret: set {SECRET_ENV}, pass a secret file, or create {path}")
    return _create_default(path)
