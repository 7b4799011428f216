"""llama.cpp's native ``llama-server`` as a ``bench compare`` peer: finding the binary, sizing and starting it.

The binary is either given (``--peer llama-server=PATH``) or the one ``scripts/build_llama_server.sh``
built for this CPU from the llama.cpp source vendored in the pinned llama-cpp-python sdist, cached
under ``$TOKENMILL_CACHE_DIR/llama.cpp/<version>-<cpu key>/bin/llama-server``. A missing binary or a
model that is not a GGUF file is a skip reason, never an error: the comparison runs without it and
says why. Owns the process (started on a free port, polled on ``/health``, SIGTERM then SIGKILL);
the requests go through the ``bench serve`` client (``server_compare``).
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenmill import envs

# The llama-cpp-python release whose vendored llama.cpp scripts/build_llama_server.sh builds.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BUILD_SCRIPT = "scripts/build_llama_server.sh"
# Peers that run as their own HTTP server (``--peer NAME[=PATH]``).
SERVER_PEERS = ("llama-server",)
# llama.cpp pads each slot's context to a multiple of this many tokens (llama-context.cpp).
CONTEXT_PAD = 256


def cpu_key() -> str:
    """12 hex digits naming this CPU's instruction sets: sha256 over the machine type and the sorted
    /proc/cpuinfo feature flags. A build made with ``GGML_NATIVE`` (``-march=native``) runs only where
    the key is the same."""
    from tokenmill.csrc_build import cpu_flags

    text = platform.machine() + ":" + " ".join(sorted(cpu_flags()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_binary_path(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where ``scripts/build_llama_server.sh`` puts llama-server for this CPU:
    ``$TOKENMILL_CACHE_DIR/llama.cpp/<version>-<cpu key>/bin/llama-server`` (default root ``~/.cache/tokenmill``)."""
    return envs.cache_dir() / "llama.cpp" / f"{version}-{cpu_key()}" / "bin" / "llama-server"


@dataclass(frozen=True)
class ServerPeer:
    """One ``--peer``: its name and the binary asked for (None: the cached build, ``default_binary_path``)."""

    name: str
    path: Path | None = None

    @property
    def binary(self) -> Path:
        """The binary to run: the given path, else this CPU's cached build."""
        return self.path if self.path is not None else default_binary_path()


def parse_peer(text: str) -> ServerPeer:
    """A ``--peer`` value: ``llama-server`` (the cached build) or ``llama-server=PATH``.

    Raises:
        ValueError: naming ``peer``, for an unknown peer name or an empty path.
    """
    name, sep, path = text.partition("=")
    name = name.strip()
    if name not in SERVER_PEERS:
        raise ValueError(f"peer: unknown server peer {name!r} (known: {', '.join(SERVER_PEERS)}; in-process "
                         "peers go in --peers)")
    if sep and not path.strip():
        raise ValueError(f"peer: {text!r} names no path; give {name}=PATH or just {name}")
    return ServerPeer(name, Path(path.strip()).expanduser() if sep else None)


def skip_reason(peer: ServerPeer, model_path: Path) -> str | None:
    """Why ``peer`` cannot run on ``model_path`` here (no binary, not executable, not a GGUF), or None."""
    binary = peer.binary
    if not binary.is_file():
        if peer.path is None:
            return f"no llama-server built for this CPU at {binary}; build it with `bash {BUILD_SCRIPT}`"
        return f"no llama-server binary at {binary}"
    if not os.access(binary, os.X_OK):
        return f"{binary} is not executable"
    if model_path.suffix != ".gguf":
        return f"llama-server needs a .gguf model file, got {model_path}"
    return None


