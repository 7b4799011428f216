"""Server-sent events from a worker's stream: reading them off an upstream response, the events that carry
tokens, and writing events and errors back in the same framing."""
from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp


@dataclass
class SSEEvent:
    """One event of a stream: its bytes as received, and its ``data`` parsed (``obj``) when JSON."""

    raw: bytes
    done: bool = False  # data: [DONE]
    obj: dict | None = None

    def carries_token(self) -> bool:
        """Whether the client learns of generated output from it: text, token ids, a finish reason, an
        error, usage or the end. A chat stream's role chunk (empty content, no token ids) does not."""
        if self.done or self.obj is None:
            return self.done
        if "error" in self.obj or self.obj.get("usage"):
            return True
        for choice in choices_of(self.obj):
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if (choice.get("text") or choice.get("token_ids") or choice.get("finish_reason") is not None
                    or delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")):
                return True
        return False


class SSEReader:
    """Splits a worker's raw bytes into events (blank-line separated); ``next`` is None at the end."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.content = response.content
        self.buffer = b""
        self.ended = False

    async def next(self) -> SSEEvent | None:
        """The next event, None at the end of the stream; raises ``UPSTREAM_ERRORS`` if it broke."""
        while b"\n\n" not in self.buffer:
            if self.ended:
                return None
            chunk = await self.content.readany()
            if not chunk:
                self.ended = True
                return None  # a trailing partial event is the mark of a broken stream: dropped
            self.buffer = (self.buffer + chunk).replace(b"\r\n", b"\n")
        raw, self.buffer = self.buffer.split(b"\n\n", 1)
        data = [line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:")]
        event = SSEEvent(raw + b"\n\n")
        if data:
            text = b"\n".join(data)
            if text.strip() == b"[DONE]":
                event.done = True
            else:
                try:
                    obj = json.loads(text)
                except ValueError:
                    obj = None
                event.obj = obj if isinstance(obj, dict) else None
        return event


def choices_of(obj: dict) -> list[dict]:
    """The well-formed choices of a chunk (a foreign worker's odd ones are passed on, not read)."""
    choices = obj.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def is_empty_choice(choice: dict) -> bool:
    """A stream choice that tells the client nothing (no text, delta, logprobs or finish reason)."""
    return (not choice.get("text") and not choice.get("delta") and choice.get("logprobs") is None
            and choice.get("finish_reason") is None)


def encode_event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def sse_error(message: str) -> bytes:
    error = {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": 503}}
    return f"data: {json.dumps(error)}\n\n".encode()
