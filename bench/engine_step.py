"""Where an engine step's time goes, in-process: EngineCore.step() on B sequences generating
together (prompt tokens, then decode), the forward timed apart from the rest of the step.

    .venv/bin/python bench/engine_step.py --model ~/.cache/tailguard/bench-m --batch 8 --threads 2
    .venv/bin/python bench/engine_step.py --batch 64 --threads 1          # the embedded model

Prints the median decode step, forward, and outside-the-forward (output head, argmax, plan,
scheduler update) in ms, and the msgpack encode of each step's outputs + stats; --old-buckets
runs with the token-bucket floor of 16 that preceded session 19, --profile adds a cProfile of
the steps. Set OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=200000 to match the served engine.
No baseline: the ratios live in bench_vllm.py; take numbers under `flock -x /tmp/tg-cpu.lock`.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec

from tailguard.core.request import EngineRequest, SamplingParams
from tailguard.engine.config import EngineConfig
from tailguard.engine.core import EngineCore
from tailguard.engine.protocol import UpdateMsg
from tailguard.model.embedded import default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: embedded)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--old-buckets", action="store_true", help="token buckets from 16")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    model = args.model or default_model_dir()
    extra: dict[str, Any] = {}
    if args.old_buckets:
        extra["token_buckets"] = (16, 32, 64, 128, 256, 512, 1024)
    cfg = EngineConfig(
        model_dir=str(model),
        dtype=args.dtype,
        threads=args.threads,
        max_model_len=2048,
        nice=0,
        **extra,
    )
    core = EngineCore(cfg, model)
    core.warmup()
    encode = msgspec.msgpack.Encoder().encode
    rng = random.Random(0)
    forwards: list[float] = []
    inner = core.runner.model.forward

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*a, **k)
        forwards.append(time.perf_counter() - t0)
        return out

    core.runner.model.forward = timed  # type: ignore[method-assign]

    def run(tag: str) -> tuple[list[float], list[float], list[float]]:
        for i in range(args.batch):
            prompt = tuple(rng.randrange(3, 32000) for _ in range(args.prompt))
            sp = SamplingParams(max_tokens=args.output, ignore_eos=True)
            core.add(EngineRequest(request_id=f"{tag}{i}", prompt_token_ids=prompt, sampling=sp))
        steps, encodes = [], []
        forwards.clear()
        while core.has_work():
            t0 = time.perf_counter()
            outs = core.step()
            t1 = time.perf_counter()
            encode(UpdateMsg(outputs=outs, stats=core.stats()))
            steps.append(t1 - t0)
            encodes.append(time.perf_counter() - t1)
        return steps[1:], forwards[1:], encodes[1:]  # [0] is the prefill

    run("warm")
    steps, fwd, enc = run("run")
    s, f, e = (statistics.median(x) * 1e3 for x in (steps, fwd, enc))
    print(
        f"{model.name} batch={args.batch} threads={args.threads} dtype={args.dtype} "
        f"buckets={'from 16' if args.old_buckets else 'from 1'}: decode step {s:.1f} ms, "
        f"forward {f:.1f} ms, outside the forward {s - f:.1f} ms, encode+stats {e:.2f} ms "
        f"({args.batch / (s + e) * 1e3:.0f} tok/s engine-only)"
    )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run("prof")
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