def slot_context(max_request_tokens: int) -> int:
    """Tokens of context per llama-server slot for requests of at most ``max_request_tokens`` tokens
    (prompt + output), rounded up to llama.cpp's padding of ``CONTEXT_PAD``.

    Raises:
        ValueError: ``max_request_tokens`` < 1.
    """
    if max_request_tokens < 1:
        raise ValueError(f"max_request_tokens must be >= 1, got {max_request_tokens}")
    return -(-max_request_tokens // CONTEXT_PAD) * CONTEXT_PAD


def llama_server_command(binary: Path, model_path: Path, threads: int, parallel: int, slot_tokens: int, port: int,
                         extra_args: tuple[str, ...] = ()) -> list[str]:
    """The llama-server command line: the model, ``threads`` for decode and prompt batches, ``parallel``
    slots (``-np``) of ``slot_tokens`` each (``-c`` is the total, split evenly between the slots:
    llama.cpp's non-unified KV cache, so one long request cannot take another's room), continuous
    batching (its default), on 127.0.0.1:``port``; ``extra_args`` go last (they win).

    Raises:
        ValueError: naming the field, for threads, parallel or slot_tokens below 1.
    """
    for name, value in (("threads", threads), ("parallel", parallel), ("slot_tokens", slot_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return [str(binary), "-m", str(model_path), "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
            "-c", str(parallel * slot_tokens), "--host", "127.0.0.1", "--port", str(port), *extra_args]


REPACK_FLAGS = ("--repack", "-nr", "--no-repack")


BUILD_INFO = "build-info.txt"  # written by scripts/build_llama_server.sh beside the binary's bin/


def built_without_amx(binary: Path | None) -> bool:
    """Whether ``binary`` was built by ``scripts/build_llama_server.sh`` with no AMX code (its
    ``build-info.txt`` says ``amx=off``): such a binary repacks safely on an AMX CPU."""
    if binary is None:
        return False
    try:
        lines = (Path(binary).resolve().parent.parent / BUILD_INFO).read_text().split()
    except OSError:
        return False
    return "amx=off" in lines


def peer_args_for_this_cpu(peer_args: tuple[str, ...], cpu_flags: set[str] | frozenset[str],
                           binary: Path | None = None) -> tuple[str, ...]:
    """``peer_args`` plus ``--no-repack`` on a CPU with AMX (``amx_tile`` in ``cpu_flags``), unless they already
    say how to repack or ``binary`` is known to have no AMX code (``built_without_amx``).

    A GGML_NATIVE llama-server sends Q4_1/Q4_0/Q8_0 products to ggml's AMX path on such CPUs, which
    crashed on this project's Intel Xeon VMs (SIGSEGV in ``ggml_backend_amx_mul_mat`` during the warm-up
    run, llama.cpp 0.5.0-dev 0c1e570); without repacking it runs its AVX-512 kernels. That is only partly a
    cure: a process under load still crashed there once, so ``scripts/build_llama_server.sh`` also builds
    without AMX code on such CPUs and marks them so; this flag covers binaries built elsewhere. It is not
    added for the script's builds: without repacking llama.cpp's Q4_1 decode ran 30% slower here (22.0
    against 31.6 tok/s at batch 1), so the comparison would not be against its best. The comparison's
    note shows the flag.
    """
    if built_without_amx(binary):
        return tuple(peer_args)
    if "amx_tile" in cpu_flags and not any(a.split("=", 1)[0] in REPACK_FLAGS for a in peer_args):
        return (*peer_args, "--no-repack")
    return tuple(peer_args)


def binary_version(binary: Path) -> str:
    """The first line ``llama-server --version`` prints (``version: N (commit)``), or "" when it prints none."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip().startswith("version")]
    return lines[0] if lines else ""


class LlamaServerProcess:
    """A running llama-server: started by ``start``, stopped by ``stop`` (also as a context manager).

    Its output goes to a log file in a temporary directory; ``log_tail`` reads the end of it for errors.
    """

    def __init__(self, command: list[str], port: int) -> None:
        self.command = command
        self.url = f"http://127.0.0.1:{port}"
        self._dir = tempfile.TemporaryDirectory(prefix="llama-server-")
        self.log_path = Path(self._dir.name) / "llama-server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> LlamaServerProcess:
        """Start the process and wait until ``/health`` answers 200 (the model is loaded); returns self.

        Raises:
            RuntimeError: the process exited first, or was not healthy within ``timeout_s`` (it is
                stopped then); the message carries the end of its log.
        """
        from tokenmill.procs import die_with_parent, wait_healthy

        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent)

        def alive() -> str | None:
            if self.proc.poll() is not None:
                return f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}"
            return None

        try:
            wait_healthy([self.url], alive, timeout_s=timeout_s, name=None)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"llama-server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}") from None
        return self

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the process's output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the process and remove its log directory."""
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LlamaServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
