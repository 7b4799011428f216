"""A saved fast tokenizer served without importing transformers.

``import transformers`` (version 5) scans the source of every model it ships to build its lazy import table:
about 1 s of a cached ``tokenmill serve`` on a Zen 1 EPYC, where everything else the start needs (torch,
FastAPI, the engine, the weights) takes 4 s. A GGUF file's tokenizer, once cached (``gguf_cache``), is a
``tokenizer.json`` that the ``tokenizers`` library runs by itself, a ``tokenizer_config.json`` naming the
special tokens, and a Jinja chat template. :class:`LightTokenizer` serves those directly:

- ``encode`` / ``decode`` are the ``tokenizers`` calls transformers' fast tokenizer makes for them;
- ``apply_chat_template`` renders the template with Jinja2 in a sandbox set up as chat templates expect
  (``trim_blocks``, ``lstrip_blocks``, loop controls, a ``tojson`` filter that keeps non-ASCII,
  ``raise_exception`` and ``strftime_now``), the special tokens' strings as variables, and message keys whose
  value is None left out (a template tests ``message.tool_calls is defined``);
- anything else (another attribute, an argument this class does not render itself, a template it cannot
  compile) goes to the transformers tokenizer loaded from the same files on first use (``hf``), so the
  object answers whatever a ``PreTrainedTokenizerFast`` answers.

Saved tokenizers of the plain fast class (``tokenizer_class`` ``TokenizersBackend`` or
``PreTrainedTokenizerFast``, what llama-type GGUF files give) and of ``Qwen2Tokenizer`` (Qwen2 and Qwen3 files)
whose config holds nothing but the fields read here come this way (:func:`light_tokenizer_fits`). Every one runs
the pipeline tokenizer.json holds: the one the first load built from the GGUF, llama.cpp's split for the file's
``tokenizer.ggml.pre`` included (``models/gguf_tokenizer.py``). transformers 5's ``Qwen2Tokenizer`` class would
instead rebuild its own pipeline around the vocabulary (NFC, then Qwen2's split), which is not what the first
load served nor what llama.cpp runs for a file whose ``pre`` is not "qwen2"; so its transformers fallback
(``hf``) is the plain fast class too. tests/test_light_tokenizer.py compares every method against transformers
on each such tokenizer the tests build.
"""
from __future__ import annotations

import datetime
import functools
import json
import logging
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LIGHT_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast", "Qwen2Tokenizer")
# tokenizer_config.json fields whose meaning this class reproduces; a config with any other field (added
# tokens with their own flags, add_bos_token, a processor class, ...) keeps transformers' tokenizer
_KNOWN_FIELDS = frozenset({
    "backend", "tokenizer_class", "bos_token", "eos_token", "unk_token", "pad_token", "model_max_length",
    "is_local", "local_files_only", "clean_up_tokenization_spaces", "chat_template", "add_prefix_space",
})
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def light_tokenizer_fits(saved: Path) -> bool:
    """Whether the tokenizer saved in ``saved`` (a ``save_pretrained`` directory) can be a
    :class:`LightTokenizer`: a plain fast class, only known config fields, no cleanup of spaces, a string or
    no chat template. Never raises (an unreadable directory: False)."""
    return _fitting_fields(saved) is not None


def open_light_tokenizer(saved: Path) -> LightTokenizer | None:
    """``saved`` as a :class:`LightTokenizer`, or None where it must be transformers' (it does not
    :func:`light_tokenizer_fits`). tokenizer_config.json is read once.

    Raises:
        OSError, ValueError: the files cannot be read or parsed.
    """
    fields = _fitting_fields(saved)
    return None if fields is None else LightTokenizer(saved, fields)


