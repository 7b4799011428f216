"""LLM: the offline API (`LLM(model).generate(prompts, SamplingParams(...))` and `.chat(messages)`)."""
from __future__ import annotations

import gc
import itertools
import weakref

from tqdm import tqdm

from tokenmill.chat_prompt import ChatPromptRenderer
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.engine_args import EngineArgs, options_doc, with_options_signature
from tokenmill.lora import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


class LLM:
    __doc__ = f"""Offline batch generation over an in-process engine.

    Takes the engine options (the fields of ``tokenmill.engine_args.EngineArgs``) as keyword arguments, the
    model also positionally; ``LLM.from_engine_args`` takes an ``EngineArgs``. With a disk KV tier, call
    ``close()`` (or use ``with LLM(...) as llm``) so cached blocks are written there for the next run. With
    ``enable_lora``, ``generate(..., lora_request=LoRARequest(name, id, path))`` picks an adapter per prompt.

    Args:
{options_doc(indent=" " * 8)}

    Raises:
        TypeError: an unknown keyword, naming it.
        ValueError: an option out of range or inconsistent with another, naming it.
    """

    @with_options_signature
    def __init__(self, model: str | None = None, **kwargs) -> None:
        config = EngineArgs.from_kwargs("LLM", {"model": model, **kwargs}).create_engine_config()
        self.engine = LLMEngine(config)
        # The engine froze the heap out of the garbage collector (LLMEngine.__init__): once this LLM is
        # freed without close(), its engine's reference cycles must be collectable again.
        weakref.finalize(self, gc.unfreeze)
        self._counter = itertools.count()
        self._chat_renderer = ChatPromptRenderer(self.get_tokenizer())

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An LLM with these engine options."""
        return cls(**engine_args.kwargs())

    def get_tokenizer(self):
        return self.engine.get_tokenizer()

    def close(self) -> None:
        """Save cached KV blocks to the disk tier (if any) and release it; see ``LLMEngine.close``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- RL rollouts: weights updated in place, sleep / wake up (tokenmill/rl, docs/rl.md) ----------
    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True,
                                 weight_version: str | None = None) -> dict:
        """Copy a safetensors directory or GGUF file of the same architecture and shapes into the
        weights in place; the prefix cache (every tier) stops serving blocks of the old weights
        (flushed, or with ``flush_cache=False`` never matched). Returns ``weight_info()``.

        Raises:
            tokenmill.rl.WeightUpdateError (a ValueError): a missing path, another config, missing,
                unknown, misshaped or non-float tensors (all listed); nothing was changed.
        """
        return self.engine.update_weights_from_disk(model_path, flush_cache, weight_version)

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True,
                                   weight_version: str | None = None) -> dict:
        """Replace named tensors (checkpoint names; ``{name: tensor}`` or pairs; any subset) in place,
        as :meth:`update_weights_from_disk`."""
        return self.engine.update_weights_from_tensor(named_tensors, flush_cache, weight_version)

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV block: pool, RAM tier and this model's disk records."""
        self.engine.flush_prefix_cache(clear_disk=True)

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1) and the weights too (level 2) until :meth:`wake_up`."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed; outputs are the same as before it."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.rl_state.sleep_level > 0

    def weight_info(self) -> dict:
        """Version, fingerprint, path, load time and update count of the served weights."""
        return self.engine.weight_info()

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns finished RequestOutputs in input order.

        ``lora_request``: one adapter for every prompt, or a list with one entry (or None: the base
        model) per prompt; needs ``enable_lora``. ``priority``: one per prompt (vLLM's), lower runs first;
        needs ``scheduling_policy="priority"``.

        Raises ValueError (before anything is queued) when a prompt, its parameters or its adapter are invalid.
        """
        self.engine.check_awake()
        if not isinstance(prompts, list) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: text, dict, or a list of token ids
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params")
        if not isinstance(lora_request, list):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(lora_request)} lora_request entries")
        if priority is None:
            priority = [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priority entries")
        ids = [f"offline-{next(self._counter)}" for _ in prompts]
        added = []
        try:
            for request_id, prompt, params, lora, rank in zip(ids, prompts, sampling_params, lora_request, priority):
                self.engine.add_request(request_id, prompt, params, lora_request=lora, priority=rank)
                added.append(request_id)
        except Exception:
            self.engine.abort_request(added)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while len(results) < len(ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:  # a failed step (StepFailedError) or an interrupt: leave no request behind
            self.engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        allow_special_tokens_in_content: bool = False,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate
        (``allow_special_tokens_in_content`` and ``continue_final_message`` as in
        :meth:`apply_chat_template`). ``tools``: OpenAI
        tool dicts, rendered by the template or, when it has no tools section, as a Hermes system
        block; messages may hold assistant ``tool_calls`` and ``tool`` turns (see
        ``tokenmill.tool_calling``). Parse calls out of the text with ``tool_calling.extract_tool_calls``.
        ``lora_request`` as in :meth:`generate` (per conversation when a list)."""
        from tokenmill.tool_calling import conversation_for_template, template_supports_tools

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        supports_tools = template_supports_tools(self.get_tokenizer().chat_template)
        prompts = []
        for conversation in conversations:
            conversation, template_tools = conversation_for_template(conversation, tools, supports_tools)
            prompts.append({"prompt_token_ids": self.apply_chat_template(
                conversation, add_generation_prompt, allow_special_tokens_in_content, tools=template_tools,
                continue_final_message=continue_final_message)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, allow_special_tokens_in_content: bool = False,
        tools: list[dict] | None = None, continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        Special-token strings inside message contents stay plain text, so only the template makes
        control tokens; ``allow_special_tokens_in_content=True`` parses them into control tokens
        (tokenizing the rendered text as a whole). See ``engine/chat_prompt.py``. ``tools``
        (OpenAI tool dicts) go to the template's ``tools`` variable; for templates without one use
        ``tokenmill.tool_calling.conversation_for_template`` first. ``continue_final_message``: the
        prompt ends inside the last message, which must be the assistant's, with no end-of-turn token
        after it, so the model continues it (needs ``add_generation_prompt=False``; a
        ``tokenmill.chat_prompt.ChatPromptError``, a ValueError, otherwise).
        """
        return self._chat_renderer.render(messages, add_generation_prompt, allow_special_tokens_in_content,
                                          tools=tools, continue_final_message=continue_final_message)


def build_engine_config(**kwargs) -> EngineConfig:
    """The EngineConfig for ``LLM(**kwargs)`` (same keyword names), without loading anything.

    Raises:
        TypeError: an unknown keyword.
        ValueError: a setting out of range, naming the field.
    """
    return EngineArgs.from_kwargs("build_engine_config", kwargs).create_engine_config()
