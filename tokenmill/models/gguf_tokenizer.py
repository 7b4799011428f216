"""A GGUF tokenizer's pre-tokenizer as llama.cpp splits text for the file's ``tokenizer.ggml.pre``.

transformers rebuilds a byte-level BPE tokenizer from GGUF metadata with GPT-2's split (one regex ending in
``\\s+(?!\\S)|\\s+``) unless it knows the ``pre`` value (it knows llama3, qwen2, tekken, gpt-4o and their aliases,
with llama.cpp's regexes). For the values below llama.cpp splits otherwise: ``smollm`` and the StarCoder family
first cut every digit out on its own, so "\\n\\n" before a digit is one piece (one token) in llama.cpp and two
"\\n" tokens after GPT-2's split. Here the split becomes llama.cpp's list of regexes, each applied to the pieces
the one before left (pieces between matches kept), then byte-level encoding, so the ids equal llama.cpp's.
Source of the regex lists: llama.cpp's ``llm_tokenizer_bpe`` (src/llama-vocab.cpp), per pre-tokenizer type.

Pure Python (the ``tokenizers`` package only, no torch): the router loads this file on its own.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

# llama.cpp's GPT-2 regex: GPT-2's without the trailing ``|\s+`` (a lone whitespace before a non-space is the
# piece between two matches, as llama.cpp keeps it).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> the regexes llama.cpp applies in turn (only values whose split transformers gets wrong).
LLAMA_CPP_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    _DIGITS_THEN_GPT2),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling", "mellum",
                     "gigachat", "a.x-4.0", "modern-bert", "roberta-bpe"), (_GPT2,)),
    "falcon": _FALCON,
}


def llama_cpp_pre_tokenizer(pre: str | None) -> Any | None:
    """The ``tokenizers`` pre-tokenizer that splits as llama.cpp does for ``tokenizer.ggml.pre`` = ``pre``
    (a Sequence of isolating regex Splits, then byte-level encoding without a regex of its own), or None where
    transformers' own conversion already splits as llama.cpp (or ``pre`` is not in ``LLAMA_CPP_SPLITS``)."""
    from tokenizers import Regex, pre_tokenizers

    regexes = LLAMA_CPP_SPLITS.get(pre or "")
    if regexes is None:
        return None
    return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def apply_llama_cpp_split(tokenizer: Any, model: str | None, pre: str | None) -> bool:
    """Give ``tokenizer`` (a transformers fast tokenizer built from a GGUF file) llama.cpp's pre-tokenizer for
    the file's ``tokenizer.ggml.model`` / ``tokenizer.ggml.pre``; only byte-level BPE files (model "gpt2") change.
    Returns whether it changed."""
    split = llama_cpp_pre_tokenizer(pre) if model == "gpt2" else None
    if split is None:
        return False
    tokenizer.backend_tokenizer.pre_tokenizer = split
    return True


def read_tokenizer_kind(path: Path) -> tuple[str | None, str | None]:
    """(``tokenizer.ggml.model``, ``tokenizer.ggml.pre``) of a GGUF file, with the ``gguf`` package's reader (for
    callers without tokenmill's own header reader, such as the router)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def text(key: str) -> str | None:
        field = reader.get_field(key)
        return None if field is None else str(field.contents())

    return text("tokenizer.ggml.model"), text("tokenizer.ggml.pre")
