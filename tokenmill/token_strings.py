"""TokenStrings: how one token is shown on its own in log-probabilities (its text, or a ``bytes:`` marker).

A token whose bytes are valid UTF-8 alone is shown as its decoded text. A token that is only part
of a character (byte-level BPE pieces of an emoji, SentencePiece ``<0xF0>`` byte-fallback tokens)
decodes to U+FFFD alone, so distinct tokens would look alike; such a token is shown as
``bytes:`` followed by its bytes written ``\\xNN`` (``"bytes:\\xf0\\x9f\\x98"``), the form OpenAI's
API uses. ``raw_bytes`` gives the token's bytes either way. Pure CPU; never imports torch.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
BYTES_PREFIX = "bytes:"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenString:
    """One token as a response shows it.

    Args:
        text: the decoded text, or the ``bytes:\\xNN...`` marker when the bytes are not UTF-8 alone.
        raw_bytes: the token's bytes (None only for a decoder whose bytes cannot be recovered).
        is_partial: True when ``text`` is a ``bytes:`` marker.
    """

    text: str
    raw_bytes: bytes | None
    is_partial: bool


def _gpt2_byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet: printable stand-in character -> byte (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_types(decoder: dict | None) -> set[str]:
    """Every decoder type in a tokenizer.json ``decoder`` entry (Sequence members included)."""
    if not decoder:
        return set()
    types = {decoder.get("type", "")}
    for member in decoder.get("decoders") or ():
        types |= _decoder_types(member)
    return types


class TokenStrings:
    """Token id -> :class:`TokenString`, computed once per id and remembered.

    Args:
        tokenizer: a transformers tokenizer or a ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._cache: dict[int, TokenString] = {}
        self._byte_level: dict[str, int] | None = None
        self._byte_fallback = False
        self._added: set[int] | None = None  # read from the tokenizer's config on first need

    def _read_config(self) -> None:
        config = json.loads(self._backend.to_str())
        types = _decoder_types(config.get("decoder"))
        self._byte_level = _gpt2_byte_decoder() if "ByteLevel" in types else None
        self._byte_fallback = "ByteFallback" in types
        self._added = {int(t["id"]) for t in config.get("added_tokens") or ()}

    def __call__(self, token_id: int) -> TokenString:
        """The token's string and bytes."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def text(self, token_id: int) -> str:
        """The string a response shows for this token (text or ``bytes:`` marker)."""
        return self(token_id).text

    def _compute(self, token_id: int) -> TokenString:
        text = self._backend.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT_CHAR not in text:
            return TokenString(text, text.encode("utf-8"), False)
        raw = self._raw_bytes(token_id)
        if raw is None:  # cannot tell a real U+FFFD from a partial character: keep the text
            return TokenString(text, None, False)
        try:
            return TokenString(raw.decode("utf-8"), raw, False)  # a token that really holds U+FFFD
        except UnicodeDecodeError:
            return TokenString(BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw), raw, True)

    def _raw_bytes(self, token_id: int) -> bytes | None:
        if self._added is None:
            self._read_config()
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return None
        if token_id in self._added:  # added tokens are stored as plain text
            return piece.encode("utf-8")
        if self._byte_fallback:
            match = _BYTE_FALLBACK.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        if self._byte_level is not None:
            try:
                return bytes(self._byte_level[c] for c in piece)
            except KeyError:
                return None
        return None
