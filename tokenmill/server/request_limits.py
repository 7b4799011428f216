"""RequestLimits: how much one API request may ask of the engine (``tokenmill serve``'s
``--max-stop-strings`` ... ``--max-queued-requests``), and the checks that refuse more with a 400
naming the field. Every limit here protects the engine thread or its memory from one client; the
offline ``LLM`` takes no such limits (its caller is the only tenant).

Pure checks over request fields; never touches the engine. Imports nothing heavy at module level
(``tokenmill serve --help`` reads the flags from here).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from typing import TYPE_CHECKING

from tokenmill.engine_args import positive_float, positive_int

if TYPE_CHECKING:
    from tokenmill.sampling_params import StructuredOutputsParams
    from tokenmill.server.errors import APIError


@dataclass(frozen=True)
class RequestLimits:
    """Limits on one request to the OpenAI routes. Each is a ``tokenmill serve`` flag of the same
    name (``max_stop_strings`` is ``--max-stop-strings``).

    Attributes:
        max_stop_strings: most strings in ``stop`` (OpenAI allows 4).
        max_stop_string_length: most characters in one ``stop`` string.
        max_stop_token_ids: most ids in ``stop_token_ids``.
        max_logit_bias: most entries in ``logit_bias``.
        max_prompts_per_request: most prompts in one completions ``prompt`` list.
        max_num_seqs_per_request: most sequences one request creates: prompts × ``n``.
        max_tokens_per_request: most tokens one request may generate: the sum over its sequences of
            ``max_tokens`` (for chat without ``max_tokens``: what is left of ``max_model_len``).
        max_structured_output_bytes: most bytes (UTF-8) of one output constraint: the JSON schema,
            regex, grammar or choices, or the tools of a forced tool call.
        structured_outputs_compile_timeout: seconds a constraint may take to compile; a slower one is
            refused with 400 (compiling runs on a worker thread, never on the engine thread).
        max_tools: most entries in ``tools`` (OpenAI allows 128).
        max_queued_requests: most sequences waiting for the engine (not yet running); a request that
            would go past it gets 503 with ``Retry-After`` (SGLang's flag). A request is always
            taken when none wait.
    """

    max_stop_strings: int = 32
    max_stop_string_length: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_prompts_per_request: int = 1024
    max_num_seqs_per_request: int = 1024
    max_tokens_per_request: int = 4_194_304
    max_structured_output_bytes: int = 262_144
    structured_outputs_compile_timeout: float = 10.0
    max_tools: int = 128
    max_queued_requests: int = 8192

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value!r}")

    # ---- checks (each raises an APIError naming the request field) -----------------------------
    def check_stop(self, stop: list[str] | None, stop_token_ids: list[int] | None) -> None:
        """``stop`` (count, each string's length) and ``stop_token_ids`` (count)."""
        if stop is not None:
            if len(stop) > self.max_stop_strings:
                raise _refuse(f"stop may hold at most {self.max_stop_strings} strings, got {len(stop)}", param="stop")
            longest = max((len(s) for s in stop), default=0)
            if longest > self.max_stop_string_length:
                raise _refuse(f"each stop string may be at most {self.max_stop_string_length} characters long, "
                               f"got one of {longest}", param="stop")
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise _refuse(f"stop_token_ids may hold at most {self.max_stop_token_ids} ids, got {len(stop_token_ids)}",
                           param="stop_token_ids")

    def check_logit_bias(self, logit_bias: dict | None) -> None:
        """``logit_bias`` entry count."""
        if logit_bias is not None and len(logit_bias) > self.max_logit_bias:
            raise _refuse(f"logit_bias may hold at most {self.max_logit_bias} entries, got {len(logit_bias)}",
                           param="logit_bias")

    def check_num_seqs(self, num_prompts: int, n: int) -> None:
        """Prompts per request, and the sequences they make (prompts × ``n``)."""
        if num_prompts > self.max_prompts_per_request:
            raise _refuse(f"prompt may hold at most {self.max_prompts_per_request} prompts, got {num_prompts}",
                           param="prompt")
        if num_prompts * n > self.max_num_seqs_per_request:
            raise _refuse(f"this request would make {num_prompts} prompt(s) × n = {n} = {num_prompts * n} sequences; "
                           f"at most {self.max_num_seqs_per_request} are allowed", param="n")

    def check_num_tokens(self, max_tokens_each: list[int], n: int, max_tokens_param: str) -> None:
        """The tokens a request may generate: ``n`` × the sum of each prompt's resolved ``max_tokens``."""
        total = n * sum(max_tokens_each)
        if total > self.max_tokens_per_request:
            raise _refuse(f"this request may generate n × {max_tokens_param} = {total} tokens over its prompts; at "
                           f"most {self.max_tokens_per_request} are allowed: lower n or {max_tokens_param}",
                           param=max_tokens_param)

    def check_tools(self, tools: list | None) -> None:
        """``tools`` count."""
        if tools is not None and len(tools) > self.max_tools:
            raise _refuse(f"tools may hold at most {self.max_tools} tools, got {len(tools)}", param="tools")

    def check_constraint_size(self, constraint: StructuredOutputsParams, param: str) -> None:
        """An output constraint's size in UTF-8 bytes (``param``: the field that holds it)."""
        size = len(constraint.spec().encode("utf-8", errors="surrogatepass"))
        if size > self.max_structured_output_bytes:
            raise _refuse(f"{param} is {size} bytes; at most {self.max_structured_output_bytes} bytes are allowed",
                           param=param)

    # ---- command line --------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per limit (``--max-stop-strings`` ...), defaults from this class."""
        d = cls()
        group = parser.add_argument_group("request limits (each refused with 400 naming the field, except the queue)")
        add = group.add_argument
        add("--max-stop-strings", type=positive_int, default=d.max_stop_strings, metavar="N",
            help=f"most strings in stop (default {d.max_stop_strings})")
        add("--max-stop-string-length", type=positive_int, default=d.max_stop_string_length, metavar="CHARS",
            help=f"most characters in one stop string (default {d.max_stop_string_length})")
        add("--max-stop-token-ids", type=positive_int, default=d.max_stop_token_ids, metavar="N",
            help=f"most ids in stop_token_ids (default {d.max_stop_token_ids})")
        add("--max-logit-bias", type=positive_int, default=d.max_logit_bias, metavar="N",
            help=f"most entries in logit_bias (default {d.max_logit_bias})")
        add("--max-prompts-per-request", type=positive_int, default=d.max_prompts_per_request, metavar="N",
            help=f"most prompts in one completions request (default {d.max_prompts_per_request})")
        add("--max-num-seqs-per-request", type=positive_int, default=d.max_num_seqs_per_request, metavar="N",
            help=f"most sequences one request makes, prompts × n (default {d.max_num_seqs_per_request})")
        add("--max-tokens-per-request", type=positive_int, default=d.max_tokens_per_request, metavar="N",
            help="most tokens one request may generate, n × max_tokens summed over its prompts "
                 f"(default {d.max_tokens_per_request})")
        add("--max-structured-output-bytes", type=positive_int, default=d.max_structured_output_bytes,
            metavar="BYTES", help="most bytes of one output constraint: JSON schema, regex, grammar, choices, or the "
                                  f"tools of a forced tool call (default {d.max_structured_output_bytes})")
        add("--structured-outputs-compile-timeout", type=positive_float, default=d.structured_outputs_compile_timeout,
            metavar="SECONDS", help="seconds an output constraint may take to compile before the request is refused "
                                    f"(default {d.structured_outputs_compile_timeout:g})")
        add("--max-tools", type=positive_int, default=d.max_tools, metavar="N",
            help=f"most entries in tools (default {d.max_tools})")
        add("--max-queued-requests", type=positive_int, default=d.max_queued_requests, metavar="N",
            help="most sequences waiting for the engine; more get 503 with Retry-After "
                 f"(default {d.max_queued_requests})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RequestLimits:
        """The limits given by :meth:`add_cli_args`' flags."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _refuse(message: str, param: str) -> APIError:
    """A 400 naming ``param`` (fastapi is imported only once a request is checked)."""
    from tokenmill.server.errors import APIError

    return APIError(message, param=param)




