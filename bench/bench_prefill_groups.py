"""Prefill chunks grouped by query bucket (engine/plan.py's `_by_query_bucket`) against one group
for every prefill chunk (before session 23), side by side in one process, same requests.

    .venv/bin/python bench/bench_prefill_groups.py [--model DIR] [--requests 192] [--rounds 2]

Each run adds every request at once (prompts of 4-300 tokens, a few output tokens, greedy), so
the prefill steps mix short and long chunks, and times EngineCore.step() until the engine
drains: total, the prefill steps' share, and the tokens. Runs alternate A B B A ... and print
the per-variant medians and the ratio (one group / by bucket) last. Tokens must be identical.
Not part of `make test`; take numbers under `flock -x /tmp/tg-cpu.lock`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

import tailguard.engine.plan as plan_mod
from tailguard.core.request import EngineRequest, SamplingParams
from tailguard.core.scheduler import ScheduledSeq
from tailguard.engine.config import EngineConfig
from tailguard.engine.core import EngineCore
from tailguard.model.embedded import default_model_dir

BY_BUCKET = plan_mod._by_query_bucket


def one_prefill_group(items: list[ScheduledSeq]) -> list[list[int]]:
    """Before session 23: the decodes, then every prefill chunk in one group."""
    decode = [i for i, it in enumerate(items) if it.num_new == 1]
    prefill = [i for i, it in enumerate(items) if it.num_new > 1]
    return [g for g in (decode, prefill) if g]


def run(core: EngineCore, requests: list[EngineRequest]) -> tuple[float, float, list[list[int]]]:
    for r in requests:
        core.add(r)
    total = prefill = 0.0
    outs: dict[str, list[int]] = {}
    while core.has_work():
        t0 = time.perf_counter()
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        dt = time.perf_counter() - t0
        total += dt
        if core.log.take()[-1].num_prefill_tokens:
            prefill += dt
    return total, prefill, [outs[r.request_id] for r in requests]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: embedded)")
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--output", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = args.model or default_model_dir()
    torch.set_num_threads(args.threads)
    core = EngineCore(EngineConfig(model_dir=str(model), threads=args.threads, nice=0), Path(model))
    core.warmup()
    rng = random.Random(7)
    vocab = core.runner.mcfg.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(4, 300))] for _ in range(args.requests)
    ]
    tokens: dict[str, list[list[int]]] = {}
    times: dict[str, list[tuple[float, float]]] = {"by bucket": [], "one group": []}
    order = ["by bucket", "one group", "one group", "by bucket"] * args.rounds
    for n, variant in enumerate(order):
        plan_mod._by_query_bucket = BY_BUCKET if variant == "by bucket" else one_prefill_group
        reqs = [
            EngineRequest(
                request_id=f"{n}-{i}",
                prompt_token_ids=tuple(prompts[i]),
                sampling=SamplingParams(max_tokens=args.output, ignore_eos=True),
            )
            for i in range(args.requests)
        ]
        total, prefill, got = run(core, reqs)
        tokens.setdefault(variant, got)
        assert tokens[variant] == got
        times[variant].append((total, prefill))
        print(f"  {variant:9s}: {total * 1e3:8.1f} ms, prefill steps {prefill * 1e3:8.1f} ms")
    plan_mod._by_query_bucket = BY_BUCKET
    same = tokens["by bucket"] == tokens["one group"]
    med = {v: statistics.median(t for t, _ in ts) for v, ts in times.items()}
    pre = {v: statistics.median(p for _, p in ts) for v, ts in times.items()}
    print(f"tokens identical: {same}")
    print(
        f"prefill steps: one group {pre['one group'] * 1e3:.1f} ms, by bucket "
        f"{pre['by bucket'] * 1e3:.1f} ms: {pre['one group'] / pre['by bucket']:.2f}x"
    )
    print(
        f"total: one group {med['one group'] * 1e3:.1f} ms, by bucket "
        f"{med['by bucket'] * 1e3:.1f} ms: {med['one group'] / med['by bucket']:.2f}x"
    )


if __name__ == "__main__":
    main()