def _fitting_fields(saved: Path) -> dict | None:
    """tokenizer_config.json's fields where ``saved`` fits a :class:`LightTokenizer` (light_tokenizer_fits), else
    None."""
    try:
        fields = json.loads((saved / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict) or fields.get("tokenizer_class") not in LIGHT_CLASSES:
        return None
    if not set(fields) <= _KNOWN_FIELDS or fields.get("clean_up_tokenization_spaces", False) is not False:
        return None
    if not all(fields.get(name) is None or isinstance(fields[name], str) for name in _SPECIAL):
        return None
    if fields.get("add_prefix_space") not in (None, False):  # a prefix space: transformers' tokenizer rebuilds
        return None
    if not (saved / "tokenizer.json").is_file() or isinstance(fields.get("chat_template"), (list, dict)):
        return None
    return fields


class LightTokenizer:
    """A saved fast tokenizer, run through ``tokenizers`` and Jinja2 (see the module docstring).

    Args:
        saved: the directory ``save_pretrained`` wrote (tokenizer.json, tokenizer_config.json and, from
            transformers 5, chat_template.jinja).
        fields: tokenizer_config.json's fields when the caller has read them already (default: read here).

    Raises:
        OSError, ValueError: the files cannot be read or parsed.
    """

    # what transformers' fast tokenizer reports for files whose config holds none of these (light_tokenizer_fits)
    add_bos_token = False
    add_eos_token = False
    split_special_tokens = False
    padding_side = "right"
    truncation_side = "right"

    def __init__(self, saved: Path | str, fields: dict | None = None) -> None:
        from tokenizers import Tokenizer

        saved = Path(saved)
        self._saved = saved
        self.name_or_path = str(saved)
        if fields is None:
            fields = json.loads((saved / "tokenizer_config.json").read_text(encoding="utf-8"))
        self._fields = fields  # to rebuild transformers' tokenizer should the directory be gone by then (hf)
        self.backend_tokenizer = Tokenizer.from_file(str(saved / "tokenizer.json"))
        self._hf_class = fields.get("tokenizer_class", "TokenizersBackend")
        template_file = saved / "chat_template.jinja"
        self.chat_template: str | None = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                                          else fields.get("chat_template"))
        self.model_max_length = fields.get("model_max_length", int(1e30))
        self.clean_up_tokenization_spaces = False
        self.special_tokens_map = {name: fields[name] for name in _SPECIAL if fields.get(name) is not None}
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    # ---- special tokens -------------------------------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def all_special_tokens(self) -> list[str]:
        """The special tokens' strings, each once, in bos, eos, unk, pad order."""
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.backend_tokenizer.token_to_id(t) for t in self.all_special_tokens]

    # ---- vocabulary -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Tokens of the model's vocabulary, added tokens not counted (as transformers counts them)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """Tokens with the added ones."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    # ---- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True, **kwargs) -> list[int]:
        """Token ids of ``text`` (the tokenizer's post-processor adds its special tokens unless
        ``add_special_tokens`` is False). A pair or other keyword arguments (truncation, tensors): transformers."""
        if kwargs or text_pair is not None:
            return self.hf.encode(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        # encode_batch, as transformers calls it: it lets other Python threads run meanwhile (encode holds the GIL
        # for the whole call: a 1 MB prompt would stall the server's event loop)
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs) -> str:
        """Text of ``token_ids``; other keyword arguments: transformers."""
        if kwargs:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False, **kwargs) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs) for ids in sequences]

    # ---- chat template --------------------------------------------------------------------------
    def apply_chat_template(
        self, conversation: list[dict], tools: list[dict] | None = None, *, tokenize: bool = True,
        add_generation_prompt: bool = False, continue_final_message: bool = False, **kwargs,
    ) -> str | list[int]:
        """The conversation rendered with the chat template, as text (``tokenize=False``, what the engine asks
        for). ``continue_final_message``: the text ends right after the last message's content, for the model
        to continue it. ``tokenize=True`` (transformers 5 answers a ``BatchEncoding``) and other arguments
        (documents, another template, batched conversations, tools given as functions, reasoning fields):
        transformers' method. Extra keyword arguments are template variables.

        Raises:
            ValueError: no chat template; ``continue_final_message`` with ``add_generation_prompt``, or the
                last message's content cannot be found in the text.
            jinja2.TemplateError: the template rejects the conversation (``raise_exception``).
        """
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        template = None if tokenize or batched or _UNRENDERED & kwargs.keys() else self._compiled_template()
        if (template is None or batched or isinstance(continue_final_message, str) or _UNRENDERED & kwargs.keys()
                or not _plain_json([conversation, tools, kwargs])
                or any(isinstance(m, dict) and _REASONING & m.keys() for m in conversation)
                or (continue_final_message and conversation and not isinstance(conversation[-1].get("content"), str))):
            return self.hf.apply_chat_template(
                conversation, tools=tools, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if not all(isinstance(m, dict) for m in conversation):
            raise TypeError("chat messages must be dicts")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        # a key whose value is None is left out: templates test presence (``message.tool_calls is defined``)
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        # continue_final_message: a marker after the last content shows where that content ends in the text.
        # Its trailing space tells whether the template trimmed the content's end: then so is the text's.
        final = messages[-1].get("content", "") if continue_final_message else ""
        marker = f"<<TOKENMILL-CONTINUE-{uuid.uuid4().hex.upper()}>> " if continue_final_message else None
        if marker is not None:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + marker}
        text = template.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        if marker is not None:
            at = text.rfind(marker.strip())
            if at < 0 or final.strip() not in text:
                raise ValueError("continue_final_message is set but the final message does not appear in the "
                                 "chat after applying the chat template")
            text = text[:at] if text.startswith(marker, at) else text[:at].rstrip()
        return text

    def _compiled_template(self):
        """The chat template compiled for this class's renderer, or None (no template, or one using syntax
        only transformers' environment knows, such as ``{% generation %}``)."""
        if not self.chat_template:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        return _compile(self.chat_template)

    # ---- everything else: transformers' tokenizer -----------------------------------------------
    @property
    def hf(self):
        """transformers' tokenizer of the same files, loaded on first use (imports transformers)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer, PreTrainedTokenizerFast

                logger.debug("loading transformers' tokenizer for %s", self._saved)
                cls = PreTrainedTokenizerFast if self._hf_class in LIGHT_CLASSES else AutoTokenizer
                try:
                    self._hf = cls.from_pretrained(str(self._saved))
                except OSError:  # the cache entry went away since the start: the same files, from memory
                    with tempfile.TemporaryDirectory() as tmp:
                        self._write(Path(tmp))
                        self._hf = cls.from_pretrained(tmp)
            return self._hf

    def _write(self, directory: Path) -> None:
        """The files this tokenizer was read from, rewritten from memory into ``directory``."""
        (directory / "tokenizer_config.json").write_text(json.dumps(self._fields), encoding="utf-8")
        (directory / "tokenizer.json").write_text(self.backend_tokenizer.to_str(), encoding="utf-8")
        if self.chat_template is not None:
            (directory / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")

    @property
    def hf_class_name(self) -> str:
        """The class transformers would load these files as (what ``/tokenizer_info`` reports)."""
        return self._hf_class

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, *args, **kwargs):
        return self.hf(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LightTokenizer({self.name_or_path!r}, vocab={len(self)})"


def transformers_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` as a transformers tokenizer object (for libraries that check the class, such as
    llguidance and xgrammar): a :class:`LightTokenizer`'s ``hf``, anything else as it is."""
    return tokenizer.hf if isinstance(tokenizer, LightTokenizer) else tokenizer


