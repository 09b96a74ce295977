"""The engine process: the only process that runs model code.

    python -m tailguard.engine.process --config-json '{...}' --input ipc://... --output ipc://...

It pulls requests and aborts from the client, runs EngineCore.step() while there is work, and
pushes outputs after every step, with a stats snapshot at most every STATS_INTERVAL_S.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import msgspec
import zmq

from tailguard.engine.config import EngineConfig
from tailguard.engine.protocol import (
    AbortMsg,
    AddMsg,
    FatalMsg,
    ReadyMsg,
    ShutdownMsg,
    ToEngine,
    UpdateMsg,
)

STATS_INTERVAL_S = 0.01  # snapshots cost a few syscalls and an O(queued) sum: not every step
IDLE_POLL_MS = 50  # how long an idle engine blocks waiting for work


def config_from_json(text: str) -> EngineConfig:
    raw = json.loads(text)
    for key in ("seq_buckets", "token_buckets"):
        if key in raw:
            raw[key] = tuple(raw[key])
    return EngineConfig(**raw)


def set_priority(nice: int) -> None:
    """Raise (or lower) this process's CPU priority; without the permission, say so and go on."""
    if nice == 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        print(
            f"tailguard engine: cannot set nice={nice} (needs CAP_SYS_NICE); "
            "running at the default priority",
            file=sys.stderr,
        )


def serve(config: EngineConfig, input_addr: str, output_addr: str) -> int:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(output_addr)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(ToEngine).decode
    try:
        from tailguard.engine.core import EngineCore
        from tailguard.model.embedded import default_model_dir

        model_dir = Path(config.model_dir) if config.model_dir else default_model_dir()
        core = EngineCore(config, model_dir)
        core.warmup()
    except Exception as exc:
        push.send(encode(FatalMsg(error=f"{type(exc).__name__}: {exc}")))
        traceback.print_exc()
        push.close(linger=2000)
        return 1
    push.send(
        encode(
            ReadyMsg(
                stats=core.stats(),
                max_model_len=core.runner.max_model_len,
                num_kv_blocks=core.runner.layout.num_blocks,
            )
        )
    )
    parent = os.getppid()
    last_stats = 0.0
    while True:
        timeout = 0 if core.has_work() else IDLE_POLL_MS
        aborted = []
        while pull.poll(timeout):
            timeout = 0
            msg = decode(pull.recv())
            if isinstance(msg, AddMsg):
                core.add(msg.request)
            elif isinstance(msg, AbortMsg):
                out = core.abort(msg.request_id)
                if out is not None:
                    aborted.append(out)
            elif isinstance(msg, ShutdownMsg):
                push.close(linger=1000)
                return 0
        outputs = aborted + (core.step() if core.has_work() else [])
        now = time.monotonic()
        stats = None
        if now - last_stats >= STATS_INTERVAL_S:
            stats, last_stats = core.stats(), now
        if outputs or stats is not None:
            push.send(encode(UpdateMsg(outputs=outputs, stats=stats)))
        if not outputs and os.getppid() != parent:  # orphaned: the server is gone
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tailguard-engine")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    config = config_from_json(args.config_json)
    set_priority(config.nice)
    if config.device.startswith("cuda"):
        from tailguard.engine.allocator import configure_cuda_allocator

        configure_cuda_allocator()
    return serve(config, args.input, args.output)


if __name__ == "__main__":
    sys.exit(main())
