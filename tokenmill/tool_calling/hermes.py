"""Hermes-format tool calls in model output (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``).

:func:`extract_tool_calls` parses a finished output and is the reference; :class:`HermesStreamParser`
reads the same output in pieces and yields OpenAI chat ``delta`` dicts. Pure Python; no server imports.

What a block is (both): ``<tool_call>``, JSON whitespace, one JSON object, JSON whitespace, then
``</tool_call>`` -- or the end of the text (possibly inside ``</tool_call>``) for the last block. The
object needs a non-empty string ``name``; ``arguments`` (or its synonym ``parameters``) must be an
object and defaults to ``{}``. When a key repeats, its first occurrence counts. Any other block is
malformed: its ``<tool_call>`` tag stays as content and reading goes on right after it.
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
_JSON_WS = " \t\n\r"
_DECODER = json.JSONDecoder()

IdFactory = Callable[[int], str]
"""Makes the id of the tool call with the given index (0, 1, ... within one output)."""


def new_tool_call_id(index: int = 0) -> str:
    """A fresh random OpenAI-style tool call id, ``call_`` and 24 hex digits (``index`` is unused)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``arguments`` is the arguments object's text exactly as the model wrote it."""

    id: str
    name: str
    arguments: str
    type: str = "function"

    def to_openai(self) -> dict:
        """The call as an OpenAI ``message.tool_calls`` item."""
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ExtractedToolCalls:
    """An output split into ``content`` (the text outside the calls, stripped; None if empty) and calls."""

    content: str | None
    tool_calls: list[ToolCall]


def extract_tool_calls(text: str, id_factory: IdFactory | None = None) -> ExtractedToolCalls:
    """Splits a finished model output into content and Hermes tool calls (never raises on bad text).

    ``content`` is the concatenation of the text outside the calls, stripped of surrounding
    whitespace; a malformed block stays in it. ``id_factory`` (default: random ids) names call ``i``.
    """
    make_id = id_factory or new_tool_call_id
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (at := text.find(TOOL_CALL_START, pos)) >= 0:
        pieces.append(text[pos:at])
        parsed = _parse_block(text, at + len(TOOL_CALL_START))
        if parsed is None:
            pieces.append(TOOL_CALL_START)
            pos = at + len(TOOL_CALL_START)
            continue
        name, arguments, pos = parsed
        calls.append(ToolCall(id=make_id(len(calls)), name=name, arguments=arguments))
    pieces.append(text[pos:])
    return ExtractedToolCalls("".join(pieces).strip() or None, calls)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_WS:
        i += 1
    return i


def _decode(text: str, i: int) -> tuple[object, int] | None:
    try:
        return _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        return None


def _parse_block(text: str, i: int) -> tuple[str, str, int] | None:
    """(name, raw arguments, end of block) for the block whose body starts at ``i``; None if malformed."""
    i = _skip_ws(text, i)
    if not text.startswith("{", i):
        return None
    name: str | None = None
    arguments: str | None = None
    i = _skip_ws(text, i + 1)
    closed = text.startswith("}", i)
    i += closed
    while not closed:
        key = _decode(text, i) if text.startswith('"', i) else None
        if key is None:
            return None
        i = _skip_ws(text, key[1])
        if not text.startswith(":", i):
            return None
        start = _skip_ws(text, i + 1)
        value = _decode(text, start)
        if value is None:
            return None
        if key[0] == "name" and name is None:
            if not isinstance(value[0], str) or not value[0]:
                return None
            name = value[0]
        elif key[0] in ARGUMENT_KEYS and arguments is None:
            if not isinstance(value[0], dict):
                return None
            arguments = text[start:value[1]]
        i = _skip_ws(text, value[1])
        if not text.startswith((",", "}"), i):
            return None
        closed = text[i] == "}"
        i = _skip_ws(text, i + 1) if not closed else i + 1
    if name is None:
        return None
    i = _skip_ws(text, i)
    if text.startswith(TOOL_CALL_END, i):
        return name, arguments or "{}", i + len(TOOL_CALL_END)
    if TOOL_CALL_END.startswith(text[i:]):  # the output ended inside or before the closing tag
        return name, arguments or "{}", len(text)
    return None


_SCALAR = re.compile(r"[A-Za-z0-9+\-.]*")
_STRING_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'["{}\[\]]')
_EXPECTED = {"open": "{", "first_key": '"', "key": '"', "colon": ":", "after_value": ","}  # in a block
_NEXT_PHASE = {"open": "first_key", "colon": "value", "after_value": "key"}


