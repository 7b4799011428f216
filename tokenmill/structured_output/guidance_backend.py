"""The llguidance backend (Microsoft's llguidance: Earley parser over a token trie; the default).

Constraints compile to llguidance's grammar text (JSON schema, regex, Lark); GBNF grammars are
converted to Lark by llguidance itself. JSON is written with compact separators and no free
whitespace; ``json_object`` is the bounded schema of ``json_object.py``. llguidance refuses schema
keywords it does not implement; its warnings are refused too, so a constraint is never weakened
silently.
"""
from __future__ import annotations

import copy
import json

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from tokenmill.structured_output.backend import CompiledConstraint, ConstraintError, Matcher, StructuredOutputBackend
from tokenmill.structured_output.json_object import json_object_schema
from tokenmill.structured_output.schema_check import load_json_schema
from tokenmill.structured_output.tool_call_format import CALL_END, CALL_SEPARATOR, call_begin, parse_tool_calls_spec

# Compact JSON, no whitespace between tokens (no runaway whitespace).
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def ll_tokenizer(tokenizer, vocab_size: int, eos: list[int] | None) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a fast tokenizer (transformers' or tokenmill's LightTokenizer): its ``tokenizers``
    JSON without padding or truncation, as ``llguidance.hf.from_tokenizer`` builds it, without importing transformers
    (which that module does). ``eos``: the ids that end a sequence (None: the tokenizer's eos_token_id).

    Raises:
        ValueError: the tokenizer has no ``backend_tokenizer`` (not a fast tokenizer).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured outputs need a fast tokenizer (tokenizer.json)")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                  eos_token=eos if eos is not None else tokenizer.eos_token_id)


def _lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


class GuidanceMatcher(Matcher):
    """An ``llguidance.LLMatcher`` behind the Matcher interface."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        super().__init__(matcher)
        self.eos_token_ids = eos_token_ids

    def accept_token(self, token_id: int) -> bool:
        # Checked first: consuming a forbidden token would leave the matcher in its error state for good.
        if self.matcher.is_error():
            return False
        if token_id in self.eos_token_ids:
            allowed = self.matcher.is_accepting()
        else:
            allowed = not self.matcher.is_stopped() and self.matcher.validate_tokens([token_id]) == 1
        return allowed and bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()


class GuidanceBackend(StructuredOutputBackend):
    """llguidance bound to one tokenizer (see StructuredOutputBackend)."""

    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        super().__init__(vocab_size)
        eos = sorted(eos_token_ids) or None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.ll_tokenizer = ll_tokenizer(tokenizer, vocab_size, eos)
        self.executor = llguidance.LLExecutor()

    def _grammar(self, kind: str, spec: str) -> str:
        if kind in ("json", "json_object"):
            schema = json_object_schema() if kind == "json_object" else json.dumps(load_json_schema(spec, kind))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in choices))
        if kind == "grammar":
            lark = spec
            if "::=" in spec:  # GBNF / EBNF
                try:
                    lark = gbnf_to_lark(spec)
                except Exception as exc:  # noqa: BLE001 - the library's parse error, reported to the user
                    raise ConstraintError(kind, f"the GBNF grammar does not parse: {exc}") from None
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if kind == "tool_calls":
            return llguidance.LLMatcher.grammar_from_lark(self._tool_calls_lark(spec))
        raise ConstraintError(kind, "unknown constraint kind")

    @staticmethod
    def _tool_calls_lark(spec: str) -> str:
        parsed = parse_tool_calls_spec(spec)
        rules = []
        for i, (name, parameters) in enumerate(parsed.tools):
            load_json_schema(json.dumps(parameters), "tool_calls")
            schema = {**parameters, "x-guidance": _JSON_DEFAULTS}
            rules.append(f"call_{i}: {_lark_string(call_begin(name))} args_{i} {_lark_string(CALL_END)}")
            rules.append(f"args_{i}: %json {json.dumps(schema)}")
        calls = " | ".join(f"call_{i}" for i in range(len(parsed.tools)))
        start = f"start: call ({_lark_string(CALL_SEPARATOR)} call)*" if parsed.parallel else "start: call"
        return "\n".join([start, f"call: {calls}", *rules])

    def compile(self, kind: str, spec: str) -> CompiledConstraint:
        grammar = self._grammar(kind, spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error or messages:
            reason = "; ".join(m.strip() for m in messages) or "rejected by llguidance"
            raise ConstraintError(kind, reason)
        return CompiledConstraint(self.name, kind, spec, grammar)

    def new_matcher(self, compiled: CompiledConstraint) -> GuidanceMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, compiled.handle, log_level=0)
        if matcher.is_error():
            raise ConstraintError(compiled.kind, matcher.get_error())
        return GuidanceMatcher(matcher, self.eos_token_ids)

    def fill_bitmask(self, matchers: list[Matcher], bitmask: np.ndarray) -> None:
        assert bitmask.shape == (len(matchers), self.num_words) and bitmask.dtype == np.int32, bitmask.shape
        pairs = [(m.matcher, i) for i, m in enumerate(matchers)]  # type: ignore[attr-defined]
        llguidance.numpy.fill_next_token_bitmask_par(self.executor, pairs, bitmask)
