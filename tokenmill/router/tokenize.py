"""Router-side tokenization: a prompt or a chat conversation -> the token ids a tokenmill worker
would compute for it, so ``kv_aware`` can hash the prompt's blocks exactly as the worker's prefix
cache does.

Completions: ``encode(prompt, add_special_tokens=True)`` (``LLMEngine.tokenize_prompt``). Chat:
OpenAI messages normalised as the server does (``ChatMessage.as_dict``), tools through
``tokenmill.tool_calling`` and the chat template through ``ChatPromptRenderer`` (the server's
``render_chat``). The tokenizer is read from a HF directory (``--tokenizer``, or the model path) or,
for a GGUF file (None: the embedded default model), from the GGUF cache entry a worker on this
machine already wrote. Never imports torch (transformers' ``PreTrainedTokenizerFast`` does not; its
``AutoTokenizer`` does) — except to parse a GGUF file no worker has cached yet.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from tokenmill.engine.chat_prompt import ChatPromptRenderer

logger = logging.getLogger(__name__)

_MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


class RouterTokenizer:
    """Prompt and conversation tokenization, identical to a worker serving the same tokenizer.

    Args:
        tokenizer: a transformers fast tokenizer (with the model's chat template for chat).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._renderer: ChatPromptRenderer | None = None

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completions prompt's token ids (special tokens added, as the worker does)."""
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    allow_special_tokens_in_content: bool = False, tools: list | None = None,
                    tool_choice: Any = None) -> list[int]:
        """A chat request's prompt token ids (OpenAI ``messages``, ``tools`` and ``tool_choice``).

        Raises:
            ValueError: messages the template (or tools validation) rejects; the worker refuses them too.
        """
        from tokenmill.tool_calling import conversation_for_template, parse_tools, template_supports_tools

        template_tools = None
        if tools:
            request = parse_tools(tools, tool_choice)
            template_tools = request.openai_tools() if request.tools and request.mode != "none" else None
        if self._renderer is None:
            self._renderer = ChatPromptRenderer(self.tokenizer)
        conversation, template_tools = conversation_for_template(
            [_template_message(m) for m in messages], template_tools,
            template_supports_tools(self.tokenizer.chat_template))
        return self._renderer.render(conversation, add_generation_prompt, allow_special_tokens_in_content,
                                     tools=template_tools)


def _template_message(message: dict) -> dict:
    """An OpenAI message as the worker's chat template sees it (``ChatMessage.as_dict``): content
    parts joined into one text, unset fields left out."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    out = {"role": message.get("role"), "content": content or ""}
    for key in ("name", "tool_calls", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def load_router_tokenizer(path: str | None) -> RouterTokenizer:
    """The tokenizer of a model path: a HF directory (``tokenizer.json``), a ``.gguf`` file, a directory
    holding one ``.gguf`` file, or None for the embedded default model.

    Raises:
        FileNotFoundError: the path does not exist (or the default model is not installed).
    """
    from transformers import PreTrainedTokenizerFast

    gguf = _gguf_file(path)
    if gguf is None:
        return RouterTokenizer(PreTrainedTokenizerFast.from_pretrained(str(path)))
    gguf_cache = _models_module("gguf_cache")
    saved = gguf_cache.entry_dir(gguf) / "tokenizer"
    if saved.is_dir():
        return RouterTokenizer(PreTrainedTokenizerFast.from_pretrained(str(saved)))
    logger.info("no cached tokenizer for %s yet: parsing the GGUF file (this loads torch once)", gguf)

    def produce():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    return RouterTokenizer(gguf_cache.cached_tokenizer(gguf, produce))


def _gguf_file(path: str | None) -> Path | None:
    """The GGUF file ``path`` means (the worker's loader rules), or None for a HF directory."""
    if path is None:
        return _models_module("default_model").default_model_path()
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file() and not (p / "tokenizer.json").is_file():
        found = sorted(p.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    return None


def _models_module(name: str) -> ModuleType:
    """``tokenmill.models.<name>`` without the package ``__init__`` (which imports the model classes, and
    so torch): the module itself is pure Python."""
    loaded = sys.modules.get(f"tokenmill.models.{name}")
    if loaded is not None:
        return loaded
    alias = f"tokenmill.router._models_{name}"
    if alias not in sys.modules:
        spec = importlib.util.spec_from_file_location(alias, _MODELS_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[alias] = module
    return sys.modules[alias]