class _ValueScan:
    """Finds where one JSON value that starts at ``start`` ends, in text that grows between calls
    (tracks strings and nesting only; the caller validates the finished value with ``json.loads``)."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.depth = 0
        self.in_string = False

    def advance(self, text: str, final: bool) -> int | None:
        """The end of the value, or None while it may still go on (``final``: no more text comes)."""
        if text[self.start] not in '{["':  # a number, true, false, null: ends at the first other char
            self.pos = _SCALAR.match(text, self.pos).end()
            return self.pos if self.pos < len(text) or final else None
        while m := (_STRING_STOP if self.in_string else _CONTAINER_STOP).search(text, self.pos):
            char, at = m.group(), m.start()
            if char == "\\":
                if at + 1 == len(text):
                    self.pos = at
                    return None
                self.pos = at + 2
                continue
            self.pos = at + 1
            if char == '"':
                self.in_string = not self.in_string
                if not self.in_string and self.depth == 0:
                    return self.pos
            else:
                self.depth += 1 if char in "{[" else -1
                if self.depth == 0:
                    return self.pos
        self.pos = len(text)
        return None


@dataclass
class _Block:
    """Reading state of the ``<tool_call>`` block that starts at ``start`` (absolute text index)."""

    start: int
    phase: str = "open"  # open, first_key, key, key_scan, colon, value, value_scan, after_value, after_object, skip
    scan: _ValueScan | None = None
    key: str | None = None
    role: str | None = None  # of the value being scanned: "name", "arguments" or None (ignored)
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_sent: int = 0  # text index up to which the arguments went out
    call: int | None = None  # index of the announced call


class HermesStreamParser:
    """Turns model output that arrives in pieces into OpenAI chat-completion ``delta`` dicts.

    ``feed(delta_text)`` and a final ``finish()`` return the deltas to send: ``{"content": ...}`` for
    text outside calls, and per call ``{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments": ""}}]}`` once its name is complete, then ``{"tool_calls": [{"index", "function":
    {"arguments": fragment}}]}`` as the raw arguments text arrives. Text that may still be part of a
    tag or of leading/trailing whitespace is held back.

    For every output whose blocks are well formed, or malformed before their name is complete,
    the streamed content joins to ``extract_tool_calls(text).content`` ("" for None) -- exactly, the
    same stripping included -- and the calls (count, names, ``"".join`` of each call's fragments)
    equal its ``tool_calls``. A call cannot be taken back once announced: when its block turns
    out malformed later (bad JSON after the name, output cut off mid-arguments), the call keeps
    the arguments sent so far and the rest of the block, up to ``</tool_call>``, is dropped, while
    ``extract_tool_calls`` would keep the whole block as content.

    Args:
        id_factory: makes the id of call ``i`` (default: random ids); pass the one given to
            ``extract_tool_calls`` to get the same ids in both.
    """

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        self._make_id = id_factory or new_tool_call_id
        self._text = ""
        self._pos = 0  # the text before it has been dealt with
        self._final = False
        self._block: _Block | None = None
        self._calls: list[ToolCall] = []
        self._content_started = False
        self._pending_ws = ""  # whitespace sent only if more content follows
        self._out: list[dict] = []

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls announced so far, with the arguments text sent so far."""
        return list(self._calls)

    @property
    def has_tool_calls(self) -> bool:
        """Whether at least one call has been announced."""
        return bool(self._calls)

    def feed(self, delta_text: str) -> list[dict]:
        """Takes the next piece of output; returns the deltas it releases (maybe none)."""
        assert not self._final, "feed() after finish()"
        self._text += delta_text
        return self._run()

    def finish(self) -> list[dict]:
        """Ends the output: releases held-back content and settles an unterminated block."""
        self._final = True
        return self._run()

    def _run(self) -> list[dict]:
        while self._step():
            pass
        if self._block is None and self._pos:  # drop text already dealt with
            self._text, self._pos = self._text[self._pos:], 0
        out, self._out = self._out, []
        return out

    def _step(self) -> bool:
        """Does one thing; False when waiting for more text."""
        block, text = self._block, self._text
        if block is None:
            at = text.find(TOOL_CALL_START, self._pos)
            if at >= 0:
                self._content(text[self._pos:at])
                self._block, self._pos = _Block(at), at + len(TOOL_CALL_START)
                return True
            end = len(text) - (0 if self._final else _partial_suffix(text, self._pos, TOOL_CALL_START))
            self._content(text[self._pos:end])
            self._pos = max(self._pos, end)
            return False
        if block.phase == "skip":
            at = text.find(TOOL_CALL_END, self._pos)
            if at < 0 and not self._final:
                self._pos = max(self._pos, len(text) - len(TOOL_CALL_END) + 1)
                return False
            self._pos = len(text) if at < 0 else at + len(TOOL_CALL_END)
            self._block = None
            return True
        if block.phase in ("key_scan", "value_scan"):
            return self._scan(block)
        self._pos = _skip_ws(text, self._pos)
        if self._pos == len(text):
            if block.phase == "after_object" and self._final:
                self._block = None
                return True
            return self._fail(block) if self._final else False
        return self._structure(block, text[self._pos])

    def _structure(self, block: _Block, char: str) -> bool:
        """The next non-whitespace ``char`` of the block, in ``block.phase``."""
        phase = block.phase
        if phase == "after_object":
            rest = self._text[self._pos:]
            if rest.startswith(TOOL_CALL_END) or (TOOL_CALL_END.startswith(rest) and self._final):
                self._pos += min(len(rest), len(TOOL_CALL_END))
                self._block = None
                return True
            return False if TOOL_CALL_END.startswith(rest) else self._fail(block)
        if char == "}" and phase in ("first_key", "after_value"):
            self._pos += 1
            return self._close_object(block)
        if phase == "value":
            return self._start_value(block, char)
        if char != _EXPECTED[phase]:
            return self._fail(block)
        if phase in ("first_key", "key"):
            block.role, block.scan, block.phase = None, _ValueScan(self._pos), "key_scan"
            return True
        self._pos += 1
        block.phase = _NEXT_PHASE[phase]
        return True

    def _start_value(self, block: _Block, char: str) -> bool:
        """Starts reading a member's value (``char`` is its first character)."""
        role = None
        if block.key == "name" and block.name is None:
            role = "name"
        elif block.key in ARGUMENT_KEYS and block.args_start is None:
            role = "arguments"
        if role == "name" and char != '"' or role == "arguments" and char != "{":
            return self._fail(block)
        if role == "arguments":
            block.args_start = block.args_sent = self._pos
        block.role, block.scan, block.phase = role, _ValueScan(self._pos), "value_scan"
        return True

    def _scan(self, block: _Block) -> bool:
        """Goes on reading the key or value that ``block.scan`` follows."""
        scan = block.scan
        assert scan is not None
        end = scan.advance(self._text, self._final)
        if block.role == "arguments":
            self._send_arguments(block, scan.pos)
        if end is None:
            return self._fail(block) if self._final else False
        try:
            value = json.loads(self._text[scan.start:end])
        except (ValueError, RecursionError):
            return self._fail(block)
        self._pos = end
        if block.phase == "key_scan":
            block.key, block.phase = value, "colon"
            return True
        if block.role == "name":
            if not isinstance(value, str) or not value:
                return self._fail(block)
            block.name = value
            self._announce(block)
        elif block.role == "arguments":
            block.args_end = end
        block.phase = "after_value"
        return True

    def _close_object(self, block: _Block) -> bool:
        if block.name is None:
            return self._fail(block)
        if block.args_start is None:
            self._push_arguments(block, "{}")
        block.phase = "after_object"
        return True

    def _fail(self, block: _Block) -> bool:
        """The block is malformed: before its call was announced, its tag becomes content; after,
        the rest of the block is skipped."""
        if block.call is None:
            self._content(TOOL_CALL_START)
            self._block, self._pos = None, block.start + len(TOOL_CALL_START)
        else:
            block.phase = "skip"
        return True

    def _announce(self, block: _Block) -> None:
        index = len(self._calls)
        call = ToolCall(id=self._make_id(index), name=block.name or "", arguments="")
        self._calls.append(call)
        block.call = index
        self._out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                          "function": {"name": call.name, "arguments": ""}}]})
        if block.args_end is not None:
            self._send_arguments(block, block.args_end)

    def _send_arguments(self, block: _Block, upto: int) -> None:
        if block.call is not None and upto > block.args_sent:
            self._push_arguments(block, self._text[block.args_sent:upto])
            block.args_sent = upto

    def _push_arguments(self, block: _Block, fragment: str) -> None:
        assert block.call is not None
        call = self._calls[block.call]
        self._calls[block.call] = ToolCall(call.id, call.name, call.arguments + fragment)
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else None
        if last is not None and last["index"] == block.call and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self._out.append({"tool_calls": [{"index": block.call, "function": {"arguments": fragment}}]})

    def _content(self, text: str) -> None:
        """Sends content, keeping the whole content stripped: leading whitespace is dropped, trailing
        whitespace waits for more content."""
        if not self._content_started:
            text = text.lstrip()
        if not text:
            return
        text = self._pending_ws + text
        kept = text.rstrip()
        self._pending_ws = text[len(kept):]
        if not kept:
            return
        self._content_started = True
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += kept
        else:
            self._out.append({"content": kept})


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """Length of the longest end of ``text[start:]`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
