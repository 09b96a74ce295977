"""The request pipeline: owned admission tickets, the embeddings fan-out, a fresh envelope for
cached answers, and an import graph without cycles."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import pytest
from tests.server.inproc import Recorder, request, running_app, until

import tailguard.server
from tailguard.core.request import EngineOutput, EngineRequest, RequestKind
from tailguard.errors import OutOfMemoryRequestError
from tailguard.server.cache import ResponseCache
from tailguard.server.call import Call
from tailguard.server.pipeline import splice
from tailguard.server.schemas import InferRequest


def _call() -> Call:
    now = time.monotonic()
    return Call("POST", "/v1/infer", {}, b"", "127.0.0.1", Recorder(), t_arrival=now, t_read=now)


async def test_a_ticket_leaves_the_ledger_on_every_way_out() -> None:
    async with running_app() as app:
        p = app.pipeline
        req = InferRequest(prompt="x", top_k=1)
        job = p.job(_call(), RequestKind.SCORE, req, endpoint="infer", obj="inference")
        job.ids = (1, 5, 6)
        with pytest.raises(ValueError, match="boom"):
            async with p.admit(_call(), job):
                assert app.admission.queued_requests == 1
                raise ValueError("boom")
        assert app.admission.queued_requests == 0

        async def held() -> None:
            async with p.admit(_call(), job):
                await asyncio.Event().wait()  # until cancelled

        task = asyncio.ensure_future(held())
        await until(lambda: app.admission.queued_requests == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert app.admission.queued_requests == 0


async def test_a_failed_embedding_input_cancels_its_siblings() -> None:
    async with running_app(simulated_tokens_per_s=100.0) as app:
        bad = tuple(app.model.tokenizer.encode("bad"))
        run = app.engine.run
        started: list[str] = []
        cancelled: list[str] = []

        async def spy(req: EngineRequest) -> EngineOutput:
            if req.prompt_token_ids == bad:
                await until(lambda: len(started) == 2)  # the siblings are in the engine
                raise OutOfMemoryRequestError("does not fit")
            started.append(req.request_id)
            try:
                return await run(req)
            except asyncio.CancelledError:
                cancelled.append(req.request_id)
                raise

        app.engine.run = spy  # type: ignore[method-assign]
        body = {"input": ["a long first input", "bad", "a long third input"]}
        # a deadline far off: at 100 tokens/s the 150 ms SLA would refuse the inputs (503)
        # whenever the step-cost fit has caught up with the simulated engine's speed
        headers = {"Cache-Control": "no-store", "X-Request-Timeout-Ms": "20000"}
        r = await request(app, "POST", "/v1/embeddings", body, headers)
        assert r.status == 507, r.body
        assert sorted(cancelled) == sorted(started) and len(started) == 2
        assert app.admission.queued_requests == 0
        await until(lambda: app.engine.stats.aborted_total == 2)


async def test_a_cached_infer_answer_gets_a_fresh_id_and_timing() -> None:
    async with running_app(simulated_tokens_per_s=500.0, max_queued_requests=1) as app:
        body = {"prompt": "cache me", "top_k": 2}
        first = await request(app, "POST", "/v1/infer", body)
        assert first.status == 200
        hold = {"prompt": "hold", "max_tokens": 40, "timeout": 30}
        held = asyncio.ensure_future(request(app, "POST", "/v1/completions", hold))
        await until(lambda: app.admission.queued_requests == 1)
        hit = await request(app, "POST", "/v1/infer", body)
        assert hit.status == 200 and hit.headers["x-tailguard-cache"] == "hit"
        old, new = first.json(), hit.json()
        assert new["top_k"] == old["top_k"] and new["usage"] == old["usage"]
        assert new["id"] != old["id"] and new["object"] == "inference"
        assert new["timing"]["compute_ms"] == 0.0 and old["timing"]["compute_ms"] > 0
        held.cancel()


def test_putting_a_cached_answer_again_only_refreshes_its_recency() -> None:
    """The usual put (the same deterministic answer again) moves the key to the most recently
    used end and leaves the byte count alone; a different answer replaces the old one."""
    cache = ResponseCache(max_entries=2, max_bytes=1000)
    cache.put(b"a", b"{1}")
    cache.put(b"b", b"{22}")
    cache.put(b"a", b"{1}")  # a is now the most recently used
    cache.put(b"c", b"{333}")  # evicts b, the least recently used
    assert cache.get(b"b") is None and cache.get(b"a") == b"{1}" and len(cache) == 2
    cache.put(b"a", b"{4444}")
    assert cache.get(b"a") == b"{4444}"
    assert cache._bytes == len(b"a{4444}") + len(b"c{333}")


def test_splice_makes_one_object() -> None:
    assert splice({"id": "x"}, b'{"a":1}') == b'{"id":"x","a":1}'
    assert splice({"id": "x"}, b"{}") == b'{"id":"x"}'


def _server_imports() -> dict[str, set[str]]:
    """tailguard.server module -> the tailguard.server modules it imports (anywhere in it:
    module level, in functions, under TYPE_CHECKING)."""
    folder = Path(tailguard.server.__file__).parent
    names = {f.stem for f in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in names:
        tree = ast.parse((folder / f"{name}.py").read_text())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "tailguard.server":
                    deps |= {a.name for a in node.names if a.name in names}
                elif node.module.startswith("tailguard.server."):
                    deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps |= {
                    a.name.split(".")[2]
                    for a in node.names
                    if a.name.startswith("tailguard.server.")
                }
        graph[name] = deps - {name}
    return graph


def test_no_import_cycle_in_server() -> None:
    graph = _server_imports()
    assert graph["pipeline"] and graph["app"] >= {"pipeline", "handlers", "generate"}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = " -> ".join([*path[path.index(node) :], node])
            raise AssertionError(f"import cycle in tailguard.server: {cycle}")
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])
