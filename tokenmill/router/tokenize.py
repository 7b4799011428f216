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

logger = logging.getLogger(__name__)

_MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


class RouterTokenizer:
    """Prompt and conversation tokenization, identical to a worker serving the same tokenizer.

    Args:
        tokenizer: a transformers fast tokenizer (with the model's chat template for chat).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._renderer: Any = None  # a ChatPromptRenderer, made on the first chat
        # The Rust tokenizer under a transformers fast tokenizer: the same ids (special tokens are its
        # post-processor's), without the wrapper's Python (half the time of a short prompt's encode).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is not None:  # the state the wrapper's encode would set before each call
            self._backend.no_truncation()
            self._backend.no_padding()
            self._backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completions prompt's token ids (special tokens added, as the worker does)."""
        if self._backend is not None:
            return self._backend.encode(prompt, add_special_tokens=True).ids
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    allow_special_tokens_in_content: bool = False, tools: list | None = None,
                    tool_choice: Any = None, continue_final_message: bool = False) -> list[int]:
        """A chat request's prompt token ids (OpenAI ``messages``, ``tools``, ``tool_choice`` and
        ``continue_final_message``).

        Raises:
            ValueError: messages the template (or tools validation) rejects; the worker refuses them too.
        """
        from tokenmill.chat_prompt import ChatPromptRenderer  # pure Python, but a package the router
        from tokenmill.tool_calling import conversation_for_template, parse_tools, template_supports_tools  # loads late

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
                                     tools=template_tools, continue_final_message=continue_final_message)


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

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        split = _models_module("gguf_tokenizer")  # llama.cpp's split for the file, as the worker's loader
        split.apply_llama_cpp_split(tokenizer, *split.read_tokenizer_kind(gguf))
        return tokenizer

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


class RequestTokenizer:
    """The prompt token ids of an OpenAI request body, for policies that hash blocks (``kv_aware``).

    The tokenizer comes from ``path`` when given (the router's ``--tokenizer``), else from the first
    tokenmill worker that reports its model (``/debug/status`` ``config.tokenizer`` or ``config.model``;
    None there is the embedded default model), loaded once on first use. A worker whose model path
    does not exist on the router's host leaves the router without a tokenizer: text prompts are then
    routed without token ids (``kv_aware`` falls back to least load under its cap), logged once.

    Args:
        path: a tokenizer or model path (HF directory or GGUF), or None to learn it from the workers.
    """

    def __init__(self, path: str | None = None) -> None:
        self._explicit = path is not None
        self._source: tuple[str | None] | None = (path,) if path is not None else None
        self._tokenizer: RouterTokenizer | None = None
        self._failed = False

    def offer_source(self, model_path: str | None) -> None:
        """A tokenmill worker's model path (None: the embedded default); the first one offered is used."""
        if self._source is None:
            self._source = (model_path,)

    def tokenizer(self) -> RouterTokenizer | None:
        """The tokenizer, loading it on first call (blocking: call from a worker thread); None when no
        source is known yet or loading failed."""
        if self._tokenizer is None and self._source is not None and not self._failed:
            try:
                self._tokenizer = load_router_tokenizer(self._source[0])
            except Exception as exc:  # noqa: BLE001 — any failure: route without token ids, say why once
                self._failed = True
                logger.warning("router tokenizer for %s unavailable (%s: %s); kv_aware routes text prompts by load "
                               "only (pass --tokenizer PATH)", self._source[0] or "the embedded model",
                               type(exc).__name__, exc)
        return self._tokenizer

    def shared_with(self, model_path: str | None) -> bool:
        """Whether a tokenmill worker serving ``model_path`` tokenizes as this router does: the
        tokenizer is loaded and is either the router's ``--tokenizer`` (the operator's word) or was
        loaded from that same model path."""
        return self._tokenizer is not None and (self._explicit or self._source == (model_path,))

    @property
    def ready(self) -> bool:
        """True once the tokenizer is loaded (or known unavailable): ``token_ids`` then never blocks on a load."""
        return self._tokenizer is not None or self._failed

    def token_ids(self, kind: str, body: dict) -> list[int] | None:
        """Prompt token ids of a ``completions`` (one string prompt) or ``chat`` body, as the worker will
        compute them; None when they cannot be known here (several prompts, no tokenizer, or a body the
        worker will refuse — the worker names the field)."""
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return None
            tokenizer = self.tokenizer()
            return tokenizer.encode_prompt(prompt) if tokenizer is not None else None
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        try:
            return tokenizer.render_chat(messages, bool(body.get("add_generation_prompt", True)),
                                         bool(body.get("allow_special_tokens_in_content") or False),
                                         tools=body.get("tools"), tool_choice=body.get("tool_choice"),
                                         continue_final_message=body.get("continue_final_message") is True)
        except Exception:  # noqa: BLE001 — the worker validates the body and answers the client
            return None
