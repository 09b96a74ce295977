"""Generated text, token by token: incremental detokenization and stop strings.

`Detokenizer` turns a stream of token ids into text in time linear in the stream's length. It
decodes a short window instead of every id so far (the prefix/read offsets of TGI and vLLM):
`ids[prefix:read]` is the last piece of text handed out, `ids[prefix:]` the same plus the new
ids; the difference is the new text. Decoding the new ids with the previous piece as left
context keeps what a token's text owes to its neighbour (SentencePiece's leading space)
right. While the window ends inside a UTF-8 sequence (the decode ends in U+FFFD), nothing is
handed out until the rest arrives.

`GeneratedText` adds stop strings on top: matched on the text, the earliest wins, and while
streaming the text that could be the start of a stop string is held back until it is known
not to be one.
"""

from __future__ import annotations

from collections.abc import Sequence

from tailguard.model.tokenizer import Tokenizer

__all__ = ["Detokenizer", "GeneratedText"]

# A UTF-8 character is at most 4 bytes, so at most 4 byte tokens: a decode that still ends in
# U+FFFD after this many more adds is not a character being completed but text the model got
# wrong (or chunks that keep ending mid-character): hand out what is complete, so the window
# (and the cost of each decode) stays bounded.
MAX_WAITS = 4
# Left context kept across ids that add no text (special tokens): enough for a leading space.
CONTEXT_IDS = 8


class Detokenizer:
    """Text of a growing list of token ids, one delta per `add`."""

    __slots__ = ("_ids", "_prefix", "_read", "_tok", "_waits")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decode to the last text handed out (left context)
        self._read = 0  # ids before this have been turned into text
        self._waits = 0  # adds in a row whose decode ended inside a character

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Feed ids; return the text they complete ("" while a UTF-8 sequence is incomplete).
        `final`: nothing more comes, hand out everything (an incomplete tail as U+FFFD)."""
        ids = self._ids
        ids.extend(new_ids)
        if len(ids) == self._read:
            return ""
        done = self._tok.decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text = self._tok.decode(ids[self._prefix :])
        if not final and text.endswith("\ufffd"):
            self._waits += 1
            if self._waits <= MAX_WAITS:
                return ""  # wait: the new ids may be the start of one character
            return self._complete_part(done, text)
        self._waits = 0
        if len(text) > len(done):
            self._prefix = self._read
        else:  # no new text (special tokens): keep the context, but not without bound
            self._prefix = max(self._prefix, len(ids) - CONTEXT_IDS)
        self._read = len(ids)
        return text[len(done) :]

    def _complete_part(self, done: str, text: str) -> str:
        """Hand out the text up to the last whole character (or all of it, for garbage)."""
        ids, self._waits = self._ids, 0
        end = len(ids)
        for k in range(len(ids) - 1, max(self._read, len(ids) - 4), -1):
            part = self._tok.decode(ids[self._prefix : k])
            if len(part) > len(done) and not part.endswith("\ufffd"):
                end, text = k, part
                break
        self._prefix, self._read = self._read, end
        return text[len(done) :]


class GeneratedText:
    """A generation's text with stop-string matching and streaming hold-back."""

    __slots__ = ("_detok", "_hold", "_parts", "_pending", "_stops", "stopped")

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self._detok = Detokenizer(tokenizer)
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._parts: list[str] = []  # text handed out
        self._pending = ""  # decoded text held back: it could be the start of a stop string
        self.stopped = False  # a stop string was found; the text ends before it

    @property
    def text(self) -> str:
        """All the text handed out so far (after a final `add`, the whole answer)."""
        return "".join(self._parts)

    def add(self, new_ids: Sequence[int], final: bool) -> str:
        """Feed tokens; return the text that is now safe to send."""
        if self.stopped:
            return ""
        # A stop string cannot start in text already handed out: the hold-back keeps the last
        # (longest stop - 1) characters, so searching what is held plus the new text is enough.
        buf = self._pending + self._detok.add(new_ids, final)
        hits = [i for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:  # the earliest stop string wins
            buf = buf[: min(hits)]
            self.stopped = True
        end = len(buf) if final or self.stopped else max(len(buf) - self._hold, 0)
        self._pending = buf[end:]
        delta = buf[:end]
        if delta:
            self._parts.append(delta)
        return delta
