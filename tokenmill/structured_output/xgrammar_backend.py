"""The xgrammar backend (MLC's xgrammar: pushdown automata with a precomputed token mask cache).

Constraints compile through xgrammar's GrammarCompiler (JSON schema, regex, EBNF or Lark, and a
structural tag for tool calls); ``json_object`` is the bounded schema of ``json_object.py``. xgrammar
accepts some JSON-schema keywords it does not enforce; ``schema_check.XGRAMMAR_KEYWORDS`` lists the
ones it does and anything else is refused.
"""
from __future__ import annotations

import json
import re

import numpy as np
import xgrammar
import xgrammar.structural_tag as xgr_tag

from tokenmill.light_tokenizer import transformers_tokenizer
from tokenmill.structured_output.backend import CompiledConstraint, ConstraintError, Matcher, StructuredOutputBackend
from tokenmill.structured_output.json_object import json_object_schema
from tokenmill.structured_output.schema_check import XGRAMMAR_FORMATS, XGRAMMAR_KEYWORDS, check_keywords, load_json_schema
from tokenmill.structured_output.tool_call_format import CALL_END, CALL_SEPARATOR, call_begin, parse_tool_calls_spec

_SOURCE_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] \S+\.(?:cc|h|cpp):\d+: ")
_JSON_OPTIONS = {"any_whitespace": False, "separators": (",", ":"), "strict_mode": True}


class XgrammarMatcher(Matcher):
    """An ``xgrammar.GrammarMatcher`` behind the Matcher interface. ``json_only``: the output is
    compact JSON, where no raw control character and no special token can ever be valid."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, json_only: bool = False) -> None:
        super().__init__(matcher)
        self.json_only = json_only

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    """xgrammar bound to one tokenizer (see StructuredOutputBackend)."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], max_threads: int = 2) -> None:
        super().__init__(vocab_size)
        tokenizer = transformers_tokenizer(tokenizer)  # xgrammar reads a transformers tokenizer object
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids) or None
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads)
        self.batch_matcher = xgrammar.BatchGrammarMatcher(max_threads)
        special = set(info.special_token_ids) | set(getattr(tokenizer, "all_special_ids", ()))
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special |= {i for i, token in added.items() if getattr(token, "special", False)}
        self._json_tokens = self._json_token_mask(info, special, eos_token_ids)

    def _json_token_mask(self, info: xgrammar.TokenizerInfo, special: set[int], eos_token_ids: set[int]) -> np.ndarray:
        """[W] int32: every token but those holding a raw control character (byte < 0x20) and the
        special tokens other than end-of-sequence. xgrammar 0.2 lets both into strings with
        ``minLength``/``maxLength``, which would make invalid JSON; compact JSON never needs them."""
        allowed = np.ones(self.num_words * 32, dtype=bool)
        allowed[self.vocab_size:] = False
        for token_id, token in enumerate(info.decoded_vocab[: self.vocab_size]):
            if any(byte < 0x20 for byte in token):
                allowed[token_id] = False
        for token_id in special:
            if 0 <= token_id < self.vocab_size and token_id not in eos_token_ids:
                allowed[token_id] = False
        return np.packbits(allowed.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).view(np.int32)[:, 0]

    def _schema(self, spec: str, kind: str) -> dict:
        schema = load_json_schema(spec, kind)
        check_keywords(schema, XGRAMMAR_KEYWORDS, XGRAMMAR_FORMATS, self.name, kind)
        return schema

    def _compile(self, kind: str, spec: str) -> xgrammar.CompiledGrammar:
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(self._schema(spec, kind)), **_JSON_OPTIONS)
        if kind == "json_object":
            return self.compiler.compile_json_schema(json_object_schema(), **_JSON_OPTIONS)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        if kind == "grammar":
            if "::=" in spec:
                return self.compiler.compile_grammar(spec)
            return self.compiler.compile_grammar(xgrammar.Grammar.from_lark(spec))
        if kind == "tool_calls":
            parsed = parse_tool_calls_spec(spec)
            tags = []
            for name, parameters in parsed.tools:
                schema = self._schema(json.dumps(parameters), kind)
                content = xgr_tag.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=1)
                tags.append(xgr_tag.TagFormat(begin=call_begin(name), content=content, end=CALL_END))
            fmt = xgr_tag.TagsWithSeparatorFormat(tags=tags, separator=CALL_SEPARATOR, at_least_one=True,
                                                  stop_after_first=not parsed.parallel)
            return self.compiler.compile_structural_tag(xgr_tag.StructuralTag(format=fmt))
        raise ConstraintError(kind, "unknown constraint kind")

    def compile(self, kind: str, spec: str) -> CompiledConstraint:
        try:
            compiled = self._compile(kind, spec)
        except ConstraintError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse / conversion errors
            # Drop xgrammar's "[HH:MM:SS] /path/file.cc:123: " source locations.
            reason = _SOURCE_LOCATION.sub("", " ".join(str(exc).split())).strip()
            raise ConstraintError(kind, reason or type(exc).__name__) from None
        return CompiledConstraint(self.name, kind, spec, compiled)

    def new_matcher(self, compiled: CompiledConstraint) -> XgrammarMatcher:
        return XgrammarMatcher(xgrammar.GrammarMatcher(compiled.handle), json_only=compiled.kind in ("json", "json_object"))

    def fill_bitmask(self, matchers: list[Matcher], bitmask: np.ndarray) -> None:
        assert bitmask.shape == (len(matchers), self.num_words) and bitmask.dtype == np.int32, bitmask.shape
        self.batch_matcher.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask)  # type: ignore[attr-defined]
        json_rows = [i for i, m in enumerate(matchers) if m.json_only]  # type: ignore[attr-defined]
        if json_rows:
            bitmask[json_rows] &= self._json_tokens
