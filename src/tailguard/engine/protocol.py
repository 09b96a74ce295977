"""Messages on the IPC channel between the engine client and the engine process (msgpack)."""

from __future__ import annotations

import msgspec

from tailguard.core.request import EngineOutput, EngineRequest
from tailguard.core.stats import EngineStats


class AddMsg(msgspec.Struct, tag="add"):
    request: EngineRequest


class AbortMsg(msgspec.Struct, tag="abort"):
    request_id: str


class ShutdownMsg(msgspec.Struct, tag="shutdown"):
    pass


class ReadyMsg(msgspec.Struct, tag="ready"):
    stats: EngineStats
    max_model_len: int
    num_kv_blocks: int


class UpdateMsg(msgspec.Struct, tag="update"):
    outputs: list[EngineOutput]
    stats: EngineStats | None = None


class FatalMsg(msgspec.Struct, tag="fatal"):
    error: str  # why the engine could not start or run; the process exits after sending it


ToEngine = AddMsg | AbortMsg | ShutdownMsg
FromEngine = ReadyMsg | UpdateMsg | FatalMsg
