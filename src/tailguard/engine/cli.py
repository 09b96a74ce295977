"""`tailguard generate`: one-shot generation from the command line (in-process engine)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tailguard.engine.config import EngineConfig, available_cores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: embedded model)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from tailguard.core.request import EngineRequest, SamplingParams
    from tailguard.engine.core import EngineCore
    from tailguard.errors import TailguardError
    from tailguard.model.embedded import default_model_dir
    from tailguard.model.tokenizer import load_tokenizer

    try:
        model_dir = Path(args.model) if args.model else default_model_dir()
        config = EngineConfig(
            model_dir=str(model_dir), dtype=args.dtype, warmup=False, threads=available_cores()
        )
        tokenizer = load_tokenizer(model_dir)
        core = EngineCore(config, model_dir)
    except TailguardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ids = tokenizer.encode(args.prompt)
    core.add(
        EngineRequest(
            request_id="cli",
            prompt_token_ids=tuple(ids),
            arrival_s=time.monotonic(),
            sampling=SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
            ),
        )
    )
    out_ids: list[int] = []
    t0 = time.perf_counter()
    while core.has_work():
        for out in core.step():
            out_ids.extend(out.new_token_ids)
            if out.error:
                print(f"error: {out.error}", file=sys.stderr)
                return 1
    dt = time.perf_counter() - t0
    print(args.prompt + tokenizer.decode(out_ids))
    print(
        f"[{len(ids)} prompt + {len(out_ids)} generated tokens in {dt * 1000:.0f} ms, "
        f"{core.runner.dtype}, model {model_dir}]",
        file=sys.stderr,
    )
    return 0
