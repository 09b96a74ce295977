"""The model runner: owns the model and the device memory (KV pool), turns a scheduled step into
one padded forward pass, and samples.

Memory is allocated once: the KV cache at start-up (sized from config, or on CUDA from the free
memory left after a warm-up forward at the largest bucket), and every op of a forward is padded
to a bucket (engine/buckets.py: tokens, logits rows, attention group G x Q x B) so the allocator
only ever sees shapes it met during warm-up; `shapes` records the full key of every op run.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tailguard.core.request import EngineRequest, Pooling, RequestKind
from tailguard.core.scheduler import ScheduledSeq, SeqResult
from tailguard.engine.buckets import (
    ShapeKey,
    ShapeTracker,
    attention_shapes,
    block_ladder,
    bucket_for,
    group_shape,
    spread,
    step_keys,
)
from tailguard.engine.config import EngineConfig
from tailguard.engine.graphs import DecodeGraphs, GraphMode, graph_eligible
from tailguard.engine.plan import StepPlan, greedy_only
from tailguard.engine.sampling import greedy_rows, sample_rows
from tailguard.model.batch import NULL_BLOCK, AttnGroup, ForwardBatch
from tailguard.model.config import MistralConfig
from tailguard.model.kernels import (
    LinearKernel,
    load_bf16_kernel,
    load_decode_stack,
    load_prefill_attention,
    load_row_kernel,
    load_small_m_kernel,
)
from tailguard.model.loader import (
    best_cpu_dtype,
    load_model,
    onednn_isa_cap,
    onednn_uses_amx,
    read_cpu_flags,
    resolve_dtype,
)
from tailguard.model.mistral import DecoderLayer, allocate_kv_cache, attention_mask

log = logging.getLogger("tailguard.engine")


class InjectedOOM(torch.OutOfMemoryError):
    """Raised by the test hook (EngineConfig.oom_test_hook) to exercise OOM isolation on CPU."""


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int  # including the reserved null block
    block_size: int
    bytes_per_block: int  # K and V over all layers

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def kv_bytes_per_block(mcfg: MistralConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mcfg.num_hidden_layers * block_size * mcfg.num_key_value_heads * mcfg.head_dim * elem


def choose_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype != "auto":
        return resolve_dtype(config.dtype)
    if config.device.startswith("cuda"):
        return torch.bfloat16
    return best_cpu_dtype()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = choose_dtype(config)
        self.model, self.mcfg = load_model(model_dir, dtype=self.dtype, device=config.device)
        self.model.eval()
        self.small_m_kernel = self._small_m_kernel()
        self.row_kernel = (
            load_row_kernel() if config.row_kernels and self.device.type == "cpu" else None
        )
        self.model.use_row_kernel(self.row_kernel)
        if config.prepack_weights or self.small_m_kernel is not None:
            # a no-op where neither oneDNN packing nor the kernel applies (CUDA, fp16)
            self.model.prepack(pack=config.prepack_weights, kernel=self.small_m_kernel)
        self.max_model_len = config.max_model_len or self.mcfg.max_position_embeddings
        self.blocks_ladder = block_ladder(math.ceil(self.max_model_len / config.block_size))
        self.shapes = ShapeTracker()
        self.last_shape: tuple[int, int] = (0, 0)  # (logits rows, tokens) of the last step
        self.kv_allocations = 0
        self._device_allocs_before_kv = _device_allocs(self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layout = self._allocate_kv()
        kernel = self.small_m_kernel
        if kernel is not None and kernel.dtype == torch.bfloat16:
            attention = load_prefill_attention()
            if attention is not None:
                attention.use_amx(kernel.amx)  # AMX tiles where the linears have them
            self.model.use_prefill_attention(attention)
        if config.fused_decode and kernel is not None and self.row_kernel is not None:
            stack = load_decode_stack(kernel.dtype)
            if stack is not None:
                stack.use_amx(kernel.amx)  # the op-by-op path's bits
            self.model.use_decode_stack(stack, self.kv_caches)
        self._pool_sums: dict[str, torch.Tensor] = {}  # request id -> running hidden sum (fp32)
        self._generators: dict[str, torch.Generator] = {}  # seeded sampling, per request
        # requests without a seed of their own sample from one generator seeded from the
        # engine's `seed`: a restarted engine given the same work samples the same tokens
        self._rng = torch.Generator(device=self.device).manual_seed(config.seed)
        self._oom_ids = frozenset((config.oom_test_hook or "").split(",")) - {""}
        self.graphs: DecodeGraphs | None = None  # captured at warm-up (decode_graphs)
        self.graph_capture_s = 0.0
        self.graph_steps = 0  # steps replayed from a graph
        self.headroom_bytes = 0  # CUDA: allocator cache reserved after warm-up
        self.warmup_phases: dict[str, float] = {}  # seconds per warm-up phase

    def _small_m_kernel(self) -> LinearKernel | None:
        """Our own linear kernel where the config asks for it and it applies, else None: CPU
        fp32 (gemv.c), or CPU bf16 (gemv_bf16.c: vdpbf16ps, and AMX tiles where the CPU has
        them). A dtype or device it does not cover is said once here, a failed build or a CPU
        without AVX512-BF16 by the loader."""
        if not self.config.small_m_kernel:
            return None
        if self.device.type == "cpu" and self.dtype == torch.float32:
            return load_small_m_kernel()
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            return self._bf16_kernel()
        log.warning(
            "tailguard: our linear kernels are for CPU fp32 and bf16, this engine runs %s on "
            "%s: using the device's matmuls",
            self.dtype,
            self.device,
        )
        return None

    @staticmethod
    def _bf16_kernel() -> LinearKernel | None:
        """gemv_bf16.c, on AMX tiles where oneDNN would have them: there its AMX path beats
        oneDNN's up to ~256 rows and matches it above (docs/benchmarks.md, issue 12, session
        31), but without AMX in our build its vdpbf16ps path is 5-10x slower than oneDNN's AMX
        at prefill sizes, so then oneDNN keeps the matmuls."""
        kernel = load_bf16_kernel()
        if kernel is None or kernel.amx or not onednn_uses_amx(read_cpu_flags(), onednn_isa_cap()):
            return kernel
        log.info("tailguard: bf16 on AMX tiles: oneDNN's matmuls (the bf16 kernel has no AMX)")
        return None

    # ---- memory --------------------------------------------------------------------------
    def _allocate_kv(self) -> KVLayout:
        per_block = kv_bytes_per_block(self.mcfg, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            num_blocks = self._cuda_num_blocks(per_block)
        else:
            num_blocks = self.config.kv_cache_bytes // per_block
        need = math.ceil(self.max_model_len / self.config.block_size) + 1
        if num_blocks < need:
            raise ValueError(
                f"KV pool of {num_blocks} blocks cannot hold one sequence of max_model_len="
                f"{self.max_model_len} ({need} blocks of {self.config.block_size}): raise "
                f"kv_cache_bytes to at least {need * per_block} or lower max_model_len"
            )
        self.kv_caches = allocate_kv_cache(
            self.mcfg, num_blocks, self.config.block_size, self.dtype, self.device
        )
        self.kv_allocations += 2 * len(self.kv_caches)
        return KVLayout(num_blocks, self.config.block_size, per_block)

    def device_allocations(self) -> int:
        """KV and device allocations so far. CUDA: measured, the caching allocator's
        `num_device_alloc` (cudaMalloc calls) since just before the pool was allocated; it
        grows after warm-up only if some op needed memory of a size not cached. CPU has no such
        counter: the count of KV tensors the runner allocated (process RSS is the CPU check)."""
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            return _device_allocs(self.device) - self._device_allocs_before_kv
        return self.kv_allocations

    def _cuda_num_blocks(self, per_block: int) -> int:  # pragma: no cover - needs a GPU
        """Warm up once at the largest bucket with a minimal pool, then give the pool a fraction
        of what is free: activation peaks are measured, not guessed."""
        probe_blocks = math.ceil(self.max_model_len / self.config.block_size) + 2
        self.kv_caches = allocate_kv_cache(
            self.mcfg, probe_blocks, self.config.block_size, self.dtype, self.device
        )
        self.layout = KVLayout(probe_blocks, self.config.block_size, per_block)
        self._dummy_forward(self.config.token_buckets[-1], self.config.seq_buckets[-1])
        for key in self._attention_shapes()[-8:]:  # the largest groups: the activation peak
            self._dummy_attention(key)
        torch.cuda.synchronize(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free * self.config.kv_cache_memory_fraction) // per_block

    def release_memory(self) -> None:
        """After an OOM: give cached, unused device memory back before retrying smaller."""
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.empty_cache()

    def forget(self, request_id: str) -> None:
        """A request finished or was aborted/preempted: drop its per-request state."""
        self._pool_sums.pop(request_id, None)
        self._generators.pop(request_id, None)

    # ---- execution -----------------------------------------------------------------------
    def _attention_shapes(self) -> list[ShapeKey]:
        c = self.config
        return attention_shapes(
            c.max_num_seqs,
            c.max_num_batched_tokens,
            c.block_size,
            self.blocks_ladder,
            c.seq_buckets,
        )

    def warmup(self) -> list[tuple[int, int, float]]:
        """Run every op shape serving can produce once: a forward per token bucket, the output
        head per sequence bucket, and (CUDA) every attention group shape alone (one layer's op,
        the same in every layer), so the allocator's high-water mark is reached before the
        first request. On CPU, which has no caching allocator to fill, only a geometric subset
        of the token and sequence buckets is run (`spread`: 15 of the 51 token buckets; all
        51 took a 246M model 44 s) and the rest are declared, as the attention shapes are
        (buckets.py). Returns (rows, tokens, seconds) of each token bucket's forward run (one
        head row) and of the head alone at each row bucket run (0 tokens): a first calibration
        of step cost."""
        c = self.config
        cpu = self.device.type == "cpu"
        if not cpu:  # pragma: no cover - needs a GPU
            torch.cuda.reset_peak_memory_stats(self.device)
        token_runs = spread(c.token_buckets) if cpu else list(c.token_buckets)
        row_runs = spread(c.seq_buckets) if cpu else list(c.seq_buckets)
        timings = []
        phases: dict[str, float] = {}
        mark = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal mark
            self._sync()
            now = time.perf_counter()
            phases[name] = now - mark
            mark = now

        for num_tokens in token_runs:
            t0 = time.perf_counter()
            self._dummy_forward(num_tokens, c.seq_buckets[0])
            self._sync()
            timings.append((1, num_tokens, time.perf_counter() - t0))
        phase("forwards")
        hidden = torch.zeros(
            c.seq_buckets[-1], self.mcfg.hidden_size, dtype=self.dtype, device=self.device
        )
        with torch.inference_mode():
            for rows in row_runs:
                t0 = time.perf_counter()
                self.model.compute_logits(hidden[:rows])
                self._sync()
                timings.append((rows, 0, time.perf_counter() - t0))
                self.shapes.record([("logits", rows)])
            phase("heads")
            if not cpu:  # pragma: no cover - needs a GPU
                for key in self._attention_shapes():
                    self._dummy_attention(key)
                self._dummy_sampling(hidden)
            else:
                self.shapes.allow(self._attention_shapes())
                self.shapes.allow(("tokens", t) for t in c.token_buckets)
                self.shapes.allow(("logits", r) for r in c.seq_buckets)
            phase("attention")
        self.graphs = self._capture_graphs()
        phase("graphs")
        if not cpu:  # pragma: no cover - needs a GPU
            self._reserve_headroom()
        self.shapes.mark_warm()
        self.warmup_phases = phases
        log.info(
            "tailguard: warm-up %s",
            ", ".join(f"{name} {secs:.1f} s" for name, secs in phases.items()),
        )
        return timings

    def _sync(self) -> None:
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)

    def _dummy_sampling(self, hidden: torch.Tensor) -> None:  # pragma: no cover - needs a GPU
        """Greedy, temperature and top-p picks and a prompt's top log-probs over the most rows
        a step can have, from a throwaway generator: the sampler's buffers are cached too."""
        logits = self.model.head(hidden)
        rows = list(range(logits.shape[0]))
        throwaway = torch.Generator(device=self.device).manual_seed(0)
        greedy_rows(logits, rows)
        for top_p in (1.0, 0.9):
            sample_rows(logits, [1.0] * len(rows), [top_p] * len(rows), [None] * len(rows),
                        throwaway)  # fmt: skip
        torch.log_softmax(logits[0].float(), dim=-1).topk(20)

    def _reserve_headroom(self) -> None:  # pragma: no cover - needs a GPU
        """Leave the caching allocator a free segment as large as warm-up's activation peak
        (and 16 small-pool segments): a step whose tensors are laid out differently from any
        warm-up step's is still served from cache, with no cudaMalloc while serving
        (bench/gpu_checks.py's allocator check counts them)."""
        dev = self.device
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - torch.cuda.memory_allocated(dev)
        size = max(peak, 64 << 20)
        try:
            big = torch.empty(size, dtype=torch.uint8, device=dev)
            small = [torch.empty(1 << 20, dtype=torch.uint8, device=dev) for _ in range(32)]
        except torch.OutOfMemoryError:
            log.warning("tailguard: no room for %d MiB of allocator headroom", size >> 20)
            return
        del big, small  # freed to the cache, not to the device
        self.headroom_bytes = size

    def _graph_mode(self) -> GraphMode | None:
        mode = self.config.decode_graphs
        if mode == "static":
            return GraphMode.STATIC
        if mode == "auto" and self.device.type == "cuda":
            return GraphMode.CUDA
        return None

    def _capture_graphs(self) -> DecodeGraphs | None:
        """One graph per decode bucket (G up to max_num_seqs' bucket, every block bucket), or
        None where the mode is off or the capture fails (then every step runs eagerly: said
        once in the log)."""
        mode = self._graph_mode()
        if mode is None:
            return None
        c = self.config
        seqs = [g for g in c.seq_buckets if g <= bucket_for(c.seq_buckets, c.max_num_seqs)]
        graphs = DecodeGraphs(
            self.model, self.kv_caches, seqs, self.blocks_ladder, c.block_size, mode
        )
        try:
            keys = [(g, b) for g in seqs for b in self.blocks_ladder]
            self.graph_capture_s = graphs.capture(keys)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            log.warning("tailguard: decode graph capture failed, decode steps run eagerly: %s", exc)
            self.release_memory()
            return None
        self.shapes.record(graphs.keys)
        log.info(
            "tailguard: %d decode graphs (%s) captured in %.1f s",
            len(graphs.keys),
            mode.value,
            self.graph_capture_s,
        )
        return graphs

    def _dummy_forward(self, num_tokens: int, logits_rows: int) -> None:
        """A whole forward over `num_tokens` tokens (one sequence: one attention group) that
        only touches the null block, then the head over `logits_rows` rows."""
        key = group_shape(1, num_tokens, 1, self.blocks_ladder, self.config.seq_buckets)
        group = self._null_group(key, num_tokens)
        batch = ForwardBatch(
            input_ids=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            positions=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            groups=(group,),
        )
        with torch.inference_mode():
            hidden = self.model(batch, self.kv_caches)
            self.model.compute_logits(hidden[:logits_rows])
        self.shapes.record(step_keys(num_tokens, logits_rows, [key]))

    def _null_group(self, key: ShapeKey, num_tokens: int) -> AttnGroup:
        """A group of shape `key` whose queries are the first tokens (the rest padding) and
        whose tables point at the null block only."""
        _, g, q, b = key
        assert isinstance(g, int) and isinstance(q, int) and isinstance(b, int)
        index = torch.arange(g * q, device=self.device).clamp(max=num_tokens).view(g, q)
        return AttnGroup(
            token_index=index,
            block_tables=torch.full((g, b), NULL_BLOCK, dtype=torch.long, device=self.device),
            context_lens=torch.ones(g, dtype=torch.long, device=self.device),
            query_start=torch.zeros(g, dtype=torch.long, device=self.device),
        )

    def _dummy_attention(self, key: ShapeKey) -> None:
        """Layer 0's attention op alone on one group shape, reading the null block."""
        _, g, q, b = key
        assert isinstance(g, int) and isinstance(q, int) and isinstance(b, int)
        layer = self.model.layers[0]
        assert isinstance(layer, DecoderLayer)
        attn = layer.attn
        n_tok = g * q
        group = self._null_group(key, n_tok)
        q_ext = torch.zeros(
            n_tok + 1, attn.n_head, attn.head_dim, dtype=self.dtype, device=self.device
        )
        out = torch.zeros(
            n_tok + 1, attn.n_head * attn.head_dim, dtype=self.dtype, device=self.device
        )
        k_cache, v_cache = self.kv_caches[0]
        with torch.inference_mode():
            mask = attention_mask(
                group, n_tok, b * self.config.block_size, self.mcfg.sliding_window, self.dtype
            )
            attn.attend(q_ext, group, mask, k_cache, v_cache, out)
        self.shapes.record([key])

    def execute(self, items: list[ScheduledSeq]) -> list[SeqResult]:
        if self._oom_ids and not self._oom_ids.isdisjoint(i.seq.request_id for i in items):
            raise InjectedOOM(f"injected out-of-memory (test hook) in a batch of {len(items)}")
        if self.graphs is not None and graph_eligible(items):
            key = self.graphs.bucket(items)
            if key is not None:
                return self._execute_graph(items, self.graphs, key)
        plan = StepPlan.build(items, self.config, self.blocks_ladder, self.device)
        if greedy_only(items):
            with torch.inference_mode():
                ids = self.model.decode_greedy(plan.batch, self.kv_caches, plan.last_index)
            if ids is not None:  # the decode stack ran the norm, the head and the argmax too
                self.shapes.record(plan.keys)
                self.last_shape = plan.shape
                return [SeqResult(token_id=t) for t in ids.tolist()[: len(items)]]
        with torch.inference_mode():
            hidden = self.model(plan.batch, self.kv_caches)  # [T, hidden]
            rows = hidden[plan.last_index]  # [S, hidden]: each sequence's last new token
            # [S, vocab] in the model dtype; fp32 rows are made only where sampled or scored
            logits = self.model.head(rows) if plan.needs_logits else None
            results = self._results(items, plan.spans, hidden, rows, logits)
        self.shapes.record(plan.keys)
        self.last_shape = plan.shape
        return results

    def _execute_graph(
        self, items: list[ScheduledSeq], graphs: DecodeGraphs, key: tuple[int, int]
    ) -> list[SeqResult]:
        """A decode step replayed from its bucket's graph (engine/graphs.py)."""
        out = graphs.run(items, key)
        with torch.inference_mode():
            spans = [(i, i + 1) for i in range(len(items))]
            results = self._results(items, spans, out.hidden, out.hidden, out.logits)
        self.shapes.record([out.key])
        self.last_shape = (key[0], key[0])
        self.graph_steps += 1
        return results

    def _results(
        self,
        items: list[ScheduledSeq],
        spans: list[tuple[int, int]],
        hidden: torch.Tensor,
        rows: torch.Tensor,
        logits: torch.Tensor | None,
    ) -> list[SeqResult]:
        tokens = self._next_tokens(items, logits)
        results: list[SeqResult] = []
        for i, item in enumerate(items):
            req = item.seq.request
            wants_embedding = req.kind == RequestKind.EMBED or req.want_embedding
            if wants_embedding and req.pooling == Pooling.MEAN:
                self._accumulate(req.request_id, item, hidden[spans[i][0] : spans[i][1]])
            if not item.completes:
                results.append(SeqResult())
                continue
            embedding = (
                self._embedding(req.request_id, rows[i], req.pooling, item.seq.num_tokens)
                if wants_embedding
                else None
            )
            top = None
            if req.kind == RequestKind.SCORE and req.top_k > 0 and logits is not None:
                logp = torch.log_softmax(logits[i].float(), dim=-1)
                vals, ids = logp.topk(min(req.top_k, logp.numel()))
                top = list(zip(ids.tolist(), vals.tolist(), strict=True))
            results.append(SeqResult(token_id=tokens.get(i), embedding=embedding, top_logprobs=top))
            if item.seq.is_single_pass:
                self.forget(req.request_id)
        return results

    def _next_tokens(
        self, items: list[ScheduledSeq], logits: torch.Tensor | None
    ) -> dict[int, int]:
        """Row index -> next token, for every generation whose prompt is done this step: greedy
        rows by one argmax over the batch, sampled rows together (engine/sampling.py)."""
        if logits is None:
            return {}
        generating = [
            i
            for i, item in enumerate(items)
            if item.completes
            and item.seq.request.kind == RequestKind.GENERATE
            and not item.seq.is_single_pass
        ]
        if not generating:
            return {}
        sampled = [i for i in generating if items[i].seq.request.sampling.temperature > 0]
        greedy = [i for i in generating if items[i].seq.request.sampling.temperature <= 0]
        if self.row_kernel is not None and logits.dtype != torch.float32:
            logits = logits.float()
        threads = torch.get_num_threads()
        picks = greedy_rows(logits, greedy, self.row_kernel, threads)
        tokens = dict(zip(greedy, picks, strict=True))
        if sampled:
            reqs = [items[i].seq.request for i in sampled]
            picks = sample_rows(
                logits,
                [r.sampling.temperature for r in reqs],
                [r.sampling.top_p for r in reqs],
                [self._generator(r) for r in reqs],
                self._rng,
                rows=sampled,
                kernel=self.row_kernel,
                threads=threads,
            )
            tokens.update(zip(sampled, picks, strict=True))
        return tokens

    def _generator(self, req: EngineRequest) -> torch.Generator | None:
        """A seeded request's own generator (made on its first sampled token), else None."""
        seed = req.sampling.seed
        if seed is None:
            return None
        own = self._generators.get(req.request_id)
        if own is None:
            own = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[req.request_id] = own
        return own

    def _accumulate(self, rid: str, item: ScheduledSeq, chunk: torch.Tensor) -> None:
        total = chunk.sum(dim=0, dtype=torch.float32)  # [hidden]; no [n, hidden] fp32 copy
        if item.start == 0 or rid not in self._pool_sums:  # first chunk (or recomputed)
            self._pool_sums[rid] = total
        else:
            self._pool_sums[rid] += total

    def _embedding(self, rid: str, last: torch.Tensor, pooling: Pooling, n: int) -> list[float]:
        vec = self._pool_sums.pop(rid) / n if pooling == Pooling.MEAN else last.float()
        return torch.nn.functional.normalize(vec, dim=0).tolist()


def _device_allocs(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_device_alloc", 0))  # pragma: no cover
