"""Run `tailguard serve` with garbage-collector pressure: the lab's way to inject GC pauses.

A heap of `--objects` small lists is kept alive (the long-lived object graph a leaky cache
builds) and a thread runs a full collection every `--interval-s`; each one walks the whole heap
while holding the GIL, so the event loop and every request stop for its duration, and the
server's own gc.callbacks count it in tailguard_gc_pause_seconds. Run:

    python -m tailguard.tools.lab.gc_pressure --objects 1500000 --interval-s 0.5 -- serve ...

Everything after `--` is passed to `tailguard` unchanged (the server is started in-process
with runpy, so this module imports nothing of the server itself).
"""

from __future__ import annotations

import argparse
import gc
import runpy
import sys
import threading
import time

__all__ = ["main"]


def _collector(objects: int, interval_s: float, stop: threading.Event) -> None:
    # tailguard's server gc.freeze()s its start-up heap (never scanned again), so the
    # pressure's heap is built after that: once the freeze happened, or after 30 s anyway.
    deadline = time.monotonic() + 30.0
    while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
        if stop.wait(0.05):
            return
    heap = [[i] for i in range(objects)]  # kept alive while the thread runs
    t0 = time.perf_counter()
    gc.collect()
    pause_ms = (time.perf_counter() - t0) * 1e3
    print(f"gc_pressure: {len(heap)} objects, a full collection takes {pause_ms:.0f} ms, "
          f"every {interval_s:g} s", flush=True)  # fmt: skip
    while not stop.wait(interval_s):
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("gc_pressure: give the tailguard command after `--`", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--objects", type=int, default=1_000_000, help="long-lived lists kept alive")
    p.add_argument("--interval-s", type=float, default=0.5, help="seconds between collections")
    args = p.parse_args(argv[:cut])
    if args.objects < 0 or args.interval_s <= 0:
        p.error("--objects must be >= 0 and --interval-s > 0")
    stop = threading.Event()
    worker = threading.Thread(target=_collector, args=(args.objects, args.interval_s, stop),
                              daemon=True)  # fmt: skip
    worker.start()
    sys.argv = ["tailguard", *argv[cut + 1 :]]
    try:
        runpy.run_module("tailguard.cli", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
