"""Incremental detokenization and stop strings (tailguard.server.text)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailguard.model.embedded import mistral_v1_tokenizer_path
from tailguard.model.tokenizer import Tokenizer, load_tokenizer
from tailguard.server.text import Detokenizer, GeneratedText
from tailguard.server.tokenizer import SimpleTokenizer

SIMPLE = SimpleTokenizer()


class CountingTokenizer:
    """Counts the ids every decode call is given (the cost of detokenizing)."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.bos_id, self.eos_id, self.vocab_size = inner.bos_id, inner.eos_id, inner.vocab_size
        self.decoded_ids = 0

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.inner.encode(text, add_bos)

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded_ids += len(ids)
        return self.inner.decode(ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.inner.apply_chat_template(messages)


def _stream(tok: Tokenizer, ids: list[int], chunks: Sequence[int] = (1,)) -> list[str]:
    """Feed `ids` in chunks of the given sizes (cycled); the deltas, the last one final."""
    detok = Detokenizer(tok)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        part, i, k = ids[i : i + n], i + n, k + 1
        deltas.append(detok.add(part, final=i >= len(ids)))
    return deltas


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("v1")
    shutil.copy(mistral_v1_tokenizer_path(), folder / "tokenizer.model.v1")
    return load_tokenizer(Path(folder))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60), st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_deltas_add_up_to_the_whole_decode(text: str, chunks: list[int]) -> None:
    ids = SIMPLE.encode(text, add_bos=False)
    deltas = _stream(SIMPLE, ids, chunks)
    assert "".join(deltas) == text
    # a character split over byte tokens is never handed out half-done
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_waits_for_its_last_byte() -> None:
    detok = Detokenizer(SIMPLE)
    euro = SIMPLE.encode("€", add_bos=False)  # three byte tokens
    assert len(euro) == 3
    assert detok.add(euro[:1]) == ""
    assert detok.add(euro[1:2]) == ""
    assert detok.add(euro[2:]) == "€"
    assert detok.add(SIMPLE.encode("x", add_bos=False)) == "x"


def test_incomplete_tail_is_handed_out_at_the_end() -> None:
    detok = Detokenizer(SIMPLE)
    cut = SIMPLE.encode("€", add_bos=False)[:2]
    assert detok.add(cut) == ""
    assert detok.add([], final=True) == "\ufffd"


def test_garbage_bytes_do_not_grow_the_window_forever() -> None:
    tok = CountingTokenizer(SIMPLE)
    detok = Detokenizer(tok)
    stray = 0x80 + 3  # a lone UTF-8 continuation byte: never completes a character
    out = "".join(detok.add([stray]) for _ in range(1000))
    assert out.count("\ufffd") > 0
    assert tok.decoded_ids < 40 * 1000  # bounded window, not 1000**2 / 2


def test_sentencepiece_spaces_survive(spm: Tokenizer) -> None:
    text = "Hello world, this is a test of ünïcode and 12345 numbers."
    ids = spm.encode(text, add_bos=False)
    whole = spm.decode(ids)
    for chunks in ((1,), (2,), (3, 1)):
        assert "".join(_stream(spm, ids, chunks)) == whole


@pytest.mark.parametrize("n", [500, 4000])
def test_decoding_cost_is_linear(n: int) -> None:
    tok = CountingTokenizer(SIMPLE)
    text = GeneratedText(tok, ["never appears"])
    ids = SIMPLE.encode("abcdefghij" * (n // 10), add_bos=False)
    for i, t in enumerate(ids):
        text.add([t], final=i == len(ids) - 1)
    assert text.text == "abcdefghij" * (n // 10)
    # each id is decoded about twice (once as new text, once as left context); re-decoding
    # everything each time would be n**2 / 2
    assert tok.decoded_ids <= 3 * n


def _feed(text: GeneratedText, s: str, final: bool = True) -> list[str]:
    ids = SIMPLE.encode(s, add_bos=False)
    return [text.add([t], final=final and i == len(ids) - 1) for i, t in enumerate(ids)]


def test_stop_string_across_tokens_is_never_sent() -> None:
    text = GeneratedText(SIMPLE, ["STOP"])
    deltas = _feed(text, "hello STOP and more")
    assert text.stopped
    assert "".join(deltas) == text.text == "hello "
    assert not any("S" in d for d in deltas)


def test_earliest_stop_string_wins() -> None:
    text = GeneratedText(SIMPLE, ["xyz", "b"])
    _feed(text, "aaxybxyz")
    assert text.text == "aaxy"


def test_held_back_text_that_was_not_a_stop_is_sent() -> None:
    text = GeneratedText(SIMPLE, ["abc"])
    deltas = _feed(text, "xxab", final=False)
    assert "".join(deltas) == "xx"  # "ab" may be the start of "abc"
    assert text.add(SIMPLE.encode("d", add_bos=False), final=False) == "abd"[:1]
    assert text.add([], final=True) == "bd"
    assert text.text == "xxabd" and not text.stopped


def test_no_stop_strings_holds_nothing_back() -> None:
    text = GeneratedText(SIMPLE, [])
    assert _feed(text, "abc", final=False) == ["a", "b", "c"]
