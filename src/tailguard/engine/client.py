"""EngineClient: the HTTP process's handle on the engine process (submit, stream, abort).

The client owns the process: it starts it, waits for warm-up, and watches it. If the engine
dies, every in-flight request ends with EngineUnavailableError at once (no hanging), `ready`
goes False, and the client restarts it, at most `max_restarts` times. Sockets are recreated on
each restart so messages meant for a dead engine are never replayed into a new one.

This module never imports torch: the HTTP process stays light.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import uuid

import msgspec
import zmq

from tailguard.core.request import EngineRequest
from tailguard.core.stats import EngineStats, StepStats
from tailguard.engine.config import EngineConfig
from tailguard.engine.protocol import (
    AbortMsg,
    AddMsg,
    FatalMsg,
    FromEngine,
    ReadyMsg,
    ShutdownMsg,
    UpdateMsg,
)
from tailguard.engine.router import RequestRouter, RoutedClient
from tailguard.errors import EngineUnavailableError

STARTUP_TIMEOUT_S = 600.0  # loading + warm-up of a large checkpoint can take minutes
WATCH_INTERVAL_S = 0.1
KEEP_STEPS = 1024  # step records kept until `stats` is read (a reader that stops reading)


def _fd(sock: zmq.Socket[bytes]) -> int:
    fd = sock.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    return fd


class EngineClient(RoutedClient):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._stats = EngineStats()
        self._unread_steps: list[StepStats] = []
        self._ready = False
        self._restarts = 0
        self._closing = False
        self._router = RequestRouter(self._send_add, self._send_abort)
        self._proc: subprocess.Popen[bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ipc_dir = tempfile.mkdtemp(prefix="tailguard-ipc-")
        self._ctx = zmq.Context()
        self._push: zmq.Socket[bytes] | None = None
        self._pull: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future[ReadyMsg] | None = None  # resolved by the reader
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromEngine).decode
        self.max_model_len = 0
        self.num_kv_blocks = 0
        self.last_error: str | None = None

    # ---- protocol properties ---------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        s = self._stats
        s.recent_steps, self._unread_steps = self._unread_steps, []  # each step handed over once
        return s

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self._launch()
        self._tasks.append(asyncio.create_task(self._watch(), name="engine-watch"))

    async def close(self) -> None:
        self._closing = True
        self._ready = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if self._push is not None and self._proc is not None and self._proc.poll() is None:
            self._push.send(self._encode(ShutdownMsg()))
        if self._proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self._proc.wait), 5.0)
            except TimeoutError:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait)
        self._fail_all("engine is shutting down")
        self._close_sockets()
        # destroy, not term: term blocks forever if any socket is still open somewhere
        self._ctx.destroy(linger=0)

    async def _launch(self) -> None:
        self._close_sockets()
        tag = uuid.uuid4().hex[:8]
        to_engine = f"ipc://{self._ipc_dir}/in-{tag}"
        from_engine = f"ipc://{self._ipc_dir}/out-{tag}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(to_engine)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(from_engine)
        self._loop = loop = asyncio.get_running_loop()
        self._started = loop.create_future()
        # Engine messages are read in a reader callback, in the event loop's I/O phase, not by
        # a task: a task would wake one loop iteration later, and under a burst an iteration is
        # tens of ms of accepting and parsing. Outputs reach their handlers one hop sooner.
        loop.add_reader(_fd(self._pull), self._on_readable)
        loop.call_soon(self._on_readable)  # the FD is edge-triggered: drain what came before
        env = dict(os.environ)
        # intra-op threads are set deliberately: the engine's count there, 1 everywhere else
        env["OMP_NUM_THREADS"] = str(self.config.threads)
        env["MKL_NUM_THREADS"] = str(self.config.threads)
        # Idle OpenMP workers sleep instead of spinning: on a machine whose cores the HTTP
        # process also needs, spinning workers steal them and stall every small op's barrier.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # ...but spin briefly (libgomp: ~0.1 ms) between the ops of one forward, where the gap
        # is microseconds: sleeping there cost a 246M-parameter model's decode step ~40%
        # (2 cores, 8 streams: 63 -> 95 tok/s; docs/benchmarks.md, issue 12).
        env.setdefault("GOMP_SPINCOUNT", "200000")
        cfg = json.dumps(dataclasses.asdict(self.config))
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tailguard.engine.process",
                "--config-json",
                cfg,
                "--input",
                to_engine,
                "--output",
                from_engine,
            ],
            env=env,
        )
        msg = await self._await_ready()
        self.max_model_len = msg.max_model_len
        self.num_kv_blocks = msg.num_kv_blocks
        self._take_stats(msg.stats)  # its step records are the warm-up steps: keep them
        self._ready = True

    async def _await_ready(self) -> ReadyMsg:
        assert self._started is not None and self._proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while loop.time() < deadline:
            done, _ = await asyncio.wait([self._started], timeout=0.2)
            if done:
                return self._started.result()  # raises if the engine reported a fatal error
            if self._proc.poll() is not None:
                raise EngineUnavailableError(
                    f"engine process exited with code {self._proc.returncode} during start-up; "
                    "see its log above"
                )
        self._proc.kill()
        raise EngineUnavailableError(f"engine not ready after {STARTUP_TIMEOUT_S:.0f} s")

    def _close_sockets(self) -> None:
        self._stop_reader()
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._push = self._pull = None

    # ---- background tasks ------------------------------------------------------------------
    def _on_readable(self) -> None:
        """Drain every message the engine sent (the ZeroMQ FD only signals edges)."""
        while self._pull is not None:
            try:
                raw = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(self._decode(raw))

    def _dispatch(self, msg: FromEngine) -> None:
        if isinstance(msg, UpdateMsg):
            self._router.deliver(msg.outputs)
            if msg.stats is not None:
                self._take_stats(msg.stats)
        elif isinstance(msg, ReadyMsg):
            if self._started is not None and not self._started.done():
                self._started.set_result(msg)
        elif isinstance(msg, FatalMsg):
            self.last_error = msg.error
            if self._started is not None and not self._started.done():
                self._started.set_exception(
                    EngineUnavailableError(f"engine failed to start: {msg.error}")
                )

    async def _watch(self) -> None:
        while not self._closing:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self._proc is None or self._proc.poll() is None:
                continue
            code = self._proc.returncode
            self._ready = False
            self._stop_reader()
            self._fail_all(f"engine process died (exit code {code}); retry shortly")
            if self._restarts >= self.config.max_restarts:
                self.last_error = (
                    f"engine died {self._restarts + 1} times; not restarting "
                    f"(max_restarts={self.config.max_restarts})"
                )
                return
            self._restarts += 1
            try:
                await self._launch()
            except EngineUnavailableError as exc:
                self.last_error = str(exc)

    def _take_stats(self, stats: EngineStats) -> None:
        """Keep the newest snapshot; its step records join those not read yet (the engine
        sends each step once, and a reader polling less often than snapshots arrive must not
        lose them). `stats` hands them over once."""
        self._unread_steps.extend(stats.recent_steps)
        if len(self._unread_steps) > KEEP_STEPS:
            del self._unread_steps[:-KEEP_STEPS]
        stats.recent_steps = []
        self._stats = stats

    def _stop_reader(self) -> None:
        if self._pull is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(_fd(self._pull))

    def _fail_all(self, why: str) -> None:
        self._router.fail_all(why)

    # ---- requests -------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        self._send_abort(request_id)

    def _check_ready(self) -> None:
        if not self._ready or self._push is None:
            raise EngineUnavailableError(
                self.last_error or "engine is not ready yet; retry shortly"
            )

    def _send_add(self, request: EngineRequest) -> None:
        if self._push is None:
            raise EngineUnavailableError(self.last_error or "engine is not ready yet; retry")
        self._push.send(self._encode(AddMsg(request=request)))

    def _send_abort(self, request_id: str) -> None:
        if self._push is not None and self._ready:
            self._push.send(self._encode(AbortMsg(request_id=request_id)))
