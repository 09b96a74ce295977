"""GCTimer: every garbage-collector pause of this process, timed through gc.callbacks.

One timer for both processes: the engine reports its total in its stats, the HTTP server's
metrics read theirs at every scrape (`tailguard_gc_pause_seconds_total{process}`).
"""

from __future__ import annotations

import gc
import time

__all__ = ["GCTimer"]


class GCTimer:
    def __init__(self) -> None:
        self.pause_s_total = 0.0
        self.collections = 0
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        # Only plain arithmetic here: a collection can start while this thread holds a lock
        # (any allocation may trigger GC), and taking that lock again from here deadlocks.
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0:
            self.pause_s_total += time.perf_counter() - self._t0
            self.collections += 1
            self._t0 = 0.0