# apply_chat_template arguments rendered by transformers' method, not here
_UNRENDERED = frozenset({"documents", "chat_template", "return_dict", "return_tensors", "padding", "truncation",
                         "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})
# message keys transformers copies under each other's names (reasoning text): such conversations go there
_REASONING = frozenset({"reasoning_content", "thinking", "reasoning"})


def _plain_json(value: Any) -> bool:
    """Whether ``value`` is built only of JSON types (what a template may see unchanged)."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is list:
        return all(_plain_json(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain_json(v) for k, v in value.items())
    return False


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """JSON for templates: non-ASCII kept, no HTML escaping (Jinja's own ``tojson`` escapes ``<>&'``)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _template_dict(*args, **kwargs) -> dict:
    """``dict(...)`` for templates."""
    return dict(*args, **kwargs)


_template_dict.fromkeys = dict.fromkeys


def _public_names(names) -> None:
    from jinja2.exceptions import SecurityError

    for name in names:
        if not isinstance(name, str) or name.startswith("_"):
            raise SecurityError(f"a template namespace cannot hold the name {name!r}")


def _namespace_class():
    from jinja2.utils import Namespace

    class PublicNamespace(Namespace):
        """Jinja's ``namespace()`` refusing names that start with an underscore (a template from a model file is
        not trusted: no name may reach Python's internals)."""

        def __init__(*args, **kwargs):  # Jinja's signature: namespace(self=...) stays a plain attribute
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            _public_names(attrs)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _public_names([name])
            Namespace.__setitem__(self, name, value)

    return PublicNamespace


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _namespace_class()  # no private names (Jinja's own takes any)
    env.globals["dict"] = _template_dict  # a builder, not the dict type (whose attributes reach the type system)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError:
        return None
