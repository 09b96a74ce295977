"""Graceful degradation: a bounded exact-match cache of deterministic answers.

Only requests whose answer cannot change are stored (temperature 0 or a fixed seed; embeddings and
single-pass queries always). The cache is consulted only when the server would otherwise fail the
request (overload rejection, out-of-memory), never on the normal path, so a cached answer is
never preferred to a fresh one. `Cache-Control: no-cache` opts a request out of being served from
the cache, `no-store` out of being stored. It holds an answer's deterministic payload only
(choices, data, usage): the envelope (id, created, timing) is made fresh for every answer.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["ResponseCache"]


class ResponseCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: bytes) -> bytes | None:
        payload = self._data.get(key)
        if payload is not None:
            self._data.move_to_end(key)
        return payload

    def put(self, key: bytes, payload: bytes) -> None:
        size = len(key) + len(payload)
        if not self.enabled or size > self.max_bytes:
            return
        old = self._data.get(key)
        if old == payload:  # a key seen before answers the same (deterministic): recency only
            self._data.move_to_end(key)
        else:
            if old is not None:
                del self._data[key]
                self._bytes -= len(key) + len(old)
            self._data[key] = payload
            self._bytes += size
        while len(self._data) > self.max_entries or self._bytes > self.max_bytes:
            k, v = self._data.popitem(last=False)  # least recently used
            self._bytes -= len(k) + len(v)
