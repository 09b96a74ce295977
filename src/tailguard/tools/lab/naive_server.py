"""The runbook's server, built the runbook's way: the baseline tailguard is measured against.

FastAPI; `/v1/infer` runs one unpadded forward pass of the model per request in a
ThreadPoolExecutor of 2 x cores, with `torch.set_num_threads(2 x cores)` ("physical cores x 2");
no admission control, no batching, no deadlines: under a burst every request queues in the pool
and everyone is late. `/metrics` exports `mistral_inference_latency_seconds` (SLA buckets).
Kept deliberately naive; do not fix it here. Run:

    python -m tailguard.tools.lab.naive_server --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest

from tailguard.core.sla import SLA_BUCKETS
from tailguard.model.batch import NULL_BLOCK, AttnGroup, ForwardBatch
from tailguard.model.embedded import default_model_dir
from tailguard.model.loader import load_model
from tailguard.model.mistral import MistralModel, allocate_kv_cache
from tailguard.model.tokenizer import load_tokenizer

__all__ = ["build_app", "main"]

BLOCK = 16


def forward_one(model: MistralModel, ids: list[int], top_k: int) -> dict[str, Any]:
    """One request, one unpadded forward: a fresh KV cache per call (the runbook's allocations)."""
    cfg = model.config
    t = len(ids)
    nblocks = (t + BLOCK - 1) // BLOCK
    dtype = model.embed_tokens.weight.dtype
    kv = allocate_kv_cache(cfg, nblocks + 1, BLOCK, dtype, "cpu")  # block 0 is the null block
    group = AttnGroup(
        token_index=torch.arange(t)[None],  # [1, T]
        block_tables=torch.arange(1, nblocks + 1)[None],  # [1, B]
        context_lens=torch.tensor([t]),
        query_start=torch.tensor([0]),
    )
    batch = ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.arange(t),
        slot_mapping=torch.arange(t) + BLOCK * (NULL_BLOCK + 1),
        groups=(group,),
    )
    with torch.inference_mode():
        hidden = model(batch, kv)  # [T, H]
        logprobs = torch.log_softmax(model.compute_logits(hidden[-1:]), dim=-1)[0]  # [V]
        top = torch.topk(logprobs, top_k)
    return {
        "top_k": [
            {"token_id": int(i), "logprob": float(v)}
            for v, i in zip(top.values, top.indices, strict=True)
        ]
    }


def build_app() -> FastAPI:
    cores = os.cpu_count() or 1
    torch.set_num_threads(2 * cores)  # the runbook's "physical cores x 2"
    model_dir = default_model_dir()
    model, _cfg = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    pool = ThreadPoolExecutor(max_workers=2 * cores)
    registry = CollectorRegistry()
    latency = Histogram(
        "mistral_inference_latency_seconds",
        "End-to-end server time",
        ["endpoint", "outcome"],
        buckets=SLA_BUCKETS,
        registry=registry,
    )
    app = FastAPI(title="naive runbook server")

    @app.post("/v1/infer")
    async def infer(request: Request) -> JSONResponse:
        t0 = time.monotonic()
        body = await request.json()
        ids = body.get("input_ids") or tok.encode(body.get("prompt", ""), add_bos=True)
        loop = asyncio.get_running_loop()
        t_submit = time.monotonic()
        out = await loop.run_in_executor(pool, forward_one, model, ids, int(body.get("top_k", 5)))
        out["timing"] = {
            "queue_ms": 0.0,
            "compute_ms": (time.monotonic() - t_submit) * 1e3,
            "server_ms": (time.monotonic() - t0) * 1e3,
        }
        latency.labels("infer", "ok").observe(time.monotonic() - t0)
        return JSONResponse(out)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--backlog", type=int, default=2048, help="uvicorn's default")
    args = p.parse_args(argv)
    app = build_app()
    print(f"naive server: listening on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, backlog=args.backlog, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
