"""TokenStrings (issue 23, item 1): a token that is not valid UTF-8 alone is shown as a ``bytes:\\xNN``
marker with its raw bytes; every token of the SmolLM2 vocabulary gets a distinct string; the
completions logprobs builder keeps distinct tokens distinct and its text offsets right.
"""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.tiny_models import smollm2_tokenizer
from tokenmill.outputs import Logprob
from tokenmill.server.openai_format import CompletionLogprobs, chat_logprobs
from tokenmill.token_strings import TokenStrings


def marker_bytes(text: str) -> bytes:
    """The bytes a token string stands for: a ``bytes:\\xNN`` marker's bytes, or the text's UTF-8."""
    if text.startswith("bytes:"):
        hex_digits = text[len("bytes:"):].split("\\x")[1:]
        assert all(len(h) == 2 for h in hex_digits), text
        return bytes(int(h, 16) for h in hex_digits)
    return text.encode("utf-8")


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_tokenizer()


def test_every_smollm2_token_has_a_distinct_string_and_its_own_bytes(smollm2):
    strings = TokenStrings(smollm2)
    vocab = smollm2.backend_tokenizer.get_vocab(with_added_tokens=True)
    seen: dict[str, int] = {}
    num_partial = 0
    for token_id in vocab.values():
        token = strings(token_id)
        assert seen.setdefault(token.text, token_id) == token_id, (token.text, token_id, seen[token.text])
        assert marker_bytes(token.text) == token.raw_bytes
        if token.is_partial:
            num_partial += 1
            with pytest.raises(UnicodeDecodeError):
                token.raw_bytes.decode("utf-8")
        else:
            assert token.text == smollm2.decode([token_id])
    assert len(seen) == len(vocab) == 49152
    assert num_partial > 100  # byte-level BPE has many pieces of characters


def test_emoji_pieces_are_bytes_markers(smollm2):
    strings = TokenStrings(smollm2)
    ids = smollm2.encode("😀😃", add_special_tokens=False)
    texts = [strings.text(i) for i in ids]
    assert texts == ["bytes:\\xf0\\x9f", "bytes:\\x98", "bytes:\\x80", "bytes:\\xf0\\x9f", "bytes:\\x98", "bytes:\\x83"]
    assert b"".join(strings(i).raw_bytes for i in ids).decode("utf-8") == "😀😃"
    # A token whose bytes really are U+FFFD (EF BF BD) is text, not a marker.
    [replacement] = smollm2.encode("\ufffd", add_special_tokens=False)
    assert strings(replacement).text == "\ufffd" and strings(replacement).raw_bytes == b"\xef\xbf\xbd"


def test_byte_fallback_tokens_are_bytes_markers():
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "▁a": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    strings = TokenStrings(tokenizer)
    ids = tokenizer.encode("a é", add_special_tokens=False)  # é has no piece: two byte tokens
    assert [strings.text(i) for i in ids] == [" a", " ", "bytes:\\xc3", "bytes:\\xa9"]
    assert strings(4 + 0x41).text == "A" and not strings(4 + 0x41).is_partial  # a byte token that is ASCII


def test_completion_logprobs_keep_partial_tokens_apart_with_text_offsets(smollm2):
    strings = TokenStrings(smollm2)
    ids = smollm2.encode("a😀b", add_special_tokens=False)
    alternatives = smollm2.encode("😃😄😁", add_special_tokens=False)
    entries = []
    for token_id in ids:
        entry = {token_id: Logprob(-0.5, rank=1)}
        for alt in dict.fromkeys(alternatives):
            if alt not in entry:
                entry[alt] = Logprob(-1.0 - len(entry), rank=len(entry) + 1)
        entries.append(entry)
    builder = CompletionLogprobs(strings)
    builder.append(ids, entries)
    got = builder.take()
    assert [len(top) for top in got["top_logprobs"]] == [len(e) for e in entries]  # nothing merged
    assert b"".join(marker_bytes(t) for t in got["tokens"]).decode("utf-8") == "a😀b"
    # Each partial token's offset is where its character starts; "b" follows the one-char emoji.
    assert got["text_offset"] == [0] + [1] * (len(ids) - 2) + [2]

    content = chat_logprobs(ids, entries, 3, strings)["content"]
    assert b"".join(bytes(item["bytes"]) for item in content).decode("utf-8") == "a😀b"
    assert [item["token"] for item in content] == got["tokens"]
    for item in content:
        assert len({t["token"] for t in item["top_logprobs"]}) == 3
