"""What a stream has delivered so far (``StreamState``: text, token ids, logprobs per choice) and how an
unfinished choice is resumed on another worker as a ``/v1/completions`` request for prompt + tokens so far,
translated back into the client's format (exact for greedy and seeded sampling; docs/router.md)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.router.sse import SSEEvent, choices_of, encode_event, is_empty_choice

TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")  # what the router adds to tokenmill streams
# Sampling fields a resumed choice keeps (n, seed, max_tokens, min_tokens and echo are set per choice).
RESUME_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "include_stop_str_in_output",
                 "skip_special_tokens", "cache_salt", "response_format", "structured_outputs")
RESUME_SEARCH = 8  # cut points tried below the last token before falling back to regenerating all of it
REPLACEMENT_CHAR = "\ufffd"


@dataclass


class ChoiceState:
    """One choice of a stream: its prompt and generated token ids, the text the client got, its end."""

    index: int
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finished: bool = False


class StreamState:
    """What the client was sent of one streamed request (kind ``completions`` or ``chat``)."""

    def __init__(self, kind: str, body: dict) -> None:
        self.kind, self.body = kind, body
        self.n = body.get("n") or 1
        self.wants_token_ids = body.get("return_token_ids") is True
        options = body.get("stream_options")  # the worker checks its type; the router only reads it
        self.wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.deterministic = body.get("temperature") == 0 or body.get("seed") is not None
        self.choices: dict[int, ChoiceState] = {}
        self.header: dict = {}  # id, object, created, model of the client's stream
        self.chat_prompt_token_ids: list[int] | None = None
        self.done = False  # [DONE] sent
        self.usage_sent = False
        self.has_token_ids = False  # the worker answered with token ids (a tokenmill worker)

    def choice(self, index: int) -> ChoiceState:
        if index not in self.choices:
            self.choices[index] = ChoiceState(index)
        return self.choices[index]

    def observe(self, event: SSEEvent) -> bytes:
        """Record an event of the original worker; returns the bytes to send the client (token-id
        fields the client did not ask for are removed)."""
        if event.done:
            self.done = True
            return event.raw
        obj = event.obj
        if obj is None:
            return event.raw
        if not self.header and "id" in obj:
            self.header = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        if obj.get("usage"):
            self.usage_sent = True
        changed = False
        if "prompt_token_ids" in obj:  # chat: the prompt rides on the first chunk
            self.chat_prompt_token_ids = obj["prompt_token_ids"]
            self.has_token_ids = True
            if not self.wants_token_ids:
                obj = {k: v for k, v in obj.items() if k != "prompt_token_ids"}
                changed = True
        choices = choices_of(obj)
        for i, choice in enumerate(choices):
            state = self.choice(choice.get("index", 0))
            if "prompt_token_ids" in choice:
                state.prompt_token_ids = choice["prompt_token_ids"]
            if "token_ids" in choice:
                state.token_ids.extend(choice["token_ids"] or ())
                self.has_token_ids = True
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            text = choice.get("text") if self.kind == "completions" else delta.get("content")
            if isinstance(text, str) and text:
                state.text.append(text)
            if choice.get("finish_reason") is not None:
                state.finished = True
            if not self.wants_token_ids and any(k in choice for k in TOKEN_ID_FIELDS):
                stripped = {k: v for k, v in choice.items() if k not in TOKEN_ID_FIELDS}
                choices[i] = None if is_empty_choice(stripped) else stripped  # it only carried token ids
                changed = True
        if not changed:
            return event.raw
        choices = [c for c in choices if c is not None]
        if not choices and obj.get("choices") and not obj.get("usage"):
            return b""
        return encode_event({**obj, "choices": choices})

    def prompt_of(self, state: ChoiceState) -> list[int] | str | None:
        """The prompt to resume ``state`` from: token ids when known, else the original prompt."""
        if self.kind == "chat":
            return self.chat_prompt_token_ids
        if state.prompt_token_ids is not None:
            return state.prompt_token_ids
        p = state.index // self.n
        for other in self.choices.values():
            if other.index // self.n == p and other.prompt_token_ids is not None:
                return other.prompt_token_ids
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return prompt[p] if p < len(prompt) else None
        return prompt

    def resume_body(self, state: ChoiceState, prompt: list[int] | str, cut: int) -> dict:
        """The ``/v1/completions`` body that continues ``state`` after its first ``cut`` tokens."""
        body = {k: self.body[k] for k in RESUME_FIELDS if k in self.body}
        budget = self.body.get("max_completion_tokens") if self.kind == "chat" else None
        if budget is None:
            budget = self.body.get("max_tokens", 16 if self.kind == "completions" else None)
        seed = self.body.get("seed")
        ids = prompt if isinstance(prompt, str) else list(prompt) + state.token_ids[:cut]
        body.update(prompt=ids, n=1, stream=True, return_token_ids=True, echo=False,
                    max_tokens=None if budget is None else max(budget - cut, 0),
                    min_tokens=max((self.body.get("min_tokens") or 0) - cut, 0))
        if seed is not None:
            body["seed"] = seed + state.index % self.n  # the engine's seed for choice j of a prompt
        if self.kind == "completions" and self.body.get("logprobs") is not None:
            body["logprobs"] = self.body["logprobs"]
        return body

    def translate(self, obj: dict, state: ChoiceState, skip: list[int]) -> bytes | None:
        """A chunk of a resume request as a chunk of the client's stream, or None if it carries nothing
        new. ``skip``: [characters, token ids] regenerated before the cut that the client already has."""
        out = []
        for choice in obj.get("choices") or ():
            text = choice.get("text") or ""
            if skip[0]:
                cut, skip[0] = min(skip[0], len(text)), skip[0] - min(skip[0], len(text))
                text = text[cut:]
            token_ids = list(choice.get("token_ids") or ())
            if skip[1]:
                cut, skip[1] = min(skip[1], len(token_ids)), skip[1] - min(skip[1], len(token_ids))
                token_ids = token_ids[cut:]
            finish = choice.get("finish_reason")
            state.token_ids.extend(token_ids)
            if text:
                state.text.append(text)
            if finish is not None:
                state.finished = True
            if not text and not finish and not (token_ids and self.wants_token_ids):
                continue
            if self.kind == "chat":
                new = {"index": state.index, "delta": {"content": text} if text else {}, "logprobs": None,
                       "finish_reason": finish, "stop_reason": choice.get("stop_reason")}
            else:
                new = {"index": state.index, "text": text, "logprobs": choice.get("logprobs"),
                       "finish_reason": finish, "stop_reason": choice.get("stop_reason")}
            if self.wants_token_ids and "token_ids" in choice:
                new["token_ids"] = token_ids
            out.append(new)
        if not out:
            return None
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return b"".join(encode_event({"object": kind, **self.header, "choices": [c]}) for c in out)

    def usage(self) -> bytes:
        """The usage chunk of a resumed stream (the original worker's was lost with it)."""
        if self.kind == "chat":
            prompt_tokens = len(self.chat_prompt_token_ids or ())
        else:
            prompts = {c.index // self.n: len(c.prompt_token_ids or ()) for c in self.choices.values()}
            prompt_tokens = sum(prompts.values())
        completion_tokens = sum(len(c.token_ids) for c in self.choices.values())
        return encode_event({**self.header, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}})
