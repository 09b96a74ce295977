"""RequestRouter: the per-request plumbing shared by the real and the simulated engine clients."""

from __future__ import annotations

import asyncio

import pytest

from tailguard.core.request import EngineOutput, EngineRequest, FinishReason
from tailguard.engine.router import RequestRouter
from tailguard.errors import EngineUnavailableError


class Engine:
    """Records what the router sends; the test plays the engine's part."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.aborted: list[str] = []
        self.router = RequestRouter(lambda r: self.sent.append(r.request_id), self.aborted.append)


def _req(rid: str) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=(5, 6))


def _out(rid: str, tok: int, done: bool = False) -> EngineOutput:
    reason = FinishReason.LENGTH if done else None
    return EngineOutput(rid, new_token_ids=[tok], finished=done, finish_reason=reason)


async def test_outputs_reach_their_stream_after_the_listener() -> None:
    e = Engine()
    order: list[str] = []
    e.router.on_output = lambda out: order.append(f"ledger {out.new_token_ids[0]}")
    it = e.router.stream(_req("a"))
    first = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0)
    assert e.sent == ["a"]
    e.router.deliver([_out("a", 7), _out("other", 9)])  # nobody reads "other": dropped
    out = await first
    order.append(f"handler {out.new_token_ids[0]}")
    assert out.received_s > 0
    e.router.deliver([_out("a", 8, done=True)])
    assert [o.new_token_ids async for o in it] == [[8]]
    assert order == ["ledger 7", "ledger 9", "handler 7", "ledger 8"]
    assert e.aborted == [] and len(e.router) == 0  # finished: nothing to abort


async def test_closing_a_stream_early_aborts_it() -> None:
    e = Engine()
    it = e.router.stream(_req("a"))
    pending = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0)
    e.router.deliver([_out("a", 7)])
    await pending
    await it.aclose()
    assert e.aborted == ["a"] and len(e.router) == 0


async def test_cancelling_a_single_pass_request_aborts_it() -> None:
    e = Engine()
    task = asyncio.ensure_future(e.router.single(_req("q")))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert e.aborted == ["q"] and len(e.router) == 0


async def test_a_dead_engine_fails_every_request_at_once() -> None:
    e = Engine()
    stream = e.router.stream(_req("a"))
    reads = asyncio.ensure_future(stream.__anext__())
    single = asyncio.ensure_future(e.router.single(_req("q")))
    await asyncio.sleep(0)
    e.router.fail_all("engine died")
    for fut in (reads, single):
        with pytest.raises(EngineUnavailableError, match="engine died"):
            await fut
    assert e.aborted == []  # nothing to abort in a dead engine


async def test_one_request_id_at_a_time() -> None:
    e = Engine()
    single = asyncio.ensure_future(e.router.single(_req("q")))
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="already in flight"):
        await e.router.single(_req("q"))
    e.router.deliver([EngineOutput("q", finished=True, finish_reason=FinishReason.DONE)])
    assert (await single).finish_reason == FinishReason.DONE
