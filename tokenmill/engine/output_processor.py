"""OutputProcessor: turns updated Requests into RequestOutputs (detokenization, stop strings, n > 1 fan-in).

Owns one IncrementalDetokenizer per generated sequence. Never touches tensors or the KV cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.request import Request
from tokenmill.token_strings import TokenStrings


@dataclass
class _SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer
    num_tokens_emitted: int = 0
    num_logprobs_emitted: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output: CompletionOutput | None = None


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: dict[str, _SequenceState]
    arrival_time: float
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    num_finished: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    lora_request: LoRARequest | None = None
    kv_transfer_params: dict | None = None  # where a decode worker pulls this prompt's K/V (a producer's lease)


class OutputProcessor:
    """Tracks every live request's text and builds the RequestOutput of each engine step."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_strings = TokenStrings(tokenizer)  # Logprob.decoded_token: text, or a bytes: marker
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        sequences = {}
        for index, child in enumerate(children):
            sequences[child.request_id] = _SequenceState(
                index=index,
                detokenizer=IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, child.sampling_params),
            )
            self.child_to_parent[child.request_id] = request_id
        self.parents[request_id] = _ParentState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=children[0].prompt_token_ids,
            sequences=sequences,
            arrival_time=children[0].arrival_time,
            lora_request=children[0].lora_request,
        )

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.sequences) if parent else []

    def finish_reasons(self, request_id: str) -> list[str | None]:
        """Each sequence's finish reason so far (None: still running); [] for an unknown request."""
        parent = self.parents.get(request_id)
        return [seq.finish_reason for seq in parent.sequences.values()] if parent else []

    def remove(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent:
            for child_id in parent.sequences:
                self.child_to_parent.pop(child_id, None)

    def process(self, updated: list[Request]) -> tuple[list[RequestOutput], list[str]]:
        """Detokenize this step's new tokens.

        Returns (outputs, child ids that hit a stop string and must be finished by the scheduler).
        """
        now = time.monotonic()
        to_stop: list[str] = []
        touched: dict[str, _ParentState] = {}
        updated_ids: set[str] = set()
        for request in updated:
            parent_id = self.child_to_parent.get(request.request_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            seq = parent.sequences[request.request_id]
            if seq.finish_reason is not None:
                continue
            if parent.first_token_time is None:
                parent.first_token_time = now
                parent.num_cached_tokens = request.num_cached_tokens or 0
                parent.first_scheduled_time = request.first_scheduled_time
                if request.wants_prompt_logprobs:  # complete once the first token exists
                    parent.prompt_logprobs = list(request.prompt_logprobs)
                    self._decode_logprob_tokens([e for e in parent.prompt_logprobs if e is not None])
            new_ids = request.output_token_ids[seq.num_tokens_emitted :]
            if len(new_ids) > 1 and request.sampling_params.stop:
                # Several tokens in one step (speculative decoding): stop at the one completing a stop
                # string, as plain decoding would; the tokens after it are not part of the output.
                for j, token_id in enumerate(new_ids):
                    stop_str = seq.detokenizer.update([token_id])
                    if stop_str is not None:
                        new_ids = new_ids[: j + 1]
                        break
            else:
                stop_str = seq.detokenizer.update(new_ids)
            seq.num_tokens_emitted += len(new_ids)
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                if not request.is_finished:
                    to_stop.append(request.request_id)
            elif request.is_finished:
                seq.detokenizer.finish()
                seq.finish_reason = request.status.finish_reason
                seq.stop_reason = request.stop_reason
            num_emitted = seq.num_tokens_emitted  # < request.num_output_tokens after a stop string mid-step
            new_logprobs = None
            cumulative_logprob = request.cumulative_logprob
            if request.sampling_params.logprobs is not None:
                new_logprobs = request.logprobs[seq.num_logprobs_emitted : num_emitted]
                seq.num_logprobs_emitted = min(len(request.logprobs), num_emitted)
                self._decode_logprob_tokens(new_logprobs)
                if num_emitted < request.num_output_tokens:
                    cumulative_logprob = sum(entry[t].logprob for entry, t in
                                             zip(request.logprobs, request.output_token_ids[:num_emitted]))
            seq.output = CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.output_text,
                token_ids=request.output_token_ids[:num_emitted],
                cumulative_logprob=cumulative_logprob,
                logprobs=request.logprobs[:num_emitted] if request.sampling_params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                delta_text=seq.detokenizer.get_delta_text(),
                delta_token_ids=new_ids,
                delta_logprobs=new_logprobs,
            )
            if seq.finish_reason is not None:
                parent.num_finished += 1
            if request.kv_transfer_params_out is not None:
                parent.kv_transfer_params = request.kv_transfer_params_out
            touched[parent_id] = parent
            updated_ids.add(request.request_id)

        outputs = []
        for parent in touched.values():
            finished = parent.num_finished == len(parent.sequences)
            completions = []
            for child_id, seq in parent.sequences.items():
                if seq.output is None:
                    completions.append(CompletionOutput(index=seq.index))
                elif child_id in updated_ids:
                    completions.append(seq.output)
                else:  # no news for this sequence: same state, empty delta
                    completions.append(replace(seq.output, delta_text="", delta_token_ids=[], delta_logprobs=None))
            parent.metrics = {
                "arrival_time": parent.arrival_time,
                "first_scheduled_time": parent.first_scheduled_time or parent.arrival_time,
                "first_token_time": parent.first_token_time or now,
            }
            if finished:
                parent.metrics["finished_time"] = now
                self.remove(parent.request_id)
            outputs.append(
                RequestOutput(
                    request_id=parent.request_id,
                    prompt=parent.prompt,
                    prompt_token_ids=parent.prompt_token_ids,
                    outputs=completions,
                    finished=finished,
                    prompt_logprobs=parent.prompt_logprobs,
                    num_cached_tokens=parent.num_cached_tokens,
                    metrics=dict(parent.metrics),
                    lora_request=parent.lora_request,
                    kv_transfer_params=parent.kv_transfer_params,
                )
            )
        return outputs, to_stop

    def _decode_logprob_tokens(self, entries: list[dict]) -> None:
        for entry in entries:
            for token_id, logprob in entry.items():
                if logprob.decoded_token is None:
                    logprob.decoded_token = self.token_strings.text(token_id)
