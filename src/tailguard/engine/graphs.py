"""Decode steps replayed from CUDA graphs, one per (sequence bucket G, block bucket B).

A decode step of a 246M model on an H200 is bound by kernel launches, not by the GPU: ~15 ms
eager (16 layers x ~20 launches from Python) against ~1.9 ms replayed from a graph
(bench/gpu_check.sh, session 23). Every decode step's shape is already a bucket (G sequences
of one query over B blocks: engine/buckets.py), so warm-up captures one graph per decode
bucket and serving replays the one that holds the step.

A graph reads fixed addresses: each step's inputs are copied into static buffers sized for the
largest bucket (a graph of G rows and B blocks reads their first G rows and the table buffer of
width B), and its outputs land in static `hidden` / `logits` buffers, so the graphs share one
memory pool and none keeps its own outputs alive. Graphs are captured largest first, so smaller
ones reuse the pool's blocks.

Padding rows decode token 0 at position 0 into the reserved null block's slot, with a context
of one key (finite, never NaN), as the eager path's padding does.

`GraphMode.STATIC` runs the same buffers and forward without capturing (any device): the CPU
tests exercise every line of this path but the capture itself.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tailguard.core.request import RequestKind
from tailguard.core.scheduler import ScheduledSeq
from tailguard.engine.buckets import ShapeKey, bucket_for
from tailguard.model.batch import NULL_BLOCK, AttnGroup, ForwardBatch
from tailguard.model.mistral import KVCache, MistralModel

log = logging.getLogger("tailguard.engine")


class GraphMode(enum.Enum):
    CUDA = "cuda"  # captured CUDA graphs
    STATIC = "static"  # the same static buffers, the forward called directly (tests, CPU)


def graph_key(g: int, b: int) -> ShapeKey:
    return ("decode_graph", g, b)


def graph_eligible(items: Sequence[ScheduledSeq]) -> bool:
    """A step the graphs can run: every sequence generating one token from one new token, and
    none wanting its hidden state (embeddings) or log-probs of a prompt."""
    for it in items:
        req = it.seq.request
        if (
            it.num_new != 1
            or not it.completes
            or req.kind != RequestKind.GENERATE
            or it.seq.is_single_pass
            or req.want_embedding
        ):
            return False
    return bool(items)


@dataclass(frozen=True)
class DecodeOutput:
    hidden: torch.Tensor  # [n, H] final-norm hidden state of each sequence (a static view)
    logits: torch.Tensor  # [n, vocab] in the model dtype (a static view)
    key: ShapeKey


class DecodeGraphs:
    """Static input/output buffers and one replayable decode forward per (G, B)."""

    def __init__(
        self,
        model: MistralModel,
        kv_caches: KVCache,
        seq_buckets: Sequence[int],
        ladder: Sequence[int],
        block_size: int,
        mode: GraphMode,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.seq_buckets = tuple(seq_buckets)
        self.ladder = tuple(ladder)
        self.block_size = block_size
        self.mode = mode
        dev = model.device
        g_max = self.seq_buckets[-1]
        # rows: token id, position, KV slot, context length; one host-to-device copy per step
        self.meta = torch.zeros(4, g_max, dtype=torch.long, device=dev)
        self.input_ids, self.positions, self.slots, self.context_lens = self.meta.unbind(0)
        self.token_index = torch.arange(g_max, dtype=torch.long, device=dev).view(g_max, 1)
        self.tables = {
            b: torch.full((g_max, b), NULL_BLOCK, dtype=torch.long, device=dev) for b in self.ladder
        }
        self.hidden = torch.zeros(g_max, model.config.hidden_size, dtype=model.dtype, device=dev)
        self.logits = torch.zeros(g_max, model.config.vocab_size, dtype=model.dtype, device=dev)
        # host staging (engine/graphs.py `load`): numpy views of (on CUDA pinned) CPU tensors
        pin = mode is GraphMode.CUDA
        self._host_meta = torch.zeros(4, g_max, dtype=torch.long, pin_memory=pin)
        self._host_tables = {
            b: torch.zeros(g_max, b, dtype=torch.long, pin_memory=pin) for b in self.ladder
        }
        self._host_meta_np = self._host_meta.numpy()
        self._host_tables_np = {b: t.numpy() for b, t in self._host_tables.items()}
        self._padding = np.array([[0], [0], [NULL_BLOCK * block_size], [1]], dtype=np.int64)
        self._replay: dict[tuple[int, int], Callable[[], None]] = {}
        self._pool: Any = None  # torch.cuda.graph_pool_handle(), shared by every graph

    # ---- capture -------------------------------------------------------------------------
    def forward_fn(self, g: int, b: int) -> Callable[[], None]:
        """The decode forward + head of bucket (G, B) on the static buffers."""
        group = AttnGroup(
            token_index=self.token_index[:g],
            block_tables=self.tables[b][:g],
            context_lens=self.context_lens[:g],
            query_start=self.positions[:g],  # a decode's one query sits at its position
        )
        batch = ForwardBatch(
            input_ids=self.input_ids[:g],
            positions=self.positions[:g],
            slot_mapping=self.slots[:g],
            groups=(group,),
        )
        model, kv, hidden_out, logits_out = self.model, self.kv_caches, self.hidden, self.logits

        def forward() -> None:
            hidden = model(batch, kv)
            hidden_out[:g].copy_(hidden)
            logits_out[:g].copy_(model.head(hidden))

        return forward

    def capture(self, keys: Sequence[tuple[int, int]]) -> float:
        """Make (G, B) replayable for each key, largest first; returns the seconds taken.
        Raises what the capture raises (the runner then serves eagerly)."""
        t0 = time.perf_counter()
        self._reset_inputs(self.seq_buckets[-1])
        for g, b in sorted(keys, reverse=True):
            fn = self.forward_fn(g, b)
            self._replay[(g, b)] = fn if self.mode is GraphMode.STATIC else self._cuda_graph(fn)
        return time.perf_counter() - t0

    def _cuda_graph(self, fn: Callable[[], None]) -> Callable[[], None]:  # pragma: no cover
        """Warm `fn` on a side stream (lazy inits, cuBLAS workspaces), then record it into
        the shared pool."""
        dev = self.model.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():
            fn()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            fn()
        return graph.replay

    # ---- replay --------------------------------------------------------------------------
    @property
    def keys(self) -> list[ShapeKey]:
        return [graph_key(g, b) for g, b in self._replay]

    def bucket(self, items: Sequence[ScheduledSeq]) -> tuple[int, int] | None:
        """The captured (G, B) that holds this decode step, or None (run it eagerly)."""
        if len(items) > self.seq_buckets[-1]:
            return None
        blocks = max(len(it.seq.block_table) for it in items)
        if blocks > self.ladder[-1]:
            return None
        key = (bucket_for(self.seq_buckets, len(items)), bucket_for(self.ladder, blocks))
        return key if key in self._replay else None

    def run(self, items: Sequence[ScheduledSeq], key: tuple[int, int]) -> DecodeOutput:
        g, b = key
        bs = self.block_size
        ids, pos, slots, ctx, tables = [], [], [], [], []
        for it in items:
            seq, p = it.seq, it.start
            table = seq.block_table
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            tables.append(table)
        self.load(g, b, ids, pos, slots, ctx, tables)
        with torch.inference_mode():
            self._replay[key]()
        n = len(items)
        return DecodeOutput(self.hidden[:n], self.logits[:n], graph_key(g, b))

    def load(
        self,
        g: int,
        b: int,
        ids: Sequence[int],
        pos: Sequence[int],
        slots: Sequence[int],
        ctx: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> None:
        """The inputs of bucket (G, B): len(ids) sequences, the rest of the G rows padding.
        Staged in host buffers allocated once (pinned on CUDA) and copied in with two copies:
        no [G, B] Python lists or tensors made per step (256 x 128 table entries at the
        largest bucket). The previous step's copies are done by now: its tokens were read."""
        n = len(ids)
        m = self._host_meta_np
        m[:, :n] = (ids, pos, slots, ctx)
        m[:, n:g] = self._padding
        t = self._host_tables_np[b]
        t[:g] = NULL_BLOCK
        for row, table in enumerate(tables):
            t[row, : len(table)] = table
        self.meta.copy_(self._host_meta, non_blocking=True)
        self.tables[b][:g].copy_(self._host_tables[b][:g], non_blocking=True)

    def _reset_inputs(self, g: int) -> None:
        """Padding values everywhere: what capture-time forwards read."""
        self.meta[:, :g] = torch.tensor(
            [[0], [0], [NULL_BLOCK * self.block_size], [1]], device=self.meta.device
        )
        for t in self.tables.values():
            t.fill_(NULL_BLOCK)
